// bucketserve::qkv_rope and bucketserve::attn_mlp: a Llama-shaped decoder layer of a mixed, verify or decode step in
// two C++ calls (models/fused_layer.py swaps the layers that call them; the K/V cache write stays in the graph,
// between the two).
//
// Why: the unfused layer is ~7 op calls and ~4 inductor kernels from the graph's Python wrapper, plus as many size
// asserts, reinterprets and allocations: ~3 ms of a 16-ms batch-8 decode step (perf, one thread, AMD EPYC Zen 5)
// went to Python, the dispatcher and inductor's elementwise kernels rather than the linears and the attention. Here
// the same kernels (dispatch.cpp's, the same choices and the same bits) are called one after another from C++.
//
// Numerics: the same as the unfused bf16 layer. The RMSNorms always take rms_norm.c (the unfused layer leaves steps
// under 64 rows to inductor's formula, whose mean sums in another order: a rounding step apart, rarely); the rotary
// rounds each product as eager does, and the residual adds are bf16 adds (both layer_math.c). fp32 (the default
// without AVX512-BF16): the norms take dispatch.cpp's fp32 loop (its mean summed in its own order, as inductor's
// is), the rotary and the adds loops here with eager's roundings, the SiLU product ATen's ops.
#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/neg.h>

#include <cstring>
#include <tuple>

#include "dispatch.h"

namespace {

// layer_math.c's entries, bound by address (models/native_dispatch.py)
using RotaryFn = int (*)(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads, int64_t dim,
                         int64_t stride, int64_t cs_stride);
using AddFn = int (*)(const void *a, const void *b, void *out, int64_t n);
RotaryFn rotary_fn = nullptr;
AddFn add_fn = nullptr;

// a + b (same shape, bf16: layer_math.c, fp32: a loop here, else ATen's add; the same bits), a new contiguous tensor
at::Tensor residual_add(const at::Tensor &a, const at::Tensor &b) {
    const bool plain = bucketserve::native_on() && a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
                       a.is_contiguous() && b.is_contiguous();
    if (plain && add_fn != nullptr && a.scalar_type() == at::kBFloat16) {
        at::Tensor out = at::empty_like(a);
        if (add_fn(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel()) == 0) return out;
    }
    if (plain && a.scalar_type() == at::kFloat) {  // ATen's add: ~5 us a call from here under the profiler
        at::Tensor out = at::empty_like(a);
        const float *x = a.data_ptr<float>(), *y = b.data_ptr<float>();
        float *o = out.data_ptr<float>();
        for (int64_t i = 0, n = a.numel(); i < n; i++) o[i] = x[i] + y[i];
        return out;
    }
    return at::add(a, b).contiguous();
}

// fp32 x [tokens, heads * dim] contiguous rotated in place by c, s (`cs` elements a token: dim, or 0 for one row for
// all), eager's formula with each product rounded before the sum (this file is built without FMA contraction: no
// -march, so no FMA instructions). Why: ATen's seven ops a call (halves, negation, cat, products, sum, copy) took
// ~3 ms of a batch-8 decode step under the profiler
void rotate_f32(float *x, const float *c, const float *s, int64_t tokens, int64_t heads, int64_t dim, int64_t cs) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *ct = c + t * cs, *st = s + t * cs;
        for (int64_t h = 0; h < heads; h++) {
            float *r = x + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = r[i], b = r[half + i];
                const float lo = a * ct[i], los = -b * st[i], hi = b * ct[half + i], his = a * st[half + i];
                r[i] = lo + los;
                r[half + i] = hi + his;
            }
        }
    }
}

// x [..., heads * dim] contiguous (its rows the tokens), rotated in place by cos / sin [..., dim] (a row per token,
// or one row for all): layer_math.c (bf16), rotate_f32 (fp32), else the eager formula in ATen's ops (each rounded,
// as eager's).
void rotate(at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin, int64_t dim) {
    const int64_t width = x.size(-1), tokens = x.numel() / width, heads = width / dim;
    const at::Tensor c = cos.contiguous(), s = sin.contiguous();
    const int64_t rows = c.numel() / dim;
    TORCH_CHECK(width % dim == 0 && c.size(-1) == dim && s.sizes() == c.sizes() && (rows == tokens || rows == 1),
                "rotary: ", x.sizes(), " rows against cos ", c.sizes(), " of head dim ", dim);
    if (bucketserve::native_on() && rotary_fn != nullptr && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
        c.scalar_type() == at::kBFloat16 && s.scalar_type() == at::kBFloat16 &&
        rotary_fn(x.data_ptr(), c.data_ptr(), s.data_ptr(), tokens, heads, dim, width, rows == 1 ? 0 : dim) == 0)
        return;
    if (bucketserve::native_on() && x.is_contiguous() && x.scalar_type() == at::kFloat &&
        c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat) {
        rotate_f32(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), tokens, heads, dim,
                   rows == 1 ? 0 : dim);
        return;
    }
    at::Tensor v = x.view({tokens, heads, dim});
    const at::Tensor rotated = at::cat({at::neg(v.narrow(2, dim / 2, dim / 2)), v.narrow(2, 0, dim / 2)}, 2);
    v.copy_(at::add(at::mul(v, c.view({rows, 1, dim})), at::mul(rotated, s.view({rows, 1, dim}))));
}

