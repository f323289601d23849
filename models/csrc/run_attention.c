/* Attention of a short run of tokens of one slot, bfloat16, on AMX tiles: a verify step's row and its drafts
 * (models/csrc/dispatch.cpp calls it for runs of 2..SHORT_RUN tokens, and piece_attention.c hands it pieces of up to
 * RUN_MAX_TOKENS tokens where it may use the tiles).
 *
 * Why: a verify step carries each speculating row's last token and its drafts, 2-4 tokens at consecutive positions
 * of one slot. As decoding rows (decode_attention.c) each token re-read the slot's K/V and cost what a row does
 * (~11-16 us a layer at 300 positions, its 3 query heads compute-bound); as a piece (piece_attention.c) the slot's K
 * was repacked for each call and 16-token blocks carried 1-4 tokens. Here the run's n tokens x G query heads of a
 * KV head are the 16 columns of one tile product, and the slot's K/V is read once, in place, for all of them.
 * Measured (SmolLM2's shapes, one thread, 16 slots at ~300 positions, 30 layers' caches in turn): 16 runs of 4
 * tokens 585 us a layer against 1073 as 64 decoding rows; of 2 tokens 575 against 688; 16 single rows 489.
 *
 * Same arguments as bucketserve_piece_attention (shapes and strides in piece_attention.c's header comment): token t
 * sees positions [0, start + t]. Per KV head, query rows c = t * G + g (16 a block), one pass over the positions a
 * 64-position chunk at a time (online softmax, as decode_attention.c):
 *   1. S^T [64, 16] = K Q^T in fp32: K's 16-position blocks are A tiles as they sit in the cache (D contiguous), Q^T
 *      the B tiles (VNNI: row r holds dims 2r, 2r+1 of the 16 queries), built once a block;
 *   2. per query (a lane): the running max over the positions it sees, p = exp(scale * (s - max)), 0 beyond, sums in
 *      fp32; P rounded to bf16 (as SDPA's bf16 kernels and piece_attention.c round it), pairs of positions
 *      interleaved and gathered into P [16, 64] rows (an A tile);
 *   3. O [16, D] = O * (the max's rescale) + P V on tiles, V interleaved by pairs of positions in L1 a 32-position
 *      step at a time; at the end divided by the sums and rounded once.
 * K and V are prefetched AHEAD positions ahead, on into the next KV head's and, given one, the next call's slot.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>

#include "attention_common.h"

#define RUN_MAX_D 256
#define CHUNK 64  /* positions a step of the online softmax: four 16-position score tiles */
#define AHEAD 128 /* positions prefetched ahead (K and V), into L2 */

/* The K and V rows a head's pass reads, then the ones the next pass will (the next KV head of the call, or the
 * next call's slot): `fetch` prefetches stream position i of that concatenation, so the memory stays busy across
 * the passes' ends. */
typedef struct {
    const char *k, *v, *nk, *nv;
    int64_t rows, next_rows, rs, bytes;
} Stream;

static inline void fetch(const Stream *s, int64_t i) {
    const char *k = s->k, *v = s->v;
    if (i >= s->rows) {
        i -= s->rows;
        if (i >= s->next_rows) return;
        k = s->nk;
        v = s->nv;
    }
    for (int64_t off = 0; off < s->bytes; off += 64) {
        __builtin_prefetch(k + i * s->rs + off, 0, 2);
        __builtin_prefetch(v + i * s->rs + off, 0, 2);
    }
}

/* Scores of positions [p0, p0 + 64) (fewer at the end, `len`): S^T rows into st [64, 16], four 16-position tiles
 * in flight (a tile product's latency is several of its issue intervals). K rows past the head's L come from a
 * zeroed copy (the slot's buffer may end there). */
