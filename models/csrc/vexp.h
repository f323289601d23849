/* exp(x) for x <= 0 in fp32 vector lanes (scores minus their running max), relative error ~1e-7; below -87 it is
 * ~1e-38. A macro over the vector width (GCC vector extensions): `name` takes and returns VF (fp32 lanes); VI is its
 * int32 twin, SELECT(mask, yes, no) and SPLAT(x) its helpers. vec16.h defines the 16-lane one, decode_avx2.c the
 * 8-lane one. Needs <string.h> (memcpy). */
#ifndef BUCKETSERVE_VEXP_H
#define BUCKETSERVE_VEXP_H

#define DEFINE_VEXP(name, VF, VI, SELECT, SPLAT)                                                                   \
    static inline VF name(VF x) {                                                                                  \
        x = SELECT(x < SPLAT(-87.0f), SPLAT(-87.0f), x);                                                           \
        VF t = x * 1.44269504088896341f;                                                                           \
        VI n = __builtin_convertvector(t - 0.5f, VI); /* round(t) for t <= 0 */                                    \
        VF nf = __builtin_convertvector(n, VF);                                                                    \
        VF r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;                                          \
        VF p = SPLAT(1.9875691500e-4f);                                                                            \
        p = p * r + 1.3981999507e-3f;                                                                              \
        p = p * r + 8.3334519073e-3f;                                                                              \
        p = p * r + 4.1665795894e-2f;                                                                              \
        p = p * r + 1.6666665459e-1f;                                                                              \
        p = p * r + 5.0000001201e-1f;                                                                              \
        p = p * r * r + r + 1.0f;                                                                                  \
        VI e = (n + 127) << 23;                                                                                    \
        VF scale;                                                                                                  \
        memcpy(&scale, &e, sizeof scale);                                                                          \
        return p * scale;                                                                                          \
    }

#endif
