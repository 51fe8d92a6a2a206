// `optstate validate`: completeness, checksums and state sanity of a checkpoint, reported as a
// list of findings (each naming the file, entry and range where it can) instead of stopping at the
// first problem.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "optstate/checkpoint.h"

namespace optstate {

struct Finding {
  std::string entry;    // "<fqn>.<entry>", or "" for the checkpoint as a whole
  std::string message;  // names the file and the range where the problem is located
};

struct ValidationReport {
  std::vector<Finding> findings;
  int64_t entries_checked = 0;
  int64_t values_checked = 0;
  bool checksums_verified = false;  // the format stores checksums and every chunk matched (CheckpointReader::checksummed)
  std::string unchecked;            // otherwise what they leave unchecked (CheckpointReader::unchecked)
  std::string file_digests;         // whole-file digests verified, "" if none (CheckpointReader::verify_file_digests)
  bool ok() const { return findings.empty(); }
};

// Opens with `open` (a format's reader) and checks everything. A checkpoint that cannot be opened
// because its own bytes are wrong (manifest, sizes, paths) is a finding; the Result fails only
// when there is nothing to validate (no such path, not a checkpoint at all).
using OpenFn = std::function<Result<std::unique_ptr<CheckpointReader>>(const std::filesystem::path&)>;
Result<ValidationReport> validate_checkpoint(const std::filesystem::path& path, const OpenFn& open);

}  // namespace optstate
