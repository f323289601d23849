/* Decode attention for float32 models on CPUs with AVX2 and FMA but no AVX-512 (an AMD EPYC with Zen 3 cores, say):
 * the entry decode_attention.c hands its fp32 rows to where the build has no 16-lane vectors.
 *
 * Why a kernel of its own: decode_attention.c is written in 16-lane vectors; without AVX-512 GCC lowers their
 * comparisons and shuffles to scalar instructions, and its accumulators (3 queries x 64 dims) need twice the 16
 * ymm registers. It ran 3-4x slower than PyTorch's SDPA there, and SDPA reads a decode row's K/V at about half the
 * memory's speed (fp32, one thread, 16 rows at 300 positions: 1.2-1.4 ms a layer in a step, ~0.5 to read them).
 * This one is written in 8-lane vectors, which AVX2 has, and in three passes per (row, KV head), each small enough
 * for the registers: the scores of every query head (K read once from memory, four positions at a time), their
 * softmax (exact: max first, then exp and sum), then each query head's weighted sum of V (V read from memory for
 * the first, from L2 for the others: a head's V at 2048 positions is 512 KiB at D = 64).
 *
 * Shapes as decode_attention.c (fp32 only): q [R, H, G, D] contiguous; k, v: row r reads slot slots[r], position
 * p of head h at slot * s_slot + h * s_head + p * D; ext[r] positions (>= 1); out [R, H, G, D]. D % 8 == 0.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "vec8.h"

#define AHEAD 64 /* positions prefetched ahead into L2, as decode_attention.c (4 KiB pages stop the hardware's) */

static inline void prefetch_row8(const float *base, int64_t p, int64_t D) {
    const char *row = (const char *)(base + p * D);
    for (int64_t off = 0; off < D * 4; off += 64) __builtin_prefetch(row + off, 0, 2);
}

/* One (row, KV head): G queries qb [G, D] over n positions of kb, vb [n, D] -> ob [G, D]; sc: [G, n] scratch.
 * Inlined with constant G and D where the caller knows them (SmolLM2: 3 and 64), so the D loops unroll. `run` >= 1:
 * the queries are a run's tokens, `run` query heads each (g = token * run + head), token t at position n - T + t of
 * T = G / run tokens, seeing positions [0, n - T + t]; the scores are computed once for the longest and each query's
 * softmax and sum over V stop at its own extent, as that token's decoding row would (the same bits). 0: every query
 * sees the n positions. */
