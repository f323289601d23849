/* Attention of a short run of tokens of one slot, bfloat16, on AVX512-BF16 dot products: run_attention.c's pass
 * where the CPU has no AMX tiles (models/csrc/dispatch.cpp calls it for a verify step's runs of 3..SHORT_RUN tokens,
 * piece_attention.c for pieces of up to RUN_MAX_TOKENS tokens).
 *
 * Why: without tiles, a verify step's row and its drafts went as decoding rows (decode_attention.c), so each token
 * re-read the slot's K/V and paid the decode kernel's per-row reductions; as a piece, the slot's K was transposed
 * (gathers) for each call and 16-token blocks carried 1-4 tokens. Here the run's n tokens x G query heads of a KV
 * head are the 16 lanes of the scores, and the slot's K/V is read once, in place, for all of them. Measured (AMD
 * EPYC Zen 5, one thread, SmolLM2's shapes, 8 slots at ~300 positions, the 30 layers' caches in turn): 8 runs of 4
 * tokens 4.4-4.9 ms against 6.7 as 32 decoding rows; of 2 tokens 4.3-4.7 against 3.7, so runs of 2 stay decoding
 * rows here (native_library.shortest_run). A 32-token verify step of 8 such rows: attention 6.8 -> 4.9 ms.
 *
 * Same arguments as bucketserve_run_attention (shapes and strides in piece_attention.c's header comment): token t
 * sees positions [0, start + t]. Per KV head, query rows c = t * G + g (16 a block, one per lane), one pass over the
 * positions the block sees, CHUNK at a time (online softmax):
 *   1. S^T [CHUNK, 16] = K Q^T in fp32: per position, D/2 dot products of Q^T's rows (row i: dims 2i, 2i + 1 of the
 *      16 queries) with the position's K dword i broadcast; K read where it sits, 16 positions a pass;
 *   2. per lane: the running max, p = exp(scale * (s - max)), 0 past the positions the row sees, sums in fp32; P
 *      rounded to bf16 (as the other kernels round it) and paired by positions (2j, 2j + 1) per lane;
 *   3. O [rows, D] = O * alpha + P V, lanes now dims (only the block's own rows): per pair of positions, row c's
 *      weight pair broadcast times V's two rows interleaved (once a chunk); at the end divided by the sums, rounded
 *      once.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "attention_common.h"

#define VEC_MAX_D 256
#define CHUNK 32
#define AHEAD 64 /* positions prefetched ahead (K and V), into L2: 64 read best of 0-256 (8 runs of 4 tokens) */

/* S^T rows st [len, 16] of positions [p0, p0 + len): lane c = row c's q . k over D (qtile: D/2 rows of 16 dwords),
 * K's positions `ks` dwords apart. PASS positions a pass, as many independent sums as keep the dot products' pipes
 * full past their latency. Inlined with constant D and ks where it can (`scores`): the PASS positions' addresses are
 * then offsets of one pointer, where a runtime stride made them a chain of dependent adds (one a cycle, which bounded
 * the pass at one dot product a cycle). */
#define PASS 16
static inline __attribute__((always_inline)) void scores_at(const uint16_t *k, const uint16_t *v, int64_t ks,
                                                            int64_t p0, int64_t len, int64_t D, const uint32_t *qtile,
                                                            float *st) {
    const int64_t half = D / 2, kvp = 2 * ks;
    const uint32_t *kb = (const uint32_t *)(k + p0 * kvp);
    int64_t j = 0;
    for (; j + PASS <= len; j += PASS) {
        /* the PASS positions AHEAD on are PASS * D * 2 bytes of K and as many of V: one 64-byte line of each an
         * iteration of the D/2 below (PASS = 16), spread out rather than a burst */
        const char *fk = (const char *)(k + (p0 + j + AHEAD) * kvp), *fv = (const char *)(v + (p0 + j + AHEAD) * kvp);
        const uint32_t *r = kb + j * ks;
        __m512 a[PASS];
        for (int u = 0; u < PASS; u++) a[u] = _mm512_setzero_ps();
        for (int64_t i = 0; i < half; i++) {
            const int64_t line = (i * PASS / 16) * 64, pos = line / (D * 2);
            __builtin_prefetch(fk + pos * kvp * 2 + line % (D * 2), 0, 2);
            __builtin_prefetch(fv + pos * kvp * 2 + line % (D * 2), 0, 2);
            const __m512bh qv = (__m512bh)_mm512_load_si512(qtile + i * 16);
            for (int u = 0; u < PASS; u++)
                a[u] = _mm512_dpbf16_ps(a[u], qv, (__m512bh)_mm512_set1_epi32((int)r[u * ks + i]));
        }
        for (int u = 0; u < PASS; u++) _mm512_store_ps(st + (j + u) * 16, a[u]);
    }
    for (; j < len; j++) {
        const uint32_t *r = kb + j * ks;
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < half; i++)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_load_si512(qtile + i * 16), (__m512bh)_mm512_set1_epi32((int)r[i]));
        _mm512_store_ps(st + j * 16, a);
    }
}

