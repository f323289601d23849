/* One entry for a decode-sized linear or gated SiLU MLP, whichever weight copy it reads: the Python side picks
 * the copy once per weight (models/prepack.py) and calls here once per op. Why: the per-call Python of choosing a
 * kernel, checking its inputs and (for the MLP) running silu and the product as two more PyTorch ops cost more
 * than a one-row step's arithmetic (~10 us a linear, ~35 us an MLP, x 210 linears / 30 MLPs a step).
 *
 * kind: 0 the small matmul on the plain weight [N, K]; 1 the AMX matmul on its tile copy; 2 the AMX matmul on
 * the int8 tile copy with per-column scales `s`; 3 the float32 one-row matmul on the plain fp32 weight (x and y
 * fp32; the others read and write bf16); 4 the AVX512-BF16 vector matmul on the tile copy (CPUs without AMX); 5 the
 * float32 vector matmul on the fp32 tile copy (x and y fp32); 6 the vector matmul on the int8 tile copy with
 * per-column scales `s` (CPUs without AMX); 7 the float32 lm_head of greedy steps (greedy_head.c) on the fp32 tile copy,
 * `s` its int8 screen copy (x and y fp32); 8 and 9 the float32 vector matmul on the exact 4-bit or 8-bit copy of a
 * weight whose fp32 values it holds exactly (exact_codes.c: `w` the codes, `s` their scales; x and y fp32). */
#include "vec16.h"

int bucketserve_small_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n,
                                  int64_t k, int threads);
int bucketserve_amx_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                                int threads);
int bucketserve_small_matmul_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n, int64_t k,
                                 int threads);
int bucketserve_tiled_matmul_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                                  int64_t K, int threads);
int bucketserve_tiled_matmul_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                                 int threads);
int bucketserve_amx_matmul_q8(const uint16_t *x, const int8_t *q, const float *scale, uint16_t *y, int64_t M,
                              int64_t N, int64_t K, int threads);
int bucketserve_tiled_matmul_q8(const uint16_t *x, const int8_t *q, const float *scale, uint16_t *y, int64_t M,
                                int64_t N, int64_t K, int threads);
int bucketserve_greedy_head_f32(const float *x, const float *tiles, const int8_t *screen, float *y, int64_t M,
                                int64_t N, int64_t K, int threads);
int bucketserve_exact4_matmul_f32(const float *x, const uint8_t *codes, const float *pairs, float *y, int64_t M,
                                  int64_t N, int64_t K, int threads);
int bucketserve_exact8_matmul_f32(const float *x, const int8_t *codes, const float *scales, float *y, int64_t M,
                                  int64_t N, int64_t K, int threads);

/* y [M, N] = x [M, K] @ w.T. Returns 0, or -1 when the kernel does not take the shapes (the caller uses oneDNN). */
int bucketserve_linear(const void *x, const void *w, const float *s, void *y, int64_t M, int64_t N, int64_t K,
                       int kind, int threads) {
    switch (kind) {
    case 0: return bucketserve_small_matmul_bf16(x, (const uint16_t *)w, y, M, N, K, threads);
    case 1: return bucketserve_amx_matmul_bf16(x, (const uint16_t *)w, y, M, N, K, threads);
    case 2: return bucketserve_amx_matmul_q8(x, (const int8_t *)w, s, y, M, N, K, threads);
    case 3: return bucketserve_small_matmul_f32(x, (const float *)w, y, M, N, K, threads);
    case 4: return bucketserve_tiled_matmul_bf16(x, (const uint16_t *)w, y, M, N, K, threads);
    case 5: return bucketserve_tiled_matmul_f32(x, (const float *)w, y, M, N, K, threads);
    case 6: return bucketserve_tiled_matmul_q8(x, (const int8_t *)w, s, y, M, N, K, threads);
    case 7: return bucketserve_greedy_head_f32(x, (const float *)w, (const int8_t *)s, y, M, N, K, threads);
    case 8: return bucketserve_exact4_matmul_f32(x, (const uint8_t *)w, s, y, M, N, K, threads);
    case 9: return bucketserve_exact8_matmul_f32(x, (const int8_t *)w, s, y, M, N, K, threads);
    default: return -1;
    }
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* 16 bf16 -> fp32 lanes */
static inline __m512 widen_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* exp(x) in 16 lanes, as vexp (vec16.h) computes it: x = n ln2 + r (Cody-Waite: ln2 in two parts, |r| <= ln2 / 2),
 * Cephes' polynomial for exp(r) (relative error ~1e-7), times 2^n by scalef (exact: inf above the fp32 range, 0
 * below). x is clamped to [-104, 89] first (past both ends the result is already 0 or inf); a NaN x clamps too,
 * and the caller's NaN numerator carries it. */
static inline __m512 exp_512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* y[i] = silu(gate[i]) * y[i], n % 16 == 0: silu(g) = g / (1 + exp(-g)), as PyTorch's silu (one fp32 division),
 * each result rounded to bf16. Why: the portable loop below (an exp for x <= 0, selects, a division, a round trip
 * through memory for the rounding) took 5.5 ms of a 128-token mixed step's MLPs (128 x 1536 x 30 layers), this
 * 2.8; on 1.18 M elements of real matmul outputs both equal eager's bits. One difference: the rounding instruction
 * flushes fp32 denormals (|x| < 1.2e-38) to zero, where eager keeps them (as rms_norm.c). */
static void silu_times(uint16_t *y, const uint16_t *gate, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 g = widen_bf16(gate + i), u = widen_bf16(y + i);
        const __m512 d = _mm512_add_ps(one, exp_512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        const __m256i act = (__m256i)_mm512_cvtneps_pbh(_mm512_div_ps(g, d)); /* silu, rounded to bf16 */
        const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(act), 16));
        _mm256_storeu_si256((__m256i *)(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a, u)));
    }
}
#else
static void silu_times(uint16_t *y, const uint16_t *gate, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        v16f g = load_bf16(gate + i), u = load_bf16(y + i);
        /* sigmoid from exp(-|g|) (vexp takes x <= 0): 1 / (1 + e) for g >= 0, e / (1 + e) below */
        v16f e = vexp(vselect(g < splat(0.0f), g, -g));
        v16f sig = vselect(g < splat(0.0f), e, splat(1.0f)) / (splat(1.0f) + e);
        uint16_t act[16];
        store_bf16(act, g * sig);
        store_bf16(y + i, load_bf16(act) * u);
    }
}
#endif

/* y [M, N] = silu(x @ wg.T) * (x @ wu.T), both weights of the same kind; gate [M, N] is scratch. Rounding as
 * eager bf16: each matmul's output, silu's and the product's are rounded to bf16 (silu in fp32 from the rounded
 * gate). Returns 0, or -1 as bucketserve_linear. */
int bucketserve_gated_bf16(const uint16_t *x, const void *wg, const float *sg, const void *wu, const float *su,
                           uint16_t *y, uint16_t *gate, int64_t M, int64_t N, int64_t K, int kind, int threads) {
    if ((M * N) % 16) return -1;
    if (kind == 3 || kind == 5 || kind >= 7 || bucketserve_linear(x, wg, sg, gate, M, N, K, kind, threads) != 0) return -1;
    if (bucketserve_linear(x, wu, su, y, M, N, K, kind, threads) != 0) return -1;
    silu_times(y, gate, M * N);
    return 0;
}
