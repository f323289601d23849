/* The float32 lm_head of a step whose tokens are each row's maximum (every row greedy, no logprobs, no penalties:
 * server/engine/step_sampling.py's cheapest path): each row's first maximum found exactly, without reading the
 * whole fp32 weight.
 *
 * Why: below ~12 rows a fp32 decode step is bound by reading its weights (538 MB for SmolLM2-135M at ~14 GB/s on
 * the Zen 3 EPYC), and the 49152 x 576 lm_head is 113 MB of them (21%). The greedy token needs only the index of
 * the largest logit and that logit's value, so the head here reads an int8 copy of the weight (28 MB, one scale a
 * vocabulary row) for an estimate of every logit with a bound on its error, and then the fp32 weight of the few
 * rows whose bound reaches the best lower bound (SmolLM2: 2 a row at the median and 32 at most over 228 hidden
 * states of generated text; 17 and 124 at the ends of 40 prompts of random tokens, the bench's).
 *
 * Exactness. With s_v = max|w_v| / 127 and q_v = round(w_v / s_v), |w_vk - s_v q_vk| <= s_v / 2, so the true dot
 * product x . w_v lies within s_v ||x||_1 / 2 of s_v (x . q_v). The two fp32 sums (the estimate's, and the tiled
 * kernel's k-order FMAs that give the reference logit) each lie within K u sum|x_k| |127.5 s_v| of their exact
 * values (u = 2^-24), so ref_v is within B_v = c s_v ||x||_1 of the estimate, c = 0.5 + 2 * 127.5 K u plus slack for
 * the scale's and the norm's own roundings. The largest lower bound (estimate - B) is at most the largest ref_v,
 * so every v whose upper bound (estimate + B) falls short of it cannot be the first maximum, and every v that could
 * (ties included) is recomputed: k-order FMAs from 0 over its fp32 weight row, exactly the tiled kernel's sum (the
 * same bits). The row then holds -inf except its first maximum, which holds its logit: its argmax, and the verify
 * step's, are the full head's. A row whose ||x||_1 is not finite, or with more than FULL_AT candidates, takes the
 * full head.
 *
 * Shapes: x [M, K] fp32 contiguous; tiles [N/32, K, 32] fp32 (tiled_matmul.c's copy), or NULL where the weight has
 * an exact copy; screen: the int8 copy in the same layout ([N/32, K, 32] bytes), then the N fp32 scales, then the
 * address of the plain weight [N, K] (8 bytes: the candidates' rows are read there), then the weight's exact copy
 * (exact_codes.c) as three int64: its kind (linear.c's 8 or 9; 0: none), its codes' and its scales' addresses. The
 * full logits of up to EXACT_MAX_ROWS rows come from the exact copy where there is one (the same bits, a quarter of
 * the bytes), else from the tiles; y [M, N] fp32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int bucketserve_tiled_matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                                 int threads);
int bucketserve_exact4_matmul_f32(const float *x, const uint8_t *codes, const float *pairs, float *y, int64_t M,
                                  int64_t N, int64_t K, int threads);
int bucketserve_exact8_matmul_f32(const float *x, const int8_t *codes, const float *scales, float *y, int64_t M,
                                  int64_t N, int64_t K, int threads);

/* 1 while the running step wants only each row's maximum from the head (models/greedy_head.py sets it around the
 * step's graph; the engine thread alone runs steps). 0: the full head. */
volatile int bucketserve_head_argmax = 0;

/* Steps of more rows take the full head: the estimate costs as many FMAs as the full head, and from ~6-8 rows those,
 * not the weight's bytes, bound it. The SmolLM2 head on the Zen 3 EPYC, one thread, full / screened ms (the kernels
 * alone): 1 row 7.0-8.1 / 2.1-2.5, 2 rows 6.9-8.4 / 2.4-3.3, 4 rows 7.3-7.9 / 4.1-4.5, 6 rows 7.5-8.7 / 5.1-5.4,
 * 8 rows 7.6-10.9 / 7.2-9.0, 10 rows 8.9-12.3 / 8.8-13.3; served (step traces, session 59) decode steps of 4 rows
 * came out level and of 8 rows slower (67.6 against 59.8 ms), so 7+ rows keep the full head. */
#define SCREEN_MAX_ROWS 6
#define FULL_AT 512 /* candidates past which a row's full logits are cheaper than recomputing them one by one */

int bucketserve_greedy_head_max_rows(void) { return SCREEN_MAX_ROWS; }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The 8 int8 weights at p as fp32 (exact: |q| <= 127). */
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* x . q for rows [m0, m0 + rows) and columns [8 v0, 8 (v0 + nv)) of the group's 32 vocabulary rows (its [K, 32]
 * int8 weights qg) into part [M, 32]: each k's weights widened in registers and multiplied by every row of the
 * pass. Inlined with constant rows and nv (1-2 rows all four vectors, 3-6 rows a half: 2 x rows or 4 x rows
 * accumulators, nv weight vectors and a broadcast fit the 16 registers); `stream`: the pass that reads the group
 * from memory prefetches 2 KiB ahead of itself. */
