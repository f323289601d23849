/* Causal attention of a prompt piece over its slot, bfloat16 or float32 (models/native.py builds and loads this;
 * models/attention.py calls it for the prompt pieces of mixed steps and for prefills).
 *
 * Why: PyTorch's CPU flash SDPA spends ~0.85 ns a score here (256 queries of 9 heads over 1024 positions: 2.0 ms a
 * layer, ~150 ms of a 1024-token prompt's 470), mostly outside its matmuls. This computes each block's two
 * products (scores Q K^T, output P V) straight from packed K and V: AMX tiles where the CPU has them (a few tile
 * instructions per 16 x 16 block, which leaves the softmax's vector work), else AVX512-BF16 dot products; fp32 with
 * AVX-512 FMAs (piece_products.h). Measured (one thread, SmolLM2's heads): AMX ~4x SDPA; without AMX (AMD EPYC)
 * bf16 3.3-4.3x and fp32 1.4-2.1x SDPA at 128-1024 tokens.
 *
 * A piece is n tokens of one slot at positions start..start+n-1; token t sees positions [0, start + t] (causal,
 * bottom-right aligned). Shapes (elements: bf16 as uint16, or fp32): q: token t, head h at q + t*qt + h*qh (D
 * contiguous); out the same with ot, oh; k, v: position p of KV head g at k + g*kvh + p*kvp (D contiguous). H query
 * heads, Hkv KV heads (H a multiple: head h reads KV head h / (H / Hkv), as repeat_kv). D % 32 == 0, D <= 256.
 *
 * Per KV head, the positions [0, start + n) are copied once into the products' layouts, shared by the head's query
 * heads and all query blocks. bf16: K transposed into "VNNI" pairs (row r of a 16-position block holds the dims
 * 2r, 2r+1 of its 16 positions: an AMX B tile, or D/2 vectors) and V in pairs of positions (row r holds positions
 * 2r, 2r+1 of 16 dims). fp32: K transposed per dim (16 positions a vector); V is read in place. Then per (query
 * head, block of 16 tokens), without online rescaling:
 *   1. S [16, L] = Q K^T in fp32, L = the positions the block's last token sees (rounded up to 16);
 *   2. per row: max, p = exp(scale * (s - max)) = 2^(scale * log2(e) * (s - max)) over the positions the row sees
 *      (0 beyond), row sum in fp32; bf16 rounds P (as SDPA's bf16 kernels do before the second product);
 *   3. O [16, D] = P V in fp32, divided by the row sums (bf16: rounded once, nearest even).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_D 256

#include "piece_products.h"

/* bf16 pieces of up to this many tokens take run_attention.c where the tiles are on, else run_vec.c: both take the
 * few tokens' query heads of a KV head together and read K in place, where this kernel packs the slot's K for
 * 16-token blocks of one query head (a 4-token piece at 300 positions, hot: 25 against 63 us on tiles). */
#define RUN_MAX_TOKENS 8
typedef int (*run_fn)(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start, int64_t H,
                      int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh, int64_t kvh, int64_t kvp,
                      float scale, int threads, const void *next_k, const void *next_v, int64_t next_rows, int warm);
int bucketserve_run_attention(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                              int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                              int64_t kvh, int64_t kvp, float scale, int threads, const void *next_k,
                              const void *next_v, int64_t next_rows, int warm);
int bucketserve_run_attention_vec(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                                  int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                                  int64_t kvh, int64_t kvp, float scale, int threads, const void *next_k,
                                  const void *next_v, int64_t next_rows, int warm);

/* x [16] rows of 16 dwords -> their transpose, in place (x[r] dword c = the input's x[c] dword r): 32-bit, then
 * 64-bit interleaves within 128-bit lanes, then two rounds of lane shuffles; 64 shuffles where 16 gathers of 16
 * dwords cost ~5x as much here (AMD EPYC: the gathers were ~10% of a 116-token piece's attention). */
static inline void transpose16(__m512i x[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) { /* lane l of t[2i]: (x2i[4l], x2i+1[4l], x2i[4l+1], x2i+1[4l+1]); t[2i+1]: +2 */
        t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* lane l of u[4i + e]: dword 4l + e of rows 4i..4i+3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) { /* row 4l + e: lane l of u[e], u[4 + e], u[8 + e], u[12 + e] */
        const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), b = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xdd);
        x[e] = _mm512_shuffle_i32x4(a, c, 0x88);
        x[8 + e] = _mm512_shuffle_i32x4(a, c, 0xdd);
        x[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
        x[12 + e] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
}

/* Rows [16b, 16b + 16) of base (`ps` elements of `es` bytes apart), 64 bytes from `off` each, transposed as 16 x 16
 * dwords into out (16 rows of 64 bytes, 64 bytes apart): rows at or past L read as zeros. */
