/* Decode attention over the per-slot KV cache for bfloat16 and float32 models (models/native.py builds and loads
 * this).
 *
 * Why: PyTorch's CPU SDPA (flash) is built for long query blocks; a decode row has one query per head (three
 * per KV head once the grouped-query heads are packed), and SDPA spends most of a decode step's attention
 * on per-block overhead (measured: ~0.8 ms per layer for 16 rows at 250 positions, 2 GB/s of K/V). This
 * reads each row's K and V once, only the positions the row sees, in one pass (online softmax).
 *
 * Shapes (elements: bf16 as uint16, or fp32): q [R, H, G, D] contiguous (G query heads per KV head); k, v: the slot
 * buffers, row r reads slot slots[r]: position p of head h at slot * s_slot + h * s_head + p * D; ext[r]:
 * how many positions row r sees (1..capacity); out [R, H, G, D]. Math in fp32 (scores, softmax, sums),
 * result rounded to bf16 (nearest even), as SDPA's bf16 kernels do; where the CPU has AVX512-BF16 and D % 32 == 0
 * the softmax weights are rounded to bf16 before the value sum, as SDPA's bf16 kernels round them before their
 * second matmul (one_head_dp). fp32: the same math, fp32 in and out (one_head). Needs D % 16 == 0, D <= 256,
 * G <= 16.
 * Portable C: GCC vector extensions (16 fp32 lanes), lowered to whatever the build machine has (-march=native).
 */
#include "vec16.h"

#define MAX_G 16
#define MAX_C 16 /* 16-lane chunks of one head: D <= 256 */
/* Positions prefetched ahead, into L2 (prefetcht1): K/V rows of a slot sit in 4 KiB pages the hardware prefetcher
 * stops at. Into L1, 32 ahead, the op read ~8.5 GB/s (AMD EPYC, bf16, 30 layers: 8 rows at 150 positions 3.3 ms, 16
 * at 250 10.0 ms; into L2 64 ahead 2.6 and 6.9; fp32 5.2 / 13.8 -> 4.7 / 12.4; 128 ahead no better). */
#define AHEAD 64

static inline float hsum(v16f v) {
    v += __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return v[0];
}

static inline v16f vmax(v16f a, v16f b) { return vselect(a > b, a, b); }

