// The torch.save fuzz targets' signer: an input with data.pkl's CRC-32 made right, so changes to
// the pickle reach the interpreter instead of stopping at the checksum.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "dcp/zip.h"

namespace optstate::torchsave {

inline void put_u32(std::string& s, uint64_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) s[at + i] = static_cast<char>(v >> (8 * i) & 0xff);
}

inline uint32_t get_u16(const std::string& s, uint64_t at) {
  return static_cast<uint8_t>(s[at]) | static_cast<uint32_t>(static_cast<uint8_t>(s[at + 1])) << 8;
}

// The input with data.pkl's CRC-32 set to that of its bytes, in its local header and its directory
// entry; nothing where the zip does not parse that far.
inline std::optional<std::string> with_pickle_crc(const std::string& in) {
  const auto bytes = std::as_bytes(std::span(in));
  const uint64_t n = in.size();
  auto cd = zip::find_central_directory(bytes.subspan(n - std::min<uint64_t>(n, zip::kMaxTailBytes)), n, "fuzz");
  if (!cd.ok() || cd->offset > n || cd->size > n - cd->offset) return std::nullopt;
  auto entries = zip::parse_central_directory(bytes.subspan(cd->offset, cd->size), *cd, "fuzz", /*allow_compressed=*/true);
  if (!entries.ok()) return std::nullopt;
  for (const zip::Entry& e : *entries) {
    if (!e.name.ends_with("/data.pkl") || e.local_header_offset > n || n - e.local_header_offset < 30) continue;
    auto at = zip::data_offset(bytes.subspan(e.local_header_offset, 30), e, cd->offset, "fuzz");
    if (!at.ok()) return std::nullopt;
    const uint32_t crc = zip::crc32(bytes.subspan(*at, e.size));
    std::string out = in;
    put_u32(out, e.local_header_offset + 14, crc);
    // Its directory entry: walk the records (46 fixed bytes, name, extra, comment) to the one named so.
    for (uint64_t p = cd->offset; p + 46 <= cd->offset + cd->size;) {
      const uint64_t name_len = get_u16(in, p + 28), next = p + 46 + name_len + get_u16(in, p + 30) + get_u16(in, p + 32);
      if (next > n) break;
      if (std::string_view(in).substr(p + 46, name_len) == e.name) put_u32(out, p + 16, crc);
      p = next;
    }
    return out;
  }
  return std::nullopt;
}

}  // namespace optstate::torchsave