static inline void transpose_block(const char *base, int64_t b, int64_t off, int64_t L, int64_t ps, int64_t es,
                                   char *out) {
    __m512i x[16];
    for (int64_t c = 0; c < 16; c++)
        x[c] = 16 * b + c < L ? _mm512_loadu_si512(base + ((16 * b + c) * ps) * es + off) : _mm512_setzero_si512();
    transpose16(x);
    for (int r = 0; r < 16; r++) _mm512_store_si512((__m512i *)(out + r * 64), x[r]);
}

/* K [L, D] of one KV head -> kt: per block of 16 positions and 32 dims, a B tile [16 rows, 16 positions x 2]:
 * kt[(b * D/32 + d) * 512 + r * 32 + c * 2 + i] = K[16b + c, 32d + 2r + i]; positions >= L are zeros. */
static void pack_k(const uint16_t *k, uint16_t *kt, int64_t L, int64_t Lp, int64_t D, int64_t ps) {
    const int64_t dblocks = D / 32;
    for (int64_t b = 0; b < Lp / 16; b++)
        for (int64_t d = 0; d < dblocks; d++) /* tile row r: the dword r (dims 2r, 2r+1) of each of the 16 positions */
            transpose_block((const char *)k, b, 64 * d, L, ps, 2, (char *)(kt + (b * dblocks + d) * 512));
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

/* float32 K [L, D] of one KV head -> kt [Lp/16, D, 16]: kt[(b * D + d) * 16 + c] = K[16b + c, d]; 0 past L. */
static void pack_k_f32(const float *k, float *kt, int64_t L, int64_t Lp, int64_t D, int64_t ps) {
    for (int64_t b = 0; b < Lp / 16; b++)
        for (int64_t d = 0; d < D; d += 16) /* rows d..d+15 of the block: dim d + r of each of the 16 positions */
            transpose_block((const char *)k, b, 4 * d, L, ps, 4, (char *)(kt + (b * D + d) * 16));
}

/* Step 2, rows [0, 16) of a block: row r sees positions [0, first + r] (first: the position of the block's first
 * token), none when r >= rows. s [16, L32] fp32 scores in, P [16, L32] out, bf16 (as SDPA's bf16 kernels round P
 * before the second product) or fp32 (f32), 0 past each row's positions up to L32; inv[r] = 1 / the row's sum (0
 * for an empty row). */
static void softmax_rows(const float *s, void *p, float *inv, int64_t rows, int64_t first, int64_t L16, int64_t L32,
                         float scale, int f32) {
    for (int64_t r = 0; r < 16; r++) {
        const float *sr = s + r * L32;
        const int64_t len = r < rows ? first + r + 1 : 0;
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
            if (f32) {
                _mm512_storeu_ps((float *)p + r * L32 + j, e0);
                _mm512_storeu_ps((float *)p + r * L32 + j + 16, e1);
            } else {
                _mm512_storeu_si512((uint16_t *)p + r * L32 + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
        }
        inv[r] = len ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
    }
}

/* One query head, tokens [t0, t0 + 16) of the piece (rows past n are zeros and not written); q, out: the head's
 * first token; k, v: its KV head (fp32: V read in place); kt, vv: that head's packed K (and bf16 V). Scratch: s
 * [16, Lp] fp32, p [16, Lp] and qb [16, D] of the element type. tiles: AMX products (bf16), else vector ones. */
static void block(const void *q, int64_t qt, const void *v, int64_t ps, const void *kt, const uint16_t *vv, void *out,
                  int64_t ot, int64_t t0, int64_t n, int64_t start, int64_t D, float scale, float *s, void *p,
                  void *qb, int tiles, int f32) {
    const int64_t rows = n - t0 < 16 ? n - t0 : 16;
    const int64_t seen = start + t0 + rows;  /* positions the block's last row sees */
    const int64_t L16 = (seen + 15) / 16 * 16, L32 = (seen + 31) / 32 * 32, es = f32 ? 4 : 2;
    for (int64_t r = 0; r < 16; r++) /* row r of qb: token t0 + r's query, or zeros */
        for (int64_t d = 0; d < D * es; d += 64)
            _mm512_store_si512((__m512i *)((char *)qb + r * D * es + d),
                               r < rows ? _mm512_loadu_si512((const char *)q + (t0 + r) * qt * es + d)
                                        : _mm512_setzero_si512());
    float inv[16];
    if (f32) {
        scores_f32(qb, kt, D, L16 / 16, L32, s);
        softmax_rows(s, p, inv, rows, start + t0, L16, L32, scale, 1);
        output_f32(p, v, ps, (float *)out + t0 * ot, ot, rows, start + t0, D, L32, inv);
        return;
    }
#if HAVE_TILES
    if (tiles) {
        scores_tiles(qb, kt, D, L16 / 16, L32, s);
        softmax_rows(s, p, inv, rows, start + t0, L16, L32, scale, 0);
        output_tiles(p, vv, (uint16_t *)out + t0 * ot, ot, rows, D, L32, inv);
        return;
    }
#endif
    (void)tiles;
    scores_vec(qb, kt, D, L16 / 16, L32, s);
    softmax_rows(s, p, inv, rows, start + t0, L16, L32, scale, 0);
    output_vec(p, vv, (uint16_t *)out + t0 * ot, ot, rows, D, L32, inv);
}

/* q, k, v, out: bf16 (uint16 bits), or fp32 (f32), strides in elements. tiles (bf16 only): the AMX products (the
 * caller checked that this process may use the tiles), else vector dot products. Returns 0, or -1 when the shapes
 * do not fit or the build has no tiles where asked (the caller then uses SDPA). */
int bucketserve_piece_attention(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                                int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                                int64_t kvh, int64_t kvp, float scale, int threads, int tiles, int f32) {
    if (n < 1 || start < 0 || Hkv < 1 || H % Hkv || D < 32 || D % 32 || D > MAX_D || kvp < D || kvp % 2) return -1;
    if (tiles && (f32 || !HAVE_TILES)) return -1;
    const run_fn run = tiles ? bucketserve_run_attention : bucketserve_run_attention_vec;
    if (!f32 && n <= RUN_MAX_TOKENS &&
        run(q, k, v, out, n, start, H, Hkv, D, qt, qh, ot, oh, kvh, kvp, scale, threads, NULL, NULL, 0, 0) == 0)
        return 0;
    const int64_t L = start + n, Lp = (L + 31) / 32 * 32, G = H / Hkv, qblocks = (n + 15) / 16, es = f32 ? 4 : 2;
    void *kt = scratch(0, (size_t)(Hkv * Lp * D * es));
    uint16_t *vv = f32 ? NULL : scratch(1, (size_t)(Hkv * Lp * D * 2)); /* fp32 reads V in place */
    if (!kt || (!f32 && !vv)) return -1;
    int failed = 0; /* a thread without its scratch: the caller then uses SDPA, which writes all of out */
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t g = 0; g < Hkv; g++) {
            if (f32) {
                pack_k_f32((const float *)k + g * kvh, (float *)kt + g * Lp * D, L, Lp, D, kvp);
            } else {
                pack_k((const uint16_t *)k + g * kvh, (uint16_t *)kt + g * Lp * D, L, Lp, D, kvp);
                pack_v((const uint16_t *)v + g * kvh, vv + g * Lp * D, L, Lp, D, kvp);
            }
        }
        float *s = scratch(2, (size_t)(16 * Lp * 4));
        void *p = scratch(3, (size_t)(16 * Lp * es)), *qb = scratch(4, (size_t)(16 * D * es));
        if (!s || !p || !qb) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#if HAVE_TILES
        if (tiles) configure();
#endif
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < H * qblocks; i++) {
            if (!s || !p || !qb) continue;
            const int64_t h = i / qblocks, b = qblocks - 1 - i % qblocks, g = h / G; /* the longest blocks first */
            block((const char *)q + h * qh * es, qt, (const char *)v + g * kvh * es, kvp, (char *)kt + g * Lp * D * es,
                  f32 ? NULL : vv + g * Lp * D, (char *)out + h * oh * es, ot, b * 16, n, start, D, scale, s, p, qb,
                  tiles, f32);
        }
#if HAVE_TILES
        if (tiles) _tile_release();
#endif
    }
    (void)threads;
    return failed ? -1 : 0;
}
#else
int bucketserve_piece_attention_f32x8(const float *q, const float *k, const float *v, float *out, int64_t n,
                                      int64_t start, int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh,
                                      int64_t ot, int64_t oh, int64_t kvh, int64_t kvp, float scale, int threads);

/* Without AVX512-BF16: fp32 pieces go to piece_avx2.c's 8-lane kernel (AVX2 builds without AVX-512; -1 elsewhere),
 * bf16 ones decline (SDPA). */
int bucketserve_piece_attention(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start,
                                int64_t H, int64_t Hkv, int64_t D, int64_t qt, int64_t qh, int64_t ot, int64_t oh,
                                int64_t kvh, int64_t kvp, float scale, int threads, int tiles, int f32) {
    if (!f32 || tiles) return -1;
    return bucketserve_piece_attention_f32x8(q, k, v, out, n, start, H, Hkv, D, qt, qh, ot, oh, kvh, kvp, scale,
                                             threads);
}
#endif
