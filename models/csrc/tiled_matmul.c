/* y = x @ w.T in bfloat16 with AVX512-BF16 vector products, on the copy of the weight in the AMX tiles' layout
 * (models/native_matmul.py packs it; models/prepack.py routes bf16 steps of every size here on CPUs without AMX).
 *
 * Why: on an AMD EPYC with AVX512-BF16 and no AMX (one thread), oneDNN's prepacked bf16 matmul ran the 211
 * weights of a SmolLM2 step (269 MB) in 18-34 ms at 1-16 rows, and the small matmul (small_matmul.c, dot
 * products along K on the plain weight) 16.4 ms at one row and 19.5 at two. Neither reached the arithmetic peak
 * (~230 GFLOP/s: one 512-bit bf16 dot product a cycle) nor what memory gives when asked far enough ahead. Here each
 * 64-byte row of a weight tile already holds, for 16 output columns, the pair of weights of two consecutive k:
 * exactly what one `vdpbf16ps` multiplies by a broadcast pair of an input row. So a block of up to MAX_BLOCK input
 * rows keeps 2 x rows accumulators (two column tiles) in registers, every weight vector loaded once feeds every
 * row of the block, and the weight stream is prefetched into L2 (`prefetcht1`) AHEAD k blocks ahead: prefetching
 * into L1 instead measured 9-12 GB/s, into L2 22 GB/s. Measured (the 211 weights, medians of 7, one thread):
 * 1 row 12.2 ms (small matmul 16.4, oneDNN 21.1), 4 rows 12.7 (oneDNN 18.2), 8 rows 12.1 (23.6), 16 rows 21.6
 * (31.0), 64 rows 79 (89), 272 rows 337 (343).
 *
 * Packed weight (elements, bf16 as uint16): [N/32, K/32, 2, 16, 16, 2] (amx_matmul.c's layout): for column group
 * g (32 outputs) and k block b, tile j row r holds w[32g + 16j + n, 32b + 2r + i] at n * 2 + i. A group is one
 * contiguous run of K * 32 elements.
 *
 * Shapes: x [M, K] contiguous, y [M, N] contiguous, K % 32 == 0, N % 32 == 0, M >= 1. Sums in fp32 (exact products
 * of bf16 pairs, summed pair by pair along K), rounded to bf16 once (nearest even).
 *
 * float32 (the same scheme with FMAs, steps of 1-32 rows of fp32 models; AVX-512, or AVX2 with FMA below): the copy
 * is [N/32, K, 32] (for column group g, the 32 weights of k at k * 32: two vectors), each broadcast input element
 * multiplies both. Measured the
 * same way (538 MB of fp32 weights): 1 row 20.8 ms (the plain-weight one-row kernel, small_matmul.c, 25.8; MKL's
 * sgemv ~47), 8 rows 22.0 (oneDNN 39.2), 16 rows 43.3 (54.3), 32 rows 82 (98), 64 even, 128 slower (327 vs 316).
 * Each output's sum runs in k order in fp32, as a plain dot product does; MKL and oneDNN sum in other orders.
 *
 * Weight-only int8 (`--quantize int8` without AMX): the same layout with one signed byte an element (a tile row is
 * 32 bytes) and a fp32 scale per output column (amx_matmul.c's int8 copy). Each row's 32 bytes become the 32 bf16 a
 * bf16 row would hold (exact: |q| <= 127): sign-extended to int32, converted to fp32, rounded in pairs to bf16
 * (five instructions a vector, against the dot products of up to 12 rows); each column's fp32 sum is scaled before
 * the one rounding to bf16. Half the bytes of bf16 stream from memory. Every pass over the rows converts again:
 * converting each group once into an L2 buffer for the passes to read (as amx_matmul.c does) measured slower here
 * (the 211 weights at 16 rows: 32.5 ms, against 22.9 converting in each pass; bf16 22.1).
 */
#include <stddef.h>
#include <stdint.h>

