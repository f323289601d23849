/* Causal attention of a prompt piece over its slot, bfloat16, with AMX tiles (models/native.py builds and loads
 * this; models/attention.py calls it for the prompt pieces of mixed steps).
 *
 * Why: PyTorch's CPU flash SDPA spends ~0.85 ns a score here (256 queries of 9 heads over 1024 positions: 2.0 ms a
 * layer, ~150 ms of a 1024-token prompt's 470), mostly outside its matmuls. With AMX the two products (scores
 * Q K^T and the output P V) are a few tile instructions per 16 x 16 block, which leaves the softmax's vector work.
 *
 * A piece is n tokens of one slot at positions start..start+n-1; token t sees positions [0, start + t] (causal,
 * bottom-right aligned). Shapes (elements, bf16 as uint16): q: token t, head h at q + t*qt + h*qh (D contiguous);
 * out the same with ot, oh; k, v: position p of KV head g at k + g*kvh + p*kvp (D contiguous). H query heads,
 * Hkv KV heads (H a multiple: head h reads KV head h / (H / Hkv), as repeat_kv). D % 32 == 0, D <= 256.
 *
 * Per KV head, the positions [0, start + n) are copied once into the tiles' layouts, shared by the head's query
 * heads and all query blocks: K transposed into "VNNI" pairs (a B tile of the score product: row r holds the
 * dims 2r, 2r+1 of 16 positions) and V in pairs of positions (a B tile of the output product: row r holds
 * positions 2r, 2r+1 of 16 dims). Then per (query head, block of 16 tokens), without online rescaling:
 *   1. S [16, L] = Q K^T in fp32 tiles, L = the positions the block's last token sees (rounded up to 16);
 *   2. per row: max, p = exp(scale * (s - max)) = 2^(scale * log2(e) * (s - max)) over the positions the row sees (0 beyond), row sum in fp32, P in
 *      bf16 (as SDPA's bf16 kernels round P before the second product);
 *   3. O [16, D] = P V in fp32 tiles, divided by the row sums, rounded to bf16 once (nearest even).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_D 256

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

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

/* K [L, D] of one KV head -> kt: per block of 16 positions and 32 dims, a B tile [16 rows, 16 positions x 2]:
 * kt[(b * D/32 + d) * 512 + r * 32 + c * 2 + i] = K[16b + c, 32d + 2r + i]; positions >= L are zeros. */
static void pack_k(const uint16_t *k, uint16_t *kt, int64_t L, int64_t Lp, int64_t D, int64_t ps) {
    const int64_t dblocks = D / 32;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)(ps / 2)));
    for (int64_t b = 0; b < Lp / 16; b++) {
        const int64_t valid = L - 16 * b < 16 ? L - 16 * b : 16;
        const __mmask16 m = valid >= 16 ? 0xFFFF : (__mmask16)((1u << (valid > 0 ? valid : 0)) - 1);
        for (int64_t d = 0; d < dblocks; d++) {
            uint16_t *tile = kt + (b * dblocks + d) * 512;
            const int32_t *base = (const int32_t *)(k + 16 * b * ps + 32 * d);
            for (int r = 0; r < 16; r++) /* row r: the dword r (dims 2r, 2r+1) of each of the 16 positions */
                _mm512_store_si512((__m512i *)(tile + r * 32),
                                   _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + r, 4));
        }
    }
}

/* V [L, D] of one KV head -> vv [Lp/2, D, 2]: vv[(p * D + d) * 2 + i] = V[2p + i, d]; positions >= L are zeros
 * (P is 0 there, and 0 * a stale NaN would not be). */