// x [b, T, E] (the layer's input) -> q [b, T, H * D], k, v [b, T, H_kv * D]: the input RMSNorm, the three
// projections, and the rotary embedding of q and k (cos, sin [b or 1, T, D]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope_kernel(const at::Tensor &x, const at::Tensor &norm, double eps,
                                                               const at::Tensor &wq, const at::Tensor &wk,
                                                               const at::Tensor &wv, const at::Tensor &cos,
                                                               const at::Tensor &sin, int64_t head_dim) {
    const at::Tensor h = bucketserve::rms_norm(x, norm, eps);
    at::Tensor q = bucketserve::linear(h, wq, std::nullopt).contiguous();
    at::Tensor k = bucketserve::linear(h, wk, std::nullopt).contiguous();
    at::Tensor v = bucketserve::linear(h, wv, std::nullopt).contiguous();
    rotate(q, cos, sin, head_dim);
    rotate(k, cos, sin, head_dim);
    return {q, k, v};
}

// The rest of the layer, after the graph wrote k and v into the cache: attention over key / value (the cache's
// buffers), the output projection and residual, the post-attention RMSNorm, the gated MLP and residual.
//   mixed or verify step: x [1, T, E], q [1, T, H * D], key / value [S + 1, H_kv, C, D], mask [1, 1, T, 2] long
//     (slot, position) per token: bucketserve::mixed_attention's;
//   decode step: x [b, 1, E], q [b, 1, H * D], key / value [b, H_kv, C, D], mask [b, 1, 1, K] additive (K <= C:
//     the KV bucket, whose first K positions are read): bucketserve::attention's, query heads packed by KV group.
// kept ([1, T, 1] bool, the last layer of a step that keeps some rows' logits): the MLP's input is zeroed on the
// other rows (models/kept_rows.py: the linears skip zero rows). Returns the layer's output [b, T, E].
at::Tensor attn_mlp_kernel(const at::Tensor &x, const at::Tensor &q, const at::Tensor &key, const at::Tensor &value,
                           const at::Tensor &mask, const at::Tensor &wo, const at::Tensor &norm, double eps,
                           const at::Tensor &wg, const at::Tensor &wu, const at::Tensor &wd,
                           const std::optional<at::Tensor> &kept, double scale, int64_t head_dim) {
    const int64_t b = q.size(0), tokens = q.size(1), heads = q.size(2) / head_dim;
    at::Tensor attended;  // [b, T, H * D]
    if (mask.scalar_type() == at::kLong) {
        const at::Tensor query = q.view({b, tokens, heads, head_dim}).transpose(1, 2);  // [1, H, T, D]
        attended = bucketserve::mixed_attention(query, key, value, mask, scale).transpose(1, 2).reshape(q.sizes());
    } else {
        const int64_t kv_heads = key.size(1), width = mask.size(-1);
        const at::Tensor query = q.view({b, kv_heads, heads / kv_heads, head_dim});  // head h = kv * G + g
        const at::Tensor k = key.size(2) > width ? key.narrow(2, 0, width) : key;
        const at::Tensor v = value.size(2) > width ? value.narrow(2, 0, width) : value;
        attended = bucketserve::attention(query, k, v, mask, scale).reshape(q.sizes());
    }
    const at::Tensor mid = residual_add(x, bucketserve::linear(attended, wo, std::nullopt));
    at::Tensor h = bucketserve::rms_norm(mid, norm, eps);
    if (kept.has_value()) {
        const at::Tensor keep = kept->to(at::kBool).contiguous();
        TORCH_CHECK(keep.numel() == h.numel() / h.size(-1) && h.is_contiguous(), "kept rows: ", keep.sizes());
        const bool *on = keep.data_ptr<bool>();
        char *row = static_cast<char *>(h.data_ptr());
        const int64_t bytes = h.size(-1) * h.element_size();
        for (int64_t r = 0; r < keep.numel(); r++)
            if (!on[r]) std::memset(row + r * bytes, 0, bytes);
    }
    return residual_add(mid, bucketserve::linear(bucketserve::gated_silu(h, wg, wu), wd, std::nullopt));
}