static inline float hmax(v16f v) {
    v = vmax(v, __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
    v = vmax(v, __builtin_shuffle(v, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
    v = vmax(v, __builtin_shuffle(v, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0}));
    return v[0];
}

/* Element access of the generic kernel: bf16 (uint16 bits) or fp32, by a flag that is a constant wherever the
 * kernel is inlined (the branches fold away). */
static inline v16f load_elems(const void *p, int64_t i, const int f32) {
    if (f32) {
        v16f f;
        memcpy(&f, (const float *)p + i, sizeof f);
        return f;
    }
    return load_bf16((const uint16_t *)p + i);
}

/* Every 64-byte line of position p's row (D elements) of a head's buffer, into L2. */
static inline void prefetch_row(const void *base, int64_t p, int64_t D, const int f32) {
    const int64_t bytes = D * (f32 ? 4 : 2);
    const char *row = (const char *)base + p * bytes;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
}

/* The first AHEAD positions of a head's K and V (nothing prefetched them yet). */
static inline void prefetch_head(const void *kb, const void *vb, int64_t n, int64_t D, const int f32) {
    for (int64_t p = 0; p < AHEAD && p < n; p++) {
        prefetch_row(kb, p, D, f32);
        prefetch_row(vb, p, D, f32);
    }
}

/* Positions whose scores are all computed before their softmax (a chunk): the online softmax's bookkeeping (the
 * running max, the rescale of the accumulators and its exp) then runs once a chunk instead of once every 16
 * positions. Measured alone (16 rows at 250 positions, bf16, the layer in L3): that bookkeeping every 16 positions
 * took half the kernel's time. */
#define CHUNK 64
#define CHUNK_BLOCKS (CHUNK / 16)

/* The online softmax over one chunk: sc[0..nb) hold its scores, 16 positions a block (lanes of the last block from
 * `last` on are past the end). Updates the running max *m and the lane sums *lsum, overwrites the scores with
 * their weights exp(score - max) and returns what the values accumulated so far are scaled by. */
static inline float softmax_chunk(v16f *sc, int64_t nb, int64_t last, float *m, v16f *lsum) {
    const v16i live = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (int32_t)last;
    sc[nb - 1] = vselect(live, sc[nb - 1], splat(-3.0e38f));
    v16f top = sc[0];
    for (int64_t b = 1; b < nb; b++) top = vmax(top, sc[b]);
    const float t = hmax(top), next = t > *m ? t : *m;
    const float alpha = vexp(splat(*m - next))[0];
    v16f sum = splat(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        sc[b] = vexp(sc[b] - next);
        if (b == nb - 1) sc[b] = vselect(live, sc[b], splat(0.0f));
        sum += sc[b];
    }
    *lsum = *lsum * alpha + sum;
    *m = next;
    return alpha;
}

/* One (row, KV head): G queries over n positions, a chunk at a time; q, K, V and out in bf16 (f32 == 0) or
 * fp32 (f32 == 1). Inlined with constant G, D and f32 where the caller knows them, so the chunk loops unroll and
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void one_head(const void *qb, const void *kb, const void *vb, void *ob,
                                                           int64_t n, const int64_t G, const int64_t D, float scale,
                                                           const int f32) {
    const int64_t nc = D / 16;
    v16f qv[MAX_G][MAX_C], acc[MAX_G][MAX_C], part[MAX_G][16], lsum[MAX_G];
    float m[MAX_G];
    for (int64_t g = 0; g < G; g++) {
        for (int64_t c = 0; c < nc; c++) {
            qv[g][c] = load_elems(qb, g * D + c * 16, f32) * scale;
            acc[g][c] = splat(0.0f);
        }
        m[g] = -3.0e38f;
        lsum[g] = splat(0.0f);
    }
    prefetch_head(kb, vb, n, D, f32);
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t clen = n - c0 < CHUNK ? n - c0 : CHUNK, nb = (clen + 15) / 16;
        v16f sc[MAX_G][CHUNK_BLOCKS];
        for (int64_t b = 0; b < nb; b++) {
            const int64_t p0 = c0 + 16 * b, len = n - p0 < 16 ? n - p0 : 16;
            for (int64_t j = 0; j < 16; j++) {
                if (j < len) {
                    prefetch_row(kb, p0 + j + AHEAD, D, f32);
                    v16f kv[MAX_C];
                    for (int64_t c = 0; c < nc; c++) kv[c] = load_elems(kb, (p0 + j) * D + c * 16, f32);
                    for (int64_t g = 0; g < G; g++) {
                        v16f a = qv[g][0] * kv[0];
                        for (int64_t c = 1; c < nc; c++) a += qv[g][c] * kv[c];
                        part[g][j] = a;
                    }
                } else {
                    for (int64_t g = 0; g < G; g++) part[g][j] = splat(0.0f);
                }
            }
            for (int64_t g = 0; g < G; g++) sc[g][b] = reduce16(part[g]);
        }
        float w[MAX_G][CHUNK];
        for (int64_t g = 0; g < G; g++) {
            const float alpha = softmax_chunk(sc[g], nb, clen - 16 * (nb - 1), &m[g], &lsum[g]);
            memcpy(w[g], sc[g], (size_t)nb * sizeof sc[g][0]);
            for (int64_t c = 0; c < nc; c++) acc[g][c] *= alpha;
        }
        for (int64_t j = 0; j < clen; j++) {
            prefetch_row(vb, c0 + j + AHEAD, D, f32);
            v16f vv[MAX_C];
            for (int64_t c = 0; c < nc; c++) vv[c] = load_elems(vb, (c0 + j) * D + c * 16, f32);
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < nc; c++) acc[g][c] += w[g][j] * vv[c];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = 1.0f / hsum(lsum[g]);
        for (int64_t c = 0; c < nc; c++) {
            v16f o = acc[g][c] * inv;
            if (f32)
                memcpy((float *)ob + g * D + c * 16, &o, sizeof o);
            else
                store_bf16((uint16_t *)ob + g * D + c * 16, o);
        }
    }
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* one_head with AVX512-BF16 dot products (D % 32 == 0): scores from bf16 q.k pairs straight into fp32 lanes (no
 * widening of K), and the value sum over pairs of positions: V rows p and p+1 interleaved by 16-bit element
 * (within 128-bit lanes), times the pair of their softmax weights rounded to bf16, as SDPA's bf16 kernels round
 * the probabilities before their second matmul. Why: the fp32 version spends about twice the instructions a
 * position and head, and ran at 12 GB/s from L3. Measured alone (16 rows, 250 positions, bf16): 249-263 -> 216-222
 * us a layer from L3, 351-374 -> 322-352 us from memory; at 1000 positions both are bound by reading K/V (~10 GB/s
 * here), and inside a whole decode step the change is within run-to-run noise (docs/performance.md).
 * acc[g][2c] holds dims c*32 + 8k + i (k = 128-bit lane, i < 4) of its 16 lanes, acc[g][2c + 1] dims + 4. */
static inline __attribute__((always_inline)) void one_head_dp(const uint16_t *qb, const uint16_t *kb,
                                                              const uint16_t *vb, uint16_t *ob, int64_t n,
                                                              const int64_t G, const int64_t D, float scale,
                                                              const uint16_t *kn, const uint16_t *vn, int64_t nn,
                                                              int first) {
    const int64_t nk = D / 32;
    __m512bh qv[MAX_G][MAX_C / 2];
    __m512 acc[MAX_G][MAX_C];
    v16f part[MAX_G][16], lsum[MAX_G];
    float m[MAX_G];
    uint32_t wp[MAX_G][CHUNK / 2]; /* bf16 weight pairs (positions 2j, 2j+1 of the chunk) */
    for (int64_t g = 0; g < G; g++) {
        for (int64_t c = 0; c < nk; c++) qv[g][c] = (__m512bh)_mm512_loadu_si512(qb + g * D + c * 32);
        for (int64_t c = 0; c < 2 * nk; c++) acc[g][c] = _mm512_setzero_ps();
        m[g] = -3.0e38f;
        lsum[g] = splat(0.0f);
    }
    if (first) prefetch_head(kb, vb, n, D, 0);
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t clen = n - c0 < CHUNK ? n - c0 : CHUNK, nb = (clen + 15) / 16;
        v16f sc[MAX_G][CHUNK_BLOCKS];
        for (int64_t b = 0; b < nb; b++) {
            const int64_t p0 = c0 + 16 * b, len = n - p0 < 16 ? n - p0 : 16;
            for (int64_t j = 0; j < 16; j++) {
                if (j < len) {
                    const uint16_t *kr = kb + (p0 + j) * D;
                    const int64_t t = p0 + j + AHEAD;
                    const uint16_t *kp = t < n ? kb + t * D : t - n < nn ? kn + (t - n) * D : kr;
                    __builtin_prefetch(kp, 0, 2);
                    __builtin_prefetch(kp + 32, 0, 2);
                    __m512bh kv[MAX_C / 2];
                    for (int64_t c = 0; c < nk; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kr + c * 32);
                    for (int64_t g = 0; g < G; g++) {
                        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
                        for (int64_t c = 1; c < nk; c++) a = _mm512_dpbf16_ps(a, qv[g][c], kv[c]);
                        part[g][j] = (v16f)a;
                    }
                } else {
                    for (int64_t g = 0; g < G; g++) part[g][j] = splat(0.0f);
                }
            }
            for (int64_t g = 0; g < G; g++) sc[g][b] = reduce16(part[g]) * scale;
        }
        for (int64_t g = 0; g < G; g++) {
            const float alpha = softmax_chunk(sc[g], nb, clen - 16 * (nb - 1), &m[g], &lsum[g]);
            for (int64_t b = 0; b < nb; b++) {
                __m256bh eb = _mm512_cvtneps_pbh((__m512)sc[g][b]);
                memcpy(wp[g] + 8 * b, &eb, sizeof eb);
            }
            for (int64_t c = 0; c < 2 * nk; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(alpha));
        }
        for (int64_t j = 0; j < clen; j += 2) {
            const uint16_t *vr = vb + (c0 + j) * D;
            for (int64_t t = c0 + j + AHEAD; t < c0 + j + AHEAD + 2; t++) {
                const uint16_t *vp = t < n ? vb + t * D : t - n < nn ? vn + (t - n) * D : vr;
                __builtin_prefetch(vp, 0, 2);
                __builtin_prefetch(vp + 32, 0, 2);
            }
            __m512i lo[MAX_C / 2], hi[MAX_C / 2];
            for (int64_t c = 0; c < nk; c++) {
                __m512i a = _mm512_loadu_si512(vr + c * 32);
                __m512i b = j + 1 < clen ? _mm512_loadu_si512(vr + D + c * 32) : _mm512_setzero_si512();
                lo[c] = _mm512_unpacklo_epi16(a, b);
                hi[c] = _mm512_unpackhi_epi16(a, b);
            }
            for (int64_t g = 0; g < G; g++) {
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)wp[g][j / 2]);
                for (int64_t c = 0; c < nk; c++) {
                    acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], (__m512bh)lo[c], w);
                    acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], (__m512bh)hi[c], w);
                }
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = 1.0f / hsum(lsum[g]);
        for (int64_t c = 0; c < 2 * nk; c++) {
            float lanes[16];
            _mm512_storeu_ps(lanes, acc[g][c]);
            const int64_t base = (c / 2) * 32 + (c % 2) * 4;
            for (int i = 0; i < 16; i++) ob[g * D + base + (i / 4) * 8 + i % 4] = to_bf16(lanes[i] * inv);
        }
    }
}
#define DP_TAKES(D) ((D) % 32 == 0)
#else
#define one_head_dp(qb, kb, vb, ob, n, G, D, scale, kn, vn, nn, first) one_head(qb, kb, vb, ob, n, G, D, scale, 0)
#define DP_TAKES(D) 0
#endif

