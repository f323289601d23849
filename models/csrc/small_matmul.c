/* y = x @ w.T for a few rows of bfloat16 (decode steps of 1-4 rows), on the plain [N, K] weight (models/native_matmul.py
 * builds and loads this; models/prepack.py calls it for bf16 linears of up to MAX_ROWS rows).
 *
 * Why: a decode step's linears read every weight once for a handful of rows, so they are bound by memory
 * bandwidth. oneDNN's prepacked bf16 matmul reads at ~8.5 GB/s for 1-16 rows here; one core can stream ~12.5
 * GB/s. This streams each weight row once, contiguously (one or two input rows: 16 or 8 weight rows in flight at a
 * time, rows_wide; three or four: two, rows_narrow; with software prefetches ahead), and takes dot products of bf16
 * pairs with AVX512-BF16 (exact products, fp32 sums): 10.7-11.4 GB/s at one row two weight rows at a time, 1.46x
 * oneDNN; 1.3x at 2 rows, 1.16x at 4, even at 8 and slower than oneDNN's AMX path from 16 rows on (measured in
 * docs/performance.md). Without AVX512-BF16 it declines (returns -1) and oneDNN runs.
 *
 * Shapes (elements, bf16 as uint16): x [M, K] contiguous, w [N, K] contiguous, y [M, N]; K % 32 == 0, N % 16 == 0,
 * 1 <= M <= MAX_ROWS. Sums in fp32, rounded to bf16 (nearest even) once at the end.
 */
#include "vec16.h"

#define MAX_ROWS 4 /* from 8 rows on oneDNN is as fast (1.01x measured), from 16 faster */
#define NARROW_AHEAD 4 /* 3-4 input rows, two weight rows at a time: the two rows 4 ahead are prefetched */
#define WIDE_AHEAD 32  /* 1-2 input rows, 16 / M weight rows at a time: every other row 32 ahead is prefetched */

#ifdef __AVX512BF16__
#include <immintrin.h>

/* Output rows [n0, n1) (a multiple of 16 apart) for 3-4 input rows: 16 weight rows a block, two at a time (two
 * independent sums per input row hide the dot products' latency). Inlined with constant M. */
static inline __attribute__((always_inline)) void rows_narrow(const uint16_t *x, const uint16_t *w, uint16_t *y,
                                                            const int64_t M, int64_t N, const int64_t K, int64_t n0,
                                                            int64_t n1) {
    const int64_t chunks = K / 32;
    for (; n0 < n1; n0 += 16) {
        v16f part[MAX_ROWS][16];
        for (int j = 0; j < 16; j += 2) {
            const uint16_t *wr = w + (n0 + j) * K;
            __m512 acc[MAX_ROWS][2];
            for (int64_t m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                __builtin_prefetch(wr + NARROW_AHEAD * K + c * 32);
                __builtin_prefetch(wr + (NARROW_AHEAD + 1) * K + c * 32);
                __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + c * 32);
                __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + K + c * 32);
                for (int64_t m = 0; m < M; m++) {
                    __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + c * 32);
                    acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
                    acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
                }
            }
            for (int64_t m = 0; m < M; m++) {
                part[m][j] = (v16f)acc[m][0];
                part[m][j + 1] = (v16f)acc[m][1];
            }
        }
        for (int64_t m = 0; m < M; m++) {
            v16f s = reduce16(part[m]);
            for (int i = 0; i < 16; i++) y[m * N + n0 + i] = to_bf16(s[i]);
        }
    }
}

/* Output rows [n0, n1) (a multiple of 16 apart) for 1-2 input rows: 16 weight rows a block, R = 16 / M at a time
 * (R independent sums per input row hide the dot products' latency, and R weight rows in flight keep the memory
 * busy). Inlined with constant M (and K where the caller knows it): the M x R accumulators stay in registers.
 * Why R = 16 / M: measured on an AMD EPYC (one core streams ~16.8 GB/s), the 211 weights of a SmolLM2 step (269 MB)
 * at one input row took 25-26 ms two weight rows at a time and 17-18 ms sixteen at a time (prefetching every other
 * row 32 rows ahead); two input rows 25.2-25.4 -> 20.8-21.7 ms with eight; four input rows were slower so (28 against
 * 25-27 ms) and keep rows_narrow. */
