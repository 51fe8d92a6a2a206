#include "optstate/dtype.h"

#include <array>
#include <cmath>
#include <cstring>

namespace optstate {
namespace {
constexpr std::array<DTypeInfo, 21> kTable{{
    {DType::kF32, "f32", "F32", "float32", "FloatStorage", 4, true},
    {DType::kBF16, "bf16", "BF16", "bfloat16", "BFloat16Storage", 2, true},
    {DType::kF16, "f16", "F16", "float16", "HalfStorage", 2, true},
    {DType::kF64, "f64", "F64", "float64", "DoubleStorage", 8, true},
    {DType::kU8, "u8", "U8", "uint8", "ByteStorage", 1, false},
    {DType::kI8, "i8", "I8", "int8", "CharStorage", 1, false},
    {DType::kI32, "i32", "I32", "int32", "IntStorage", 4, false},
    {DType::kI64, "i64", "I64", "int64", "LongStorage", 8, false},
    {DType::kI16, "i16", "I16", "int16", "ShortStorage", 2, false},
    {DType::kBool, "bool", "BOOL", "bool", "BoolStorage", 1, false},
    {DType::kC64, "c64", "C64", "complex64", "ComplexFloatStorage", 8, false},
    {DType::kC128, "c128", "", "complex128", "ComplexDoubleStorage", 16, false},
    {DType::kF8E4M3FN, "f8_e4m3fn", "F8_E4M3", "float8_e4m3fn", "", 1, false},
    {DType::kF8E5M2, "f8_e5m2", "F8_E5M2", "float8_e5m2", "", 1, false},
    {DType::kF8E4M3FNUZ, "f8_e4m3fnuz", "", "float8_e4m3fnuz", "", 1, false},
    {DType::kF8E5M2FNUZ, "f8_e5m2fnuz", "", "float8_e5m2fnuz", "", 1, false},
    {DType::kF8E8M0FNU, "f8_e8m0fnu", "F8_E8M0", "float8_e8m0fnu", "", 1, false},
    {DType::kU16, "u16", "U16", "uint16", "", 2, false},
    {DType::kU32, "u32", "U32", "uint32", "", 4, false},
    {DType::kU64, "u64", "U64", "uint64", "", 8, false},
    // one byte holds two float4s, and torch's shape counts the bytes; safetensors' F4 counts the
    // float4s, so the two name different shapes: none here
    {DType::kF4E2M1FNX2, "f4_e2m1fn_x2", "", "float4_e2m1fn_x2", "", 1, false},
}};
}  // namespace

const DTypeInfo& dtype_info(DType dtype) { return kTable[static_cast<size_t>(dtype)]; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& info : kTable)
    if (info.name == name) return info.dtype;
  return std::nullopt;
}
std::optional<DType> dtype_from_safetensors(std::string_view name) {
  for (const auto& info : kTable)
    if (!info.safetensors_name.empty() && info.safetensors_name == name) return info.dtype;
  return std::nullopt;
}
std::optional<DType> dtype_from_torch_name(std::string_view name) {
  if (name.substr(0, 6) == "torch.") name.remove_prefix(6);
  for (const auto& info : kTable)
    if (info.torch_name == name) return info.dtype;
  return std::nullopt;
}

std::optional<DType> dtype_from_torch_storage(std::string_view name) {
  for (const auto& info : kTable)
    if (!info.torch_storage.empty() && info.torch_storage == name) return info.dtype;
  return std::nullopt;
}

float bf16_to_f32(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, 4);
  return out;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float magnitude;
  if (exp == 0) {
    magnitude = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal, exact
  } else if (exp == 31) {
    magnitude = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -magnitude : magnitude;
}

uint16_t f32_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (std::isnan(value)) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t f32_to_f16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  if (std::isnan(value)) return sign | 0x7e00;
  const float a = std::fabs(value);
  if (a >= 65520.0f) return sign | 0x7c00;  // past the largest half (65504) by half an ulp or more
  if (a < 0x1p-14f) {  // a multiple of 2^-24 or between two: round the count (to even)
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p24f)));
  }
  const uint32_t mag = bits & 0x7fffffffu, mant = mag & 0x7fffffu;
  uint32_t h = (((mag >> 23) - 112u) << 10) | (mant >> 13);  // rebias 127 -> 15
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent, as it should
  return static_cast<uint16_t>(sign | h);
}

std::optional<double> scalar_value(DType d, const std::byte* raw) {
  switch (d) {
    case DType::kF32: { float f; std::memcpy(&f, raw, 4); return static_cast<double>(f); }
    case DType::kF64: { double v; std::memcpy(&v, raw, 8); return v; }
    case DType::kI64: { int64_t i; std::memcpy(&i, raw, 8); return static_cast<double>(i); }
    case DType::kI32: { int32_t i; std::memcpy(&i, raw, 4); return static_cast<double>(i); }
    case DType::kBF16: { uint16_t h; std::memcpy(&h, raw, 2); return static_cast<double>(bf16_to_f32(h)); }
    default: return std::nullopt;
  }
}

}  // namespace optstate
