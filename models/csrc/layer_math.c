/* The fused decoder layer's elementwise work (models/csrc/layer_ops.cpp; models/fused_layer.py): the rotary
 * embedding and the residual adds, in bf16, rounded as eager's bf16 ops round.
 *
 * Rotary position embedding of bf16 query or key rows, in place, as transformers' eager bf16
 * `apply_rotary_pos_emb`:
 *     x' = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)),   rotate_half(x) = (-x[D/2:], x[:D/2])
 * each product rounded to bf16 before the sum, as eager's three bf16 ops (and inductor, emulating them) round.
 *
 * Why here: inductor ran it as two kernels a layer (the halves, then the sum fused with the cache write), each a
 * call from the graph's Python; inside the layer's C++ op it is one pass over rows that are in L1.
 *
 * Shapes (elements, bf16 as uint16): x [tokens, heads, D] with `stride` elements from one token to the next and the
 * heads of a token adjacent; cos, sin [tokens, D] with `cs_stride` elements a token (0: one row for every token);
 * D even (16 lanes at a time, the rest of each half one by one). Returns 0, or -1 when the shapes do not fit (the
 * caller then runs the eager formula). */
#include "vec16.h"

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float rounded(float f) { return from_bf16(to_bf16(f)); }

int bucketserve_rotary_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t tokens, int64_t heads,
                            int64_t D, int64_t stride, int64_t cs_stride) {
    if (tokens < 0 || heads < 1 || D < 2 || D % 2 || stride < heads * D || cs_stride < 0) return -1;
    const int64_t half = D / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *row = x + t * stride + h * D;
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) {
                const v16f a = get_bf16(row + i), b = get_bf16(row + half + i);
                const v16f lo = round_bf16(a * get_bf16(c + i)) + round_bf16(-b * get_bf16(s + i));
                const v16f hi = round_bf16(b * get_bf16(c + half + i)) + round_bf16(a * get_bf16(s + half + i));
                put_bf16(row + i, lo);
                put_bf16(row + half + i, hi);
            }
            for (; i < half; i++) { /* head dims that are not a multiple of 32 */
                const float a = from_bf16(row[i]), b = from_bf16(row[half + i]);
                row[i] = to_bf16(rounded(a * from_bf16(c[i])) + rounded(-b * from_bf16(s[i])));
                row[half + i] = to_bf16(rounded(b * from_bf16(c[half + i])) + rounded(a * from_bf16(s[half + i])));
            }
        }
    }
    return 0;
}

/* out[i] = bf16(a[i] + b[i]) for n elements (bf16 bits; out may be a or b), as eager's bf16 add: ATen's took 12 us at
 * 128 x 576 here (its AVX2 loop), twice a layer. */
int bucketserve_add_bf16(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n) {
    if (n < 0) return -1;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) put_bf16(out + i, get_bf16(a + i) + get_bf16(b + i));
    for (; i < n; i++) out[i] = to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
    return 0;
}