static void scores(const uint16_t *k, const uint16_t *v, int64_t kvp, int64_t p0, int64_t len, int64_t D,
                   const uint32_t *qtile, float *st) {
    if (D == 64 && kvp == 64)
        scores_at(k, v, 32, p0, len, 64, qtile, st);
    else if (D == 128 && kvp == 128)
        scores_at(k, v, 64, p0, len, 128, qtile, st);
    else
        scores_at(k, v, kvp / 2, p0, len, D, qtile, st);
}

/* o [16, D] fp32 (row c's dims in unpack order: lo's dword 4k + r of each 32-dim half holds dim 8k + r, hi's
 * 8k + 4 + r) = o * alpha + P V over positions [p0, p0 + len); V rows at or past L read as zeros (the slot's buffer
 * may end there). Lanes are dims, so only the block's rows are computed, 16 / nv at a time (nv = D / 16 vectors a
 * row: 16 accumulators; rows past `rows` in the last group are padding lanes, computed and not stored). Inlined with a constant nv, so
 * the accumulators stay in registers. vint: scratch [CHUNK / 2, D] dwords. */
static inline __attribute__((always_inline)) void output_at(const uint32_t *pairs, const uint16_t *v, int64_t kvp,
                                                            int64_t p0, int64_t len, int64_t L, int64_t nv,
                                                            int64_t rows, __m512 alpha, float *o, uint32_t *vint) {
    const int64_t np = (len + 1) / 2, D = nv * 16, group = 16 / nv;
    for (int64_t j = 0; j < np; j++) { /* V's rows 2j, 2j + 1 as dword pairs, 16-bit interleaves in 128-bit lanes */
        const int64_t a = p0 + 2 * j, b = a + 1;
        for (int64_t h = 0; h < D; h += 32) {
            const __m512i x = a < L ? _mm512_loadu_si512(v + a * kvp + h) : _mm512_setzero_si512();
            const __m512i y = b < L ? _mm512_loadu_si512(v + b * kvp + h) : _mm512_setzero_si512();
            _mm512_store_si512(vint + j * D + h, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(vint + j * D + h + 16, _mm512_unpackhi_epi16(x, y));
        }
    }
    float w[16];
    _mm512_storeu_ps(w, alpha);
    for (int64_t c0 = 0; c0 < rows; c0 += group) {
        __m512 acc[16];
        for (int64_t r = 0; r < group; r++)
            for (int64_t e = 0; e < nv; e++)
                acc[r * nv + e] = _mm512_mul_ps(_mm512_load_ps(o + (c0 + r) * D + e * 16), _mm512_set1_ps(w[c0 + r]));
        for (int64_t j = 0; j < np; j++) {
            const uint32_t *vj = vint + j * D;
            for (int64_t r = 0; r < group; r++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pairs[j * 16 + c0 + r]);
                for (int64_t e = 0; e < nv; e++)
                    acc[r * nv + e] = _mm512_dpbf16_ps(acc[r * nv + e], pb, (__m512bh)_mm512_load_si512(vj + e * 16));
            }
        }
        for (int64_t r = 0; r < group; r++)
            for (int64_t e = 0; e < nv; e++) _mm512_store_ps(o + (c0 + r) * D + e * 16, acc[r * nv + e]);
    }
}

static void output(const uint32_t *pairs, const uint16_t *v, int64_t kvp, int64_t p0, int64_t len, int64_t L,
                   int64_t D, int64_t rows, __m512 alpha, float *o, uint32_t *vint) {
    if (D == 64)
        output_at(pairs, v, kvp, p0, len, L, 4, rows, alpha, o, vint);
    else if (D == 128)
        output_at(pairs, v, kvp, p0, len, L, 8, rows, alpha, o, vint);
    else if (D == 256)
        output_at(pairs, v, kvp, p0, len, L, 16, rows, alpha, o, vint);
    else /* other head dims: the same pass, its accumulators not all in registers */
        output_at(pairs, v, kvp, p0, len, L, D / 16, rows, alpha, o, vint);
}

/* KV head kh: its query rows, 16 a block, one pass over the positions the block's rows see. 0, or -1 without
 * scratch. */