#define MAX_BLOCK 12 /* input rows a pass keeps in registers: 24 accumulators + 2 weight vectors + a broadcast */
#define AHEAD 4      /* k blocks (2 KiB each) between the weights a pass reads and those it prefetches */
#define AHEAD_F32 64 /* fp32: k (128 bytes each) between the weights a pass reads and those it prefetches: 8 KiB */

/* All column groups of w (group g: its K * 32 weights from g * K * 32), split evenly among `threads`; each group's
 * M input rows in passes of at most MAX_BLOCK rows, as equal as possible (13 rows: 6 + 7, not 12 + 1: a pass of few
 * rows is bound by its dot products' latency), except with FULL_FIRST (bf16): there the first pass, which streams
 * the group from memory and waits on it, takes MAX_BLOCK rows and the passes from L2 share the rest (13 rows: 12 + 1).
 * On the Zen 5 EPYC (the 210 weights of a SmolLM2 step, one thread, medians of three alternations): 13 rows 13.1 ->
 * 9.9 ms, 16 rows 12.9 -> 10.1, 20 rows 13.3 -> 11.5, 22 rows level, 28 rows 16.9 -> 14.3, 32 rows 17.3 -> 16.4.
 * The same products in the same order: the same bits. PASS(x, wg, scale, y, r, N, K, m0, g, first) is a pass of constant r
 * rows (the accumulators stay in registers); `first` for the group's first pass, the one that reads it from memory
 * (and prefetches); scale: the int8 weight's column scales, each column's sum multiplied before rounding (NULL:
 * none). */
