#pragma once

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "optstate/state.h"

namespace optstate::testing {

// A fresh directory under the system temp dir, removed when the object goes out of scope.
struct TempDir {
  std::filesystem::path path;
  TempDir();
  ~TempDir();
};

// A whole file's bytes (empty if it cannot be read), and a file replaced by `bytes`.
std::string read_file(const std::filesystem::path& path);
void write_file(const std::filesystem::path& path, const std::string& bytes);

Buffer f32_buffer(const std::vector<float>& values);
// A small two-param, two-group state with dense fp32 entries (and a bf16 weight entry).
OptimizerState sample_state();

}  // namespace optstate::testing
