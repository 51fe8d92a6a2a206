#include "optstate/checkpoint.h"

#include "optstate/transform.h"

#include <fmt/format.h>

#include <cstring>

namespace optstate {
namespace {

class MemoryReader final : public CheckpointReader {
 public:
  MemoryReader(OptimizerState state, std::filesystem::path label)
      : state_(std::move(state)), label_(std::move(label)) {
    meta_ = state_;
    for (auto& [fqn, ps] : meta_.params)
      for (auto& [name, e] : ps.entries) e.values = e.codes = e.absmax = Buffer{};
  }
  std::string_view format() const override { return "memory"; }
  const std::filesystem::path& path() const override { return label_; }
  const OptimizerState& meta() const override { return meta_; }
  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    auto p = state_.params.find(fqn);
    if (p == state_.params.end()) return not_found(fmt::format("no param '{}'", fqn));
    auto e = p->second.entries.find(entry);
    if (e == p->second.entries.end()) return not_found(fmt::format("no entry '{}'", entry_key(fqn, entry)));
    std::span<const std::byte> bytes = e->second.buffer(c).span();
    for (size_t at = 0; at < bytes.size(); at += kStreamPieceBytes)
      OPTSTATE_RETURN_IF_ERROR(sink(bytes.subspan(at, std::min(kStreamPieceBytes, bytes.size() - at))));
    return Status::Ok();
  }

 private:
  OptimizerState state_, meta_;
  std::filesystem::path label_;
};

}  // namespace

std::unique_ptr<CheckpointReader> memory_reader(OptimizerState state, std::filesystem::path label) {
  return std::make_unique<MemoryReader>(std::move(state), std::move(label));
}

Status CheckpointReader::read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin,
                                    int64_t end, std::span<std::byte> out) {
  auto p = meta().params.find(fqn);
  if (p == meta().params.end()) return not_found(fmt::format("{}: no param '{}'", path().string(), fqn));
  auto e = p->second.entries.find(entry);
  if (e == p->second.entries.end())
    return not_found(fmt::format("{}: no entry '{}'", path().string(), entry_key(fqn, entry)));
  OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(p->second.shape));
  const int64_t elem = component_elem_size(e->second, c), count = component_count(e->second, c, numel);
  if (begin < 0 || end < begin || end > count || static_cast<int64_t>(out.size()) != (end - begin) * elem)
    return invalid_argument(fmt::format("range [{}, {}) of entry '{}' {} is outside [0, {}) or does not fit", begin,
                                        end, entry_key(fqn, entry), component_name(c), count));
  const uint64_t lo = static_cast<uint64_t>(begin * elem), hi = static_cast<uint64_t>(end * elem);
  uint64_t at = 0;
  return stream(fqn, entry, c, [&](std::span<const std::byte> piece) {
    const uint64_t a = std::max(at, lo), b = std::min(at + piece.size(), hi);
    if (a < b) std::memcpy(out.data() + (a - lo), piece.data() + (a - at), b - a);
    at += piece.size();
    return Status::Ok();
  });
}

Status write_checkpoint(const FormatDriver& driver, const OptimizerState& state, const std::filesystem::path& path,
                        const WriteOptions& options) {
  if (!options.dequantize) return driver.write(state, path, options);
  OPTSTATE_ASSIGN_OR_RETURN(OptimizerState dense, dequantize_state(state));
  return driver.write(dense, path, options);
}

Result<OptimizerState> load_all(CheckpointReader& reader) {
  OptimizerState out = reader.meta();
  for (auto& [fqn, ps] : out.params) {
    OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(ps.shape));
    for (auto& [name, e] : ps.entries) {
      for (Component c : e.components()) {
        const int64_t want = component_bytes(e, c, numel);
        const std::string key = entry_key(fqn, name);  // clang < 16 cannot capture a structured binding
        std::vector<std::byte> bytes;
        bytes.reserve(static_cast<size_t>(want));
        OPTSTATE_RETURN_IF_ERROR(reader.stream(fqn, name, c, [&](std::span<const std::byte> piece) {
          if (bytes.size() + piece.size() > static_cast<size_t>(want))
            return corrupt(fmt::format("{}: entry '{}' {} has more bytes than its shape allows",
                                       reader.path().string(), key, component_name(c)));
          bytes.insert(bytes.end(), piece.begin(), piece.end());
          return Status::Ok();
        }));
        if (static_cast<int64_t>(bytes.size()) != want)
          return corrupt(fmt::format("{}: entry '{}' {} has {} bytes, expected {}", reader.path().string(),
                                     key, component_name(c), bytes.size(), want));
        e.buffer(c) = Buffer::take(std::move(bytes));
      }
    }
  }
  return out;
}

}  // namespace optstate