static void chunk_scores(const uint16_t *k, int64_t kvp, int64_t p0, int64_t len, int64_t D, const uint32_t *qtile,
                         uint16_t *kpad, float *st) {
    const int64_t dblocks = D / 32, stride = kvp * 2;
    const uint16_t *kb = k + p0 * kvp;
    __asm__ volatile("" ::: "memory"); /* GCC's tile loads do not declare the memory they read (see amx_matmul.c) */
    if (len == CHUNK) {
        acc_zero();
        for (int64_t d = 0; d < dblocks; d++) {
            _tile_loadd(5, qtile + d * 256, 64);
            _tile_loadd(4, kb + d * 32, stride);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, kb + 16 * kvp + d * 32, stride);
            _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(4, kb + 32 * kvp + d * 32, stride);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, kb + 48 * kvp + d * 32, stride);
            _tile_dpbf16ps(3, 6, 5);
        }
        _tile_stored(0, st, 64);
        _tile_stored(1, st + 256, 64);
        _tile_stored(2, st + 512, 64);
        _tile_stored(3, st + 768, 64);
    } else {
        for (int64_t b = 0; b < len; b += 16) {
            const uint16_t *kr = kb + b * kvp;
            int64_t rs = stride;
            if (b + 16 > len) {
                __asm__ volatile("" ::: "memory");
                memset(kpad, 0, (size_t)(16 * D * 2));
                for (int64_t j = 0; j < len - b; j++) memcpy(kpad + j * D, kr + j * kvp, (size_t)(D * 2));
                __asm__ volatile("" ::: "memory");
                kr = kpad;
                rs = D * 2;
            }
            _tile_zero(0);
            for (int64_t d = 0; d < dblocks; d++) {
                _tile_loadd(4, kr + d * 32, rs);
                _tile_loadd(5, qtile + d * 256, 64);
                _tile_dpbf16ps(0, 4, 5);
            }
            _tile_stored(0, st + b * 16, 64);
        }
    }
    __asm__ volatile("" ::: "memory"); /* nor the memory they write */
}

/* Where the AMX pass's softmax prefetches: the chunk's positions, AHEAD on, along its stream. */
typedef struct {
    const Stream *s;
    int64_t ahead;
} Ahead;

static void fetch_pair(const void *ctx, int64_t j) {
    const Ahead *a = (const Ahead *)ctx;
    fetch(a->s, a->ahead + j);
    fetch(a->s, a->ahead + j + 1);
}

/* The online softmax over a chunk's scores st [len, 16] (attention_common.h's online_softmax over the whole
 * 64-position chunk, prefetching AHEAD on along `s`), P then as an A tile pb [16, 64] bf16; returns what the output so
 * far is scaled by. */
static __m512 chunk_softmax(const float *st, __m512i limv, int64_t p0, int64_t len, float l2, __m512 *m, __m512 *l,
                            uint32_t *pairs, uint16_t *pb, const Stream *s, int64_t ahead) {
    const Ahead at = {s, ahead};
    const __m512 alpha = online_softmax(st, limv, p0, len, CHUNK, l2, m, l, pairs, fetch_pair, &at);
    /* pb row c, dword i = pairs[i][c]: a transpose of [32, 16] dwords, 16 a gather */
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16));
    for (int64_t c = 0; c < 16; c++) {
        _mm512_store_si512(pb + c * CHUNK, _mm512_i32gather_epi32(idx, (const int *)(pairs + c), 4));
        _mm512_store_si512(pb + c * CHUNK + 32, _mm512_i32gather_epi32(idx, (const int *)(pairs + 256 + c), 4));
    }
    return alpha;
}

/* V's rows 2p, 2p + 1 (p < 16) of positions [j, j + 32), dims [d0, d0 + 16 nd) -> the B tiles of a 32-position
 * step, bt[(i * 16 + p) * 32 + 2m + s]: 16-bit interleaves within 128-bit lanes (one instruction each), so tile
 * 2h + u, column m holds dim d0 + 32h + 8 (m / 4) + 4u + m % 4 (un-permuted when added up); rows past L are zeros. */
