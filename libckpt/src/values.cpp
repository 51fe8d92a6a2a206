#include "optstate/values.h"

#include "optstate/quant8.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace optstate {

namespace {

// Dequantizes a blockwise8 entry in flattened order: the absmax (one fp32 per block, 1/64 of the
// codes' size at block 256) is read first, then the codes stream through.
Status stream_dequantized(CheckpointReader& reader, const std::string& fqn, const std::string& entry, const Entry& e,
                          const ParamState& ps, const F32Sink& sink) {
  const std::string where = fmt::format("{}: entry '{}'", reader.path().string(), entry_key(fqn, entry));
  auto qm = qmap_from_name(e.qmap);
  if (!qm.ok()) return qm.status().with_context(where);
  OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(ps.shape));
  const int64_t nblocks = component_count(e, Component::kAbsmax, numel);
  std::vector<float> absmax;
  absmax.reserve(static_cast<size_t>(nblocks));
  OPTSTATE_RETURN_IF_ERROR(reader.stream(fqn, entry, Component::kAbsmax, [&](std::span<const std::byte> piece) {
    if (piece.size() % 4 != 0 || absmax.size() + piece.size() / 4 > static_cast<size_t>(nblocks))
      return corrupt(where + ": absmax has the wrong size");
    const size_t at = absmax.size();
    absmax.resize(at + piece.size() / 4);
    std::memcpy(absmax.data() + at, piece.data(), piece.size());
    return Status::Ok();
  }));
  if (static_cast<int64_t>(absmax.size()) != nblocks) return corrupt(where + ": absmax has the wrong size");
  const float* map = qmap_table(*qm).data();
  const size_t block = static_cast<size_t>(e.block_size);
  size_t index = 0;
  std::vector<float> out;
  OPTSTATE_RETURN_IF_ERROR(reader.stream(fqn, entry, Component::kCodes, [&](std::span<const std::byte> piece) {
    if (index + piece.size() > static_cast<size_t>(numel)) return corrupt(where + ": too many codes");
    out.resize(piece.size());
    // Block by block within the piece: no division per element.
    for (size_t i = 0; i < piece.size();) {
      const size_t blk = index / block, end = std::min(piece.size(), i + (blk + 1) * block - index);
      const float scale = absmax[blk];
      for (; i < end; ++i, ++index) out[i] = map[static_cast<uint8_t>(piece[i])] * scale;
    }
    return sink(out);
  }));
  if (static_cast<int64_t>(index) != numel) return corrupt(where + ": too few codes");
  return Status::Ok();
}

}  // namespace

Status stream_f32_values(CheckpointReader& reader, const std::string& fqn, const std::string& entry,
                         const F32Sink& sink) {
  const auto& params = reader.meta().params;
  auto p = params.find(fqn);
  if (p == params.end()) return not_found(fmt::format("{}: no param '{}'", reader.path().string(), fqn));
  auto it = p->second.entries.find(entry);
  if (it == p->second.entries.end())
    return not_found(fmt::format("{}: no entry '{}'", reader.path().string(), entry_key(fqn, entry)));
  const Entry& e = it->second;
  if (e.encoding == Encoding::kBlockwise8) return stream_dequantized(reader, fqn, entry, e, p->second, sink);
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
