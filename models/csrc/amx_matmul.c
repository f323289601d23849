/* y = x @ w.T in bfloat16 with AMX tiles, on a copy of the weight packed for them (models/native_matmul.py packs it and
 * calls this; models/prepack.py routes bf16 linears here).
 *
 * Why: oneDNN's prepacked bf16 matmul streams a decode step's weights at ~8 GB/s for 8-16 rows, where one core
 * reads ~12.5 GB/s, and the AVX512-BF16 kernel (small_matmul.c) is bound by its dot products from 8 rows on. An
 * AMX tile product (16 rows x 16 columns x 32 k) takes one instruction, so 1-16 rows cost the same arithmetic and
 * the loop is bound by reading the weight: tiles of 1 KiB, read once, in the order they are stored (the hardware
 * prefetcher follows that stream: software prefetch 0-16 KiB ahead measured the same).
 *
 * Packed weight (elements, bf16 as uint16): [N/32, K/32, 2, 16, 16, 2]: for a group of 32 output columns
 * (two tiles of 16) and a block of 32 k, tile j (j = 0, 1) is the "VNNI" layout AMX wants: row r holds, for each
 * of its 16 columns n, the pair w[32g + 16j + n, 32b + 2r + {0, 1}]. A group's tiles follow one another for
 * all k, so a group is one contiguous run of memory.
 *
 * Shapes: x [M, K] contiguous, y [M, N] contiguous, K % 32 == 0, N % 32 == 0, M >= 1. Rows go in pairs of 16-row
 * blocks (four accumulators: the tile products' latency overlaps); a group's tiles are read from memory for the
 * first pair and from cache for the next. Sums in fp32 (exact products of bf16 pairs), rounded to bf16 once
 * (nearest even). Measured (docs/performance.md): 1.4x oneDNN at 1-32 rows, 1.2x at 64, 0.96x at 256.
 *
 * Weight-only int8 (`--quantize int8`): the same layout with one signed byte an element, and a fp32 scale per
 * output column. Each k block's two int8 tiles are converted to bf16 (exact: |q| <= 127) into a small ring of
 * scratch tiles a few blocks ahead of the tile products, which read them from L1; each column's fp32 sum is
 * multiplied by its scale before the one rounding. Half the bytes of bf16 for the memory-bound decode steps.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#include "amx_tiles.h"

/* The tile configuration (palette 1): tmm0-3 the fp32 accumulators C[i][j] (row block i, column tile j) [rows_i,
 * 16], tmm4/5 the row blocks' k block A[i] [rows_i, 32 bf16], tmm6/7 the two weight tiles [16 pairs, 16 x 2]. */
static void configure(int rows0, int rows1) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const uint8_t rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = rows[t] ? rows[t] : 1; /* an unused block still needs a valid shape */
    }
    _tile_loadconfig(&c);
}

/* Accumulators C[i][0], C[i][1] (i = second ? 1 : 0) -> bf16 rows out[r * N + 0..31], r < rows; with `scale`
 * (the group's 32 column scales of an int8 weight) each column's sum is scaled first, then rounded once. */
static inline void store_rows(int second, uint16_t *out, int64_t N, int rows, const float *scale) {
    float acc[2][16][16];
    if (second) { /* tile numbers must be constants */
        _tile_stored(2, acc[0], 64);
        _tile_stored(3, acc[1], 64);
    } else {
        _tile_stored(0, acc[0], 64);
        _tile_stored(1, acc[1], 64);
    }
    const __m512 s0 = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.0f);
    const __m512 s1 = scale ? _mm512_loadu_ps(scale + 16) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < rows; r++) {
        __m256bh lo = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc[0][r]), s0));
        __m256bh hi = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc[1][r]), s1));
        _mm256_storeu_si256((__m256i *)(out + r * N), (__m256i)lo);
        _mm256_storeu_si256((__m256i *)(out + r * N + 16), (__m256i)hi);
    }
}

/* Output columns [32g, 32g + 32) of the rows of one block (rows1 == 0: rows0 rows from m0) or two blocks (rows0 +
 * rows1 rows: four independent accumulator chains, so the tile products' latency overlaps). */
