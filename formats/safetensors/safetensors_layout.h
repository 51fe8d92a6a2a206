// safetensors byte layout, as pure functions over byte spans (see FORMAT.md beside this file).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "optstate/dtype.h"
#include "optstate/status.h"

namespace optstate::safetensors {

inline constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // the safetensors reference limit

struct TensorInfo {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data buffer (after the header)
};

struct Header {
  std::map<std::string, std::string> metadata;  // __metadata__
  std::map<std::string, TensorInfo> tensors;
  uint64_t data_start = 0;  // 8 + header length
};

// The header length the first 8 bytes declare (little-endian u64), unchecked.
uint64_t declared_header_length(std::span<const std::byte, 8> first8);
// The header length from the first 8 bytes, checked against the file size and the cap.
Result<uint64_t> parse_header_length(std::span<const std::byte> first8, uint64_t file_size, const std::string& where);
// The JSON header. Every tensor's bytes lie in the data buffer of `data_size` bytes, match its
// dtype and shape, and together the tensors cover the buffer exactly: no holes, no overlaps.
Result<Header> parse_header(std::span<const std::byte> json_bytes, uint64_t data_size, const std::string& where);
// Whether a header of `json_bytes` (without its length prefix) stays within the cap every
// safetensors reader keeps; the error names the file and what the header holds.
Status check_header_size(uint64_t json_bytes, size_t tensors, size_t params, const std::string& where);
// A header for tensors laid out in the order given, padded with spaces to a multiple of 8,
// including its 8-byte length prefix.
std::string encode_header(const std::vector<std::pair<std::string, TensorInfo>>& tensors,
                          const std::map<std::string, std::string>& metadata);

}  // namespace optstate::safetensors
