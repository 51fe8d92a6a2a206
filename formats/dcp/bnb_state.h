#pragma once
// bitsandbytes' AdamW8bit / Adam8bit / AdamW (its Optimizer2State) as its state_dict names things,
// shared by the DCP and torch.save readers. Per param: "step", "state1" (exp_avg) and "state2"
// (exp_avg_sq): fp32 tensors of the param's shape (32-bit state, or a param below min_8bit_size),
// or uint8 codes of that shape with "absmax1"/"absmax2" (fp32, one per block of the flattened
// tensor: 256 elements, 2048 in older releases) and "qmap1"/"qmap2" (its dynamic signed / unsigned
// maps, 256 fp32): value = qmap[code] * absmax[block], the canonical blockwise8 entry.
// bitsandbytes >= 0.49.2 nests those tensors in "__bnb_optimizer_quant_state__" (hiding them from
// FSDP's gathering); older releases keep them beside "step".
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "optstate/state.h"

namespace optstate::dcp {

inline constexpr std::string_view kBnbQuantState = "__bnb_optimizer_quant_state__";

// "state1" -> exp_avg, "state2" -> exp_avg_sq; nullopt for any other name.
inline std::optional<std::string> bnb_moment(std::string_view name) {
  if (name == "state1") return std::string(kExpAvg);
  if (name == "state2") return std::string(kExpAvgSq);
  return std::nullopt;
}

// The state tensor a bitsandbytes field belongs to: "absmax1" -> "state1" (also "qmapN", and
// "maxN" / "new_maxN" of its non-blockwise 8-bit state); nullopt for others.
inline std::optional<std::string> bnb_part_of(std::string_view name) {
  for (std::string_view prefix : {"absmax", "qmap", "max", "new_max"})
    if (name.size() == prefix.size() + 1 && name.starts_with(prefix) && (name.back() == '1' || name.back() == '2'))
      return std::string("state") + name.back();
  return std::nullopt;
}

// The block size of bitsandbytes' 8-bit state with `blocks` scales for `numel` codes: 256, or 2048
// (older releases), whichever gives that count; 0 when neither does.
inline int64_t bnb_block_size(int64_t numel, int64_t blocks) {
  if (numel <= 0) return 0;
  for (int64_t b : {int64_t{256}, int64_t{2048}})
    if (blocks == (numel + b - 1) / b) return b;
  return 0;
}

}  // namespace optstate::dcp
