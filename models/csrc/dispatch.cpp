// The CPU kernels of bucketserve::linear, gated_silu, attention, rms_norm, mixed_attention and causal_attention in
// C++, so a decode step's ~180 calls of them (and a prompt step's norms and attentions) skip Python: registered
// through the Python op API (models/prepack.py, gated_mlp.py, attention.py, rms_norm.py), each went op -> dispatcher
// -> Python kernel -> ctypes, ~8.7 us a call over a ~1.5 us C call (one thread, AMD EPYC); from C++ the whole call
// is ~1.7 us. Same choices as the Python kernels, which stay where this library cannot be built
// (models/native_dispatch.py builds, loads and installs it).
//
// The kernels (models/csrc/linear.c) are bound by address from the library ctypes loaded (models/native_library.py):
// one copy of them in the process, and no link-time dependency between the two builds. The fused decoder layer's ops
// (layer_ops.cpp, built into the same library) call these kernels as the functions dispatch.h declares.
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include "dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using LinearFn = int (*)(const void *x, const void *w, const float *s, void *y, int64_t m, int64_t n, int64_t k,
                         int kind, int threads);
using GatedFn = int (*)(const void *x, const void *wg, const float *sg, const void *wu, const float *su, void *y,
                        void *gate, int64_t m, int64_t n, int64_t k, int kind, int threads);
using MaskedFn = int (*)(const void *q, const void *k, const void *v, void *out, const void *mask, int64_t mask_stride,
                         int64_t cols, int width, int64_t rows, int64_t heads, int64_t groups, int64_t dim,
                         int64_t s_slot, int64_t s_head, int64_t positions, float scale, int threads, int f32);
using RmsFn = int (*)(const void *x, const void *weight, void *out, int64_t rows, int64_t d, float eps, int threads);
using PieceFn = int (*)(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t qt, int64_t qh, int64_t ot, int64_t oh, int64_t kvh,
                        int64_t kvp, float scale, int threads, int tiles, int f32);
using RunFn = int (*)(const void *q, const void *k, const void *v, void *out, int64_t n, int64_t start, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t qt, int64_t qh, int64_t ot, int64_t oh, int64_t kvh,
                      int64_t kvp, float scale, int threads, const void *next_k, const void *next_v, int64_t next_rows,
                      int warm);
using DecodeFn = int (*)(const void *q, const void *k, const void *v, void *out, const int64_t *slots,
                         const int64_t *ext, int64_t rows, int64_t heads, int64_t groups, int64_t dim, int64_t s_slot,
                         int64_t s_head, float scale, int threads, int f32);
constexpr int64_t MAX_GROUPS = 16, MAX_HEAD_DIM = 256;  // models/native.py's (decode_attention.c's MAX_G, 16 * MAX_C)

// What a step of some rows reads: models/prepack.py's Kernel tuple (kind, weight copy, scales); kind -1 for none.
struct Kernel {
    int64_t kind = -1, weight = 0, scales = 0;
    bool valid() const { return kind >= 0; }
};

// One packed weight (models/prepack.py's Packed): its shape and dtype, oneDNN's copy, the kernels by step size.
struct Entry {
    int64_t n = 0, k = 0;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    at::Tensor onednn;
    Kernel one, few;
    int64_t few_max = 0;

    const Kernel *kernel(int64_t rows) const {  // Packed.kernel
        if (rows == 1) return one.valid() ? &one : nullptr;
        return rows > 1 && rows <= few_max && few.valid() ? &few : nullptr;
    }
};

std::mutex mutex;  // entries change at packing and when a weight is freed (any thread); steps read them
std::unordered_map<int64_t, Entry> entries;  // by the plain weight's address
LinearFn linear_fn = nullptr;
GatedFn gated_fn = nullptr;
MaskedFn masked_fn = nullptr;
RmsFn rms_fn = nullptr;
PieceFn piece_fn = nullptr;
RunFn run_fn = nullptr;
int64_t run_min = 0;  // the shortest run run_fn takes (native_library.shortest_run)
RunFn run_f32_fn = nullptr;  // fp32 runs (decode_avx2.c; native_library.shortest_run_f32)
int64_t run_f32_min = 0;
int64_t f32_mkl_rows = 0;  // float32 steps of this many rows or more take MKL's matmul (native_library.f32_mkl_rows)
DecodeFn decode_fn = nullptr;
bool tiles = false;  // the process may use AMX tiles (native_library.has("amx")): bf16 prompt pieces take them
bool parallel = false;  // the kernels were built with OpenMP
const volatile int *switched_on = nullptr;  // models/native_library.py's switch (--no-native-kernels): 1 on
std::unique_ptr<torch::Library> installed;  // the CPU kernels' registration, made by install()

// packed_for: the entry of `weight` when an input like `x` may use it. Copied out under the lock (a tensor
// reference and a few integers), so a concurrent insert cannot move it under the caller.
bool lookup(const at::Tensor &weight, const at::Tensor &x, Entry &out) {
    std::lock_guard<std::mutex> guard(mutex);
    auto it = entries.find(reinterpret_cast<int64_t>(weight.data_ptr()));
    if (it == entries.end()) return false;
    const Entry &e = it->second;
    if (weight.dim() != 2 || weight.size(0) != e.n || weight.size(1) != e.k || x.scalar_type() != e.dtype) return false;
    out = e;
    return true;
}