// The step's k or v [b, T, H_kv * D] (contiguous) into one layer's cache buffer [S, H_kv, C, D] (D contiguous), as
// slot_cache.py's layers write it: a mixed or verify step (`write` [T, 2] long: (slot, position) per token, b = 1)
// puts token t's head h at [slot, h, position]; a decode step (`write` [b] long: each row's position, T = 1) puts
// row i's head h at [i, h, position]. Out-of-range slots or positions are an error (the graph's index_copy_ raised
// one too).
void write_kv(const at::Tensor &rows, const at::Tensor &cache, const at::Tensor &write, int64_t head_dim) {
    const int64_t heads = cache.size(1), capacity = cache.size(2), es = cache.element_size();
    const bool mixed = write.dim() == 2;
    const int64_t tokens = mixed ? write.size(0) : rows.size(0);
    TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == cache.scalar_type() && write.scalar_type() == at::kLong &&
                    write.is_contiguous() && cache.size(3) == head_dim && cache.stride(3) == 1 &&
                    rows.numel() == tokens * heads * head_dim &&
                    (mixed ? write.size(1) == 2 : rows.size(1) == 1 && write.numel() == tokens),
                "K/V write: rows ", rows.sizes(), " into ", cache.sizes(), " by ", write.sizes());
    const int64_t *w = write.data_ptr<int64_t>();
    const char *src = static_cast<const char *>(rows.data_ptr());
    char *dst = static_cast<char *>(cache.data_ptr());
    const int64_t bytes = head_dim * es;
    const auto at = [&](int64_t t, int64_t h) {  // where token t's head h goes
        const int64_t slot = mixed ? w[2 * t] : t, pos = mixed ? w[2 * t + 1] : w[t];
        return dst + (slot * cache.stride(0) + h * cache.stride(1) + pos * cache.stride(2)) * es;
    };
    // every destination line asked for first: the rows land in lines that are mostly not cached (a decode step's
    // 8 rows x 3 heads x 30 layers x K and V), whose misses one after another cost ~0.1 ms a step
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = mixed ? w[2 * t] : t, pos = mixed ? w[2 * t + 1] : w[t];
        TORCH_CHECK(slot >= 0 && slot < cache.size(0) && pos >= 0 && pos < capacity, "K/V write: slot ", slot,
                    " position ", pos, " outside ", cache.sizes());
        for (int64_t h = 0; h < heads; h++)
            for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(at(t, h) + b, 1);
    }
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) std::memcpy(at(t, h), src + (t * heads + h) * bytes, bytes);
}

// bucketserve::decoder_stack: every decoder layer of a step in one call (models/fused_layer.py). x [b, T, E];
// weights: 9 a layer (input norm, q, k, v, o, post-attention norm, gate, up, down); keys / values: each layer's
// cache buffers, written here (write_kv) between the layer's qkv_rope and attn_mlp kernels, as the graph wrote them
// between the two ops; mask, cos, sin, kept, scale, head_dim: attn_mlp's and qkv_rope's (kept: the last layer's).
// The same kernels in the same order as the per-layer ops: the same bits. Why: two op calls and a graph kernel a
// layer, each from the graph's Python with its argument conversion and dispatch, cost ~2 ms of a step (AMD EPYC
// Zen 5, one thread: a 128-token mixed step ~5 ms outside the kernels, a one-row decode step ~2).
at::Tensor stack_kernel(const at::Tensor &x, at::TensorList weights, at::TensorList keys, at::TensorList values,
                        const at::Tensor &mask, const at::Tensor &cos, const at::Tensor &sin, const at::Tensor &write,
                        const std::optional<at::Tensor> &kept, double eps, double scale, int64_t head_dim) {
    const size_t layers = keys.size();
    TORCH_CHECK(layers > 0 && values.size() == layers && weights.size() == 9 * layers, "decoder_stack: ",
                weights.size(), " weights for ", keys.size(), " key and ", values.size(), " value buffers");
    at::Tensor h = x;
    for (size_t l = 0; l < layers; l++) {
        const at::Tensor *w = weights.data() + 9 * l;
        auto [q, k, v] = qkv_rope_kernel(h, w[0], eps, w[1], w[2], w[3], cos, sin, head_dim);
        write_kv(k, keys[l], write, head_dim);
        write_kv(v, values[l], write, head_dim);
        h = attn_mlp_kernel(h, q, keys[l], values[l], mask, w[4], w[5], eps, w[6], w[7], w[8],
                            l + 1 == layers ? kept : std::nullopt, scale, head_dim);
    }
    return h;
}

void bind_layer(int64_t rotary, int64_t add) {
    rotary_fn = reinterpret_cast<RotaryFn>(rotary);
    add_fn = reinterpret_cast<AddFn>(add);
}

}  // namespace

namespace bucketserve {

void install_layer_ops(torch::Library &lib) {
    lib.impl("qkv_rope", TORCH_FN(qkv_rope_kernel));
    lib.impl("attn_mlp", TORCH_FN(attn_mlp_kernel));
    lib.impl("decoder_stack", TORCH_FN(stack_kernel));
}

}  // namespace bucketserve

TORCH_LIBRARY_FRAGMENT(bucketserve_dispatch, m) {
    m.def("bind_layer(int rotary, int add) -> ()", &bind_layer);
}
