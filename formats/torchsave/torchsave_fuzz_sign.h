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

inline uint32_t get_u32(const std::string& s, uint64_t at) { return get_u16(s, at) | get_u16(s, at + 2) << 16; }

// Sets, in `out`, the CRC-32 of the entries of the archive at out[begin, end) that `pick` names to
// that of their bytes, in their local headers (or data descriptors) and directory entries. false
// where the zip does not parse that far (nothing changed then).
inline bool resign_archive(std::string& out, uint64_t begin, uint64_t end, bool (*pick)(std::string_view)) {
  const std::string in = out.substr(begin, end - begin);  // offsets in a record count from its start
  const auto bytes = std::as_bytes(std::span(in));
  const uint64_t n = in.size();
  auto cd = zip::find_central_directory(bytes.subspan(n - std::min<uint64_t>(n, zip::kMaxTailBytes)), n, "fuzz");
  if (!cd.ok() || cd->offset > n || cd->size > n - cd->offset) return false;
  auto entries = zip::parse_central_directory(bytes.subspan(cd->offset, cd->size), *cd, "fuzz", /*allow_compressed=*/true);
  if (!entries.ok()) return false;
  bool any = false;
  for (const zip::Entry& e : *entries) {
    if (!pick(e.name) || e.local_header_offset > n || n - e.local_header_offset < 30) continue;
    auto at = zip::data_offset(bytes.subspan(e.local_header_offset, 30), e, cd->offset, "fuzz");
    if (!at.ok()) continue;
    const uint32_t crc = zip::crc32(bytes.subspan(*at, e.size));
    // The local header holds it, or, with flag bit 3 (torch's writer sets it), the data descriptor
    // after the data does (its signature optional) and the local header holds 0.
    if (!(get_u16(in, e.local_header_offset + 6) & 8)) {
      put_u32(out, begin + e.local_header_offset + 14, crc);
    } else if (const uint64_t dd = *at + e.size; dd <= n && n - dd >= 8) {
      put_u32(out, begin + dd + (in.compare(dd, 4, "PK\x07\x08") == 0 ? 4 : 0), crc);
    }
    // Its directory entry: walk the records (46 fixed bytes, name, extra, comment) to the one named so.
    for (uint64_t p = cd->offset; p + 46 <= cd->offset + cd->size;) {
      const uint64_t name_len = get_u16(in, p + 28), next = p + 46 + name_len + get_u16(in, p + 30) + get_u16(in, p + 32);
      if (next > n) break;
      if (std::string_view(in).substr(p + 46, name_len) == e.name) put_u32(out, begin + p + 16, crc);
      p = next;
    }
    any = true;
  }
  return any;
}

// The input with data.pkl's CRC-32 set to that of its bytes, where the zip keeps it (resign_archive);
// nothing where the zip does not parse that far.
inline std::optional<std::string> with_pickle_crc(const std::string& in) {
  std::string out = in;
  if (!resign_archive(out, 0, in.size(), [](std::string_view name) { return name.ends_with("/data.pkl"); }))
    return std::nullopt;
  return out;
}

// A DCP data file (torch.save records one after another: each tensor's, each bytes item's that
// holds one) with every entry of every record re-signed, data.pkl and the storages, so changes to
// a record's pickle or values reach the reader instead of stopping at a CRC-32. A record ends at
// its end-of-central-directory record and starts where the one before ended, or, where a change
// moved that, where its directory's offset and size say (before a ZIP64 locator and record if it
// has them); a signature that is no record's (inside a tensor's bytes) is passed over. Returns how
// many records were re-signed.
inline size_t resign_records(std::string& out) {
  const std::string in = out;
  size_t records = 0;
  uint64_t begin = 0;
  const auto all = [](std::string_view) { return true; };
  for (size_t e = in.find("PK\x05\x06"); e != std::string::npos && e + 22 <= in.size(); e = in.find("PK\x05\x06", e + 4)) {
    const uint64_t end = e + 22 + get_u16(in, e + 20), dir = uint64_t{get_u32(in, e + 12)} + get_u32(in, e + 16);
    if (end > in.size()) break;
    bool done = resign_archive(out, begin, end, all);
    for (const uint64_t tail : {uint64_t{0}, uint64_t{20 + 56}})  // the EOCD alone, or after ZIP64's
      if (!done && e >= dir + tail && e - dir - tail != begin) done = resign_archive(out, e - dir - tail, end, all);
    if (done) {
      ++records;
      begin = end;
    }
  }
  return records;
}

inline std::optional<std::string> with_record_crcs(const std::string& in) {
  std::string out = in;
  if (resign_records(out) == 0) return std::nullopt;
  return out;
}

}  // namespace optstate::torchsave