static inline __attribute__((always_inline)) void head8(const float *qb, const float *kb, const float *vb, float *ob,
                                                        const int64_t n_all, const int64_t G, const int64_t D,
                                                        float scale, float *sc, const int64_t run) {
    const int64_t n = n_all;
    const int64_t nc = D / 8;
    for (int64_t p = 0; p < AHEAD && p < n; p++) {
        prefetch_row8(kb, p, D);
        prefetch_row8(vb, p, D);
    }
    /* scores: four positions at a time, each query head's four dot products from those K rows (L1 after the first) */
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) {
        for (int64_t j = 0; j < 4; j++) prefetch_row8(kb, p + j + AHEAD, D);
        const float *k0 = kb + p * D;
        for (int64_t g = 0; g < G; g++) {
            const float *q = qb + g * D;
            v8f a0 = splat8(0.0f), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t c = 0; c < nc; c++) {
                const v8f qc = load8(q + 8 * c);
                a0 += qc * load8(k0 + 8 * c);
                a1 += qc * load8(k0 + D + 8 * c);
                a2 += qc * load8(k0 + 2 * D + 8 * c);
                a3 += qc * load8(k0 + 3 * D + 8 * c);
            }
            float *s = sc + g * n + p;
            s[0] = hsum8(a0) * scale;
            s[1] = hsum8(a1) * scale;
            s[2] = hsum8(a2) * scale;
            s[3] = hsum8(a3) * scale;
        }
    }
    for (; p < n; p++) {
        for (int64_t g = 0; g < G; g++) {
            v8f a = splat8(0.0f);
            for (int64_t c = 0; c < nc; c++) a += load8(qb + g * D + 8 * c) * load8(kb + p * D + 8 * c);
            sc[g * n + p] = hsum8(a) * scale;
        }
    }
    /* softmax weights (unnormalized: the sums divide the outputs), then each query head's sum over V */
    for (int64_t g = 0; g < G; g++) {
        float *s = sc + g * n_all;
        const int64_t n = run ? n_all - G / run + 1 + g / run : n_all; /* this query's extent */
        float m = s[0];
        int64_t i = 0;
        if (n >= 8) {
            v8f mv = load8(s);
            for (i = 8; i + 8 <= n; i += 8) {
                const v8f x = load8(s + i);
                mv = max8(x, mv);
            }
            m = hmax8(mv);
        }
        for (; i < n; i++) m = s[i] > m ? s[i] : m;
        v8f sum8 = splat8(0.0f);
        for (i = 0; i + 8 <= n; i += 8) {
            const v8f w = vexp8(load8(s + i) - m);
            memcpy(s + i, &w, sizeof w);
            sum8 += w;
        }
        if (i < n) { /* the tail, in one padded vector (its lanes past n are -inf: weight 0) */
            float tail[8];
            for (int64_t j = 0; j < 8; j++) tail[j] = i + j < n ? s[i + j] - m : -1.0e30f;
            const v8f w = vexp8(load8(tail));
            for (int64_t j = 0; i + j < n; j++) s[i + j] = w[j];
            sum8 += select8((v8i){0, 1, 2, 3, 4, 5, 6, 7} < (int32_t)(n - i), w, splat8(0.0f));
        }
        const float sum = hsum8(sum8);
        v8f acc[32]; /* D <= 256 */
        for (int64_t c = 0; c < nc; c++) acc[c] = splat8(0.0f);
        for (int64_t j = 0; j < n; j++) {
            if (g == 0) prefetch_row8(vb, j + AHEAD, D);
            const v8f w = splat8(s[j]);
            const float *vr = vb + j * D;
            for (int64_t c = 0; c < nc; c++) acc[c] += w * load8(vr + 8 * c);
        }
        const float inv = 1.0f / sum;
        for (int64_t c = 0; c < nc; c++) {
            const v8f o = acc[c] * inv;
            memcpy(ob + g * D + 8 * c, &o, sizeof o);
        }
    }
}

/* Every (row, KV head) of a decode step in fp32 (the arguments of bucketserve_decode_attention). Returns 0, or -1
 * for shapes it does not take (D % 8, D > 256, a row of no positions: the caller then uses SDPA). */
int bucketserve_decode_attention_f32x8(const float *q, const float *k, const float *v, float *out,
                                       const int64_t *slots, const int64_t *ext, int64_t rows, int64_t heads,
                                       int64_t groups, int64_t dim, int64_t s_slot, int64_t s_head, float scale,
                                       int threads) {
    if (groups < 1 || dim % 8 || dim < 8 || dim > 256) return -1;
    int64_t most = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (ext[r] < 1) return -1;
        most = ext[r] > most ? ext[r] : most;
    }
    const int64_t G = groups, D = dim;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *sc = malloc((size_t)(G * most) * sizeof(float));
        if (sc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < rows * heads; rh++) {
            if (sc == NULL) continue;
            const int64_t r = rh / heads, h = rh % heads, base = slots[r] * s_slot + h * s_head;
            const float *qb = q + rh * G * D;
            float *ob = out + rh * G * D;
            if (G == 3 && D == 64) /* SmolLM2 and its relatives */
                head8(qb, k + base, v + base, ob, ext[r], 3, 64, scale, sc, 0);
            else
                head8(qb, k + base, v + base, ob, ext[r], G, D, scale, sc, 0);
        }
        free(sc);
    }
    return failed ? -1 : 0;
}