/* 512 int8 weights -> the same 512 as bf16 (exact: |q| <= 127 needs 7 significant bits; bf16 has 8). */
static inline void int8_tile(const int8_t *src, uint16_t *dst) {
    for (int i = 0; i < 512; i += 32) {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + i))));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + i + 16))));
        _mm512_store_si512((__m512i *)(dst + i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

static inline void int8_pair(const int8_t *src, uint16_t *dst) {
    int8_tile(src, dst);
    int8_tile(src + 512, dst + 512);
}

/* int8 weights: k blocks converted AHEAD blocks before their tile loads, and their reads prefetched PF blocks
 * further (blocks of 1 KiB). Without the prefetch the int8 stream ran at ~8 GB/s; converting just before the
 * load measured the same as AHEAD 4; PF 2 / 6 / 8 / 16 no better than 4 (docs/performance.md, "Weight-only int8"). */
#define AHEAD 4
#define PF 4

/* wg: the group's bf16 tiles, or (wq != NULL) its int8 tiles, converted AHEAD k blocks ahead into a ring of
 * scratch tile pairs in L1 (the conversion's vector work overlaps the tile products and the next blocks' reads);
 * scale: the weight's column scales (int8, also for a group run() converted whole) or NULL. */
static inline void group_block(const uint16_t *x, const uint16_t *wg, const int8_t *wq, const float *scale,
                               uint16_t *y, int64_t m0, int rows0, int rows1, int64_t N, int64_t K, int64_t g) {
    const int64_t blocks = K / 32;
    const uint16_t *x0 = x + m0 * K, *x1 = x + (m0 + rows0) * K;
    uint16_t scratch[AHEAD][1024] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    if (rows1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    /* int8: the ring of scratch tile pairs starts AHEAD k blocks ahead of the tile products */
    if (wq)
        for (int64_t b = 0; b < AHEAD && b < blocks; b++) int8_pair(wq + b * 1024, scratch[b]);
    for (int64_t b = 0; b < blocks; b++) {
        /* GCC's tile loads are asm that does not declare the memory it reads: without this barrier the stores to
         * the scratch tiles (never read by C) are dead to the compiler and dropped. */
        if (wq) __asm__ volatile("" ::: "memory");
        const uint16_t *t = wq ? scratch[b % AHEAD] : wg + b * 1024; /* two tiles of 512 elements */
        _tile_loadd(6, t, 64);
        _tile_loadd(7, t + 512, 64);
        _tile_loadd(4, x0 + b * 32, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1) {
            _tile_loadd(5, x1 + b * 32, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (wq && b + AHEAD < blocks) {
            __asm__ volatile("" ::: "memory"); /* the tile loads above read this slot first */
            int8_pair(wq + (b + AHEAD) * 1024, scratch[b % AHEAD]);
            for (int i = 0; i < 1024; i += 64) /* past the group's end: a prefetch never faults */
                _mm_prefetch((const char *)(wq + (b + AHEAD + PF) * 1024 + i), _MM_HINT_T0);
        }
    }
    const float *sg = scale ? scale + g * 32 : NULL;
    store_rows(0, y + m0 * N + g * 32, N, rows0, sg);
    if (rows1) store_rows(1, y + (m0 + rows0) * N + g * 32, N, rows1, sg);
}

/* Rows of one block (M <= 16), bf16: two groups far apart in the weight (ga, gb) in one pass over k, each group's
 * tile products in the order group_block runs them (the same bits). Two streams from memory keep more of a core's
 * misses in flight than one: 212 MB of SmolLM2's layer weights at 16 rows in 16.5-17.4 ms against 17.7-18.9 (C
 * harness, one thread; a plain read of one stream ~12.5 GB/s, of two interleaved ~14). Tiles: tmm0/1 group ga's
 * accumulators, tmm2/3 gb's, tmm4 the rows' k block, tmm5-7 weight tiles (tmm6 is reused for gb's second). */
static void configure_two(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t < 5 ? rows : 16;
    }
    _tile_loadconfig(&c);
}

static inline void two_groups(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int64_t N, int64_t K,
                              int64_t ga, int64_t gb) {
    const int64_t blocks = K / 32;
    const uint16_t *wa = w + ga * K * 32, *wb = w + gb * K * 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < blocks; b++) {
        _tile_loadd(6, wa + b * 1024, 64);
        _tile_loadd(7, wa + b * 1024 + 512, 64);
        _tile_loadd(5, wb + b * 1024, 64);
        _tile_loadd(4, x + b * 32, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, wb + b * 1024 + 512, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
    }
    store_rows(0, y + ga * 32, N, rows, NULL);
    store_rows(1, y + gb * 32, N, rows, NULL);
}

/* w: bf16 packed weight, or wq (with scale [N]) its int8 twin; the other NULL. */
static void run(const uint16_t *x, const uint16_t *w, const int8_t *wq, const float *scale, uint16_t *y, int64_t M,
                int64_t N, int64_t K, int64_t g0, int64_t g1) {
    /* Rows in pairs of 16-row blocks; the rest (under 32 rows) as one or two blocks of about equal size. */
    const int64_t paired = M >= 32 ? (M / 32) * 32 : 0;
    const int64_t rest = M - paired;
    const int r0 = rest > 16 ? (int)((rest + 1) / 2) : (int)rest, r1 = (int)(rest - r0);
    const int both = paired && rest; /* then each group switches between the two shapes */
    if (w && M <= 16 && g1 - g0 >= 2) { /* one block of rows: groups in pairs, h apart (two streams) */
        const int64_t h = (g1 - g0) / 2;
        configure_two((int)M);
        for (int64_t g = g0; g < g0 + h; g++) two_groups(x, w, y, (int)M, N, K, g, g + h);
        if ((g1 - g0) % 2) {
            configure((int)M, 0);
            group_block(x, w + (g1 - 1) * K * 32, NULL, NULL, y, 0, (int)M, 0, N, K, g1 - 1);
        }
        _tile_release();
        return;
    }
    /* int8 read by more than one pass over the rows: each group is converted once, whole, into `conv` (K x 32
     * bf16, in L2), and the passes read that like a bf16 group (converting in each pass made 128 rows slower
     * than the bf16 copy) */
    uint16_t *conv = wq && paired / 32 + (rest ? 1 : 0) > 1 ? aligned_alloc(64, (size_t)K * 64) : NULL;
    if (!both) configure(paired ? 16 : r0, paired ? 16 : r1);
    for (int64_t g = g0; g < g1; g++) {
        const uint16_t *wg = w ? w + g * K * 32 : NULL;
        const int8_t *qg = wq ? wq + g * K * 32 : NULL;
        if (conv) {
            for (int64_t b = 0; b < K / 32; b++) int8_pair(qg + b * 1024, conv + b * 1024);
            __asm__ volatile("" ::: "memory"); /* the tile loads read conv (see group_block) */
            wg = conv;
            qg = NULL;
        }
        if (paired) {
            if (both) configure(16, 16);
            for (int64_t m0 = 0; m0 < paired; m0 += 32) group_block(x, wg, qg, scale, y, m0, 16, 16, N, K, g);
        }
        if (rest) {
            if (both) configure(r0, r1);
            group_block(x, wg, qg, scale, y, paired, r0, r1, N, K, g);
        }
    }
    _tile_release();
    free(conv);
}

/* 1 when this process may use AMX (asking Linux for the tile state once), else 0: the caller never asks. */
int bucketserve_amx_supported(void) {
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && (bits & (1ul << XFEATURE_XTILEDATA)))
        return 1;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    return syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && (bits & (1ul << XFEATURE_XTILEDATA));
}

static int matmul(const uint16_t *x, const uint16_t *w, const int8_t *wq, const float *scale, uint16_t *y, int64_t M,
                  int64_t N, int64_t K, int threads) {
    if (M < 1 || K < 32 || K % 32 || N < 32 || N % 32) return -1;
    const int64_t groups = N / 32;
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        { /* tile state is per thread: each configures its own */
            int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
            run(x, w, wq, scale, y, M, N, K, groups * t / n, groups * (t + 1) / n);
        }
        return 0;
    }
#endif
    (void)threads;
    run(x, w, wq, scale, y, M, N, K, 0, groups);
    return 0;
}

/* Returns 0, or -1 when the shapes do not fit (the caller then uses oneDNN). */
int bucketserve_amx_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                                int threads) {
    return matmul(x, w, NULL, NULL, y, M, N, K, threads);
}

/* y = (x @ q.T) * scale: q the int8 weight in the same packed layout (one byte an element), scale [N] fp32 per
 * output column. Returns 0, or -1 when the shapes do not fit. */
int bucketserve_amx_matmul_q8(const uint16_t *x, const int8_t *q, const float *scale, uint16_t *y, int64_t M,
                              int64_t N, int64_t K, int threads) {
    return matmul(x, NULL, q, scale, y, M, N, K, threads);
}
#else
int bucketserve_amx_supported(void) { return 0; }

int bucketserve_amx_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                                int threads) {
    (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -1;
}

int bucketserve_amx_matmul_q8(const uint16_t *x, const int8_t *q, const float *scale, uint16_t *y, int64_t M,
                              int64_t N, int64_t K, int threads) {
    (void)x, (void)q, (void)scale, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -1;
}
#endif