/* 1 when built with OpenMP (the kernels then split their work over the threads they are given). */
int bucketserve_native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* x86 with AVX2 and no AVX-512 (an AMD EPYC with Zen 3 cores): GCC lowers this file's 16-lane vector code's
 * comparisons and shuffles to scalar instructions there, and it ran 3-4x slower than PyTorch's SDPA (fp32, one
 * thread, 16 rows at 300 positions 2.41 ms a layer against 0.71; one row 0.22 against 0.06). So fp32 rows go to
 * decode_avx2.c's 8-lane kernel and bf16 rows decline (SDPA). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define AVX2_ONLY 1
#endif
int bucketserve_decode_attention_f32x8(const float *q, const float *k, const float *v, float *out,
                                       const int64_t *slots, const int64_t *ext, int64_t rows, int64_t heads,
                                       int64_t groups, int64_t dim, int64_t s_slot, int64_t s_head, float scale,
                                       int threads);
int bucketserve_decode_f32x8_supported(void);

/* 1 when this build's decode kernel takes rows of this element type (f32: fp32, else bf16) and beats SDPA on them
 * (models/native.py `decode_kernel`). */
int bucketserve_decode_fast(int f32) {
#ifdef AVX2_ONLY
    return f32 && bucketserve_decode_f32x8_supported();
#else
    (void)f32;
    return 1;
#endif
}

