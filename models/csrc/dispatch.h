// What models/csrc/layer_ops.cpp takes from dispatch.cpp: the op kernels as plain functions (called directly, not
// through the dispatcher: the point of a fused layer), the switch, and the hook that registers the layer ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace bucketserve {

// bucketserve::linear, gated_silu (no biases), attention, mixed_attention and rms_norm: same arguments and results.
at::Tensor linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias);
at::Tensor gated_silu(const at::Tensor &x, const at::Tensor &gate, const at::Tensor &up);
at::Tensor attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, const at::Tensor &mask,
                     double scale);
at::Tensor mixed_attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                           const at::Tensor &meta, double scale);
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps);
bool native_on();  // the native kernels' switch (--no-native-kernels turns it off)

void install_layer_ops(torch::Library &lib);  // qkv_rope, attn_mlp and decoder_stack: CPU kernels

}  // namespace bucketserve
