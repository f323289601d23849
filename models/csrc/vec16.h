/* 16-lane fp32 vectors (GCC vector extensions) and the helpers both kernels share. */
#ifndef BUCKETSERVE_VEC16_H
#define BUCKETSERVE_VEC16_H

#include <stdint.h>
#include <string.h>

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

#endif