int threads() {  // native_library.threads(): -1 where a serial build would run under more threads
    int t = at::get_num_threads();
    return t > 1 && !parallel ? -1 : t;
}

std::vector<int64_t> with_last(const at::Tensor &x, int64_t n) {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    return sizes;
}

// Rows of zeros. A zero row's product with any weight is a zero row (SiLU(0) * 0 too), so where a step carries rows
// that compute nothing (a decode batch's free slots, which the decode graph zeroes: models/step_functions.py) the
// kernel need not run them: a batch-16 bf16 step with 8 free slots cost 29 ms, as much as 16 rows, against 18 for
// batch 8 (AMD EPYC, one thread). Only for the kernels whose rows are summed apart from each other, in an order
// that does not depend on how many rows a call has (tiled_matmul.c: kinds 4 bf16, 5 fp32, 6 int8; amx_matmul.c:
// kinds 1 bf16, 2 int8, whose tile products sum each element over k in the same order whatever the rows beside
// it; greedy_head.c: kind 7, each row's maximum found from that row alone, though whether its row comes back
// masked or whole depends on how many rows are live), so every other row's output (kind 7: its maximum) is the same
// bits with or without the zero rows. The others (the one-row
// kernels, oneDNN) run every row as before. On AMX CPUs the zero rows are mostly the padding tokens of mixed and
// verify steps and a verify graph's padding logit rows: a 128-token bucket of 100 tokens computes 100 rows.
bool rows_apart(int64_t kind) { return kind == 1 || kind == 2 || (kind >= 4 && kind <= 9); }

// Whether row r of x [rows, k] (bf16 or fp32, contiguous, at `data`) holds only zeros of either sign: a 64-byte line at a
// time (eight words ORed with their sign bits masked, then one test), so a live row is told apart in its first
// line and a free row of k = 1536 bf16 is 48 such tests; the tail element by element.
bool zero_row(const unsigned char *data, bool f32, int64_t r, int64_t k) {
    const int64_t bytes = k * (f32 ? 4 : 2);
    const unsigned char *row = data + r * bytes;
    const uint64_t magnitude = f32 ? 0x7fffffff7fffffffull : 0x7fff7fff7fff7fffull;
    int64_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
        uint64_t any = 0;
        for (int j = 0; j < 8; j++) {
            uint64_t word;
            std::memcpy(&word, row + i + 8 * j, sizeof word);
            any |= word & magnitude;
        }
        if (any) return false;
    }
    for (; i < bytes; i += f32 ? 4 : 2) {
        uint32_t value = 0;
        std::memcpy(&value, row + i, f32 ? 4 : 2);
        if (value & (f32 ? 0x7fffffffu : 0x7fffu)) return false;
    }
    return true;
}

// Whether row r (> 0) of x [rows, k] (contiguous, at `data`, `bytes` a row) is row r - 1 again, bit for bit. A verify
// graph's padding logit rows repeat one token's hidden state (models/runner.py: with no padding token in the bucket,
// which a verify step's drafts fill, they read token 0); a row-apart kernel gives a repeated row the same output.
bool repeat_row(const unsigned char *data, int64_t r, int64_t bytes) {
    return r > 0 && std::memcmp(data + r * bytes, data + (r - 1) * bytes, bytes) == 0;
}

// The rows of x [rows, k] that need the kernel: neither zero nor a repeat of the row before (at most `most`; the
// count stops past it). `dead`, when given, gets the others' marks: 1 zero, 2 a repeat.
int64_t live_rows(const at::Tensor &x, int64_t rows, int64_t k, int64_t most, std::vector<int64_t> *live,
                  std::vector<char> *dead) {
    const auto *data = static_cast<const unsigned char *>(x.data_ptr());  // once: data_ptr() checks the storage
    const bool f32 = x.scalar_type() == at::kFloat;
    const int64_t bytes = k * x.element_size();
    int64_t m = 0;
    for (int64_t r = 0; r < rows && m <= most; r++) {
        const char mark = zero_row(data, f32, r, k) ? 1 : repeat_row(data, r, bytes) ? 2 : 0;
        if (dead != nullptr) dead->push_back(mark);
        if (mark == 0) {
            m++;
            if (live != nullptr) live->push_back(r);
        }
    }
    return m;
}

