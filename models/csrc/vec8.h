/* 8-lane fp32 vectors (GCC vector extensions) for the AVX2 kernels (decode_avx2.c, piece_avx2.c): loads, splats,
 * selects, horizontal sums and maxima, and exp (vexp.h). Include inside an AVX2 guard. */
#ifndef BUCKETSERVE_VEC8_H
#define BUCKETSERVE_VEC8_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vexp.h"

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* x in every lane: one vbroadcastss (from memory where x is a load). `(v8f){0} + x` cost a scalar add of zero
 * before each broadcast (x + 0 is not x for x = -0), in the products' inner loops. */
static inline v8f splat8(float x) { return _mm256_set1_ps(x); }

static inline v8f select8(v8i mask, v8f yes, v8f no) { return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask)); }

static inline float hsum8(v8f v) {
    v += __builtin_shuffle(v, (v8i){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (v8i){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (v8i){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}

static inline v8f max8(v8f a, v8f b) { return select8(a > b, a, b); }

static inline float hmax8(v8f v) {
    v = max8(v, __builtin_shuffle(v, (v8i){4, 5, 6, 7, 0, 1, 2, 3}));
    v = max8(v, __builtin_shuffle(v, (v8i){2, 3, 0, 1, 6, 7, 4, 5}));
    v = max8(v, __builtin_shuffle(v, (v8i){1, 0, 3, 2, 5, 4, 7, 6}));
    return v[0];
}

DEFINE_VEXP(vexp8, v8f, v8i, select8, splat8) /* vexp.h: exp in 8 lanes */

#endif
