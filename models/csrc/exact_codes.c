/* y = x @ w.T in float32 for a weight whose fp32 values are, block by block, small integer codes times a scale
 * (plus a minimum), exactly: models/exact_codes.py finds such weights and packs them. Two forms, the ones a GGUF
 * checkpoint dequantized to fp32 has (the default model's: Q4_1 layers, a Q8_0 embedding that is also its head):
 * - 4-bit: w[n, k] = fma(q, d, m), q in 0..15, one (d, m) pair per output n and block of 32 k;
 * - 8-bit: w[n, k] = q d, q in -128..127, one d per output n and block of 32 k.
 *
 * Why: below ~12 rows a fp32 decode step is bound by reading its weights (425 MB of layer weights and a 113 MB head
 * for SmolLM2-135M at ~14 GB/s on the Zen 3 EPYC). The codes and their scales are 0.75 (4-bit) or 1.125 (8-bit)
 * bytes a weight instead of 4: a column group's weights are rebuilt, exactly, KC k at a time into an L1 buffer, and
 * every pass of input rows runs its FMAs over that chunk before the next is rebuilt (tiled_matmul.c's passes: 1-2
 * rows the whole group, 3-6 a half; the accumulators go through y between chunks, which keeps their fp32 bits). The
 * same weights in the same k-order FMAs: the same bits as the fp32 tile copy gives. SmolLM2's 210 layer weights, one
 * thread, a C harness (medians of 9, two runs; fp32 tile copy / 4-bit codes): 1 row 34-39 / 15 ms, 2 rows 34-38 /
 * 18-20, 6 rows 32-38 / 22-27, 8 rows 35-41 / 28-31, 16 rows 49-76 / 46-67, 32 rows 88-124 / 95-106, 128 rows
 * 360-408 / 334-358.
 *
 * Packed copies (models/exact_codes.py), for column group g (32 outputs) and k:
 * - 4-bit: codes [N/32, K, 16] bytes (byte i holds column 32g + i in its low nibble and 32g + 16 + i in its high
 *   one); pairs [N/32, K/32, 2, 32] fp32 (group g, k block b: d of the 32 columns, then m);
 * - 8-bit: codes [N/32, K, 32] int8 (the fp32 tile copy's layout); scales [N/32, K/32, 32] fp32.
 * Shapes: x [M, K] contiguous, y [M, N] contiguous, K % 32 == 0, N % 32 == 0, M >= 1. */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define KC 64        /* k a chunk: 8 KiB of rebuilt weights, in L1 while every pass reads them */
#define MAX_BLOCK 6  /* input rows a pass keeps in registers (tiled_matmul.c's MAX_BLOCK_AVX2) */

/* Weights [k0, k0 + kn) of a group (kn a multiple of 32) into out [kn, 32] from its codes [K, 16] and pairs
 * [K/32, 2, 32]: ~8 cycles a k on the Zen 3 EPYC from L1 (two widenings, four masks or shifts, conversions and
 * FMAs, four stores), ~8 ms for SmolLM2's 106 M layer weights: a step of many rows pays it once, where reading
 * their fp32 copy from memory took ~30. */
static inline void rebuild4(const uint8_t *codes, const float *pairs, float *out, int64_t k0, int64_t kn) {
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t b = k0 / 32; b < (k0 + kn) / 32; b++) {
        const float *d = pairs + b * 64, *m = d + 32;
        const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8), d2 = _mm256_loadu_ps(d + 16),
                     d3 = _mm256_loadu_ps(d + 24);
        const __m256 m0 = _mm256_loadu_ps(m), m1 = _mm256_loadu_ps(m + 8), m2 = _mm256_loadu_ps(m + 16),
                     m3 = _mm256_loadu_ps(m + 24);
        for (int64_t k = 32 * b; k < 32 * b + 32; k++) {
            const __m128i c = _mm_loadu_si128((const __m128i *)(codes + k * 16));
            const __m256i a = _mm256_cvtepu8_epi32(c), h = _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8));
            float *o = out + (k - k0) * 32;
            _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, low)), d0, m0));
            _mm256_store_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(h, low)), d1, m1));
            _mm256_store_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), d2, m2));
            _mm256_store_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 4)), d3, m3));
        }
    }
}

/* The same from 8-bit codes [K, 32] and scales [K/32, 32]: each product q d is exact (8 and 11 significant bits). */
static inline void rebuild8(const uint8_t *codes, const float *scales, float *out, int64_t k0, int64_t kn) {
    for (int64_t b = k0 / 32; b < (k0 + kn) / 32; b++) {
        const float *d = scales + b * 32;
        const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8), d2 = _mm256_loadu_ps(d + 16),
                     d3 = _mm256_loadu_ps(d + 24);
        for (int64_t k = 32 * b; k < 32 * b + 32; k++) {
            const int8_t *c = (const int8_t *)codes + k * 32;
            float *o = out + (k - k0) * 32;
#define WIDEN(i) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * (i)))))
            _mm256_store_ps(o, _mm256_mul_ps(WIDEN(0), d0));
            _mm256_store_ps(o + 8, _mm256_mul_ps(WIDEN(1), d1));
            _mm256_store_ps(o + 16, _mm256_mul_ps(WIDEN(2), d2));
            _mm256_store_ps(o + 24, _mm256_mul_ps(WIDEN(3), d3));
#undef WIDEN
        }
    }
}

/* Columns [32g + 8 v0, 32g + 8 (v0 + nv)) of input rows [m0, m0 + rows) over the chunk [k0, k0 + kn) rebuilt in
 * buf: the accumulators start at 0 for the first chunk and from y after it, and go back to y. Inlined with
 * constant rows and nv (2 x rows or 4 x rows accumulators, nv weight vectors and a broadcast in 16 registers). */