// y [rows, n] = the kernel `call(x rows, y rows, gate scratch rows, m)` on the rows of x [rows, k] that are not
// zero nor a repeat of the row before, zeros on the zero rows and the row before's output on a repeat. The live rows
// go to the kernel as they lie when they lead x, else gathered into a block (and their outputs scattered back).
// `gate`: the gated kernel's [rows, n] scratch, or null. Returns the kernel's status (nonzero: it declined, y is not
// written and the caller falls back).
template <typename Call>
int on_live_rows(const at::Tensor &x, at::Tensor &y, void *gate, int64_t rows, int64_t k, int64_t n, int64_t kind,
                 const Call &call) {
    if (rows < 2 || !rows_apart(kind)) return call(x.data_ptr(), y.data_ptr(), gate, rows);
    std::vector<int64_t> live;
    std::vector<char> dead;
    live.reserve(rows);
    dead.reserve(rows);
    live_rows(x, rows, k, rows, &live, &dead);
    const int64_t m = static_cast<int64_t>(live.size());
    if (m == rows) return call(x.data_ptr(), y.data_ptr(), gate, rows);
    const int64_t es = x.element_size();
    char *out = static_cast<char *>(y.data_ptr());
    int status = 0;
    if (m > 0 && live.back() == m - 1) {  // the live rows lead: run them in place
        status = call(x.data_ptr(), out, gate, m);
    } else if (m > 0) {
        at::Tensor xs = at::empty({m, k}, x.options()), ys = at::empty({m, n}, x.options());
        const char *in = static_cast<const char *>(x.data_ptr());
        char *block = static_cast<char *>(xs.data_ptr());
        for (int64_t j = 0; j < m; j++) std::memcpy(block + j * k * es, in + live[j] * k * es, k * es);
        status = call(block, ys.data_ptr(), gate, m);
        if (status == 0)
            for (int64_t j = 0; j < m; j++)
                std::memcpy(out + live[j] * n * es, static_cast<const char *>(ys.data_ptr()) + j * n * es, n * es);
    }
    if (status != 0) return status;
    for (int64_t r = 0; r < rows; r++) {  // in order: a repeat copies its row before's final output
        if (dead[r] == 1) std::memset(out + r * n * es, 0, n * es);
        if (dead[r] == 2) std::memcpy(out + r * n * es, out + (r - 1) * n * es, n * es);
    }
    return 0;
}

// rows [M, K] @ oneDNN's packed weight (+ bias), with oneDNN's post-op `attr` ("none", "swish")
at::Tensor onednn_linear(const at::Tensor &rows, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                         const char *attr) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{rows, packed, bias, std::string(attr), c10::List<std::optional<at::Scalar>>(),
                            std::optional<std::string>(std::string())};
    op.callBoxed(&stack);
    return stack[0].toTensor();
}

// (rows @ packed.T + bias) * other, oneDNN's binary post-op
at::Tensor onednn_times(const at::Tensor &rows, const at::Tensor &other, const at::Tensor &packed,
                        const std::optional<at::Tensor> &bias) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary");
    torch::jit::Stack stack{rows, other, packed, bias, std::string("mul")};
    op.callBoxed(&stack);
    return stack[0].toTensor();
}

// The kernel for a call of `rows` rows of x [rows, k] that is past the vector kernels' sizes (e.kernel(rows) is
// none) but whose live rows are within them: a verify graph's lm_head has 64 logit rows (the max batch and the draft
// rows), of which a step of one row and three drafts fills four; the others are zeros or repeats (models/runner.py).
// oneDNN ran all 64: ~51 ms of fp32 lm_head a step on a Zen 3 EPYC, where four rows on the tiled kernel take ~6. Only
// a kernel whose rows are summed apart (rows_apart): on_live_rows then runs it on the live rows alone. The count
// stops as soon as it passes what the kernels take, so a prompt step's live rows cost a cache line or two each.
const Kernel *live_rows_kernel(const Entry &e, const at::Tensor &x, int64_t rows, int64_t k) {
    if (rows <= e.few_max || e.few_max < 2 || !x.is_contiguous()) return nullptr;
    const int64_t live = live_rows(x, rows, k, e.few_max, nullptr, nullptr);
    if (live > e.few_max) return nullptr;
    const Kernel *kernel = e.kernel(live > 0 ? live : 2);
    return kernel != nullptr && rows_apart(kernel->kind) ? kernel : nullptr;
}

// x [..., K] @ weight [N, K].T + bias -> [..., N]: prepack.linear_cpu
at::Tensor linear_kernel(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    Entry e;
    if (!lookup(weight, x, e)) return at::linear(x, weight, bias);
    const int64_t k = x.size(-1), rows = x.numel() / k;
    const Kernel *kernel = *switched_on ? e.kernel(rows) : nullptr;
    if (kernel == nullptr && *switched_on) kernel = live_rows_kernel(e, x, rows, k);
    const int t = threads();
    if (kernel != nullptr && linear_fn != nullptr && t > 0) {
        const at::Tensor xc = x.contiguous();
        at::Tensor out = at::empty(with_last(x, e.n), x.options());
        const auto call = [&](const void *xs, void *ys, void *, int64_t m) {
            return linear_fn(xs, reinterpret_cast<const void *>(kernel->weight),
                             reinterpret_cast<const float *>(kernel->scales), ys, m, e.n, k,
                             static_cast<int>(kernel->kind), t);
        };
        if (on_live_rows(xc, out, nullptr, rows, k, e.n, kernel->kind, call) == 0)
            return bias.has_value() ? out.add_(*bias) : out;
    }
    if (x.scalar_type() == at::kFloat && (rows == 1 || (*switched_on && f32_mkl_rows > 0 && rows >= f32_mkl_rows)))
        return at::linear(x, weight, bias);  // MKL's: the reference's for one row, faster for long steps on AVX2
    return onednn_linear(x.reshape({-1, k}).contiguous(), e.onednn, bias, "none").view(with_last(x, e.n));
}

// silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias) -> [..., N]: gated_mlp._gated_cpu
at::Tensor gated_kernel(const at::Tensor &x, const at::Tensor &gate, const std::optional<at::Tensor> &gate_bias,
                      const at::Tensor &up, const std::optional<at::Tensor> &up_bias) {
    Entry g, u;
    if (lookup(gate, x, g) && lookup(up, x, u)) {
        const int64_t k = x.size(-1), rows = x.numel() / k;
        const Kernel *kg = g.kernel(rows), *ku = u.kernel(rows);
        // oneDNN, silu and the product fused in its epilogues; not fp32 (the fused decoder layers' MLPs there), whose
        // swish epilogue would not round as eager's silu does: its linears and eager's formula below
        if ((kg == nullptr || ku == nullptr) && x.scalar_type() != at::kFloat) {
            const at::Tensor r = x.reshape({-1, k}).contiguous();
            const at::Tensor act = onednn_linear(r, g.onednn, gate_bias, "swish");
            return onednn_times(r, act, u.onednn, up_bias).view(with_last(x, u.n));
        }
        const int t = threads();
        if (!gate_bias.has_value() && !up_bias.has_value() && *switched_on && x.scalar_type() == at::kBFloat16 &&
            gated_fn != nullptr && t > 0 && kg->kind == ku->kind) {  // one C call
            const at::Tensor xc = x.contiguous();
            at::Tensor out = at::empty(with_last(x, u.n), x.options());
            at::Tensor scratch = at::empty(with_last(x, u.n), x.options());
            const auto call = [&](const void *xs, void *ys, void *gs, int64_t m) {
                return gated_fn(xs, reinterpret_cast<const void *>(kg->weight),
                                reinterpret_cast<const float *>(kg->scales), reinterpret_cast<const void *>(ku->weight),
                                reinterpret_cast<const float *>(ku->scales), ys, gs, m, u.n, k,
                                static_cast<int>(kg->kind), t);
            };
            if (on_live_rows(xc, out, scratch.data_ptr(), rows, k, u.n, kg->kind, call) == 0)
                return out;
        }
    }
    // in place on the gate's output (the same bits as at::mul(at::silu(..), ..), two allocations fewer)
    at::Tensor h = linear_kernel(x, gate, gate_bias);
    at::silu_(h);
    return h.mul_(linear_kernel(x, up, up_bias));
}

// native._decode_takes: query [R, H_kv, G, D], key/value [S, H_kv, C, D] with the same strides, positions contiguous,
// all bf16 or all fp32, G <= MAX_GROUPS, D a multiple of 16 up to MAX_HEAD_DIM
bool decode_takes(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v) {
    if (q.dim() != 4 || k.dim() != 4) return false;
    const int64_t heads = q.size(1), groups = q.size(2), dim = q.size(3);
    const auto dtype = q.scalar_type();
    return (dtype == at::kBFloat16 || dtype == at::kFloat) && k.scalar_type() == dtype && v.scalar_type() == dtype &&
           k.size(1) == heads && k.size(3) == dim && v.sizes() == k.sizes() && v.strides() == k.strides() &&
           k.stride(3) == 1 && k.stride(2) == dim && groups >= 1 && groups <= MAX_GROUPS && dim % 16 == 0 &&
           dim >= 16 && dim <= MAX_HEAD_DIM;
}

// What an op's Python kernel returns for these arguments (its `*_general` op: where a C++ path declines, the whole
// call goes there, so the result is the Python kernel's).
at::Tensor call_general(const c10::OperatorHandle &op, torch::jit::Stack stack) {
    op.callBoxed(&stack);
    return stack[0].toTensor();
}

// query [b, H, q, D], key/value [b, H_kv, K, D], mask [b, 1, q, K] additive -> [b, H, q, D]: attention._attention_cpu.
// Decode (one query, heads packed): native.decode_attention_masked's one C call; else `attention_general` (Python).
at::Tensor attention_kernel(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                            const at::Tensor &mask, double scale) {
    const int64_t rows = query.size(0);
    if (mask.dim() == 4 && mask.size(2) == 1 && query.size(1) == key.size(1) && *switched_on && masked_fn != nullptr &&
        mask.size(0) == rows && mask.stride(3) == 1 && key.size(0) >= rows && decode_takes(query, key, value)) {
        const int t = threads();
        if (t > 0) {
            const at::Tensor q = query.contiguous();
            at::Tensor out = at::empty_like(q);
            if (masked_fn(q.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), mask.data_ptr(),
                          mask.stride(0), mask.size(3), static_cast<int>(mask.element_size()), rows, q.size(1),
                          q.size(2), q.size(3), key.stride(0), key.stride(1), key.size(2), static_cast<float>(scale), t,
                          q.scalar_type() == at::kFloat) == 0)
                return out;
        }
    }
    static const auto general = c10::Dispatcher::singleton().findSchemaOrThrow("bucketserve::attention_general", "");
    return call_general(general, {query, key, value, mask, scale});
}

