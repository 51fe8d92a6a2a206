// Entry values as fp32, whatever their stored encoding: the one place where dense 16-bit values are
// widened (and, with the 8-bit codec, blockwise8 entries dequantized). Used by hash --values,
// inspect's statistics, validate and diff.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "optstate/checkpoint.h"

namespace optstate {

using F32Sink = std::function<Status(std::span<const float>)>;

// Streams the entry's values as fp32 in flattened order, in bounded pieces.
Status stream_f32_values(CheckpointReader& reader, const std::string& fqn, const std::string& entry,
                         const F32Sink& sink);

struct ValueStats {
  int64_t count = 0, nonfinite = 0, negative = 0;
  double min = 0, max = 0, sum = 0, abs_max = 0;
  double mean() const { return count - nonfinite > 0 ? sum / static_cast<double>(count - nonfinite) : 0.0; }
};

Result<ValueStats> entry_stats(CheckpointReader& reader, const std::string& fqn, const std::string& entry);

}  // namespace optstate