int bucketserve_decode_f32x8_supported(void) { return 1; }

/* A run: n tokens of one slot at positions [start, start + n) (a verify step's row and its drafts), token t seeing
 * positions [0, start + t]; the arguments of bucketserve_run_attention (run_attention.c: q token t, query head h at
 * q + t * qt + h * qh, out alike; K/V position p of KV head g at k + g * kvh + p * kvp). Each KV head's n x G queries
 * go through one head8 call, so the slot's K/V is read once for the run rather than once a token (as decoding rows),
 * and each query's output has the bits its decoding row would. Why: a float32 verify step's drafts read their row's
 * K/V again as decoding rows, ~1.9 ms a token at 500 positions (30 layers, 12 GB/s), which made a draft cost what a
 * row does (docs/performance.md, session 58). Returns -1 for shapes it does not take (kvp != D, n x G > MAX_RUN_Q). */
#define MAX_RUN_Q 64
int bucketserve_run_attention_f32x8(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                                    int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                                    int64_t kvh, int64_t kvp, float scale, int threads, const void *next_k,
                                    const void *next_v, int64_t next_rows, int warm) {
    (void)next_k, (void)next_v, (void)next_rows, (void)warm;
    if (n < 1 || start < 0 || Hkv < 1 || H % Hkv || D % 8 || D < 8 || D > 256 || kvp != D) return -1;
    const int64_t G = H / Hkv, Q = n * G, L = start + n;
    if (Q > MAX_RUN_Q) return -1;
    const float *qf = q, *kf = k, *vf = v;
    float *of = out;
    int failed = 0;
    /* a KV head a thread, as the decode entry splits its (row, KV head) pairs */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t h = 0; h < Hkv; h++) {
        float *qb = malloc((size_t)(2 * Q * D + Q * L) * sizeof(float));
        if (qb == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *ob = qb + Q * D, *sc = ob + Q * D;
        for (int64_t t = 0; t < n; t++) /* the run's queries of this KV head, token by token */
            for (int64_t g = 0; g < G; g++) memcpy(qb + (t * G + g) * D, qf + t * qt + (h * G + g) * qh, D * 4);
        if (D == 64)
            head8(qb, kf + h * kvh, vf + h * kvh, ob, L, Q, 64, scale, sc, G);
        else
            head8(qb, kf + h * kvh, vf + h * kvh, ob, L, Q, D, scale, sc, G);
        for (int64_t t = 0; t < n; t++)
            for (int64_t g = 0; g < G; g++) memcpy(of + t * ot + (h * G + g) * oh, ob + (t * G + g) * D, D * 4);
        free(qb);
    }
    return failed ? -1 : 0;
}

int bucketserve_run_f32x8_supported(void) { return 1; }

#else

int bucketserve_decode_attention_f32x8(const float *q, const float *k, const float *v, float *out,
                                       const int64_t *slots, const int64_t *ext, int64_t rows, int64_t heads,
                                       int64_t groups, int64_t dim, int64_t s_slot, int64_t s_head, float scale,
                                       int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)slots, (void)ext, (void)rows, (void)heads, (void)groups, (void)dim;
    (void)s_slot, (void)s_head, (void)scale, (void)threads;
    return -1;
}

int bucketserve_decode_f32x8_supported(void) { return 0; }

int bucketserve_run_attention_f32x8(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                                    int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                                    int64_t kvh, int64_t kvp, float scale, int threads, const void *next_k,
                                    const void *next_v, int64_t next_rows, int warm) {
    (void)q, (void)k, (void)v, (void)out, (void)n, (void)start, (void)H, (void)Hkv, (void)D, (void)qt, (void)qh;
    (void)ot, (void)oh, (void)kvh, (void)kvp, (void)scale, (void)threads, (void)next_k, (void)next_v, (void)next_rows;
    (void)warm;
    return -1;
}

int bucketserve_run_f32x8_supported(void) { return 0; }

#endif
