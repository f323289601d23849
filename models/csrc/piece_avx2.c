/* Causal attention of a float32 prompt piece over its slot on CPUs with AVX2 and FMA but no AVX-512 (an AMD EPYC
 * with Zen 3 cores, say): piece_attention.c's entry hands its fp32 pieces here where the build has no 16-lane
 * vectors (it has none of its own there).
 *
 * Why: PyTorch's flash SDPA ran SmolLM2's prompt pieces at 17-36 GFLOP/s there (one thread; a 120-token piece from
 * position 0 ~0.9 ms a layer, a 1024-token prompt 29-36 ms a layer: a fifth of its step), against the core's ~80
 * for FMAs. Here both products are register-blocked like tiled_matmul.c's AVX2 matmul: a block of up to ROWS query
 * tokens of one head keeps its accumulators in the 16 ymm registers while K (transposed once per KV head) or V
 * streams past.
 *
 * Shapes and strides as piece_attention.c (fp32 elements): token t, head h of q at q + t*qt + h*qh (D contiguous),
 * out the same with ot, oh; position p of KV head g at k + g*kvh + p*kvp (D contiguous), v alike. H query heads,
 * Hkv KV heads (head h reads KV head h / (H / Hkv)). D % 32 == 0, D <= 256. Token t of the piece (position
 * start + t) attends positions [0, start + t].
 *
 * Per KV head, K's positions [0, start + n) are copied transposed in blocks of 16 positions ([Lp / 16, D, 16]: 8
 * positions a vector, zeros past the end; [D, Lp] rows 4 KiB apart would share L1 sets), shared by the head's query
 * heads. Then per (query head, block of ROWS tokens), without online rescaling:
 *   1. S [rows, L] = scale * Q K^T, 16 positions (two vectors) at a time, L the positions the block's last token
 *      sees;
 *   2. per row: max over the positions it sees, p = exp(s - max) there and 0 past them, the row's sum;
 *   3. O [rows, D] = P V / sum, V read in place, 16 of D's dims at a time.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "vec8.h"

#define ROWS 6    /* query tokens a block: 6 x 2 score accumulators (12 ymm), 2 K vectors and a broadcast */
#define MAX_D 256 /* as piece_attention.c */

/* S[r][p0 .. p0 + 16) = scale * q_r . K[p], r < rows (constant where inlined); kc [D, 16] the transposed K of
 * those 16 positions. */
static inline __attribute__((always_inline)) void scores16(const float *q, int64_t qt, const float *kc, int64_t p0,
                                                           int64_t D, const int rows, float scale, float *s,
                                                           int64_t sl) {
    v8f a[ROWS][2];
    for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = splat8(0.0f);
    for (int64_t d = 0; d < D; d++) {
        const v8f k0 = load8(kc + d * 16), k1 = load8(kc + d * 16 + 8);
        for (int r = 0; r < rows; r++) {
            const v8f x = splat8(q[r * qt + d]);
            a[r][0] += x * k0;
            a[r][1] += x * k1;
        }
    }
    for (int r = 0; r < rows; r++) {
        const v8f s0 = a[r][0] * scale, s1 = a[r][1] * scale;
        memcpy(s + r * sl + p0, &s0, sizeof s0);
        memcpy(s + r * sl + p0 + 8, &s1, sizeof s1);
    }
}

/* out rows [0, rows) (constant where inlined), dims [8 c0, 8 c0 + 16) = sum over p < L of P[r][p] V[p] / sum_r:
 * 6 rows x 2 vectors of accumulators, so each V vector loaded feeds 6 FMAs (V comes from L2: 256 KiB a KV head at
 * 1024 positions). */
static inline __attribute__((always_inline)) void weighted16(const float *p, int64_t sl, const float *v, int64_t kvp,
                                                             int64_t L, int64_t c0, const int rows, const float *inv,
                                                             float *out, int64_t ot) {
    v8f a[ROWS][2];
    for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = splat8(0.0f);
    for (int64_t j = 0; j < L; j++) {
        const v8f v0 = load8(v + j * kvp + 8 * c0), v1 = load8(v + j * kvp + 8 * c0 + 8);
        for (int r = 0; r < rows; r++) {
            const v8f w = splat8(p[r * sl + j]);
            a[r][0] += w * v0;
            a[r][1] += w * v1;
        }
    }
    for (int r = 0; r < rows; r++) {
        const v8f o0 = a[r][0] * inv[r], o1 = a[r][1] * inv[r];
        memcpy(out + r * ot + 8 * c0, &o0, sizeof o0);
        memcpy(out + r * ot + 8 * c0 + 8, &o1, sizeof o1);
    }
}

