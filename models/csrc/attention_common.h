/* What the bf16 attention kernels share (piece_products.h for piece_attention.c, run_attention.c and run_vec.c): the
 * tile configuration, exp for the softmax, a block of queries as Q^T, per-thread scratch and the rounding of an output
 * row. Needs AVX512-BF16 (the includers' guard). */
#ifndef BUCKETSERVE_ATTENTION_COMMON_H
#define BUCKETSERVE_ATTENTION_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif

#if HAVE_TILES
#include "amx_tiles.h"

/* Every tile 16 rows of 64 bytes: tmm0-3 fp32 accumulators, tmm4 an A tile (Q or P), tmm5-7 B tiles (K or V). */
static inline void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* The output accumulators tmm0-3: zeroed, and stored to acc[i] [16, 16] fp32. */
static inline void acc_zero(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline void acc_store(float acc[4][16][16]) {
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
}

/* One 32-position step of O = P V into the accumulators tmm0-3 (tmm0-1 only when nd <= 2, 32 dims): the A tile of
 * P at p (rows `ps` bytes apart), the B tiles of V at v + i * vnext (rows `vs` bytes apart). */
static inline void pv_tiles(const uint16_t *p, int64_t ps, const uint16_t *v, int64_t vs, int64_t vnext, int64_t nd) {
    _tile_loadd(4, p, ps);
    _tile_loadd(5, v, vs);
    _tile_loadd(6, v + vnext, vs);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    if (nd > 2) {
        _tile_loadd(7, v + 2 * vnext, vs);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, v + 3 * vnext, vs);
        _tile_dpbf16ps(3, 4, 5);
    }
}
#endif

/* 2^t for t <= 0 (scores minus their row max, in base 2): 2^round(t) (scalef: exact, 0 below the fp32 range) times
 * 2^f, |f| <= 1/2, by its degree-5 Taylor polynomial (relative error < 3e-6; P is rounded to bf16 after). */
static inline __m512 exp2_le0(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558146e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One chunk of an online softmax over scores S^T st [len, 16] (lane c: query row c, seeing positions [0, lim[c]);
 * p0 the chunk's first position), for the run kernels (run_attention.c, run_vec.c): updates the running max *m (scaled
 * to base 2) and sums *l, writes P's pairs for j < span / 2 (pairs[j] dword c = row c's bf16 weights of positions
 * p0 + 2j, + 1; 0 past its positions and past len; span even, >= len) and returns what the output so far is scaled
 * by. `hook(ctx, 2j)`, where given, runs once a pair (the AMX kernel prefetches there); inlined, it folds away. */
typedef void (*pair_hook)(const void *ctx, int64_t j);
static inline __attribute__((always_inline)) __m512 online_softmax(const float *st, __m512i limv, int64_t p0,
                                                                   int64_t len, int64_t span, float l2, __m512 *m,
                                                                   __m512 *l, uint32_t *pairs, pair_hook hook,
                                                                   const void *ctx) {
    const __m512 sc = _mm512_set1_ps(l2);
    __m512 top[4];
    for (int i = 0; i < 4; i++) top[i] = _mm512_set1_ps(-3.0e38f);
    for (int64_t j = 0; j < len; j++) /* 4 chains: vmax's latency */
        top[j % 4] = _mm512_mask_max_ps(top[j % 4], _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(p0 + j))),
                                        top[j % 4], _mm512_load_ps(st + j * 16));
    const __m512 next = _mm512_max_ps(*m, _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]),
                                                                      _mm512_max_ps(top[2], top[3])), sc));
    const __m512 alpha = exp2_le0(_mm512_sub_ps(*m, next));
    *m = next;
    uint16_t order[32];
    for (int i = 0; i < 32; i++) order[i] = (uint16_t)(i / 2 + (i % 2) * 16); /* a[c], b[c] adjacent */
    const __m512i inter = _mm512_loadu_si512(order);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < span; j += 2) {
        if (hook) hook(ctx, j);
        __m512 e[2];
        for (int i = 0; i < 2; i++) {
            const __mmask16 live = _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(p0 + j + i)));
            e[i] = j + i < len ? _mm512_maskz_mov_ps(live, exp2_le0(_mm512_fmsub_ps(_mm512_load_ps(st + (j + i) * 16),
                                                                                    sc, next)))
                               : _mm512_setzero_ps();
        }
        sum = _mm512_add_ps(sum, _mm512_add_ps(e[0], e[1])); /* fp32 weights, as piece_attention.c sums them */
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]); /* e0 lanes 0-15, e1 lanes 16-31 */
        _mm512_store_si512(pairs + (j / 2) * 16, _mm512_permutexvar_epi16(inter, both));
    }
    *l = _mm512_fmadd_ps(*l, alpha, sum);
    return alpha;
}

/* Query rows [c0, c0 + 16) of KV head kh (row c: token c / G, query head kh * G + c % G) as Q^T's dword pairs (the
 * B tiles of run_attention.c, the vectors of run_vec.c), qtile[(d * 16 + r) * 16 + c] = the dword r (dims 32d + 2r, + 1) of row c; zeros past `rows`. */
static inline void pack_queries(const uint16_t *q, int64_t qt, int64_t qh, int64_t kh, int64_t G, int64_t c0,
                                int64_t rows, int64_t D, uint32_t *qtile) {
    memset(qtile, 0, (size_t)(D / 2 * 16 * 4));
    for (int64_t c = 0; c < rows; c++) {
        const int64_t t = (c0 + c) / G, h = kh * G + (c0 + c) % G;
        const uint32_t *src = (const uint32_t *)(q + t * qt + h * qh);
        for (int64_t i = 0; i < D / 2; i++) qtile[i * 16 + c] = src[i];
    }
}

/* Scratch buffer `i` of the calling thread, at least `bytes` long (64-byte aligned; kept between calls: a fresh
 * allocation of this size is a fresh mmap each call, and its page faults cost more than the work). */
static void *scratch(int i, size_t bytes) {
    static __thread void *buf[7];
    static __thread size_t size[7];
    if (size[i] < bytes) {
        free(buf[i]);
        bytes = (bytes + 4095) / 4096 * 4096;
        buf[i] = aligned_alloc(64, bytes);
        size[i] = buf[i] ? bytes : 0;
    }
    return buf[i];
}

/* out row (t0 + r), dims [d0, d0 + 16 * nd): the fp32 sums acc[c] (16 dims each) times inv, rounded to bf16. */
static inline void store_row(uint16_t *o, const __m512 *acc, int64_t nd, float inv) {
    const __m512 w = _mm512_set1_ps(inv);
    for (int64_t c = 0; c < nd; c += 2)
        _mm512_storeu_si512(o + c * 16, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(acc[c + 1], w),
                                                                     _mm512_mul_ps(acc[c], w)));
}

#endif
