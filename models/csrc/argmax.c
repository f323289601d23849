/* Each row's greedy token: the index of its first maximum, as torch.max(dim=-1).indices gives it (a row holding a
 * NaN gives its first NaN), for bf16 or fp32 logits (server/engine/step_sampling.py's greedy_ids).
 *
 * Why: PyTorch's CPU max over a bf16 row of 49152 logits compares one element at a time, ~39 us a row here: 1.8 ms
 * of a 64-token verify step's 47 rows, ~2.5% of a served 16-client level (perf). Two vector passes over the row,
 * which the lm_head has just written to cache (the maximum, then its first index), take a few microseconds.
 *
 * Shapes: x [rows, n] with row stride `stride` (elements), elements bf16 (as uint16) or fp32 (`f32`); out [rows]. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float element(const void *row, int64_t i, int f32) {
    if (f32) return ((const float *)row)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The reference: one element at a time (the tail of the vector loop and CPUs without AVX-512 BW). */
static int64_t scalar_argmax(const void *row, int64_t from, int64_t n, int f32, int64_t best) {
    float top = element(row, best, f32);
    if (top != top) return best;
    for (int64_t i = from; i < n; i++) {
        const float v = element(row, i, f32);
        if (v != v) return i;
        if (v > top) top = v, best = i;
    }
    return best;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __m512 load16(const void *row, int64_t i, int f32) {
    if (f32) return _mm512_loadu_ps((const float *)row + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static int64_t row_argmax(const void *row, int64_t n, int f32) {
    const int64_t whole = n / 16 * 16;
    if (whole == 0) return scalar_argmax(row, 1, n, f32, 0);
    __m512 top = load16(row, 0, f32);
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    for (int64_t i = 16; i < whole; i += 16) {
        const __m512 v = load16(row, i, f32);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
    }
    if (nan) return scalar_argmax(row, 0, n, f32, 0); /* the first NaN (rare: leave it to the reference) */
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    int64_t at = 0;
    for (int64_t i = 0; i < whole; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(load16(row, i, f32), best, _CMP_EQ_OQ);
        if (hit) {
            at = i + __builtin_ctz(hit);
            break;
        }
    }
    return whole < n ? scalar_argmax(row, whole, n, f32, at) : at;
}
#else
static int64_t row_argmax(const void *row, int64_t n, int f32) { return scalar_argmax(row, 1, n, f32, 0); }
#endif

/* Returns 0, or -1 for shapes it does not take (the caller uses torch.max). */
int bucketserve_argmax(const void *x, int64_t rows, int64_t n, int64_t stride, int f32, int64_t *out, int threads) {
    if (rows < 0 || n < 1 || stride < n) return -1;
    const int64_t size = f32 ? 4 : 2;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1)
#endif
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax((const char *)x + r * stride * size, n, f32);
    (void)threads;
    return 0;
}