static void pack_v(const uint16_t *v, uint16_t *vv, int64_t L, int64_t Lp, int64_t D, int64_t ps) {
    uint16_t order[32];
    for (int i = 0; i < 32; i++) order[i] = (uint16_t)(i / 2 + (i % 2) * 32); /* a[0], b[0], a[1], b[1], ... */
    const __m512i lo = _mm512_loadu_si512(order);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t p = 0; p < Lp / 2; p++) {
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i a = 2 * p < L ? _mm512_loadu_si512(v + 2 * p * ps + d) : _mm512_setzero_si512();
            const __m512i b = 2 * p + 1 < L ? _mm512_loadu_si512(v + (2 * p + 1) * ps + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vv + (p * D + d) * 2, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vv + (p * D + d) * 2 + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* One query head, tokens [t0, t0 + 16) of the piece (rows past n are zeros and not written). s: [16, Lp] fp32,
 * p: [16, Lp] bf16 scratch; qb: [16, D] bf16 scratch. */
static void block(const uint16_t *q, int64_t qt, const uint16_t *kt, const uint16_t *vv, uint16_t *out, int64_t ot,
                  int64_t t0, int64_t n, int64_t start, int64_t D, float scale, float *s, uint16_t *pb,
                  uint16_t *qb) {
    const int64_t rows = n - t0 < 16 ? n - t0 : 16;
    const int64_t seen = start + t0 + rows;  /* positions the block's last row sees */
    const int64_t L16 = (seen + 15) / 16 * 16, L32 = (seen + 31) / 32 * 32;
    const int64_t dblocks = D / 32;
    for (int64_t r = 0; r < 16; r++)
        for (int64_t d = 0; d < D; d += 32)
            _mm512_store_si512((__m512i *)(qb + r * D + d),
                               r < rows ? _mm512_loadu_si512(q + (t0 + r) * qt + d) : _mm512_setzero_si512());
    __asm__ volatile("" ::: "memory"); /* GCC's tile loads do not declare the memory they read (see amx_matmul.c) */
    /* 1. scores, 16 positions a tile, two tiles at a time (two accumulator chains; a Q tile serves both) */
    const int64_t sblocks = L16 / 16;
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
    /* 2. softmax rows: row r sees positions [0, start + t0 + r] */
    float inv[16];
    for (int64_t r = 0; r < 16; r++) {
        float *sr = s + r * L32;
        uint16_t *pr = pb + r * L32;
        const int64_t len = r < rows ? start + t0 + r + 1 : 0;
        __m512 mx = _mm512_set1_ps(-3.0e38f);
        int64_t j = 0;
        for (; j + 16 <= len; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
        if (j < len) mx = _mm512_mask_max_ps(mx, (__mmask16)((1u << (len - j)) - 1), mx, _mm512_loadu_ps(sr + j));
        const float l2 = scale * 1.44269504088896341f; /* exp(scale * x) = 2^(l2 * x) */
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * l2), sc = _mm512_set1_ps(l2);
        __m512 sum = _mm512_setzero_ps();
        for (j = 0; j < L32; j += 32) {
            const __mmask16 m0 = j + 16 <= len ? 0xFFFF : j < len ? (__mmask16)((1u << (len - j)) - 1) : 0;
            const __mmask16 m1 = j + 32 <= len ? 0xFFFF : j + 16 < len ? (__mmask16)((1u << (len - j - 16)) - 1) : 0;
            __m512 e0 = _mm512_maskz_mov_ps(m0, exp2_le0(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), sc, m)));
            __m512 e1 = j + 16 < L16 ? _mm512_loadu_ps(sr + j + 16) : _mm512_setzero_ps();
            e1 = _mm512_maskz_mov_ps(m1, exp2_le0(_mm512_fmsub_ps(e1, sc, m)));
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
            _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        inv[r] = len ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
    }
    __asm__ volatile("" ::: "memory");
    /* 3. output, 64 dims (four accumulators) at a time, 32 positions a step */
    float acc[4][16][16] __attribute__((aligned(64)));
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t nd = D - d0 < 64 ? (D - d0) / 16 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < L32; j += 32) {
            const uint16_t *vb = vv + (j / 2) * D * 2 + d0 * 2; /* rows: position pairs, stride D pairs */
            _tile_loadd(4, pb + j, L32 * 2);
            _tile_loadd(5, vb, D * 4);
            _tile_loadd(6, vb + 32, D * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            if (nd > 2) {
                _tile_loadd(7, vb + 64, D * 4);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, vb + 96, D * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, acc[0], 64);
        _tile_stored(1, acc[1], 64);
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
        __asm__ volatile("" ::: "memory");
        for (int64_t r = 0; r < rows; r++) {
            const __m512 w = _mm512_set1_ps(inv[r]);
            for (int64_t c = 0; c < nd; c += 2) {
                const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc[c][r]), w);
                const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(acc[c + 1][r]), w);
                _mm512_storeu_si512(out + (t0 + r) * ot + d0 + c * 16, (__m512i)_mm512_cvtne2ps_pbh(b, a));
            }
        }
    }
}