/* The extents of an additive mask's rows (models/attention.py `_extents`): row r's elements (2 or 4 bytes each,
 * `width`; rows `stride` elements apart, `cols` long) are 0 bits where the row attends. ext[r] = 1 + its last
 * attended position (`cols` when it attends none). Returns 1 when every row attends exactly [0, ext[r]) (no
 * sliding window, no hole, not empty), else 0; -1 for an element width it does not take. Why here: the same
 * scan in numpy cost ~40 us for a [16, 2048] mask, in each of a step's 30 layers. */
/* One row: the count of zero elements (a loop the compiler vectorizes), the run of zeros from 0 (early exit);
 * they agree for a prefix, else the last zero is searched from the end. */
#define ROW_EXTENT(T)                                                                                          \
    do {                                                                                                       \
        const T *m = (const T *)mask + r * stride;                                                             \
        int64_t zeros = 0, first = 0, last = cols - 1;                                                         \
        for (int64_t c = 0; c < cols; c++) zeros += m[c] == 0;                                                 \
        while (first < cols && m[first] == 0) first++;                                                         \
        if (first > 0 && zeros == first) {                                                                     \
            ext[r] = first;                                                                                    \
        } else {                                                                                               \
            while (last >= 0 && m[last] != 0) last--;                                                          \
            ext[r] = last < 0 ? cols : last + 1;                                                               \
            prefix = 0;                                                                                        \
        }                                                                                                      \
    } while (0)

int bucketserve_mask_extents(const void *mask, int64_t rows, int64_t cols, int64_t stride, int width, int64_t *ext) {
    if (width != 2 && width != 4) return -1;
    int prefix = 1;
    for (int64_t r = 0; r < rows; r++) {
        if (width == 2)
            ROW_EXTENT(uint16_t);
        else
            ROW_EXTENT(uint32_t);
    }
    return prefix;
}