// x [..., D] -> RMSNorm(x) * weight [..., D], contiguous: rms_norm._rms_cpu (bf16: rms_norm.c; else, or where the
// kernel declines, the eager formula rms_norm.eager_rms_norm)
at::Tensor rms_kernel(const at::Tensor &x, const at::Tensor &weight, double eps) {
    const at::Tensor xc = x.contiguous();
    const int64_t d = xc.size(-1);
    const int t = threads();
    if (*switched_on && rms_fn != nullptr && t > 0 && d > 0 && xc.scalar_type() == at::kBFloat16 &&
        weight.scalar_type() == at::kBFloat16 && weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous()) {
        at::Tensor out = at::empty_like(xc);
        if (rms_fn(xc.data_ptr(), weight.data_ptr(), out.data_ptr(), xc.numel() / d, d, static_cast<float>(eps), t) == 0)
            return out;
    }
    if (*switched_on && d > 0 && xc.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
        weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous()) {
        // fp32: eager's formula, x * rsqrt(mean(x^2) + eps) then times the weight, each product rounded; the sum
        // of squares in 8 lanes, then across them (eager's mean sums in another order: a last bit apart at times, as
        // inductor's). Why: the fused fp32 layers call it twice a layer, and ATen's six ops took ~45 us a call
        // (a batch-8 decode step's norm, under the profiler).
        at::Tensor out = at::empty_like(xc);
        const float *x = xc.data_ptr<float>(), *w = weight.data_ptr<float>();
        float *o = out.data_ptr<float>();
        for (int64_t r = 0, rows = xc.numel() / d; r < rows; r++) {
            const float *xr = x + r * d;
            float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t i = 0;
            for (; i + 8 <= d; i += 8)
                for (int j = 0; j < 8; j++) lanes[j] += xr[i + j] * xr[i + j];
            for (; i < d; i++) lanes[i % 8] += xr[i] * xr[i];
            float sum = 0.0f;
            for (int j = 0; j < 8; j++) sum += lanes[j];
            const float scale = 1.0f / std::sqrt(sum / static_cast<float>(d) + static_cast<float>(eps));
            for (i = 0; i < d; i++) o[r * d + i] = w[i] * (xr[i] * scale);
        }
        return out;
    }
    const at::Tensor h = xc.to(at::kFloat);
    const at::Tensor normed = at::mul(h, at::rsqrt(at::add(h.pow(2).mean({-1}, true), eps)));
    return at::mul(weight, normed.to(xc.scalar_type())).to(xc.scalar_type()).contiguous();
}

// One call of a mixed step (mixed_attention.mixed_plan's Call): tokens [first, last); a prompt piece of slots[0] at
// consecutive positions from ext[0], or (decoding) one row a token, row i attending [0, ext[i]) of slot slots[i].
struct Call {
    int64_t first, last;
    std::vector<int64_t> slots, ext;
    bool decoding;
};

// meta: the (slot, position) pairs of a mixed step's tokens -> its calls, as mixed_attention.mixed_plan (padding tokens,
// slot `spare`, left out; runs of one slot up to SHORT_RUN tokens go as decoding rows). `runs` (0: none): runs of
// runs..SHORT_RUN tokens (a verify step's row and its drafts) are calls of their own, which mixed_kernel hands to
// run_fn (bf16: run_attention.c on AMX tiles from 2 tokens, 16 runs of 4 at ~300 positions 585 us a layer against
// 1073 as 64 decoding rows; run_vec.c from 3 tokens, native_library.shortest_run), fp32 ones to run_f32_fn
// (decode_avx2.c from 2 tokens: the slot's K/V read once a run, the bits of its decoding rows).
constexpr int64_t SHORT_RUN = 8;
std::vector<Call> mixed_plan(const int64_t *pairs, int64_t n, int64_t spare, int64_t runs) {
    std::vector<Call> calls;
    for (int64_t t = 0; t < n;) {
        const int64_t slot = pairs[2 * t], pos = pairs[2 * t + 1];
        int64_t end = t + 1;
        while (end < n && pairs[2 * end] == slot && pairs[2 * end + 1] == pairs[2 * end - 1] + 1) end++;
        Call *last = calls.empty() ? nullptr : &calls.back();
        if (slot == spare) {
        } else if (end - t > SHORT_RUN || (runs > 0 && end - t >= runs)) {
            calls.push_back(Call{t, end, {slot}, {pos}, false});
        } else {
            if (last == nullptr || !last->decoding || last->last != t) {
                calls.push_back(Call{t, t, {}, {}, true});
                last = &calls.back();
            }
            for (int64_t i = 0; i < end - t; i++) {
                last->slots.push_back(slot);
                last->ext.push_back(pos + 1 + i);
            }
            last->last = end;
        }
        t = end;
    }
    return calls;
}

// The rows [first, first + n) of the query heads (q + h * qh + t * qt) <-> packed decode rows [n, H, D] contiguous
// (the query heads of a KV group adjacent, as the decode kernel reads them); `es` bytes an element.
void pack_rows(const char *q, char *packed, int64_t first, int64_t n, int64_t heads, int64_t dim, int64_t qh,
               int64_t qt, int64_t es, bool back) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t h = 0; h < heads; h++) {
            char *a = packed + ((r * heads + h) * dim) * es;
            char *b = const_cast<char *>(q) + (h * qh + (first + r) * qt) * es;
            if (back)
                std::memcpy(b, a, dim * es);
            else
                std::memcpy(a, b, dim * es);
        }
}