static inline __attribute__((always_inline)) void pass_q8(const float *x, const int8_t *qg, float *part, const int rows,
                                                         const int64_t m0, const int64_t K, const int v0, const int nv,
                                                         const int stream) {
    __m256 acc[6][4];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nv; j++) acc[m][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const int8_t *t = qg + k * 32;
        if (stream && !(k & 1)) _mm_prefetch((const char *)(t + 2048), _MM_HINT_T0);
        __m256 w[4];
        for (int j = 0; j < nv; j++) w[j] = widen8(t + 8 * (v0 + j));
        for (int m = 0; m < rows; m++) {
            const __m256 xb = _mm256_broadcast_ss(x + (m0 + m) * K + k);
            for (int j = 0; j < nv; j++) acc[m][j] = _mm256_fmadd_ps(xb, w[j], acc[m][j]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(part + (m0 + m) * 32 + 8 * (v0 + j), acc[m][j]);
}

/* a pass of 3-6 rows: both halves of the group */
#define HALVES(rows)                                                                                                   \
    do {                                                                                                               \
        pass_q8(x, qg, part, rows, m0, K, 0, 2, m0 == 0);                                                              \
        pass_q8(x, qg, part, rows, m0, K, 2, 2, 0);                                                                    \
    } while (0)

/* x . q_v for all M (<= SCREEN_MAX_ROWS) rows and the group's 32 vocabulary rows into part [M, 32]: passes of up
 * to six rows over half the group, and one or two left over over all of it. */
static void group_q8(const float *x, const int8_t *qg, float *part, int64_t M, int64_t K) {
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t rows = M - m0 > 6 ? (M - m0 <= 8 ? M - m0 - 2 : 6) : M - m0;
        switch (rows) {
        case 1: pass_q8(x, qg, part, 1, m0, K, 0, 4, m0 == 0); break;
        case 2: pass_q8(x, qg, part, 2, m0, K, 0, 4, m0 == 0); break;
        case 3: HALVES(3); break;
        case 4: HALVES(4); break;
        case 5: HALVES(5); break;
        default: HALVES(6); break;
        }
        m0 += rows;
    }
}

int bucketserve_greedy_head_supported(void) { return 1; }
#else
static void group_q8(const float *x, const int8_t *qg, float *part, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < 32; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(x[m * K + k], (float)qg[k * 32 + j], acc);
            part[m * 32 + j] = acc;
        }
}

int bucketserve_greedy_head_supported(void) { return 0; }
#endif

/* The reference logit of vocabulary row v: k-order FMAs from 0 (tiled_matmul.c's sum) over its row of the plain
 * weight [N, K] (contiguous: the hardware streams it; the tile copy's column of it is K lines apart). */
static float exact_logit(const float *x, const float *plain, int64_t v, int64_t K) {
    const float *w = plain + v * K;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++) acc = fmaf(x[k], w[k], acc);
    return acc;
}

/* Row m's first maximum among the logits whose upper bound (y) reaches `low`; the row is rewritten to -inf but for
 * it. Returns 0, or -1 when it has too many candidates (the row is left for the full head). */
static int settle_row(const float *x, const float *plain, float *y, float low, int64_t N, int64_t K) {
    int64_t count = 0;
    for (int64_t v = 0; v < N; v++) count += y[v] >= low;
    if (count > FULL_AT || count == 0) return -1;
    int64_t best = -1;
    float top = 0.0f;
    for (int64_t v = 0; v < N; v++) {
        if (!(y[v] >= low)) continue;
        const float logit = exact_logit(x, plain, v, K);
        if (logit != logit) return -1; /* a NaN: the full head says where */
        if (best < 0 || logit > top) best = v, top = logit;
    }
    for (int64_t v = 0; v < N; v++) y[v] = -INFINITY;
    y[best] = top;
    return 0;
}

/* The estimate's pass over the int8 copy, groups [g0, g1): the upper bounds into y, each row's largest lower bound
 * into low [M]. part [M, 32] is scratch. */
static void estimate(const float *x, const int8_t *screen, const float *scale, const float *reach, float *y,
                     float *low, float *part, int64_t g0, int64_t g1, int64_t M, int64_t N, int64_t K) {
    for (int64_t g = g0; g < g1; g++) {
        group_q8(x, screen + g * K * 32, part, M, K);
        for (int64_t m = 0; m < M; m++) {
            float *out = y + m * N + g * 32;
            for (int j = 0; j < 32; j++) {
                const float s = scale[g * 32 + j], e = part[m * 32 + j];
                const float down = s * (e - reach[m]);
                low[m] = down > low[m] ? down : low[m];
                out[j] = s * (e + reach[m]);
            }
        }
    }
}