static void pack_v_step(const uint16_t *v, int64_t kvp, int64_t j, int64_t L, int64_t d0, int64_t nd, uint16_t *bt) {
    for (int64_t p = 0; p < 16; p++) {
        const int64_t a = j + 2 * p, b = a + 1;
        for (int64_t h = 0; h < nd / 2; h++) {
            const __m512i x = a < L ? _mm512_loadu_si512(v + a * kvp + d0 + 32 * h) : _mm512_setzero_si512();
            const __m512i y = b < L ? _mm512_loadu_si512(v + b * kvp + d0 + 32 * h) : _mm512_setzero_si512();
            _mm512_store_si512(bt + ((2 * h) * 16 + p) * 32, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(bt + ((2 * h + 1) * 16 + p) * 32, _mm512_unpackhi_epi16(x, y));
        }
    }
}

/* o [16, D] fp32 (natural dim order) = o * alpha + P V over the chunk's positions [p0, p0 + 64), 64 dims (four
 * accumulators) at a time. */
static void chunk_output(const uint16_t *pb, const uint16_t *v, int64_t kvp, int64_t p0, int64_t len, int64_t L,
                         int64_t D, __m512 alpha, float *o, uint16_t *bt) {
    float acc[4][16][16] __attribute__((aligned(64))), a[16];
    _mm512_storeu_ps(a, alpha);
    int32_t order[16]; /* natural dim e < 16 of a 32-dim half <- lane of the (lo, hi) tile pair, hi lanes + 16 */
    for (int e = 0; e < 16; e++) order[e] = (e % 8) / 4 * 16 + 4 * (e / 8) + e % 4;
    const __m512i first = _mm512_loadu_si512(order), second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t nd = D - d0 < 64 ? (D - d0) / 16 : 4;
        acc_zero();
        for (int64_t j = 0; j < len; j += 32) {
            pack_v_step(v, kvp, p0 + j, L, d0, nd, bt);
            __asm__ volatile("" ::: "memory");
            pv_tiles(pb + j, CHUNK * 2, bt, 64, 512, nd);
            __asm__ volatile("" ::: "memory");
        }
        acc_store(acc);
        __asm__ volatile("" ::: "memory");
        for (int64_t c = 0; c < 16; c++) {
            const __m512 w = _mm512_set1_ps(a[c]);
            for (int64_t i = 0; i < nd; i += 2) {
                const __m512 lo = _mm512_load_ps(acc[i][c]), hi = _mm512_load_ps(acc[i + 1][c]);
                float *r = o + c * D + d0 + i * 16;
                _mm512_store_ps(r, _mm512_fmadd_ps(_mm512_load_ps(r), w, _mm512_permutex2var_ps(lo, first, hi)));
                _mm512_store_ps(r + 16,
                                _mm512_fmadd_ps(_mm512_load_ps(r + 16), w, _mm512_permutex2var_ps(lo, second, hi)));
            }
        }
    }
}

/* KV head kh: its query rows, 16 a block, one pass over the slot's [0, start + n) positions a chunk at a time
 * (online softmax), prefetching AHEAD positions ahead along `s` (its K/V, then the next pass's). 0, or -1 without
 * scratch. */