// [n, start + n] additive in `dtype`: token i of a piece from position `start` sees positions [0, start + i]
// (mixed_attention._piece_mask). The 30 layers of a step ask for the same few: the last PIECE_MASKS kept (one engine
// thread calls; thread_local all the same).
constexpr size_t PIECE_MASKS = 4;
at::Tensor piece_mask(int64_t start, int64_t n, at::ScalarType dtype) {
    struct Mask {
        int64_t start, n;
        at::ScalarType dtype;
        at::Tensor mask;
    };
    thread_local std::vector<Mask> kept;
    for (const Mask &m : kept)
        if (m.start == start && m.n == n && m.dtype == dtype) return m.mask;
    const at::Tensor seen = at::arange(start + n).view({1, -1}).le(at::arange(start, start + n).view({-1, 1}));
    at::Tensor mask = at::zeros(seen.sizes(), at::TensorOptions().dtype(dtype))
                          .masked_fill_(seen.logical_not(), -std::numeric_limits<double>::infinity());
    if (kept.size() == PIECE_MASKS) kept.erase(kept.begin());
    kept.push_back(Mask{start, n, dtype, mask});
    return mask;
}

// A prompt piece (tokens [first, first + n) of slot `slot` from position `start`) through SDPA into `out`, exactly as
// the Python kernel calls it, where the piece kernel declines: a build with AVX-512 but no AVX512-BF16 has no fp32
// piece kernel (piece_attention.c's needs AVX512-BF16, piece_avx2.c's no AVX-512), yet a decode kernel. Before, such
// a piece handed the whole step to the Python kernel every layer (mixed_attention_general: ~0.2-0.3 ms a layer more;
// Zen 3 EPYC, fp32, a 128-token step of 8 decoding rows and a 120-token piece, before piece_avx2.c).
void sdpa_piece(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, at::Tensor &out,
                int64_t first, int64_t n, int64_t slot, int64_t start, double scale) {
    const at::Tensor q = query.narrow(2, first, n);
    const at::Tensor k = key.narrow(0, slot, 1).narrow(2, 0, start + n);
    const at::Tensor v = value.narrow(0, slot, 1).narrow(2, 0, start + n);
    const bool gqa = query.size(1) != key.size(1);
    const at::Tensor res =
        start == 0 ? at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true, scale, gqa)
                   : at::scaled_dot_product_attention(q, k, v, piece_mask(start, n, query.scalar_type()), 0.0, false,
                                                      scale, gqa);
    out.narrow(2, first, n).copy_(res);
}

