// The DCP driver's zip CRC-32: the carry-less-multiplication path (x86-64 PCLMULQDQ) and the
// table-driven one give zip's CRC-32 for every length and alignment. The end records of a hostile
// archive: offsets that wrap.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <vector>

#include "dcp/zip.h"

using namespace optstate;

TEST_CASE("zip crc32: the check value, and the folded path equal to the table for any length, offset and start") {
  const std::string_view check = "123456789";
  CHECK(zip::crc32(std::as_bytes(std::span(check))) == 0xcbf43926u);
  CHECK(zip::crc32_table(std::as_bytes(std::span(check))) == 0xcbf43926u);
  CHECK(zip::crc32({}) == 0u);
  std::mt19937_64 rng(3);
  std::vector<std::byte> buf(1 << 16);
  for (auto& b : buf) b = static_cast<std::byte>(rng());
  int64_t mismatches = 0;
  for (size_t n = 0; n <= 1100; ++n)
    for (size_t off : {size_t{0}, size_t{1}, size_t{7}, size_t{13}}) {
      const std::span<const std::byte> s(buf.data() + off, n);
      const uint32_t start = n % 3 == 0 ? 0u : static_cast<uint32_t>(rng());
      mismatches += zip::crc32(s, start) != zip::crc32_table(s, start);
    }
  // in pieces, as the DCP reader streams a record: the same as in one go
  uint32_t pieces = 0;
  for (size_t at = 0; at < buf.size(); at += 4099)
    pieces = zip::crc32(std::span(buf).subspan(at, std::min<size_t>(4099, buf.size() - at)), pieces);
  CHECK(pieces == zip::crc32_table(buf));
  CHECK(mismatches == 0);
}

TEST_CASE("zip: a ZIP64 locator whose end-record offset wraps past 2^64 is refused, not read before the buffer") {
  // A ZIP64 locator (20 bytes) then an end record whose entry count says "see ZIP64": the locator
  // names its record at 2^64 - 8, so `rec + 56` wraps to 48 and once passed the range check
  // (libFuzzer, fuzz_torchsave_file: a read 8 bytes before the tail).
  std::vector<std::byte> tail;
  auto put = [&](uint64_t v, int n) {
    for (int k = 0; k < n; ++k) tail.push_back(static_cast<std::byte>(k < 8 ? v >> (8 * k) & 0xff : 0));
  };
  put(0, 72);                                 // room where a record could be
  put(0x07064b50, 4);                         // ZIP64 end-of-central-directory locator
  put(0, 4);                                  // its disk
  put(0xfffffffffffffff8ull, 8);              // the end record's offset
  put(1, 4);                                  // disks
  put(0x06054b50, 4);                         // end of central directory
  put(0, 6);                                  // disks, entries on this disk
  put(0xffff, 2);                             // entries: in the ZIP64 record
  put(0, 4);                                  // directory size
  put(0, 4);                                  // directory offset
  put(0, 2);                                  // comment length
  const auto cd = zip::find_central_directory(tail, tail.size(), "hostile.pt");
  REQUIRE_FALSE(cd.ok());
  CHECK(cd.status().message().find("ZIP64 end record at 18446744073709551608 lies outside") != std::string::npos);
}
