/* The two products of a prompt-attention block (models/csrc/piece_attention.c, which includes this once): scores
 * S = Q K^T and output O = P V, over the packed layouts piece_attention.c describes, in three forms:
 * - bf16 with AVX512-BF16 dot products (vdpbf16ps: 16 lanes of two bf16 products each): each packed K or V vector
 *   is loaded once and multiplied with every query row's (or P row's) broadcast dim pair (position pair);
 * - bf16 with AMX tiles (a few tile instructions per 16 x 16 block), where the build and the process have them;
 * - fp32 with AVX-512 FMAs: K packed as [16 positions] vectors per dim, V read in place.
 * Needs AVX512-BF16 (the includer's guard). */
#ifndef BUCKETSERVE_PIECE_PRODUCTS_H
#define BUCKETSERVE_PIECE_PRODUCTS_H

#include <immintrin.h>
#include <stdint.h>

#include "attention_common.h"

/* Step 1 with vector dot products: S [16, L16] = Q K^T for 8 query rows and 32 positions (two packed K blocks) at
 * a time in 16 accumulators; each packed K vector (one dim pair of 16 positions) is loaded once for the 8 rows and
 * each row's dim pair broadcast once for both blocks: 10 loads a 16 dot products, where 16 rows of one block took
 * 17 (the loads bound it: 1.4x the time of the output product, which does the same arithmetic). Each score's sum
 * runs over the dim pairs in order, as before. An odd last block computes one more block of 16 (zeros in kt up to
 * Lp, into s's columns up to L32, which the softmax never reads). */
static void scores_vec(const uint16_t *qb, const uint16_t *kt, int64_t D, int64_t sblocks, int64_t L32, float *s) {
    const int64_t dblocks = D / 32;
    const int32_t *qp = (const int32_t *)qb; /* query row r's dim pair i: qp[r * D / 2 + i] */
    for (int64_t h = 0; h < 16; h += 8) {
        for (int64_t b = 0; b < sblocks; b += 2) {
            __m512 acc[8][2];
            for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            for (int64_t i = 0; i < D / 2; i++) {
                const int64_t at = (i / 16) * 512 + (i % 16) * 32;
                const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + b * dblocks * 512 + at);
                const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + (b + 1) * dblocks * 512 + at);
                for (int r = 0; r < 8; r++) {
                    const __m512bh q = (__m512bh)_mm512_set1_epi32(qp[(h + r) * D / 2 + i]);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q, k0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q, k1);
                }
            }
            for (int r = 0; r < 8; r++) {
                _mm512_storeu_ps(s + (h + r) * L32 + b * 16, acc[r][0]);
                _mm512_storeu_ps(s + (h + r) * L32 + b * 16 + 16, acc[r][1]);
            }
        }
    }
}

/* Step 3 with vector dot products: O = P V for 4 rows and 64 dims at a time (16 accumulators); each packed V
 * vector (16 dims of a position pair) is loaded once for the 4 rows, each row's P pair broadcast. */
static void output_vec(const uint16_t *pb, const uint16_t *vv, uint16_t *out, int64_t ot, int64_t rows, int64_t D,
                       int64_t L32, const float *inv) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int32_t *pp = (const int32_t *)(pb + r0 * L32); /* row r0 + r's pair j: pp[r * L32 / 2 + j] */
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int64_t nd = D - d0 < 64 ? (D - d0) / 16 : 4;
            __m512 acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
            for (int64_t j = 0; j < L32 / 2; j++) {
                const uint16_t *vb = vv + (j * D + d0) * 2;
                const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vb), v1 = (__m512bh)_mm512_loadu_si512(vb + 32);
                if (nd > 2) {
                    const __m512bh v2 = (__m512bh)_mm512_loadu_si512(vb + 64);
                    const __m512bh v3 = (__m512bh)_mm512_loadu_si512(vb + 96);
                    for (int r = 0; r < 4; r++) {
                        const __m512bh p = (__m512bh)_mm512_set1_epi32(pp[r * L32 / 2 + j]);
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], p, v0);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], p, v1);
                        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], p, v2);
                        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], p, v3);
                    }
                } else {
                    for (int r = 0; r < 4; r++) {
                        const __m512bh p = (__m512bh)_mm512_set1_epi32(pp[r * L32 / 2 + j]);
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], p, v0);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], p, v1);
                    }
                }
            }
            for (int64_t r = 0; r < 4 && r0 + r < rows; r++) store_row(out + (r0 + r) * ot + d0, acc[r], nd, inv[r0 + r]);
        }
    }
}