// query [1, H, T, D] (D contiguous), key/value [S + 1, H_kv, C, D] (slot S: padding), meta [1, 1, T, 2] long (slot,
// position) -> [1, H, T, D], zeros at padding tokens: attention._mixed_attention_cpu's calls, each a C call (prompt
// pieces: piece_attention.c, or SDPA where it declines; decoding runs: decode_attention.c); where the decode kernel or
// a layout declines, the whole op goes to the Python kernel (`mixed_attention_general`, the same result).
at::Tensor mixed_kernel(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, const at::Tensor &meta,
                        double scale) {
    const auto dtype = query.scalar_type();
    const int t = threads();
    const int64_t heads = query.dim() == 4 ? query.size(1) : 0, dim = query.dim() == 4 ? query.size(3) : 0;
    const int64_t kv_heads = key.dim() == 4 ? key.size(1) : 0;
    const bool takes = *switched_on && piece_fn != nullptr && decode_fn != nullptr && t > 0 && query.dim() == 4 &&
                       query.size(0) == 1 && query.stride(3) == 1 && (dtype == at::kBFloat16 || dtype == at::kFloat) &&
                       key.dim() == 4 && key.scalar_type() == dtype && value.scalar_type() == dtype &&
                       value.sizes() == key.sizes() && value.strides() == key.strides() && key.size(3) == dim &&
                       key.stride(3) == 1 && key.stride(2) == dim && kv_heads > 0 && heads % kv_heads == 0 &&
                       heads / kv_heads <= MAX_GROUPS && dim % 32 == 0 && dim <= MAX_HEAD_DIM &&
                       meta.scalar_type() == at::kLong && meta.is_contiguous() && meta.numel() == 2 * query.size(2);
    if (takes) {
        const bool f32 = dtype == at::kFloat;
        const int64_t es = f32 ? 4 : 2, tokens = query.size(2), spare = key.size(0) - 1, capacity = key.size(2);
        at::Tensor out = at::zeros_like(query);  // the strides of query, as the fake kernel (empty_like) declares
        const char *q = static_cast<const char *>(query.data_ptr());
        char *o = static_cast<char *>(out.data_ptr()), *k = static_cast<char *>(key.data_ptr()),
             *v = static_cast<char *>(value.data_ptr());
        const int64_t qh = query.stride(1), qt = query.stride(2), oh = out.stride(1), ot = out.stride(2);
        bool ok = true;
        const RunFn run = f32 ? run_f32_fn : run_fn;
        const bool runs = run != nullptr;
        const std::vector<Call> calls =
            mixed_plan(meta.data_ptr<int64_t>(), tokens, spare, runs ? (f32 ? run_f32_min : run_min) : 0);
        const auto is_run = [&](size_t i) {  // a short run of one slot (run_fn), its slot checked
            const Call &c = calls[i];
            return runs && !c.decoding && c.last - c.first <= SHORT_RUN && c.slots[0] >= 0 && c.slots[0] < spare &&
                   c.ext[0] >= 0 && c.ext[0] + c.last - c.first <= capacity;
        };
        for (size_t i = 0; i < calls.size() && ok; i++) {
            const Call &c = calls[i];
            const int64_t n = c.last - c.first;
            if (is_run(i)) {  // the next run's slot is prefetched during this one's last head
                const Call *next = i + 1 < calls.size() && is_run(i + 1) ? &calls[i + 1] : nullptr;
                const int64_t slot = c.slots[0], ns = next ? next->slots[0] : 0;
                ok = run(q + c.first * qt * es, k + slot * key.stride(0) * es, v + slot * key.stride(0) * es,
                            o + c.first * ot * es, n, c.ext[0], heads, kv_heads, dim, qt, qh, ot, oh, key.stride(1),
                            key.stride(2), static_cast<float>(scale), t, next ? k + ns * key.stride(0) * es : nullptr,
                            next ? v + ns * key.stride(0) * es : nullptr, next ? next->ext[0] + next->last - next->first : 0,
                            i > 0 && is_run(i - 1)) == 0;
            } else if (!c.decoding) {
                const int64_t slot = c.slots[0];
                ok = slot >= 0 && slot < spare && c.ext[0] >= 0 && c.ext[0] + n <= capacity;
                if (ok && piece_fn(q + c.first * qt * es, k + slot * key.stride(0) * es, v + slot * key.stride(0) * es,
                                   o + c.first * ot * es, n, c.ext[0], heads, kv_heads, dim, qt, qh, ot, oh,
                                   key.stride(1), key.stride(2), static_cast<float>(scale), t, tiles && !f32, f32) != 0)
                    sdpa_piece(query, key, value, out, c.first, n, slot, c.ext[0], scale);
            } else {
                ok = *std::min_element(c.slots.begin(), c.slots.end()) >= 0 &&
                     *std::max_element(c.slots.begin(), c.slots.end()) < spare &&
                     *std::min_element(c.ext.begin(), c.ext.end()) >= 1 &&
                     *std::max_element(c.ext.begin(), c.ext.end()) <= capacity;
                if (ok) {
                    std::vector<char> packed(n * heads * dim * es), result(n * heads * dim * es);
                    pack_rows(q, packed.data(), c.first, n, heads, dim, qh, qt, es, false);
                    ok = decode_fn(packed.data(), k, v, result.data(), c.slots.data(), c.ext.data(), n, kv_heads,
                                   heads / kv_heads, dim, key.stride(0), key.stride(1), static_cast<float>(scale), t,
                                   f32) == 0;
                    if (ok) pack_rows(o, result.data(), c.first, n, heads, dim, oh, ot, es, true);
                }
            }
        }
        if (ok) return out;
    }
    static const auto general =
        c10::Dispatcher::singleton().findSchemaOrThrow("bucketserve::mixed_attention_general", "");
    return call_general(general, {query, key, value, meta, scale});
}

// query [b, H, q, D] (D contiguous), key/value [b, H_kv, q, D] (the rows' own positions) -> [b, H, q, D], query i
// attending keys [0, i]: attention._causal_attention_cpu, each row one piece_attention.c call; where it declines,
// the whole op goes to the Python kernel (`causal_attention_general`: SDPA). Output strides are the query's.
at::Tensor causal_kernel(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, double scale) {
    const auto dtype = query.scalar_type();
    const int t = threads();
    if (*switched_on && piece_fn != nullptr && t > 0 && query.dim() == 4 && key.dim() == 4 &&
        (dtype == at::kBFloat16 || dtype == at::kFloat) && key.scalar_type() == dtype && value.scalar_type() == dtype &&
        value.sizes() == key.sizes() && value.strides() == key.strides() && key.size(0) == query.size(0) &&
        key.size(2) == query.size(2) && key.size(3) == query.size(3) && query.stride(3) == 1 && key.stride(3) == 1) {
        const bool f32 = dtype == at::kFloat;
        const int64_t es = f32 ? 4 : 2;
        at::Tensor out = at::empty_like(query);
        const char *q = static_cast<const char *>(query.data_ptr()), *k = static_cast<const char *>(key.data_ptr()),
                   *v = static_cast<const char *>(value.data_ptr());
        char *o = static_cast<char *>(out.data_ptr());
        bool ok = true;
        for (int64_t row = 0; ok && row < query.size(0); row++)
            ok = piece_fn(q + row * query.stride(0) * es, k + row * key.stride(0) * es, v + row * key.stride(0) * es,
                          o + row * out.stride(0) * es, query.size(2), 0, query.size(1), key.size(1), query.size(3),
                          query.stride(2), query.stride(1), out.stride(2), out.stride(1), key.stride(1),
                          key.stride(2), static_cast<float>(scale), t, tiles && !f32, f32) == 0;
        if (ok) return out;
    }
    static const auto general =
        c10::Dispatcher::singleton().findSchemaOrThrow("bucketserve::causal_attention_general", "");
    return call_general(general, {query, key, value, scale});
}

