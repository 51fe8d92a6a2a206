#include "optstate/transform.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "optstate/quant8.h"

namespace optstate {
Result<std::vector<float>> dense_to_f32(std::span<const std::byte> bytes, DType dtype, const std::string& key) {
  const int64_t elem = dtype_size(dtype);
  const int64_t numel = elem > 0 ? static_cast<int64_t>(bytes.size()) / elem : 0;
  std::vector<float> out(static_cast<size_t>(numel));
  const std::byte* src = bytes.data();
  for (int64_t i = 0; i < numel; ++i) {
    switch (dtype) {
      case DType::kF32: std::memcpy(&out[i], src + 4 * i, 4); break;
      case DType::kBF16:
      case DType::kF16: {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
        break;
      }
      case DType::kF64: {
        double d;
        std::memcpy(&d, src + 8 * i, 8);
        out[i] = static_cast<float>(d);
        break;
      }
      default: return invalid_argument(fmt::format("entry '{}' is not a float entry", key));
    }
  }
  return out;
}

Result<OptimizerState> dequantize_state(const OptimizerState& in) {
  OPTSTATE_RETURN_IF_ERROR(check_structure(in, true));
  OptimizerState out = in;
  for (auto& [fqn, ps] : out.params) {
    OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(ps.shape));
    for (auto& [name, e] : ps.entries) {
      if (e.encoding != Encoding::kBlockwise8) continue;
      OPTSTATE_ASSIGN_OR_RETURN(QMap m, qmap_from_name(e.qmap));
      std::vector<float> values(static_cast<size_t>(numel));
      dequantize_blockwise({reinterpret_cast<const uint8_t*>(e.codes.data), e.codes.size},
                           {reinterpret_cast<const float*>(e.absmax.data), e.absmax.size / 4}, e.block_size, m,
                           values);
      Entry d;
      d.encoding = Encoding::kDense;
      d.dtype = DType::kF32;
      d.values = Buffer::copy_of(std::as_bytes(std::span(values)));
      e = std::move(d);
    }
  }
  return out;
}

Result<OptimizerState> quantize_state(const OptimizerState& in, const QuantizeOptions& options) {
  OPTSTATE_RETURN_IF_ERROR(check_structure(in, true));
  if (options.block_size <= 0 || options.block_size > (int64_t{1} << 20))
    return invalid_argument(fmt::format("block size {} out of range", options.block_size));
  OptimizerState out = in;
  for (auto& [fqn, ps] : out.params) {
    OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(ps.shape));
    if (numel < options.min_8bit_size) continue;
    for (auto& [name, e] : ps.entries) {
      if (e.encoding != Encoding::kDense) continue;
      QMap m;
      if (name == kExpAvg)
        m = QMap::kDynamicSigned;
      else if (name == kExpAvgSq || name == kMaxExpAvgSq)
        m = QMap::kDynamicUnsigned;
      else
        continue;  // model weights and unknown entries stay as they are
      OPTSTATE_ASSIGN_OR_RETURN(std::vector<float> values, dense_to_f32(e.values.span(), e.dtype, entry_key(fqn, name)));
      std::vector<uint8_t> codes(static_cast<size_t>(numel));
      std::vector<float> absmax(static_cast<size_t>((numel + options.block_size - 1) / options.block_size));
      requantize_blockwise(values, options.block_size, m, codes, absmax);
      Entry q;
      q.encoding = Encoding::kBlockwise8;
      q.dtype = DType::kU8;
      q.block_size = options.block_size;
      q.qmap = std::string(qmap_name(m));
      q.codes = Buffer::copy_of(std::as_bytes(std::span(codes)));
      q.absmax = Buffer::copy_of(std::as_bytes(std::span(absmax)));
      e = std::move(q);
    }
  }
  return out;
}

}  // namespace optstate