/* Scratch buffer `i` of the calling thread, at least `bytes` long (64-byte aligned; kept between calls: a fresh
 * allocation of this size is a fresh mmap each call, and its page faults cost more than the work). */
static void *scratch(int i, size_t bytes) {
    static __thread void *buf[5];
    static __thread size_t size[5];
    if (size[i] < bytes) {
        free(buf[i]);
        bytes = (bytes + 4095) / 4096 * 4096;
        buf[i] = aligned_alloc(64, bytes);
        size[i] = buf[i] ? bytes : 0;
    }
    return buf[i];
}

/* Returns 0, or -1 when the shapes do not fit (the caller then uses SDPA). */
int bucketserve_piece_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                     int64_t n, int64_t start, int64_t H, int64_t Hkv, int64_t D, int64_t qt,
                                     int64_t qh, int64_t ot, int64_t oh, int64_t kvh, int64_t kvp, float scale, int threads) {
    if (n < 1 || start < 0 || Hkv < 1 || H % Hkv || D < 32 || D % 32 || D > MAX_D || kvp < D || kvp % 2) return -1;
    const int64_t L = start + n, Lp = (L + 31) / 32 * 32, G = H / Hkv, qblocks = (n + 15) / 16;
    uint16_t *kt = scratch(0, (size_t)(Hkv * Lp * D * 2)), *vv = scratch(1, (size_t)(Hkv * Lp * D * 2));
    if (!kt || !vv) return -1;
    int failed = 0; /* a thread without its scratch: the caller then uses SDPA, which writes all of out */
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t g = 0; g < Hkv; g++) {
            pack_k(k + g * kvh, kt + g * Lp * D, L, Lp, D, kvp);
            pack_v(v + g * kvh, vv + g * Lp * D, L, Lp, D, kvp);
        }
        float *s = scratch(2, (size_t)(16 * Lp * 4));
        uint16_t *pb = scratch(3, (size_t)(16 * Lp * 2)), *qb = scratch(4, (size_t)(16 * D * 2));
        if (!s || !pb || !qb) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
        configure();
        __asm__ volatile("" ::: "memory");
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < H * qblocks; i++) {
            if (!s || !pb || !qb) continue;
            const int64_t h = i / qblocks, b = qblocks - 1 - i % qblocks; /* the longest blocks first */
            block(q + h * qh, qt, kt + (h / G) * Lp * D, vv + (h / G) * Lp * D, out + h * oh, ot, b * 16, n, start,
                  D, scale, s, pb, qb);
        }
        _tile_release();
    }
    (void)threads;
    return failed ? -1 : 0;
}
#else
int bucketserve_piece_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                     int64_t n, int64_t start, int64_t H, int64_t Hkv, int64_t D, int64_t qt,
                                     int64_t qh, int64_t ot, int64_t oh, int64_t kvh, int64_t kvp, float scale, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)n, (void)start, (void)H, (void)Hkv, (void)D, (void)qt, (void)qh;
    (void)ot, (void)oh, (void)kvh, (void)kvp, (void)scale, (void)threads;
    return -1;
}
#endif