#define GROUPS(NAME, T, TW, PASS, FULL_FIRST)                                                                          \
    static void NAME(const T *x, const TW *w, const float *scale, T *y, int64_t M, int64_t N, int64_t K, int threads) {\
        const int64_t count = N / 32, passes = (M + MAX_BLOCK - 1) / MAX_BLOCK;                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                             \
        for (int t = 0; t < threads; t++) {                                                                            \
            for (int64_t g = count * t / threads; g < count * (t + 1) / threads; g++) {                                \
                const TW *wg = w + g * K * 32;                                                                         \
                for (int64_t p = 0, m0 = 0; p < passes; p++) {                                                         \
                    const int64_t rows = p == 0 && passes > 1 && FULL_FIRST ? MAX_BLOCK : (M - m0) / (passes - p);      \
                    const int first = p == 0;                                                                          \
                    switch (rows) {                                                                                    \
                    case 1: PASS(x, wg, scale, y, 1, N, K, m0, g, first); break;                                       \
                    case 2: PASS(x, wg, scale, y, 2, N, K, m0, g, first); break;                                       \
                    case 3: PASS(x, wg, scale, y, 3, N, K, m0, g, first); break;                                       \
                    case 4: PASS(x, wg, scale, y, 4, N, K, m0, g, first); break;                                       \
                    case 5: PASS(x, wg, scale, y, 5, N, K, m0, g, first); break;                                       \
                    case 6: PASS(x, wg, scale, y, 6, N, K, m0, g, first); break;                                       \
                    case 7: PASS(x, wg, scale, y, 7, N, K, m0, g, first); break;                                       \
                    case 8: PASS(x, wg, scale, y, 8, N, K, m0, g, first); break;                                       \
                    case 9: PASS(x, wg, scale, y, 9, N, K, m0, g, first); break;                                       \
                    case 10: PASS(x, wg, scale, y, 10, N, K, m0, g, first); break;                                     \
                    case 11: PASS(x, wg, scale, y, 11, N, K, m0, g, first); break;                                     \
                    default: PASS(x, wg, scale, y, MAX_BLOCK, N, K, m0, g, first); break;                              \
                    }                                                                                                  \
                    m0 += rows;                                                                                        \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }

#ifdef __AVX512BF16__
#include <immintrin.h>

/* 32 int8 weights (a tile row: 16 columns' pairs) -> the same 32 as bf16 pairs, in place order. */
static inline __m512bh int8_row(const int8_t *src) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo); /* lo's 16 first */
}

/* Output columns [32g, 32g + 32) of input rows [m0, m0 + rows): the group's tiles wg (bf16, or with q8 int8:
 * converted as read, each column's sum times its scale), read from memory by the first pass over the group
 * (prefetch set: it asks 8 KiB ahead) and from L2 by the passes after it. Inlined with constant `rows` and `q8`:
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pass_of(const uint16_t *x, const void *wg, const float *scale,
                                                         uint16_t *y, const int rows, const int64_t N, const int64_t K,
                                                         const int64_t m0, const int64_t g, const int prefetch,
                                                         const int q8) {
    const int64_t row_bytes = q8 ? 32 : 64; /* a tile row: 16 columns x 2 k */
    __m512 acc[MAX_BLOCK][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const uint16_t *xr = x + m0 * K;
    for (int64_t b = 0; b < K / 32; b++) {
        const char *t = (const char *)wg + b * 32 * row_bytes; /* tile 0 at t, tile 1 16 rows on */
        for (int r = 0; r < 16; r++) {
            const char *r0 = t + r * row_bytes, *r1 = r0 + 16 * row_bytes;
            if (prefetch && (!q8 || !(r & 1))) { /* a cache line at a time; past the end near the last group: a
                                                     prefetch never faults */
                _mm_prefetch(r0 + AHEAD * 2048, _MM_HINT_T1);
                _mm_prefetch(r1 + AHEAD * 2048, _MM_HINT_T1);
            }
            const __m512bh w0 = q8 ? int8_row((const int8_t *)r0) : (__m512bh)_mm512_loadu_si512(r0);
            const __m512bh w1 = q8 ? int8_row((const int8_t *)r1) : (__m512bh)_mm512_loadu_si512(r1);
            for (int m = 0; m < rows; m++) {
                int32_t pair; /* x[m, 32b + 2r .. + 1] */
                __builtin_memcpy(&pair, xr + m * K + b * 32 + 2 * r, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
            }
        }
    }
    if (q8) {
        const __m512 s0 = _mm512_loadu_ps(scale + g * 32), s1 = _mm512_loadu_ps(scale + g * 32 + 16);
        for (int m = 0; m < rows; m++)
            acc[m][0] = _mm512_mul_ps(acc[m][0], s0), acc[m][1] = _mm512_mul_ps(acc[m][1], s1);
    }
    for (int m = 0; m < rows; m++) {
        uint16_t *out = y + (m0 + m) * N + g * 32;
        _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(acc[m][0]));
        _mm256_storeu_si256((__m256i *)(out + 16), (__m256i)_mm512_cvtneps_pbh(acc[m][1]));
    }
}

#define PASS_BF16(x, wg, scale, y, rows, N, K, m0, g, first) pass_of(x, wg, scale, y, rows, N, K, m0, g, first, 0)
#define PASS_Q8(x, wg, scale, y, rows, N, K, m0, g, first) pass_of(x, wg, scale, y, rows, N, K, m0, g, first, 1)
GROUPS(groups, uint16_t, uint16_t, PASS_BF16, 1)
GROUPS(groups_q8, uint16_t, int8_t, PASS_Q8, 0)

/* float32: output columns [32g, 32g + 32) of input rows [m0, m0 + rows) from the group's [K, 32] weights wg. */
static inline __attribute__((always_inline)) void pass_f32(const float *x, const float *wg, const float *scale,
                                                          float *y, const int rows, const int64_t N, const int64_t K,
                                                          const int64_t m0, const int64_t g, const int prefetch) {
    (void)scale;
    __m512 acc[MAX_BLOCK][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const float *xr = x + m0 * K;
    for (int64_t k = 0; k < K; k++) {
        const float *t = wg + k * 32;
        if (prefetch) {
            _mm_prefetch((const char *)(t + AHEAD_F32 * 32), _MM_HINT_T1);
            _mm_prefetch((const char *)(t + AHEAD_F32 * 32 + 16), _MM_HINT_T1);
        }
        const __m512 w0 = _mm512_loadu_ps(t), w1 = _mm512_loadu_ps(t + 16);
        for (int m = 0; m < rows; m++) {
            const __m512 xb = _mm512_set1_ps(xr[m * K + k]);
            acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) {
        _mm512_storeu_ps(y + (m0 + m) * N + g * 32, acc[m][0]);
        _mm512_storeu_ps(y + (m0 + m) * N + g * 32 + 16, acc[m][1]);
    }
}

GROUPS(groups_f32, float, float, pass_f32, 0)

/* Returns 0, or -1 when the shapes do not fit (the caller then uses oneDNN). */
int bucketserve_tiled_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                                  int64_t K, int threads) {
    if (M < 1 || K < 32 || K % 32 || N < 32 || N % 32) return -1;
    groups(x, w, NULL, y, M, N, K, threads);
    return 0;
}

/* y [M, N] = (x [M, K] @ q.T) * scale: q the int8 copy (one byte an element of the bf16 layout), scale [N] fp32.
 * Returns 0, or -1 when the shapes do not fit. */
int bucketserve_tiled_matmul_q8(const uint16_t *x, const int8_t *q, const float *scale, uint16_t *y, int64_t M,
                                int64_t N, int64_t K, int threads) {
    if (M < 1 || K < 32 || K % 32 || N < 32 || N % 32) return -1;
    groups_q8(x, q, scale, y, M, N, K, threads);
    return 0;
}

/* float32 x [M, K] @ the [N/32, K, 32] copy -> y [M, N]. Returns 0, or -1 when the shapes do not fit. */
int bucketserve_tiled_matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                                 int threads) {
    if (M < 1 || K < 1 || N < 32 || N % 32) return -1;
    groups_f32(x, w, NULL, y, M, N, K, threads);
    return 0;
}

/* The most rows of a float32 step this build's vector matmul takes ahead of oneDNN (0: it has none): with AVX-512,
 * 32 (a Zen 4 EPYC, SmolLM2's 210 layer weights: 1.2x oneDNN at 32 rows, even at 64, 0.97x at 128); AVX2 below. */
int bucketserve_tiled_f32_rows(void) { return 32; }
/* The fewest rows of a float32 step that read MKL's matmul on the plain weight rather than oneDNN's packed copy (0:
 * none, here: measured only on AVX2, below). */
int bucketserve_f32_mkl_rows(void) { return 0; }
#else
int bucketserve_tiled_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                                  int64_t K, int threads) {
    (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -1;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* float32 on AVX2 (no AVX-512: a Zen 3 EPYC, say): the same copy and the same sums (each output's products added
 * in k order by FMAs: the AVX-512 kernel's bits), in 8-lane vectors. Sixteen ymm registers hold 2 x rows
 * accumulators, a half group's two weight vectors and a broadcast, so a pass of 3+ rows takes at most
 * MAX_BLOCK_AVX2 rows and one half (16 columns) of a group at a time: the first half streams the group's 128-byte
 * k lines from memory (both halves prefetched), the second reads them from L2; 1-2 rows take the whole group.
 * Why: oneDNN's fp32 matmul of a decode-sized step there does not stream the weights as fast (docs/performance.md,
 * session 53). */
#define MAX_BLOCK_AVX2 6

/* Columns [32g + 8 v0, 32g + 8 (v0 + nv)) of input rows [m0, m0 + rows): nv of the group's four 8-float vectors
 * a k (all four for 1-2 rows, a half for 3-6: 2 x rows or 4 x rows accumulators, nv weight vectors and a broadcast
 * fit the 16 registers). Inlined with constant rows and nv. `ahead`: prefetch this group AHEAD_F32 k ahead (the
 * pass that streams it from memory with nothing prefetched before it); `next`, `lines`: prefetch `lines` 64-byte
 * lines from `next` (a slice of the next group), spread evenly over the K steps (NULL: none). */
static inline __attribute__((always_inline)) void cols_f32(const float *x, const float *wg, float *y, const int rows,
                                                          const int64_t N, const int64_t K, const int64_t m0,
                                                          const int64_t g, const int v0, const int nv,
                                                          const int ahead, const char *next, const int64_t lines) {
    __m256 acc[MAX_BLOCK_AVX2][4];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nv; j++) acc[m][j] = _mm256_setzero_ps();
    const float *xr = x + m0 * K;
    int64_t due = 0; /* Bresenham: `lines` prefetches over K steps */
    for (int64_t k = 0; k < K; k++) {
        const float *t = wg + k * 32;
        if (ahead) {
            _mm_prefetch((const char *)(t + AHEAD_F32 * 32), _MM_HINT_T1);
            _mm_prefetch((const char *)(t + AHEAD_F32 * 32 + 16), _MM_HINT_T1);
        }
        if (next) {
            for (due += lines; due >= K; due -= K, next += 64) _mm_prefetch(next, _MM_HINT_T1);
        }
        __m256 wv[4];
        for (int j = 0; j < nv; j++) wv[j] = _mm256_loadu_ps(t + 8 * (v0 + j));
        for (int m = 0; m < rows; m++) {
            const __m256 xb = _mm256_broadcast_ss(xr + m * K + k);
            for (int j = 0; j < nv; j++) acc[m][j] = _mm256_fmadd_ps(xb, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(y + (m0 + m) * N + g * 32 + 8 * (v0 + j), acc[m][j]);
}

/* Sub-pass s of the group's H (a half group each: 2 a pass of 3+ rows) prefetches slice s of the next group's 2K
 * lines into L2. Why: a group is read from memory once, by its first sub-pass, and the others read it from L2; had
 * only that first sub-pass fetched (and stalled on memory), the rest would compute with memory idle. Spreading the
 * next group's fetch over all H sub-passes keeps memory busy through the compute (the 210 weights of a SmolLM2
 * step and the lm_head on the Zen 3 EPYC, one thread, alternated: 4 rows 45.8 -> 35.8 ms, 8 rows 65.5 -> 49.0,
 * 12 rows 73.4 -> 53.1, 16 rows 88-90 -> 62-69, 24 rows 97.6 -> 77.5). The thread's first group streams itself
 * (`ahead`). One and two rows keep streaming each group ahead of themselves (level either way). */
#define SLICE(s) (next ? next + ((s) * 2 * K / H) * 64 : NULL), (next ? ((s) + 1) * 2 * K / H - (s) * 2 * K / H : 0)

/* a pass of 3+ rows: the group's first half (streamed from memory in the first pass), then its second (from L2) */
#define HALF_F32(rows)                                                                                                 \
    do {                                                                                                               \
        cols_f32(x, wg, y, rows, N, K, m0, g, 0, 2, p == 0 && g == g0, SLICE(2 * p));                                  \
        cols_f32(x, wg, y, rows, N, K, m0, g, 2, 2, 0, SLICE(2 * p + 1));                                              \
    } while (0)

int bucketserve_tiled_matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                                 int threads) {
    if (M < 1 || K < 1 || N < 32 || N % 32) return -1;
    /* 1-2 rows left over past whole passes of 6 take the whole group in one pass of their own (8 = 6 + 2, 13 =
     * 6 + 6 + 1) instead of splitting the rows evenly (8 = 4 + 4): a half-group pass of 4 rows (8 accumulators)
     * costs as much as one of 6 (12), so an even split of 7-8 rows paid four passes where three do. SmolLM2's 210
     * layer weights on the Zen 3 EPYC, from memory, one thread, alternated: 8 rows 37.9 -> 31.6 ms (another run
     * 37.8 -> 28.3; a 6-row step takes ~27), 7 rows 37.2 -> 30.7, 13 rows 48.0 -> 38.6, 14 rows 44.8 -> 39.9
     * (docs/performance.md, session 56). A remainder of 3-5 rows keeps the even split (9 = 4 + 5 beats 6 + 3). */
    const int64_t tail = M > MAX_BLOCK_AVX2 && M % MAX_BLOCK_AVX2 <= 2 ? M % MAX_BLOCK_AVX2 : 0;
    const int64_t count = N / 32, passes = tail ? M / MAX_BLOCK_AVX2 : (M + MAX_BLOCK_AVX2 - 1) / MAX_BLOCK_AVX2;
    const int64_t H = M <= 2 ? 1 : 2 * passes + (tail > 0); /* sub-passes a group */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t g0 = count * t / threads, g1 = count * (t + 1) / threads;
        for (int64_t g = g0; g < g1; g++) {
            const float *wg = w + g * K * 32;
            const char *next = g + 1 < g1 ? (const char *)(wg + K * 32) : NULL;
            int64_t m0 = 0;
            for (int64_t p = 0; p < passes; p++) {
                /* as equal as possible (7 rows 3 + 4), or 6 each before a tail */
                const int64_t rows = tail ? MAX_BLOCK_AVX2 : (M - m0) / (passes - p);
                switch (rows) {
                /* the only pass: 1-2 rows stream each group themselves */
                case 1: cols_f32(x, wg, y, 1, N, K, m0, g, 0, 4, 1, NULL, 0); break;
                case 2: cols_f32(x, wg, y, 2, N, K, m0, g, 0, 4, 1, NULL, 0); break;
                case 3: HALF_F32(3); break;
                case 4: HALF_F32(4); break;
                case 5: HALF_F32(5); break;
                default: HALF_F32(MAX_BLOCK_AVX2); break;
                }
                m0 += rows;
            }
            /* the tail: the whole group (in L2 by now), with the last slice of the next group's prefetch */
            if (tail == 1) cols_f32(x, wg, y, 1, N, K, m0, g, 0, 4, 0, SLICE(H - 1));
            if (tail == 2) cols_f32(x, wg, y, 2, N, K, m0, g, 0, 4, 0, SLICE(H - 1));
        }
    }
    return 0;
}

/* AVX2: 128 rows. With the next group prefetched through every pass, SmolLM2's 210 layer weights ran on the Zen 3
 * EPYC (one thread, alternated with oneDNN's packed matmul and MKL's) at 64 rows in 155-172 ms against 209-210 and
 * 195-199, at 128 rows in 313-364 against 377-395 and 344-360; from 256 rows on MKL's was ahead of both (1024 rows:
 * 2.9-3.0 s, oneDNN 3.0-3.3, this kernel 3.5-3.9). 128 is also the token budget of a mixed step while rows decode
 * (buckets/defaults.py MIXED_STEP_TOKENS). */
int bucketserve_tiled_f32_rows(void) { return 128; }
/* AVX2: steps past this kernel's 128 rows read MKL's matmul (the same machine and weights, alternated: 256 rows 672-717
 * ms against oneDNN's 735-771, 512 rows 1309-1427 against 1430-1550, 1024 rows 2664-3167 against 2932-3261). */
int bucketserve_f32_mkl_rows(void) { return 129; }
#else
int bucketserve_tiled_matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                                 int threads) {
    (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -1;
}

int bucketserve_tiled_f32_rows(void) { return 0; }
int bucketserve_f32_mkl_rows(void) { return 0; }
#endif

int bucketserve_tiled_matmul_q8(const uint16_t *x, const int8_t *q, const float *scale, uint16_t *y, int64_t M,
                                int64_t N, int64_t K, int threads) {
    (void)x, (void)q, (void)scale, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -1;
}
#endif