static inline __attribute__((always_inline)) void pass(const float *x, const float *buf, float *y, const int rows,
                                                      const int64_t N, const int64_t K, const int64_t m0,
                                                      const int64_t g, const int64_t k0, const int64_t kn,
                                                      const int v0, const int nv) {
    __m256 acc[MAX_BLOCK][4];
    float *out = y + m0 * N + g * 32 + 8 * v0;
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nv; j++) acc[m][j] = k0 ? _mm256_loadu_ps(out + m * N + 8 * j) : _mm256_setzero_ps();
    const float *xr = x + m0 * K + k0;
    for (int64_t k = 0; k < kn; k++) {
        __m256 wv[4];
        for (int j = 0; j < nv; j++) wv[j] = _mm256_load_ps(buf + k * 32 + 8 * (v0 + j));
        for (int m = 0; m < rows; m++) {
            const __m256 xb = _mm256_broadcast_ss(xr + m * K + k);
            for (int j = 0; j < nv; j++) acc[m][j] = _mm256_fmadd_ps(xb, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(out + m * N + 8 * j, acc[m][j]);
}

/* a pass of 1-2 rows takes the whole chunk, of 3-6 rows one half of it and then the other */
#define WHOLE(r) pass(x, buf, y, r, N, K, m0, g, k0, kn, 0, 4)
#define HALVES(r) (pass(x, buf, y, r, N, K, m0, g, k0, kn, 0, 2), pass(x, buf, y, r, N, K, m0, g, k0, kn, 2, 2))

int bucketserve_exact_codes_supported(void) { return 1; }

/* y [M, N] = x [M, K] @ w.T, w from its codes and scales (bits: 4 or 8). Returns 0, or -1 when the shapes do not
 * fit or the build has no kernel (the caller then reads the fp32 tile copy). */
static int matmul(const float *x, const uint8_t *codes, const float *scales, float *y, int64_t M, int64_t N,
                  int64_t K, int threads, const int bits) {
    if (M < 1 || K < 32 || K % 32 || N < 32 || N % 32) return -1;
    /* rows in passes as tiled_matmul.c's AVX2 kernel splits them: 1-2 left past whole passes of 6 a pass of their
     * own over the whole chunk, else as equal as possible */
    const int64_t tail = M > MAX_BLOCK && M % MAX_BLOCK <= 2 ? M % MAX_BLOCK : 0;
    const int64_t passes = tail ? M / MAX_BLOCK : (M + MAX_BLOCK - 1) / MAX_BLOCK, count = N / 32;
    const int64_t code_bytes = bits * 4, scale_floats = bits == 4 ? 64 : 32; /* a k's codes; a k block's scales */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        float buf[KC * 32] __attribute__((aligned(64)));
        for (int64_t g = count * t / threads; g < count * (t + 1) / threads; g++) {
            const uint8_t *cg = codes + g * K * code_bytes;
            const float *sg = scales + g * (K / 32) * scale_floats;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kn = K - k0 < KC ? K - k0 : KC;
                /* the chunk after next: its codes and scales; past the group's end that is the next group's, and
                 * past the weight's a prefetch never faults */
                const char *ahead = (const char *)(cg + (k0 + 2 * KC) * code_bytes);
                for (int64_t i = 0; i < KC * code_bytes; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                ahead = (const char *)(sg + (k0 + 2 * KC) / 32 * scale_floats);
                for (int64_t i = 0; i < KC / 32 * scale_floats * 4; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                if (bits == 4)
                    rebuild4(cg, sg, buf, k0, kn);
                else
                    rebuild8(cg, sg, buf, k0, kn);
                int64_t m0 = 0;
                for (int64_t p = 0; p < passes; p++) {
                    const int64_t rows = tail ? MAX_BLOCK : (M - m0) / (passes - p);
                    switch (rows) {
                    case 1: WHOLE(1); break;
                    case 2: WHOLE(2); break;
                    case 3: HALVES(3); break;
                    case 4: HALVES(4); break;
                    case 5: HALVES(5); break;
                    default: HALVES(MAX_BLOCK); break;
                    }
                    m0 += rows;
                }
                if (tail == 1) WHOLE(1);
                if (tail == 2) WHOLE(2);
            }
        }
    }
    return 0;
}

int bucketserve_exact4_matmul_f32(const float *x, const uint8_t *codes, const float *pairs, float *y, int64_t M,
                                  int64_t N, int64_t K, int threads) {
    return matmul(x, codes, pairs, y, M, N, K, threads, 4);
}

int bucketserve_exact8_matmul_f32(const float *x, const int8_t *codes, const float *scales, float *y, int64_t M,
                                  int64_t N, int64_t K, int threads) {
    return matmul(x, (const uint8_t *)codes, scales, y, M, N, K, threads, 8);
}
#else
/* Measured on AVX2 only (a Zen 3 EPYC); with AVX-512 the fp32 tile copy's 16-lane kernel serves these steps. */
int bucketserve_exact_codes_supported(void) { return 0; }

int bucketserve_exact4_matmul_f32(const float *x, const uint8_t *codes, const float *pairs, float *y, int64_t M,
                                  int64_t N, int64_t K, int threads) {
    (void)x, (void)codes, (void)pairs, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -1;
}

int bucketserve_exact8_matmul_f32(const float *x, const int8_t *codes, const float *scales, float *y, int64_t M,
                                  int64_t N, int64_t K, int threads) {
    (void)x, (void)codes, (void)scales, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -1;
}
#endif
