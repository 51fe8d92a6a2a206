// Progress on stderr while a command reads a checkpoint (DESIGN §5: "progress on stderr when it is
// a terminal and the work is long"): shown once the work has run a second with stderr a terminal,
// redrawn in place at most 5 times a second, erased when done; stdout is never touched.
// OPTSTATE_PROGRESS=1 shows it always (a line per update when stderr is not a terminal), =0 never.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "optstate/checkpoint.h"

namespace optstate::cli {

class Progress {
 public:
  explicit Progress(std::string label);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void add_total(uint64_t bytes) { total_ += bytes; }
  void advance(uint64_t bytes);
  // Names the step under way (e.g. "writing DST", which reads SRC as it writes): shown at once if
  // progress is showing, then before the byte count.
  void phase(const std::string& what);
  // Erases the line (before the command prints its result); the destructor does it too.
  void finish();

 private:
  void draw(bool force);

  std::string label_, phase_;
  uint64_t total_ = 0, done_ = 0;
  bool enabled_ = false, forced_ = false, tty_ = false, drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

// Wraps a reader so the bytes it streams or reads advance `progress` (whose total grows by the
// reader's state size). Everything else is forwarded; `inner()` is the wrapped reader.
class ProgressReader final : public CheckpointReader {
 public:
  ProgressReader(std::unique_ptr<CheckpointReader> inner, Progress& progress);
  CheckpointReader& inner() { return *inner_; }

  std::string_view format() const override { return inner_->format(); }
  const std::filesystem::path& path() const override { return inner_->path(); }
  const OptimizerState& meta() const override { return inner_->meta(); }
  std::vector<std::string> not_read() const override { return inner_->not_read(); }
  std::vector<std::string> carried_not_read() const override { return inner_->carried_not_read(); }
  std::vector<std::string> read_notes() const override { return inner_->read_notes(); }
  std::string_view torchao_package() const override { return inner_->torchao_package(); }
  std::span<const AdamWFlags> adamw_flags() const override { return inner_->adamw_flags(); }
  std::span<const GroupExtras> group_extras() const override { return inner_->group_extras(); }
  std::span<const ModelTensorInfo> model_tensors() const override { return inner_->model_tensors(); }
  Status stream_model_tensor(size_t index, const ByteSink& sink) const override {
    return inner_->stream_model_tensor(index, sink);
  }
  bool checksummed() const override { return inner_->checksummed(); }
  std::optional<int64_t> ranks() const override { return inner_->ranks(); }
  std::string unchecked() const override { return inner_->unchecked(); }
  Status verify_shared_records() override { return inner_->verify_shared_records(); }
  Result<std::string> verify_file_digests() override { return inner_->verify_file_digests(); }
  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override;
  Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin, int64_t end,
                    std::span<std::byte> out) override;
  std::string locate(const std::string& fqn, const std::string& entry, Component c, int64_t index) const override {
    return inner_->locate(fqn, entry, c, index);
  }

 private:
  std::unique_ptr<CheckpointReader> inner_;
  Progress& progress_;
};

// open_checkpoint, with the reader's bytes counted by `progress`.
Result<std::unique_ptr<CheckpointReader>> open_with_progress(const std::filesystem::path& path, Progress& progress);

}  // namespace optstate::cli
