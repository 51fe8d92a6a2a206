#pragma once

#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "optstate/checkpoint.h"
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

// A source whose load() throws once `good` entries have been loaded: a bug or std::bad_alloc in the
// middle of a write, which no Status reports. `state` is borrowed: it must outlive the source.
class ThrowingSource : public StateSource {
 public:
  ThrowingSource(const OptimizerState& state, int good) : inner_(memory_source(state)), good_(good) {}
  const OptimizerState& meta() const override { return inner_->meta(); }
  Result<Entry> load(const std::string& fqn, const std::string& name) override {
    if (loads_++ >= good_) throw std::runtime_error("boom in load(" + fqn + "." + name + ")");
    return inner_->load(fqn, name);
  }

 private:
  std::unique_ptr<StateSource> inner_;
  int good_, loads_ = 0;
};

}  // namespace optstate::testing