static inline __attribute__((always_inline)) void rows_wide(const uint16_t *x, const uint16_t *w, uint16_t *y,
                                                           const int64_t M, int64_t N, const int64_t K, int64_t n0,
                                                           int64_t n1) {
    const int R = (int)(16 / M);
    const int64_t chunks = K / 32;
    for (; n0 < n1; n0 += 16) {
        v16f part[2][16];
        for (int j = 0; j < 16; j += R) {
            const uint16_t *wr = w + (n0 + j) * K;
            __m512 acc[2][16];
            for (int64_t m = 0; m < M; m++)
                for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                for (int r = 0; r < R; r += 2) __builtin_prefetch(wr + (WIDE_AHEAD + r) * K + c * 32);
                for (int r = 0; r < R; r++) {
                    const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + r * K + c * 32);
                    for (int64_t m = 0; m < M; m++)
                        acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)_mm512_loadu_si512(x + m * K + c * 32), wv);
                }
            }
            for (int64_t m = 0; m < M; m++)
                for (int r = 0; r < R; r++) part[m][j + r] = (v16f)acc[m][r];
        }
        for (int64_t m = 0; m < M; m++) {
            v16f s = reduce16(part[m]);
            for (int i = 0; i < 16; i++) y[m * N + n0 + i] = to_bf16(s[i]);
        }
    }
}

static void rows_any(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                     int64_t n0, int64_t n1) {
    switch (M) { /* a constant row count per case: the accumulators stay in registers */
    case 1:
        if (K == 576) rows_wide(x, w, y, 1, N, 576, n0, n1); /* SmolLM2's hidden and MLP sizes */
        else if (K == 1536) rows_wide(x, w, y, 1, N, 1536, n0, n1);
        else rows_wide(x, w, y, 1, N, K, n0, n1);
        break;
    case 2: rows_wide(x, w, y, 2, N, K, n0, n1); break;
    case 3: rows_narrow(x, w, y, 3, N, K, n0, n1); break;
    default: rows_narrow(x, w, y, 4, N, K, n0, n1); break;
    }
}
#endif

#ifdef __AVX512BF16__
/* float32, one input row: y [N] = w [N, K] @ x [K] for output rows [n0, n1) (a multiple of 16 apart), 16 weight
 * rows at a time (16 sums in registers, every other row prefetched WIDE_AHEAD rows ahead), each sum reduced once.
 * Why: MKL's one-row sgemv, which the float32 graphs called, streams the weights at ~11 GB/s here (AMD EPYC, one
 * core ~16.8): the 211 weights of a SmolLM2 step (538 MB) 47-54 ms against 31-33 ms this way. */
static inline __attribute__((always_inline)) void rows_f32(const float *x, const float *w, float *y, const int64_t K,
                                                          int64_t n0, int64_t n1) {
    for (; n0 < n1; n0 += 16) {
        const float *wr = w + n0 * K;
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < K; c += 16) {
            for (int r = 0; r < 16; r += 2) __builtin_prefetch(wr + (WIDE_AHEAD + r) * K + c);
            const __m512 xv = _mm512_loadu_ps(x + c);
            for (int r = 0; r < 16; r++) acc[r] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wr + r * K + c), acc[r]);
        }
        for (int r = 0; r < 16; r++) y[n0 + r] = _mm512_reduce_add_ps(acc[r]);
    }
}
#endif

/* float32 x [1, K] @ w [N, K].T -> y [1, N]; K % 16 == 0, N % 16 == 0. Returns 0, or -1 when this machine or these
 * shapes are not served (the caller uses PyTorch's matmul). */
int bucketserve_small_matmul_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n, int64_t k,
                                 int threads) {
#ifdef __AVX512BF16__
    if (rows != 1 || k % 16 || k < 16 || n % 16 || n < 16) return -1;
    const int64_t blocks = n / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        if (k == 576) rows_f32(x, w, y, 576, b0 * 16, b1 * 16); /* SmolLM2's hidden and MLP sizes */
        else if (k == 1536) rows_f32(x, w, y, 1536, b0 * 16, b1 * 16);
        else rows_f32(x, w, y, k, b0 * 16, b1 * 16);
    }
    return 0;
#else
    (void)x; (void)w; (void)y; (void)rows; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

/* 1 when this build has the kernel (AVX512-BF16), else 0: the caller then never asks. */
int bucketserve_small_matmul_supported(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, or -1 when this machine or these shapes are not served (the caller uses oneDNN). */
int bucketserve_small_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n,
                                  int64_t k, int threads) {
#ifdef __AVX512BF16__
    if (rows < 1 || rows > MAX_ROWS || k % 32 || k < 32 || n % 16 || n < 16) return -1;
    const int64_t blocks = n / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        rows_any(x, w, y, rows, n, k, b0 * 16, b1 * 16);
    }
    return 0;
#else
    (void)x; (void)w; (void)y; (void)rows; (void)n; (void)k; (void)threads;
    return -1;
#endif
}
