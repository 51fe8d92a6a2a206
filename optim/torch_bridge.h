// Between LibTorch tensors and the canonical state: dtype mapping, zero-copy export of tensors as
// Buffers, and FusedAdamW state export/import by fully qualified parameter name.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "optstate/state.h"

namespace optstate::optim {

class FusedAdamW;
class AdamW8bit;

Result<DType> dtype_of(at::ScalarType t);
at::ScalarType scalar_type_of(DType d);

// A contiguous CPU tensor's bytes, shared (the Buffer keeps the tensor alive).
Buffer buffer_of(const at::Tensor& t);
// A new CPU tensor holding a copy of `b`, checked against dtype and shape.
Result<at::Tensor> tensor_of(const Buffer& b, DType dtype, const std::vector<int64_t>& shape);
std::vector<int64_t> shape_of(const at::Tensor& t);
// A tensor over `b`'s bytes without a copy, keeping its owner alive (a copy when b has no owner).
// For buffers nothing else holds, such as those a reader just filled: the tensor is writable.
Result<at::Tensor> tensor_taking(Buffer b, DType dtype, const std::vector<int64_t>& shape);

// `names[i]` is the fqn of the i-th parameter across the optimizer's groups, in order.
// With include_params the model weights go along as "param" entries.
Result<OptimizerState> export_state(const FusedAdamW& opt, const std::vector<std::string>& names,
                                    bool include_params);
// Restores hyperparameters, steps and moments (and with load_params the weights) exactly. Each
// group takes the hyperparameters the state has for its params (groups match through their
// params, not by position); a group whose params the state has with different ones is refused.
Status import_state(FusedAdamW& opt, const std::vector<std::string>& names, const OptimizerState& state,
                    bool load_params);

// AdamW8bit: moments export as blockwise8 entries (dense fp32 below min_8bit_size). Import takes
// either encoding: dense moments of 8-bit-eligible params are quantized (exactly recovering codes
// that came from 8-bit), blockwise8 moments of small params are dequantized.
Result<OptimizerState> export_state(const AdamW8bit& opt, const std::vector<std::string>& names,
                                    bool include_params);
Status import_state(AdamW8bit& opt, const std::vector<std::string>& names, const OptimizerState& state,
                    bool load_params);

}  // namespace optstate::optim