// The kernels' entries (models/csrc/linear.c, decode_attention.c, rms_norm.c, piece_attention.c, run_attention.c or
// run_vec.c; by address), the shortest run the run kernel takes, how they were built, whether the process may use AMX
// tiles, and where the switch lives.
void bind(int64_t linear_address, int64_t gated_address, int64_t attention_address, int64_t rms_address,
          int64_t piece_address, int64_t decode_address, int64_t run_address, int64_t shortest_run,
          int64_t run_f32_address, int64_t shortest_run_f32, bool openmp, bool amx, int64_t f32_mkl,
          int64_t switch_address) {
    f32_mkl_rows = f32_mkl;
    linear_fn = reinterpret_cast<LinearFn>(linear_address);
    gated_fn = reinterpret_cast<GatedFn>(gated_address);
    masked_fn = reinterpret_cast<MaskedFn>(attention_address);
    rms_fn = reinterpret_cast<RmsFn>(rms_address);
    piece_fn = reinterpret_cast<PieceFn>(piece_address);
    decode_fn = reinterpret_cast<DecodeFn>(decode_address);
    run_fn = run_address ? reinterpret_cast<RunFn>(run_address) : nullptr;
    run_min = shortest_run;
    run_f32_fn = run_f32_address ? reinterpret_cast<RunFn>(run_f32_address) : nullptr;
    run_f32_min = shortest_run_f32;
    tiles = amx;
    parallel = openmp;
    switched_on = reinterpret_cast<const volatile int *>(switch_address);
}

void remember(int64_t address, int64_t n, int64_t k, c10::ScalarType dtype, const at::Tensor &onednn,
              int64_t one_kind, int64_t one_weight, int64_t one_scales, int64_t few_kind, int64_t few_weight,
              int64_t few_scales, int64_t few_max) {
    Entry e{n, k, dtype, onednn, Kernel{one_kind, one_weight, one_scales}, Kernel{few_kind, few_weight, few_scales},
            few_max};
    std::lock_guard<std::mutex> guard(mutex);
    entries[address] = std::move(e);
}

void forget(int64_t address) {
    std::lock_guard<std::mutex> guard(mutex);
    entries.erase(address);
}

int64_t remembered() {
    std::lock_guard<std::mutex> guard(mutex);
    return static_cast<int64_t>(entries.size());
}

// Register the CPU kernels (once; the caller has removed the Python ones first).
void install() {
    TORCH_CHECK(linear_fn != nullptr && switched_on != nullptr, "bind the kernels before installing");
    if (installed) return;
    installed = std::make_unique<torch::Library>(torch::Library::IMPL, "bucketserve", c10::DispatchKey::CPU,
                                                 __FILE__, __LINE__);
    installed->impl("linear", TORCH_FN(linear_kernel));
    installed->impl("gated_silu", TORCH_FN(gated_kernel));
    installed->impl("attention", TORCH_FN(attention_kernel));
    installed->impl("rms_norm", TORCH_FN(rms_kernel));
    installed->impl("mixed_attention", TORCH_FN(mixed_kernel));
    installed->impl("causal_attention", TORCH_FN(causal_kernel));
    bucketserve::install_layer_ops(*installed);
}

}  // namespace

namespace bucketserve {

at::Tensor linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    return linear_kernel(x, weight, bias);
}
at::Tensor gated_silu(const at::Tensor &x, const at::Tensor &gate, const at::Tensor &up) {
    return gated_kernel(x, gate, std::nullopt, up, std::nullopt);
}
at::Tensor attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, const at::Tensor &mask,
                     double scale) {
    return attention_kernel(query, key, value, mask, scale);
}
at::Tensor mixed_attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                           const at::Tensor &meta, double scale) {
    return mixed_kernel(query, key, value, meta, scale);
}
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) { return rms_kernel(x, weight, eps); }
bool native_on() { return switched_on != nullptr && *switched_on; }

}  // namespace bucketserve

TORCH_LIBRARY_FRAGMENT(bucketserve_dispatch, m) {
    m.def("bind(int linear, int gated, int attention, int rms, int piece, int decode, int run, int shortest_run, "
          "int run_f32, int shortest_run_f32, bool openmp, bool amx, int f32_mkl_rows, int switch) -> ()",
          &bind);
    m.def("remember(int address, int n, int k, ScalarType dtype, Tensor onednn, int one_kind, int one_weight, "
          "int one_scales, int few_kind, int few_weight, int few_scales, int few_max) -> ()",
          &remember);
    m.def("forget(int address) -> ()", &forget);
    m.def("remembered() -> int", &remembered);
    m.def("install() -> ()", &install);
}
