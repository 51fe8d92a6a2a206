// bitsandbytes' optimizer state_dict (torch.save of AdamW8bit / AdamW's state_dict()): encoded from
// the canonical state as pure functions; the driver (bnb_format.cpp) writes the zip and the
// tensors' bytes. Layout: FORMAT.md. Reading is the torch.save driver's (torchsave/), which knows
// bitsandbytes' names (dcp/bnb_state.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optstate/checkpoint.h"
#include "optstate/state.h"
#include "torchsave/torchsave_layout.h"

namespace optstate::bitsandbytes {

// bitsandbytes' optimizers quantize their 8-bit state in blocks of 256 with the dynamic maps.
inline constexpr int64_t kBlockSize = 256;

// Whether bitsandbytes steps this blockwise8 entry as it is (blocks of 256, the dynamic map for
// the moment); the writer stores the others dequantized, as fp32 state it steps in 32 bits.
bool steps_as_8bit(const std::string& moment, const Entry& e);

using torchsave::Plan;
using torchsave::StorageSpec;

// Where a param's state tensors stand: nested in "__bnb_optimizer_quant_state__" (bitsandbytes
// 0.49.2 and later, which load both forms) or beside "step" (earlier releases, which load only this).
enum class Layout { kNested, kFlat };

// The layout a write uses: WriteOptions::bitsandbytes_layout ("nested" or "flat"; anything else
// refused), else the source's (a bitsandbytes file read by the torch.save driver), else nested.
Result<Layout> written_layout(const WriteOptions& options);

// data.pkl and its storages for `state`: bitsandbytes' state_dict in `layout`, params numbered in
// group order with `param_names` unless every name is its number, and
// {"model": {fqn: weight}, "optimizer": ...} when the state has weights. Refused: amsgrad and
// maximize (bitsandbytes has neither), entries other than the two moments and the weights.
Result<Plan> plan_state_dict(const OptimizerState& state, Layout layout = Layout::kNested);
// The same frame written into `w` with storages from `add` (plan_state_dict's, or the carrying
// writer's: torchsave::write_carrying).
Status plan_frame(const OptimizerState& state, pickle::Writer& w, const torchsave::SpecSink& add,
                  const torchsave::FrameOptions& options, Layout layout = Layout::kNested);

// What a round trip gives back: entries bitsandbytes does not step as 8-bit become dense fp32
// (dequantized, where `state` has the buffers), dense moments fp32.
OptimizerState kept_state(const OptimizerState& state);

}  // namespace optstate::bitsandbytes