/* One block: tokens [t0, t0 + rows) of query head q (q + t * qt), over kt / v of its KV head, into out. */
static void block8(const float *q, int64_t qt, const float *kt, const float *v, int64_t kvp, float *out, int64_t ot,
                   int64_t t0, int64_t rows, int64_t start, int64_t D, float scale, float *s) {
    const int64_t L = start + t0 + rows, L16 = (L + 15) / 16 * 16, sl = L16;
    const float *qb = q + t0 * qt;
    for (int64_t p0 = 0; p0 < L16; p0 += 16) {
        switch (rows) {
        case 1: scores16(qb, qt, kt + p0 * D, p0, D, 1, scale, s, sl); break;
        case 2: scores16(qb, qt, kt + p0 * D, p0, D, 2, scale, s, sl); break;
        case 3: scores16(qb, qt, kt + p0 * D, p0, D, 3, scale, s, sl); break;
        case 4: scores16(qb, qt, kt + p0 * D, p0, D, 4, scale, s, sl); break;
        case 5: scores16(qb, qt, kt + p0 * D, p0, D, 5, scale, s, sl); break;
        default: scores16(qb, qt, kt + p0 * D, p0, D, ROWS, scale, s, sl); break;
        }
    }
    float inv[ROWS];
    for (int64_t r = 0; r < rows; r++) { /* softmax over the positions row r sees: [0, start + t0 + r] */
        float *sr = s + r * sl;
        const int64_t seen = start + t0 + r + 1;
        v8f mv = splat8(-3.0e38f);
        int64_t i = 0;
        for (; i + 8 <= seen; i += 8) mv = max8(load8(sr + i), mv);
        float m = hmax8(mv);
        for (; i < seen; i++) m = sr[i] > m ? sr[i] : m;
        v8f sum8 = splat8(0.0f);
        for (i = 0; i < L16; i += 8) { /* lanes past `seen` weigh 0 */
            const v8i lane = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + (int32_t)i;
            const v8f w = select8(lane < (int32_t)seen, vexp8(load8(sr + i) - m), splat8(0.0f));
            memcpy(sr + i, &w, sizeof w);
            sum8 += w;
        }
        inv[r] = 1.0f / hsum8(sum8);
    }
    float *o = out + t0 * ot;
    for (int64_t c0 = 0; c0 < D / 8; c0 += 2) {
        switch (rows) {
        case 1: weighted16(s, sl, v, kvp, L, c0, 1, inv, o, ot); break;
        case 2: weighted16(s, sl, v, kvp, L, c0, 2, inv, o, ot); break;
        case 3: weighted16(s, sl, v, kvp, L, c0, 3, inv, o, ot); break;
        case 4: weighted16(s, sl, v, kvp, L, c0, 4, inv, o, ot); break;
        case 5: weighted16(s, sl, v, kvp, L, c0, 5, inv, o, ot); break;
        default: weighted16(s, sl, v, kvp, L, c0, ROWS, inv, o, ot); break;
        }
    }
}

/* Returns 0, or -1 for shapes it does not take or scratch it could not get (the caller then uses SDPA). */
int bucketserve_piece_attention_f32x8(const float *q, const float *k, const float *v, float *out, int64_t n,
                                      int64_t start, int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh,
                                      int64_t ot, int64_t oh, int64_t kvh, int64_t kvp, float scale, int threads) {
    /* D % 32 as piece_attention.c's (native.piece_attention checks the same, so the C++ and Python kernels agree) */
    if (n < 1 || start < 0 || Hkv < 1 || H % Hkv || D < 32 || D % 32 || D > MAX_D || kvp < D) return -1;
    const int64_t L = start + n, Lp = (L + 15) / 16 * 16, G = H / Hkv, blocks = (n + ROWS - 1) / ROWS;
    float *kt = malloc((size_t)(Hkv * D * Lp) * sizeof(float));
    if (kt == NULL) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < Hkv; g++) { /* K transposed in blocks of 16 positions: [Lp / 16, D, 16], zeros past L */
            float *t = kt + g * D * Lp;
            const float *kg = k + g * kvh;
            memset(t + (L / 16) * 16 * D, 0, (size_t)((Lp - L / 16 * 16) * D) * sizeof(float));
            for (int64_t p = 0; p < L; p++)
                for (int64_t d = 0; d < D; d++) t[(p / 16) * 16 * D + d * 16 + p % 16] = kg[p * kvp + d];
        }
        float *s = malloc((size_t)(ROWS * Lp) * sizeof(float));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < H * blocks; i++) {
            if (s == NULL) continue;
            const int64_t h = i / blocks, b = blocks - 1 - i % blocks, g = h / G; /* the longest blocks first */
            const int64_t t0 = b * ROWS, rows = n - t0 < ROWS ? n - t0 : ROWS;
            block8(q + h * qh, qt, kt + g * D * Lp, v + g * kvh, kvp, out + h * oh, ot, t0, rows, start, D, scale, s);
        }
        free(s);
    }
    free(kt);
    return failed ? -1 : 0;
}

int bucketserve_piece_f32x8_supported(void) { return 1; }

#else

int bucketserve_piece_attention_f32x8(const float *q, const float *k, const float *v, float *out, int64_t n,
                                      int64_t start, int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh,
                                      int64_t ot, int64_t oh, int64_t kvh, int64_t kvp, float scale, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)n, (void)start, (void)H, (void)Hkv, (void)D, (void)qt, (void)qh;
    (void)ot, (void)oh, (void)kvh, (void)kvp, (void)scale, (void)threads;
    return -1;
}

int bucketserve_piece_f32x8_supported(void) { return 0; }

#endif