/* Step 1 in float32: S [16, L16] = Q K^T, 16 positions at a time in 16 accumulators (one a query row); each packed
 * K vector (one dim of the 16 positions) is loaded once for the 16 rows, each row's element broadcast. */
static void scores_f32(const float *qb, const float *kt, int64_t D, int64_t sblocks, int64_t L32, float *s) {
    for (int64_t b = 0; b < sblocks; b++) {
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m512 kv = _mm512_load_ps(kt + (b * D + d) * 16);
            for (int r = 0; r < 16; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qb[r * D + d]), kv, acc[r]);
        }
        for (int r = 0; r < 16; r++) _mm512_storeu_ps(s + r * L32 + b * 16, acc[r]);
    }
}

/* Step 3 in float32: O = P V for 4 rows and 64 dims at a time (16 accumulators), V read in place (position p of
 * the head at v + p * ps), only the positions the group's last row sees (past them P is 0 and V may be unset). */
static void output_f32(const float *pf, const float *v, int64_t ps, float *out, int64_t ot, int64_t rows,
                       int64_t first, int64_t D, int64_t L32, const float *inv) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t seen = first + (rows - r0 < 4 ? rows : r0 + 4); /* positions row r0 + 3 (or the last) sees */
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int64_t nd = D - d0 < 64 ? (D - d0) / 16 : 4;
            __m512 acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
            for (int64_t j = 0; j < seen; j++) {
                const float *vr = v + j * ps + d0;
                const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
                const __m512 v2 = nd > 2 ? _mm512_loadu_ps(vr + 32) : v0, v3 = nd > 2 ? _mm512_loadu_ps(vr + 48) : v1;
                for (int r = 0; r < 4; r++) {
                    const __m512 p = _mm512_set1_ps(pf[(r0 + r) * L32 + j]);
                    acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
                    acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
                    acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
                }
            }
            for (int64_t r = 0; r < 4 && r0 + r < rows; r++) {
                const __m512 w = _mm512_set1_ps(inv[r0 + r]);
                for (int64_t c = 0; c < nd; c++)
                    _mm512_storeu_ps(out + (r0 + r) * ot + d0 + c * 16, _mm512_mul_ps(acc[r][c], w));
            }
        }
    }
}

#if HAVE_TILES
/* Step 1 with AMX tiles: 16 positions a tile, two tiles at a time (two accumulator chains; a Q tile serves both). */
static void scores_tiles(const uint16_t *qb, const uint16_t *kt, int64_t D, int64_t sblocks, int64_t L32, float *s) {
    const int64_t dblocks = D / 32;
    __asm__ volatile("" ::: "memory"); /* GCC's tile loads do not declare the memory they read (see amx_matmul.c) */
    for (int64_t b = 0; b + 1 < sblocks; b += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t d = 0; d < dblocks; d++) {
            _tile_loadd(4, qb + d * 32, D * 2);
            _tile_loadd(5, kt + (b * dblocks + d) * 512, 64);
            _tile_loadd(6, kt + ((b + 1) * dblocks + d) * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
        }
        _tile_stored(0, s + b * 16, L32 * 4);
        _tile_stored(1, s + b * 16 + 16, L32 * 4);
    }
    if (sblocks % 2) {
        const int64_t b = sblocks - 1;
        _tile_zero(0);
        for (int64_t d = 0; d < dblocks; d++) {
            _tile_loadd(4, qb + d * 32, D * 2);
            _tile_loadd(5, kt + (b * dblocks + d) * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, s + b * 16, L32 * 4);
    }
    __asm__ volatile("" ::: "memory"); /* nor the memory they write */
}

/* Step 3 with AMX tiles: 64 dims (four accumulators) at a time, 32 positions a step. */
static void output_tiles(const uint16_t *pb, const uint16_t *vv, uint16_t *out, int64_t ot, int64_t rows, int64_t D,
                         int64_t L32, const float *inv) {
    float acc[4][16][16] __attribute__((aligned(64)));
    __asm__ volatile("" ::: "memory");
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t nd = D - d0 < 64 ? (D - d0) / 16 : 4;
        acc_zero();
        for (int64_t j = 0; j < L32; j += 32) {
            /* rows: position pairs, stride D pairs */
            pv_tiles(pb + j, L32 * 2, vv + (j / 2) * D * 2 + d0 * 2, D * 4, 32, nd);
        }
        acc_store(acc);
        __asm__ volatile("" ::: "memory");
        for (int64_t r = 0; r < rows; r++) {
            __m512 row[4];
            for (int64_t c = 0; c < nd; c++) row[c] = _mm512_load_ps(acc[c][r]);
            store_row(out + r * ot + d0, row, nd, inv[r]);
        }
    }
}
#endif

#endif