static int one_kv_head(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t n,
                       int64_t start, int64_t G, int64_t kh, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                       int64_t kvp, float scale) {
    const int64_t L = start + n, rows_all = n * G;
    float *st = scratch(0, CHUNK * 16 * 4), *o = scratch(1, (size_t)(16 * D * 4));
    uint32_t *qtile = scratch(3, (size_t)(D / 2 * 16 * 4)), *pairs = scratch(4, CHUNK / 2 * 16 * 4);
    uint32_t *vint = scratch(5, (size_t)(CHUNK / 2 * D * 4));
    if (!st || !o || !qtile || !pairs || !vint) return -1;
    const float l2 = scale * 1.44269504088896341f; /* exp(scale * x) = 2^(l2 * x) */
    for (int64_t c0 = 0; c0 < rows_all; c0 += 16) {
        const int64_t rows = rows_all - c0 < 16 ? rows_all - c0 : 16;
        const int64_t seen = start + (c0 + rows - 1) / G + 1; /* positions the block's last row sees */
        int32_t lim[16];
        for (int64_t c = 0; c < 16; c++) lim[c] = (int32_t)(c < rows ? start + (c0 + c) / G + 1 : seen);
        const __m512i limv = _mm512_loadu_si512(lim);
        pack_queries(q, qt, qh, kh, G, c0, rows, D, qtile);
        memset(o, 0, (size_t)(16 * D * 4));
        __m512 m = _mm512_set1_ps(-3.0e38f), l = _mm512_setzero_ps();
        for (int64_t p0 = 0; p0 < seen; p0 += CHUNK) {
            const int64_t len = seen - p0 < CHUNK ? seen - p0 : CHUNK;
            scores(k, v, kvp, p0, len, D, qtile, st);
            const __m512 alpha = online_softmax(st, limv, p0, len, (len + 1) / 2 * 2, l2, &m, &l, pairs, NULL, NULL);
            output(pairs, v, kvp, p0, len, L, D, rows, alpha, o, vint);
        }
        float inv[16];
        _mm512_storeu_ps(inv, l);
        /* natural dim e of a 32-dim half <- lane of the (lo, hi) unpack pair: lo's dword 4k + r holds dim 8k + r,
         * hi's 8k + 4 + r */
        int32_t order[16];
        for (int e = 0; e < 16; e++) order[e] = (e % 8) / 4 * 16 + 4 * (e / 8) + e % 4;
        const __m512i first = _mm512_loadu_si512(order), second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
        for (int64_t c = 0; c < rows; c++) {
            const int64_t t = (c0 + c) / G, h = kh * G + (c0 + c) % G;
            __m512 r[VEC_MAX_D / 16];
            for (int64_t i = 0; i < D / 16; i += 2) {
                const __m512 lo = _mm512_load_ps(o + c * D + i * 16), hi = _mm512_load_ps(o + c * D + i * 16 + 16);
                r[i] = _mm512_permutex2var_ps(lo, first, hi);
                r[i + 1] = _mm512_permutex2var_ps(lo, second, hi);
            }
            store_row(out + t * ot + h * oh, r, D / 16, 1.0f / inv[c]);
        }
    }
    return 0;
}

int bucketserve_run_vec_supported(void) { return 1; }

/* bucketserve_run_attention's arguments (bf16; the next call's slot and `warm` are not used: the hardware prefetcher
 * follows these reads), KV heads split over `threads`. Returns 0, or -1 for shapes it does not take (the caller then
 * takes another kernel). */
int bucketserve_run_attention_vec(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                                  int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                                  int64_t kvh, int64_t kvp, float scale, int threads, const void *next_k,
                                  const void *next_v, int64_t next_rows, int warm) {
    (void)next_k, (void)next_v, (void)next_rows, (void)warm;
    if (n < 1 || start < 0 || Hkv < 1 || H % Hkv || D < 32 || D % 32 || D > VEC_MAX_D || kvp < D || kvp % 2) return -1;
    int failed = 0;
    const uint16_t *k16 = (const uint16_t *)k, *v16 = (const uint16_t *)v;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(| : failed)
#endif
    for (int64_t kh = 0; kh < Hkv; kh++)
        failed |= one_kv_head((const uint16_t *)q, k16 + kh * kvh, v16 + kh * kvh, (uint16_t *)out, n, start, H / Hkv,
                              kh, D, qt, qh, ot, oh, kvp, scale);
    (void)threads;
    return failed ? -1 : 0;
}
#else
int bucketserve_run_vec_supported(void) { return 0; } /* and no bucketserve_run_attention_vec: nothing calls it */
#endif
