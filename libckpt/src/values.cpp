#include "optstate/values.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace optstate {

Status stream_f32_values(CheckpointReader& reader, const std::string& fqn, const std::string& entry,
                         const F32Sink& sink) {
  const auto& params = reader.meta().params;
  auto p = params.find(fqn);
  if (p == params.end()) return not_found(fmt::format("{}: no param '{}'", reader.path().string(), fqn));
  auto it = p->second.entries.find(entry);
  if (it == p->second.entries.end())
    return not_found(fmt::format("{}: no entry '{}'", reader.path().string(), entry_key(fqn, entry)));
  const Entry& e = it->second;
  if (e.encoding != Encoding::kDense)
    return unsupported(fmt::format("{}: entry '{}' is blockwise8; this build has no 8-bit codec",
                                   reader.path().string(), entry_key(fqn, entry)));
  const DType dtype = e.dtype;
  const size_t elem = dtype_size(dtype);
  std::vector<std::byte> carry;
  std::vector<float> out;
  auto convert = [&](std::span<const std::byte> bytes) -> Status {
    const size_t n = bytes.size() / elem;
    out.resize(n);
    if (dtype == DType::kF32) {
      std::memcpy(out.data(), bytes.data(), n * 4);
    } else {
      for (size_t i = 0; i < n; ++i) {
        const std::byte* q = bytes.data() + i * elem;
        if (dtype == DType::kF64) {
          double d;
          std::memcpy(&d, q, 8);
          out[i] = static_cast<float>(d);
        } else {
          uint16_t h;
          std::memcpy(&h, q, 2);
          out[i] = dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
      }
    }
    return sink(out);
  };
  OPTSTATE_RETURN_IF_ERROR(reader.stream(fqn, entry, Component::kValues, [&](std::span<const std::byte> piece) {
    size_t at = 0;
    if (!carry.empty()) {  // an element split across two pieces
      while (carry.size() < elem && at < piece.size()) carry.push_back(piece[at++]);
      if (carry.size() < elem) return Status::Ok();
      OPTSTATE_RETURN_IF_ERROR(convert(carry));
      carry.clear();
    }
    const size_t whole = (piece.size() - at) / elem * elem;
    OPTSTATE_RETURN_IF_ERROR(convert(piece.subspan(at, whole)));
    carry.assign(piece.begin() + static_cast<std::ptrdiff_t>(at + whole), piece.end());
    return Status::Ok();
  }));
  if (!carry.empty())
    return corrupt(fmt::format("{}: entry '{}' ends in a partial element", reader.path().string(),
                               entry_key(fqn, entry)));
  return Status::Ok();
}

Result<ValueStats> entry_stats(CheckpointReader& reader, const std::string& fqn, const std::string& entry) {
  ValueStats s;
  s.min = std::numeric_limits<double>::infinity();
  s.max = -std::numeric_limits<double>::infinity();
  OPTSTATE_RETURN_IF_ERROR(stream_f32_values(reader, fqn, entry, [&](std::span<const float> v) {
    for (float x : v) {
      ++s.count;
      if (!std::isfinite(x)) {
        ++s.nonfinite;
        continue;
      }
      const double d = x;
      s.min = std::min(s.min, d);
      s.max = std::max(s.max, d);
      s.abs_max = std::max(s.abs_max, std::fabs(d));
      s.sum += d;
      if (x < 0) ++s.negative;
    }
    return Status::Ok();
  }));
  if (s.count == s.nonfinite) s.min = s.max = 0;
  return s;
}

}  // namespace optstate
