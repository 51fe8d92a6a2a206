// The native checkpoint's manifest: parsed from and encoded to bytes, no file I/O here.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "optstate/checkpoint.h"

namespace optstate::native {

inline constexpr const char* kManifestName = "manifest.json";
inline constexpr const char* kFormatTag = "optstate-native";
inline constexpr int kManifestVersion = 1;
inline constexpr uint64_t kMaxManifestBytes = uint64_t{256} << 20;

struct DataFile {
  std::string rel_path;             // as written in the manifest, relative to the checkpoint
  uint64_t size = 0;                // declared size in bytes
  std::filesystem::path full_path;  // contained in the checkpoint directory (checked)
};

// A contiguous run [begin, end) of a component's flattened elements (or blocks, for absmax),
// stored at [offset, offset + length) of one data file.
struct Chunk {
  size_t file = 0;
  uint64_t offset = 0, length = 0;
  int64_t begin = 0, end = 0;
  uint64_t xxh3 = 0;
};

struct ChunkKey {
  std::string fqn, entry;
  Component component;
  bool operator<(const ChunkKey& o) const {
    return std::tie(fqn, entry, component) < std::tie(o.fqn, o.entry, o.component);
  }
};

struct Manifest {
  OptimizerState state;  // metadata only
  std::vector<DataFile> files;
  std::map<ChunkKey, std::vector<Chunk>> chunks;  // sorted by begin, covering each component once
};

// One rank's data file as written: its size and the chunks it holds (file index set by the caller).
struct RankFile {
  uint64_t size = 0;
  std::vector<std::pair<ChunkKey, Chunk>> chunks;
};

std::string rank_file_name(int rank);
// Writes one rank's data file from a local state (each buffer exactly the rank's range).
Result<RankFile> write_rank_file(const OptimizerState& local, const std::filesystem::path& staging, int world,
                                 int rank);
void add_rank_file(Manifest& m, const std::filesystem::path& staging, int rank, const RankFile& rf);
// A RankFile through the coordinator's store and back (JSON).
std::string encode_rank_file(const RankFile& rf);
Result<RankFile> decode_rank_file(const std::string& text);

// Validates everything that can be checked without the data: format tag and version, the manifest's
// own checksum, structure, paths contained in `dir`, chunk ranges inside their files and covering
// every element exactly once. Errors name the manifest and the offending entry.
Result<Manifest> parse_manifest(std::span<const std::byte> bytes, const std::filesystem::path& dir);
// Whether a manifest of `bytes` stays within what the reader takes (kMaxManifestBytes); the error
// names the checkpoint and its size. A writer checks before committing: a checkpoint its own
// reader refuses is no checkpoint.
Status check_manifest_size(uint64_t bytes, size_t params, const std::string& where);
// The manifest's text: nlohmann's dump(1) of it, sorted keys, its manifest_xxh3 the XXH3 of the
// compact dump() of the rest (DESIGN: the checksum a reader recomputes from the document it parsed).
std::string serialize_manifest(const Manifest& m);
// The same text made as one document and printed twice, the reference serialize_manifest equals byte
// for byte (tests and the fuzz driver hold it to that).
std::string serialize_manifest_as_one_document(const Manifest& m);
// For tests and the fuzz driver: the text with its manifest_xxh3 replaced by the value that matches
// its content, or nullopt when it is not a JSON object (or nests deeper than kMaxJsonDepth).
std::optional<std::string> resign_manifest_for_tests(const std::string& text);

}  // namespace optstate::native