/* Past this many rows the full logits read the fp32 tiles rather than the exact copy: there the FMAs bound the head,
 * and rebuilding the weights from the codes adds to them (SmolLM2's Q8_0 head on the Zen 3 EPYC, one thread, tiles
 * / 8-bit codes, ms: 1 row 7.5 / 2.9, 4 rows 9.0 / 6.0, 8 rows 12.5 / 8.9, 10 rows 12.5 / 10.4, 16 rows 13.8 / 14.0,
 * 24 rows 18.0 / 19.5). */
#define EXACT_MAX_ROWS 16

/* The full logits y [M, N] of x [M, K]: from the weight's exact copy where the screen copy names one (and M is at
 * most EXACT_MAX_ROWS, or there are no tiles), else from its fp32 tiles. */
static int full(const float *x, const float *tiles, const int8_t *screen, float *y, int64_t M, int64_t N, int64_t K,
                int threads) {
    int64_t exact[3]; /* kind, codes, scales */
    memcpy(exact, screen + N * K + 4 * N + 8, sizeof exact);
    if (M > EXACT_MAX_ROWS && tiles) exact[0] = 0;
    if (exact[0] == 8)
        return bucketserve_exact4_matmul_f32(x, (const uint8_t *)(intptr_t)exact[1], (const float *)(intptr_t)exact[2],
                                             y, M, N, K, threads);
    if (exact[0] == 9)
        return bucketserve_exact8_matmul_f32(x, (const int8_t *)(intptr_t)exact[1], (const float *)(intptr_t)exact[2],
                                             y, M, N, K, threads);
    return tiles ? bucketserve_tiled_matmul_f32(x, tiles, y, M, N, K, threads) : -1;
}

/* y [M, N]: each row's first maximum (and -inf elsewhere) when bucketserve_head_argmax is set and M is at most
 * SCREEN_MAX_ROWS, else the full logits (full()). Returns 0, or -1 when the shapes do not fit. */
int bucketserve_greedy_head_f32(const float *x, const float *tiles, const int8_t *screen, float *y, int64_t M,
                                int64_t N, int64_t K, int threads) {
    if (M < 1 || K < 1 || N < 32 || N % 32) return -1;
    if (!bucketserve_head_argmax || M > SCREEN_MAX_ROWS || !bucketserve_greedy_head_supported() || threads < 1)
        return full(x, tiles, screen, y, M, N, K, threads);
    const float *scale = (const float *)(screen + N * K);
    const float *plain; /* the plain weight [N, K], whose address the screen copy ends with */
    memcpy(&plain, screen + N * K + 4 * N, sizeof plain);
    /* c: half a quantization step, the two fp32 sums' rounding (2 x 127.5 K u, u = 2^-24) and 0.2% slack for the
     * scale's, the norm's and the bounds' own roundings */
    const float c = 0.502f + 255.0f * (float)K * 5.9604645e-8f * 1.05f;
    float reach[SCREEN_MAX_ROWS]; /* c ||x_m||_1: a logit's bound is its scale times this */
    int kind[SCREEN_MAX_ROWS];    /* 0 screened, 1 a zero row, 2 the full head (a norm not finite, or tiny) */
    for (int64_t m = 0; m < M; m++) {
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++) s += fabsf(x[m * K + k]);
        reach[m] = c * s;
        /* below 1e-30 the sums may underflow and past 1e36 an estimate overflow, where the bounds above do not
         * hold */
        kind[m] = s == 0.0f ? 1 : !(s >= 1e-30f && s <= 1e36f) ? 2 : 0;
    }
    const int64_t groups = N / 32;
    float *part = malloc((size_t)threads * M * 32 * sizeof(float));
    float *lows = malloc((size_t)threads * M * sizeof(float));
    if (part == NULL || lows == NULL) {
        free(part), free(lows);
        return full(x, tiles, screen, y, M, N, K, threads);
    }
    for (int64_t i = 0; i < threads * M; i++) lows[i] = -INFINITY;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < threads; t++)
        estimate(x, screen, scale, reach, y, lows + t * M, part + t * M * 32, groups * t / threads,
                 groups * (t + 1) / threads, M, N, K);
    free(part);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < M; m++) {
        float low = -INFINITY;
        for (int t = 0; t < threads; t++) low = lows[t * M + m] > low ? lows[t * M + m] : low;
        float *row = y + m * N;
        if (kind[m] == 1) { /* every reference logit of a zero row is +0 (FMAs from +0): the first is the maximum */
            for (int64_t v = 0; v < N; v++) row[v] = -INFINITY;
            row[0] = 0.0f;
        } else if (kind[m] == 0 && settle_row(x + m * K, plain, row, low, N, K) != 0) {
            kind[m] = 2;
        }
    }
    free(lows);
    for (int64_t m = 0; m < M; m++) /* the rows left to the full head, with every thread */
        if (kind[m] == 2) full(x + m * K, tiles, screen, y + m * N, 1, N, K, threads);
    return 0;
}
