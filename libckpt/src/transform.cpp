#include "optstate/transform.h"

#include <fmt/format.h>

#include <cstring>
#include <optional>
#include <vector>

#include "optstate/quant8.h"

namespace optstate {
namespace {

// Dense values of a float dtype into `out` (sized for them), one loop per dtype.
Status widen_to_f32(std::span<const std::byte> bytes, DType dtype, std::span<float> out, const std::string& key) {
  const std::byte* src = bytes.data();
  const size_t n = out.size();
  switch (dtype) {
    case DType::kF32:
      if (n) std::memcpy(out.data(), src, n * 4);
      return Status::Ok();
    case DType::kBF16:
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
      return Status::Ok();
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, src + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      return Status::Ok();
    default: return invalid_argument(fmt::format("entry '{}' is not a float entry", key));
  }
}

Status check_blockwise(const Entry& e, int64_t numel, const std::string& key) {
  if (numel < 0 || e.codes.size != static_cast<size_t>(numel) || e.block_size < 1 ||
      e.absmax.size / 4 != static_cast<size_t>((numel + e.block_size - 1) / e.block_size))
    return internal_error(fmt::format("{}: codes or scales do not fit its shape", key));
  return Status::Ok();
}

}  // namespace

Status dense_to_f32_into(std::span<const std::byte> bytes, DType dtype, std::span<float> out, const std::string& key) {
  const int64_t elem = dtype_size(dtype);
  if (elem <= 0 || bytes.size() != out.size() * static_cast<size_t>(elem))
    return internal_error(fmt::format("entry '{}': {} bytes of {} for {} values", key, bytes.size(), dtype_name(dtype),
                                      out.size()));
  return widen_to_f32(bytes, dtype, out, key);
}

Result<std::vector<float>> dense_to_f32(std::span<const std::byte> bytes, DType dtype, const std::string& key) {
  const int64_t elem = dtype_size(dtype);
  const int64_t numel = elem > 0 ? static_cast<int64_t>(bytes.size()) / elem : 0;
  std::vector<float> out(static_cast<size_t>(numel));
  OPTSTATE_RETURN_IF_ERROR(widen_to_f32(bytes, dtype, out, key));
  return out;
}

Result<std::vector<float>> entry_f32_values(const Entry& e, int64_t numel, const std::string& key) {
  if (e.encoding == Encoding::kDense) return dense_to_f32(e.values.span(), e.dtype, key);
  std::vector<float> values;  // dequantized into it by entry_f32_span, which sizes it to numel
  OPTSTATE_RETURN_IF_ERROR(entry_f32_span(e, numel, key, values).status());
  return values;
}

Result<std::span<const float>> entry_f32_span(const Entry& e, int64_t numel, const std::string& key,
                                              std::vector<float>& scratch) {
  if (numel < 0) return internal_error(fmt::format("{}: {} elements", key, numel));
  const auto n = static_cast<size_t>(numel);
  if (e.encoding == Encoding::kDense) {
    const int64_t elem = dtype_size(e.dtype);
    if (elem <= 0 || e.values.size != n * static_cast<size_t>(elem))
      return internal_error(fmt::format("{}: {} bytes of values for {} elements", key, e.values.size, numel));
    // fp32 values as they lie, where they are aligned for floats (a buffer's always are)
    if (e.dtype == DType::kF32 && reinterpret_cast<uintptr_t>(e.values.data) % alignof(float) == 0)
      return std::span<const float>(reinterpret_cast<const float*>(e.values.data), n);
    if (scratch.size() < n) scratch.resize(n);
    OPTSTATE_RETURN_IF_ERROR(widen_to_f32(e.values.span(), e.dtype, std::span(scratch).first(n), key));
    return std::span<const float>(scratch.data(), n);
  }
  OPTSTATE_ASSIGN_OR_RETURN(const QMap m, qmap_from_name(e.qmap));
  OPTSTATE_RETURN_IF_ERROR(check_blockwise(e, numel, key));
  if (scratch.size() < n) scratch.resize(n);
  dequantize_blockwise({reinterpret_cast<const uint8_t*>(e.codes.data), e.codes.size},
                       {reinterpret_cast<const float*>(e.absmax.data), e.absmax.size / 4}, e.block_size, m,
                       std::span(scratch).first(n));
  return std::span<const float>(scratch.data(), n);
}

namespace {

// The quantization map quantize_state gives entry `name`, or none: model weights and unknown
// entries stay as they are.
std::optional<QMap> moment_map(const std::string& name) {
  if (name == kExpAvg) return QMap::kDynamicSigned;
  if (name == kExpAvgSq || name == kMaxExpAvgSq) return QMap::kDynamicUnsigned;
  return std::nullopt;
}

bool recodes(const std::string& name, const Entry& e, int64_t numel, Recode how, const QuantizeOptions& q) {
  if (how == Recode::kDequantize) return e.encoding == Encoding::kBlockwise8;
  if (how != Recode::kQuantize) return false;
  const auto map = moment_map(name);
  if (!map || numel < q.min_8bit_size || (q.whole_blocks && numel % q.block_size != 0)) return false;
  if (e.encoding == Encoding::kDense) return true;
  return q.reblock && (e.block_size != q.block_size || e.qmap != qmap_name(*map));
}

}  // namespace

Status check_quantize_options(const QuantizeOptions& q) {
  if (q.block_size <= 0 || q.block_size > (int64_t{1} << 20))
    return invalid_argument(fmt::format("block size {} out of range", q.block_size));
  return Status::Ok();
}

Entry recode_meta(const std::string& name, const Entry& e, int64_t numel, Recode how, const QuantizeOptions& q) {
  Entry out;
  if (!recodes(name, e, numel, how, q)) {
    out = e;
    out.values = out.codes = out.absmax = Buffer{};
  } else if (how == Recode::kDequantize) {
    out.encoding = Encoding::kDense;
    out.dtype = DType::kF32;
  } else {
    out.encoding = Encoding::kBlockwise8;
    out.dtype = DType::kU8;
    out.block_size = q.block_size;
    out.qmap = std::string(qmap_name(*moment_map(name)));
  }
  return out;
}

Result<Entry> recode_entry(const std::string& name, const Entry& e, int64_t numel, Recode how,
                           const QuantizeOptions& q, const std::string& key) {
  if (!recodes(name, e, numel, how, q)) return e;
  Entry out = recode_meta(name, e, numel, how, q);
  if (how == Recode::kDequantize) {
    OPTSTATE_ASSIGN_OR_RETURN(QMap m, qmap_from_name(e.qmap));
    std::span<std::byte> values;
    out.values = Buffer::allocate(static_cast<size_t>(numel) * 4, &values);
    dequantize_blockwise({reinterpret_cast<const uint8_t*>(e.codes.data), e.codes.size},
                         {reinterpret_cast<const float*>(e.absmax.data), e.absmax.size / 4}, e.block_size, m,
                         {reinterpret_cast<float*>(values.data()), static_cast<size_t>(numel)});
    return out;
  }
  std::vector<float> values;
  if (e.encoding == Encoding::kDense) {
    OPTSTATE_ASSIGN_OR_RETURN(values, dense_to_f32(e.values.span(), e.dtype, key));
  } else {  // reblock: dequantized, then quantized as a dense entry would be
    OPTSTATE_ASSIGN_OR_RETURN(const std::span<const float> dq, entry_f32_span(e, numel, key, values));
    if (dq.data() != values.data()) values.assign(dq.begin(), dq.end());
  }
  std::span<std::byte> codes, absmax;
  const int64_t blocks = (numel + q.block_size - 1) / q.block_size;
  out.codes = Buffer::allocate(static_cast<size_t>(numel), &codes);
  out.absmax = Buffer::allocate(static_cast<size_t>(blocks) * 4, &absmax);
  requantize_blockwise(values, q.block_size, *moment_map(name),
                       {reinterpret_cast<uint8_t*>(codes.data()), codes.size()},
                       {reinterpret_cast<float*>(absmax.data()), static_cast<size_t>(blocks)});
  return out;
}

namespace {

Result<OptimizerState> recode_state(const OptimizerState& in, Recode how, const QuantizeOptions& q) {
  OPTSTATE_RETURN_IF_ERROR(check_structure(in, true));
  OPTSTATE_RETURN_IF_ERROR(check_quantize_options(q));
  OptimizerState out = in;
  for (auto& [fqn, ps] : out.params) {
    OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(ps.shape));
    for (auto& [name, e] : ps.entries) {
      OPTSTATE_ASSIGN_OR_RETURN(Entry r, recode_entry(name, e, numel, how, q, entry_key(fqn, name)));
      e = std::move(r);
    }
  }
  if (how == Recode::kQuantize && has_blockwise8(out)) out.kind = "adamw8bit";
  return out;
}

}  // namespace

bool has_blockwise8(const OptimizerState& state) {
  for (const auto& [fqn, ps] : state.params)
    for (const auto& [name, e] : ps.entries)
      if (e.encoding == Encoding::kBlockwise8) return true;
  return false;
}

Result<OptimizerState> dequantize_state(const OptimizerState& in) { return recode_state(in, Recode::kDequantize, {}); }

Result<OptimizerState> quantize_state(const OptimizerState& in, const QuantizeOptions& options) {
  return recode_state(in, Recode::kQuantize, options);
}

}  // namespace optstate