/* Every (row, KV head) of a decode step; elements bf16 (f32 == 0, as uint16 bits) or fp32 (f32 == 1: float32
 * models, where PyTorch's SDPA spent ~0.6 ms a layer on 8 decode rows at 150 positions, ~2.5x this kernel); shapes
 * in the header comment. Returns 0, or -1 for shapes this kernel does not take (the caller then uses SDPA). */
int bucketserve_decode_attention(const void *q, const void *k, const void *v, void *out, const int64_t *slots,
                                 const int64_t *ext, int64_t rows, int64_t heads, int64_t groups, int64_t dim,
                                 int64_t s_slot, int64_t s_head, float scale, int threads, int f32) {
    if (groups < 1 || groups > MAX_G || dim % 16 || dim < 16 || dim > 16 * MAX_C) return -1;
#ifdef AVX2_ONLY
    if (!f32) return -1;
    return bucketserve_decode_attention_f32x8(q, k, v, out, slots, ext, rows, heads, groups, dim, s_slot, s_head,
                                              scale, threads);
#endif
    const int64_t G = groups, D = dim, esz = f32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t rh = 0; rh < rows * heads; rh++) {
        const int64_t r = rh / heads, h = rh % heads, base = (slots[r] * s_slot + h * s_head) * esz;
        const void *qb = (const char *)q + rh * G * D * esz, *kb = (const char *)k + base, *vb = (const char *)v + base;
        void *ob = (char *)out + rh * G * D * esz;
        if (f32) {
            if (G == 3 && D == 64) /* SmolLM2 and its relatives */
                one_head(qb, kb, vb, ob, ext[r], 3, 64, scale, 1);
            else
                one_head(qb, kb, vb, ob, ext[r], G, D, scale, 1);
            continue;
        }
        /* the next (row, head)'s K/V: prefetched while this one ends (its first positions are not a stall) */
        const int64_t rn = (rh + 1) / heads, hn = (rh + 1) % heads;
        const int64_t nn = rh + 1 < rows * heads ? ext[rn] : 0;
        const int64_t next = nn ? slots[rn] * s_slot + hn * s_head : 0;
        const uint16_t *kn = (const uint16_t *)k + next, *vn = (const uint16_t *)v + next;
        const int first = rh == 0 || threads > 1;
        if (G == 3 && D == 64)
            one_head_dp(qb, kb, vb, ob, ext[r], 3, 64, scale, kn, vn, nn, first);
        else if (G == 4 && D == 64)
            one_head_dp(qb, kb, vb, ob, ext[r], 4, 64, scale, kn, vn, nn, first);
        else if (G == 4 && D == 128)
            one_head_dp(qb, kb, vb, ob, ext[r], 4, 128, scale, kn, vn, nn, first);
        else if (DP_TAKES(D))
            one_head_dp(qb, kb, vb, ob, ext[r], G, D, scale, kn, vn, nn, first);
        else
            one_head(qb, kb, vb, ob, ext[r], G, D, scale, 0);
    }
    return 0;
}

/* Decode attention read straight from the step's additive mask (one call a layer instead of a mask scan, numpy
 * bookkeeping and the kernel): row r attends slot r's positions [0, ext[r]) where ext comes from mask row r
 * (`mask_stride` elements apart, `cols` wide, `width` bytes an element). Returns 0; 1 when a row does not attend
 * exactly a non-empty prefix (a sliding window, a hole: the caller takes the general path); -1 for shapes the
 * kernel does not take. Elements bf16 (f32 == 0) or fp32 (f32 == 1). */
#define MASKED_MAX_ROWS 1024
int bucketserve_decode_attention_masked(const void *q, const void *k, const void *v, void *out, const void *mask,
                                        int64_t mask_stride, int64_t cols, int width, int64_t rows, int64_t heads,
                                        int64_t groups, int64_t dim, int64_t s_slot, int64_t s_head,
                                        int64_t positions, float scale, int threads, int f32) {
    if (rows < 1 || rows > MASKED_MAX_ROWS || cols > positions) return -1;
    int64_t ext[MASKED_MAX_ROWS], slots[MASKED_MAX_ROWS];
    int prefix = bucketserve_mask_extents(mask, rows, cols, mask_stride, width, ext);
    if (prefix < 0) return -1;
    if (prefix == 0) return 1;
    for (int64_t r = 0; r < rows; r++) {
        if (ext[r] < 1) return 1;
        slots[r] = r;
    }
    return bucketserve_decode_attention(q, k, v, out, slots, ext, rows, heads, groups, dim, s_slot, s_head, scale,
                                        threads, f32 != 0);
}
