/* RMSNorm of bfloat16 rows, rounded as transformers' eager bf16 RMSNorm rounds (models/rms_norm.py calls it for
 * prompt-sized steps):
 *     out[r] = bf16(weight * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)))   (x in fp32, the mean in fp32)
 *
 * Why: inductor's kernel for a residual add and the RMSNorm after it took 60-75 us at 256 rows of 576 and ~380 us
 * at 1024 (one thread; it converts every element bf16 -> fp32 -> bf16 -> fp32 several times, emulating eager's
 * roundings, and recomputes the add in its second pass): 10% of a 1024-token prompt's step. This kernel reads a
 * row twice from L1 (sum of squares, then scale and weight): ~31 us at 256 rows, ~130 at 1024.
 *
 * Shapes (elements, bf16 as uint16): x, out [rows, D] contiguous; weight [D]; D % 16 == 0. The sum of squares runs
 * in 16 fp32 lanes, then across them (eager sums in another order: the mean may differ in its last bit, and an
 * output by a rounding step with it, rarely); with AVX512-BF16 the roundings flush denormals to zero, as that
 * instruction does (irrelevant after a normalisation, whose outputs are near 1 in magnitude). */
#include "vec16.h"

/* x, out [rows, D] contiguous, weight [D]; rows split over `threads` (OpenMP, when built with it). Returns 0, or -1
 * when the shapes do not fit (the caller then runs the eager formula). */
int bucketserve_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t D,
                              float eps, int threads) {
    if (rows < 0 || D < 16 || D % 16) return -1;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * D;
        v16f a = splat(0.0f), b = splat(0.0f); /* two chains: the adds' latency overlaps */
        int64_t d = 0;
        for (; d + 32 <= D; d += 32) {
            const v16f u = get_bf16(xr + d), v = get_bf16(xr + d + 16);
            a += u * u;
            b += v * v;
        }
        if (d < D) {
            const v16f u = get_bf16(xr + d);
            a += u * u;
        }
        a += b;
        float sum = 0.0f;
        for (int i = 0; i < 16; i++) sum += a[i];
        const v16f scale = splat(1.0f / __builtin_sqrtf(sum / (float)D + eps));
        for (d = 0; d < D; d += 16)
            put_bf16(out + r * D + d, get_bf16(weight + d) * round_bf16(get_bf16(xr + d) * scale));
    }
    (void)threads;
    return 0;
}
