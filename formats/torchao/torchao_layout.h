// torchao's AdamW8bit optimizer state_dict (torch.save of torchao.optim.AdamW8bit's state_dict():
// Hugging Face's Trainer with optim="adamw_torch_8bit"), encoded from the canonical state as pure
// functions; the driver (torchao_format.cpp) writes the zip and the tensors' bytes. Layout:
// FORMAT.md. Reading is the torch.save driver's (torchsave/), which knows torchao's subclasses.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/state.h"
#include "torchsave/torchsave_layout.h"

namespace optstate::torchao {

// Whether torchao steps this blockwise8 entry of a param of `numel` elements as its own
// OptimState8bit: whole blocks (torchao quantizes tensor.view(-1, block_size)) and the dynamic map
// of the moment (signed for exp_avg, unsigned for exp_avg_sq and max_exp_avg_sq). The writer stores
// the others as plain fp32 tensors, which torchao steps in 32 bits as it keeps small params' state.
bool steps_as_8bit(const std::string& moment, const Entry& e, int64_t numel);

using torchsave::Plan;
using torchsave::StorageSpec;

// data.pkl and its storages for `state`: torchao's _AdamBase state_dict. Params numbered in group
// order with `param_names` unless every name is its number; per param `step` (a float32 tensor) and
// the moments, 8-bit ones as OptimState8bit; groups with `lr` a float32 tensor (torchao's step
// refuses a float) and `amsgrad`; {"model": {fqn: weight}, "optimizer": ...} when the state has
// weights. Refused: maximize (torchao has none), entries other than the moments and the weights,
// a step beyond float32's exact integers (2^24).
// 8-bit moments are `package`'s OptimState8bit (dcp::kTorchaoOptimPackages: torchao.optim, or
// torchao.prototype.low_bit_optim for torchao before 0.11).
Result<Plan> plan_state_dict(const OptimizerState& state, std::string_view package = dcp::kTorchaoDefaultPackage);
// The same frame written into `w` with storages from `add` (plan_state_dict's, or the carrying
// writer's: torchsave::write_carrying).
Status plan_frame(const OptimizerState& state, pickle::Writer& w, const torchsave::SpecSink& add,
                  const torchsave::FrameOptions& options, std::string_view package = dcp::kTorchaoDefaultPackage);

// What a round trip gives back: entries torchao does not step as 8-bit become dense (dequantized to
// fp32 where `state` has the buffers; dense ones keep their dtype), lr rounded to float32, and the
// param dtype of a param without weights but with 8-bit moments what their subclass claims.
// `eight` (default: steps_as_8bit) says which blockwise8 moments are written as 8-bit; a writer
// with a further rule (DCP: each rank's rows whole blocks) passes its own.
using KeepsEight = std::function<bool(const std::string& moment, const Entry& e, const ParamState& ps)>;
OptimizerState kept_state(const OptimizerState& state, const KeepsEight& eight = {});

// torchao's OptimState8bit of `shape` as torch.save pickles it: _rebuild_from_type_v2 of
// _rebuild_wrapper_subclass(OptimState8bit, apparent, size, stride, 0, strided, cpu, False) (torchao's
// "appearance" dtype: the param's) with the
// state {"codes": uint8 of `shape`, "scale": fp32[blocks], "qmap": fp32[256], "signed", "block_size"}
// over storages `codes_key`, `scale_key`, `qmap_key`; the class is `<package>.subclass_8bit.OptimState8bit`.
void encode_optim_state_8bit(pickle::Writer& w, const std::vector<int64_t>& shape, DType apparent, int64_t block_size,
                             bool is_signed, const std::string& codes_key, const std::string& scale_key,
                             const std::string& qmap_key, std::string_view package = dcp::kTorchaoDefaultPackage);

}  // namespace optstate::torchao
