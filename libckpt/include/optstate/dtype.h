// The one dtype table of optstate. Every format driver and the LibTorch bridge map through it.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace optstate {

// The float dtypes (is_float) are the state's (its entries and weights); the rest are what else a
// checkpoint holds beside it (a step count, 8-bit codes, a model's buffers: BatchNorm's int64 count,
// a bool mask, torchtitan's complex64 rotary table, an fp8 base model's frozen float8 weights and
// their e8m0 scales, NVFP4's packed pairs of float4), read and written as they are, never converted.
enum class DType : uint8_t {
  kF32, kBF16, kF16, kF64, kU8, kI8, kI32, kI64, kI16, kBool, kC64, kC128,
  kF8E4M3FN, kF8E5M2, kF8E4M3FNUZ, kF8E5M2FNUZ, kF8E8M0FNU, kU16, kU32, kU64, kF4E2M1FNX2
};

struct DTypeInfo {
  DType dtype;
  std::string_view name;              // canonical name in manifests and hashes ("f32")
  std::string_view safetensors_name;  // "F32"; empty where safetensors has none (complex128)
  std::string_view torch_name;        // "float32", as torch prints it without the "torch." prefix
  // "FloatStorage": the typed storage class torch.save pickles (_rebuild_tensor_v2); empty for the
  // dtypes torch gave none (float8, uint16..64), which it pickles as an UntypedStorage of bytes and
  // the dtype (_rebuild_tensor_v3)
  std::string_view torch_storage;
  uint8_t size;                       // bytes per element
  bool is_float;
};

const DTypeInfo& dtype_info(DType dtype);
inline std::string_view dtype_name(DType d) { return dtype_info(d).name; }
inline uint8_t dtype_size(DType d) { return dtype_info(d).size; }
std::optional<DType> dtype_from_name(std::string_view name);
std::optional<DType> dtype_from_safetensors(std::string_view name);
std::optional<DType> dtype_from_torch_name(std::string_view name);
std::optional<DType> dtype_from_torch_storage(std::string_view name);

// Exact widening of 16-bit floats to f32 (bf16 is the top half of an f32; f16 via IEEE rules).
float bf16_to_f32(uint16_t bits);
float f16_to_f32(uint16_t bits);
// Round-to-nearest-even narrowing, NaN kept quiet; the same rounding as torch's c10::BFloat16.
uint16_t f32_to_bf16(float value);
uint16_t f32_to_f16(float value);  // the same for IEEE half, as torch's c10::Half
// One element of `d` at `raw` (dtype_size(d) bytes, little-endian) as a double: what a 0-d tensor
// holding a Python number (a step, an lr) means. Nothing for the dtypes a number is not kept in.
std::optional<double> scalar_value(DType d, const std::byte* raw);

}  // namespace optstate