static int one_kv_head(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t n,
                       int64_t start, int64_t G, int64_t kh, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                       int64_t kvp, float scale, int cold, Stream s) {
    const int64_t L = start + n, rows_all = n * G;
    uint16_t *bt = scratch(0, 4 * 16 * 64), *pb = scratch(1, 16 * CHUNK * 2), *kpad = scratch(5, (size_t)(16 * D * 2));
    float *st = scratch(2, CHUNK * 16 * 4), *o = scratch(3, (size_t)(16 * D * 4));
    uint32_t *qtile = scratch(4, (size_t)(D / 2 * 16 * 4)), *pairs = scratch(6, CHUNK / 2 * 16 * 4);
    if (!bt || !pb || !kpad || !st || !o || !qtile || !pairs) return -1;
    const float l2 = scale * 1.44269504088896341f; /* exp(scale * x) = 2^(l2 * x) */
    for (int64_t c0 = 0; c0 < rows_all; c0 += 16) {
        const int64_t rows = rows_all - c0 < 16 ? rows_all - c0 : 16;
        Stream here = s;
        if (c0 + 16 < rows_all) here.next_rows = 0; /* another block of this head follows: it reads the same rows */
        int32_t lim[16];
        for (int64_t c = 0; c < 16; c++) lim[c] = (int32_t)(c < rows ? start + (c0 + c) / G + 1 : L);
        const __m512i limv = _mm512_loadu_si512(lim);
        pack_queries(q, qt, qh, kh, G, c0, rows, D, qtile);
        memset(o, 0, (size_t)(16 * D * 4));
        __m512 m = _mm512_set1_ps(-3.0e38f), l = _mm512_setzero_ps();
        if (cold && c0 == 0)
            for (int64_t i = 0; i < AHEAD; i++) fetch(&here, i);
        for (int64_t p0 = 0; p0 < L; p0 += CHUNK) {
            const int64_t len = L - p0 < CHUNK ? L - p0 : CHUNK;
            chunk_scores(k, kvp, p0, len, D, qtile, kpad, st);
            const __m512 alpha = chunk_softmax(st, limv, p0, len, l2, &m, &l, pairs, pb, &here, p0 + AHEAD);
            chunk_output(pb, v, kvp, p0, len, L, D, alpha, o, bt);
        }
        float inv[16];
        _mm512_storeu_ps(inv, l);
        for (int64_t c = 0; c < rows; c++) {
            const int64_t t = (c0 + c) / G, h = kh * G + (c0 + c) % G;
            __m512 r[16];
            for (int64_t i = 0; i < D / 16; i++) r[i] = _mm512_load_ps(o + c * D + i * 16);
            store_row(out + t * ot + h * oh, r, D / 16, 1.0f / inv[c]);
        }
    }
    return 0;
}

/* bucketserve_piece_attention's arguments (bf16 only; the caller checked this process may use the tiles), KV heads
 * split over `threads`, then the next call's slot (its K and V, `next_rows` positions; NULL: none), prefetched
 * while this call ends, and `warm`: a previous call prefetched this one's first positions. Returns 0, or -1 for
 * shapes it does not take (the caller then takes another kernel). */
int bucketserve_run_attention(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                              int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                              int64_t kvh, int64_t kvp, float scale, int threads, const void *next_k,
                              const void *next_v, int64_t next_rows, int warm) {
    if (n < 1 || start < 0 || Hkv < 1 || H % Hkv || D < 32 || D % 32 || D > RUN_MAX_D || kvp < D || kvp % 2) return -1;
    int failed = 0;
    const uint16_t *k16 = (const uint16_t *)k, *v16 = (const uint16_t *)v;
    const int64_t L = start + n;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(| : failed)
#endif
    for (int64_t kh = 0; kh < Hkv; kh++) {
        const int serial = threads <= 1, last = kh + 1 == Hkv;
        const Stream s = {(const char *)(k16 + kh * kvh), (const char *)(v16 + kh * kvh),
                          last ? (const char *)next_k : (const char *)(k16 + (kh + 1) * kvh),
                          last ? (const char *)next_v : (const char *)(v16 + (kh + 1) * kvh), L,
                          !serial ? 0 : last ? (next_k ? next_rows : 0) : L, kvp * 2, D * 2};
        configure();
        failed |= one_kv_head((const uint16_t *)q, k16 + kh * kvh, v16 + kh * kvh, (uint16_t *)out, n, start, H / Hkv,
                              kh, D, qt, qh, ot, oh, kvp, scale, !serial || (kh == 0 && !warm), s);
        _tile_release();
    }
    return failed ? -1 : 0;
}
#else
int bucketserve_run_attention(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                              int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                              int64_t kvh, int64_t kvp, float scale, int threads, const void *next_k,
                              const void *next_v, int64_t next_rows, int warm) {
    (void)q, (void)k, (void)v, (void)out, (void)n, (void)start, (void)H, (void)Hkv, (void)D, (void)qt, (void)qh;
    (void)ot, (void)oh, (void)kvh, (void)kvp, (void)scale, (void)threads, (void)next_k, (void)next_v;
    (void)next_rows, (void)warm;
    return -1;
}
#endif
