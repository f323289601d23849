/* 16-lane fp32 vectors (GCC vector extensions) and the helpers both kernels share. */
#ifndef BUCKETSERVE_VEC16_H
#define BUCKETSERVE_VEC16_H

#include <stdint.h>
#include <string.h>

#include "vexp.h"

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* fp32 -> bf16 bits, rounded to nearest even (inputs are finite: no NaN care). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* a[0..15] -> one vector whose lane i is the sum of a[i]'s lanes (a transpose-and-add tree: 15 pairwise steps
 * instead of 16 horizontal sums). */
static inline v16f reduce16(const v16f *a) {
    v16f b[8], c[4], d[2];
    for (int j = 0; j < 8; j++)
        b[j] = __builtin_shuffle(a[2 * j], a[2 * j + 1], (v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23})
             + __builtin_shuffle(a[2 * j], a[2 * j + 1], (v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int j = 0; j < 4; j++)
        c[j] = __builtin_shuffle(b[2 * j], b[2 * j + 1], (v16i){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27})
             + __builtin_shuffle(b[2 * j], b[2 * j + 1], (v16i){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int j = 0; j < 2; j++)
        d[j] = __builtin_shuffle(c[2 * j], c[2 * j + 1], (v16i){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29})
             + __builtin_shuffle(c[2 * j], c[2 * j + 1], (v16i){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    return __builtin_shuffle(d[0], d[1], (v16i){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30})
         + __builtin_shuffle(d[0], d[1], (v16i){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

/* 16 bf16 values -> fp32 lanes (bf16 is the top half of an fp32). */
static inline v16f load_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline v16f splat(float x) { return (v16f){0} + x; }

static inline v16f vselect(v16i mask, v16f yes, v16f no) { return (v16f)(((v16i)yes & mask) | ((v16i)no & ~mask)); }

DEFINE_VEXP(vexp, v16f, v16i, vselect, splat) /* vexp.h */

/* 16 fp32 lanes -> bf16 bits, each rounded to nearest even (as to_bf16). */
static inline void store_bf16(uint16_t *p, v16f f) {
    v16u u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    v16h h = __builtin_convertvector(u >> 16, v16h);
    memcpy(p, &h, sizeof h);
}

/* fp32 lanes rounded to bf16 and kept as fp32 (round_bf16), stored as bf16 bits (put_bf16), loaded (get_bf16):
 * with AVX512-BF16 one instruction rounds 16 lanes (the vector-extension code measured ~1.8x slower in rms_norm.c)
 * and flushes denormals to zero, as that instruction does. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
static inline v16f round_bf16(v16f x) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)x);
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
static inline void put_bf16(uint16_t *p, v16f x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)x));
}
static inline v16f get_bf16(const uint16_t *p) {
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#else
/* fp32 lanes rounded to the nearest bf16 (even on ties), kept as fp32; finite inputs. */
static inline v16f round_bf16(v16f x) {
    v16u u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}
static inline void put_bf16(uint16_t *p, v16f x) { store_bf16(p, x); }
static inline v16f get_bf16(const uint16_t *p) { return load_bf16(p); }
#endif

#endif
