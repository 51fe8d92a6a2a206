#include "progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "registry.h"

namespace optstate::cli {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kQuietFor = std::chrono::seconds(1);          // short work shows nothing
constexpr auto kRedrawEvery = std::chrono::milliseconds(200);

std::string bytes_text(uint64_t b) {
  const double d = static_cast<double>(b);
  if (b >= (uint64_t{1} << 30)) return fmt::format("{:.2f} GiB", d / (1 << 30));
  if (b >= (uint64_t{1} << 20)) return fmt::format("{:.1f} MiB", d / (1 << 20));
  return fmt::format("{:.1f} KiB", d / (1 << 10));
}

}  // namespace

Progress::Progress(std::string label) : label_(std::move(label)), start_(Clock::now()), last_(start_) {
  tty_ = isatty(STDERR_FILENO) == 1;
  const char* env = std::getenv("OPTSTATE_PROGRESS");
  forced_ = env && std::strcmp(env, "1") == 0;
  enabled_ = forced_ || (tty_ && !(env && std::strcmp(env, "0") == 0));
}

Progress::~Progress() { finish(); }

void Progress::finish() {
  if (drawn_ && tty_) std::fputs("\r\x1b[K", stderr);  // erase: the command's own output follows
  drawn_ = false;
  enabled_ = false;
}

void Progress::advance(uint64_t bytes) {
  done_ += bytes;
  draw(false);
}

void Progress::phase(const std::string& what) {
  phase_ = what;
  draw(true);
}

void Progress::draw(bool force) {
  if (!enabled_) return;
  const auto now = Clock::now();
  if (!forced_ && now - start_ < kQuietFor) return;
  const bool complete = total_ > 0 && done_ >= total_;
  if (!force && !complete && drawn_ && now - last_ < kRedrawEvery) return;
  last_ = now;
  std::string line = phase_.empty() ? label_ : fmt::format("{}: {}", label_, phase_);
  if (phase_.empty() || done_ > 0) {  // a phase that reads (convert's write streams SRC) shows the bytes too
    const double secs = std::chrono::duration<double>(now - start_).count();
    line += fmt::format(": read {} of {} ({:.0f}%), {}/s", bytes_text(done_), bytes_text(total_),
                        total_ ? std::min(100.0, 100.0 * static_cast<double>(done_) / static_cast<double>(total_))
                               : 100.0,
                        bytes_text(secs > 0 ? static_cast<uint64_t>(static_cast<double>(done_) / secs) : 0));
  }
  if (tty_) std::fprintf(stderr, "\r\x1b[K%s", line.c_str());
  else std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

ProgressReader::ProgressReader(std::unique_ptr<CheckpointReader> inner, Progress& progress)
    : inner_(std::move(inner)), progress_(progress) {
  for (const std::string& note : inner_->located_notes()) add_located_note(note);
  uint64_t total = 0;
  for (const auto& [fqn, ps] : inner_->meta().params) {
    const auto numel = checked_numel(ps.shape);
    if (!numel.ok()) continue;
    for (const auto& [name, e] : ps.entries)
      for (Component c : e.components()) total += static_cast<uint64_t>(component_bytes(e, c, *numel));
  }
  progress_.add_total(total);
}

Status ProgressReader::stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) {
  return inner_->stream(fqn, entry, c, [&](std::span<const std::byte> piece) {
    progress_.advance(piece.size());
    return sink(piece);
  });
}

Status ProgressReader::read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin,
                                  int64_t end, std::span<std::byte> out) {
  OPTSTATE_RETURN_IF_ERROR(inner_->read_range(fqn, entry, c, begin, end, out));
  progress_.advance(out.size());
  return Status::Ok();
}

Result<std::unique_ptr<CheckpointReader>> open_with_progress(const std::filesystem::path& path, Progress& progress) {
  OPTSTATE_ASSIGN_OR_RETURN(auto reader, open_checkpoint(path));
  return std::unique_ptr<CheckpointReader>(std::make_unique<ProgressReader>(std::move(reader), progress));
}

}  // namespace optstate::cli
