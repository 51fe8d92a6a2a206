// The zip container of torch.save (stored entries, ZIP64 when large), as pure functions over byte
// spans: locating the central directory from an archive's tail, parsing it and local headers with
// every offset checked against the archive, and encoding headers for the DCP writer.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "optstate/status.h"

namespace optstate::zip {

// The tail a reader should hand to find_central_directory: EOCD (22) + max comment (65535) +
// ZIP64 locator (20) + ZIP64 EOCD record (56).
inline constexpr uint64_t kMaxTailBytes = 22 + 65535 + 20 + 56;
inline constexpr uint64_t kMaxEntries = 1u << 20;

struct CentralDirectory {
  uint64_t offset = 0, size = 0, count = 0;
};

struct Entry {
  std::string name;
  uint16_t method = 0;
  uint32_t crc32 = 0;
  uint64_t size = 0;                 // stored entries: compressed == uncompressed; else the bytes on disk
  uint64_t local_header_offset = 0;
};

// `tail` is the last bytes of an archive of `archive_size` bytes (tail.size() <= archive_size).
Result<CentralDirectory> find_central_directory(std::span<const std::byte> tail, uint64_t archive_size,
                                                const std::string& where);
// `bytes` is the central directory itself. Every entry must be stored (method 0), named once, and
// lie before the central directory. With `allow_compressed`, compressed entries are listed too
// (LibTorch's TorchScript archives deflate their code/ records, which optstate never reads); a
// caller that reads an entry checks that it is stored.
Result<std::vector<Entry>> parse_central_directory(std::span<const std::byte> bytes, const CentralDirectory& cd,
                                                   const std::string& where, bool allow_compressed = false);
// The offset of an entry's data from the 30 fixed bytes of its local header; checked against the
// central directory's offset (where the data must end).
Result<uint64_t> data_offset(std::span<const std::byte> local_header30, const Entry& e, uint64_t cd_offset,
                             const std::string& where);

// zip's CRC-32 of `bytes` continuing `crc`: carry-less multiplication where the CPU has it (x86-64
// PCLMULQDQ, ~10x faster), else crc32_table's slicing-by-8. The same values either way.
uint32_t crc32(std::span<const std::byte> bytes, uint32_t crc = 0);
uint32_t crc32_table(std::span<const std::byte> bytes, uint32_t crc = 0);
// A whole record's bytes against the CRC-32 its directory entry records (0: none recorded, as torch
// writes with torch.serialization.config.save.compute_crc32 off). `where` names the record.
Status check_record_crc(std::span<const std::byte> bytes, const Entry& e, const std::string& where);

// Writing: entries laid out one after another, data of each aligned to `align` bytes from the
// archive's start (torch aligns storages to 64 for mmap) through padding in the local header's
// extra field. Always ZIP64 records, so sizes need no second pass.
class Builder {
 public:
  // The local header for an entry whose data will follow; `at` is the archive offset where it starts.
  std::string local_header(const std::string& name, uint64_t size, uint32_t crc, uint64_t at, uint64_t align = 64);
  // Central directory + ZIP64 EOCD + locator + EOCD, to append after the last entry at `at`.
  std::string finish(uint64_t at) const;
  // The last entry's CRC-32, where it was streamed (its local header written with 0, then patched).
  void set_last_crc(uint32_t crc) { recs_.back().crc = crc; }
  // Where a local header's CRC-32 field lies, from the header's start.
  static constexpr uint64_t kLocalCrcOffset = 14;

 private:
  struct Rec {
    std::string name;
    uint64_t size, offset;
    uint32_t crc;
  };
  std::vector<Rec> recs_;
};

}  // namespace optstate::zip
