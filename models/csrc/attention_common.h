/* What the bf16 attention kernels on tiles share (piece_products.h for piece_attention.c, and run_attention.c): the
 * tile configuration, exp for the softmax, per-thread scratch and the rounding of an output row. Needs AVX512-BF16
 * (the includers' guard). */
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
static void configure(void) {
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
