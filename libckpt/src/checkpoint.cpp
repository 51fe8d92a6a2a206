#include "optstate/checkpoint.h"

#include "optstate/io.h"
#include "optstate/transform.h"

#include <fmt/format.h>

#include <cstring>

namespace optstate {
namespace {

OptimizerState without_buffers(OptimizerState s) {
  for (auto& [fqn, ps] : s.params)
    for (auto& [name, e] : ps.entries) e.values = e.codes = e.absmax = Buffer{};
  return s;
}

class MemoryReader final : public CheckpointReader {
 public:
  MemoryReader(OptimizerState state, std::filesystem::path label)
      : state_(std::move(state)), meta_(without_buffers(state_)), label_(std::move(label)) {}
  std::string_view format() const override { return "memory"; }
  const std::filesystem::path& path() const override { return label_; }
  const OptimizerState& meta() const override { return meta_; }
  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    auto p = state_.params.find(fqn);
    if (p == state_.params.end()) return not_found(fmt::format("no param '{}'", fqn));
    auto e = p->second.entries.find(entry);
    if (e == p->second.entries.end()) return not_found(fmt::format("no entry '{}'", entry_key(fqn, entry)));
    return sink_pieces(e->second.buffer(c).span(), sink);
  }

 private:
  OptimizerState state_, meta_;
  std::filesystem::path label_;
};

}  // namespace

std::unique_ptr<CheckpointReader> memory_reader(OptimizerState state, std::filesystem::path label) {
  return std::make_unique<MemoryReader>(std::move(state), std::move(label));
}

Status CheckpointReader::stream_model_tensor(size_t index, const ByteSink&) const {
  return not_found(fmt::format("{}: no model tensor {}", path().string(), index));
}

Status stream_model_tensor_exactly(const CheckpointReader& reader, size_t index, const ByteSink& sink) {
  const std::span<const ModelTensorInfo> tensors = reader.model_tensors();
  if (index >= tensors.size()) return not_found(fmt::format("{}: no model tensor {}", reader.path().string(), index));
  const ModelTensorInfo& t = tensors[index];
  OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(t.shape));
  const uint64_t want = static_cast<uint64_t>(numel) * dtype_size(t.dtype);
  uint64_t got = 0;
  OPTSTATE_RETURN_IF_ERROR(reader.stream_model_tensor(index, [&](std::span<const std::byte> piece) -> Status {
    if (piece.size() > want - got)
      return corrupt(fmt::format("{}: model tensor '{}' holds more than its {} bytes", reader.path().string(), t.name,
                                 want));
    got += piece.size();
    return sink(piece);
  }));
  if (got != want)
    return corrupt(fmt::format("{}: model tensor '{}' holds {} of its {} bytes", reader.path().string(), t.name, got,
                               want));
  return Status::Ok();
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

namespace {

// Every component of `e` holds exactly the bytes a param of `numel` elements implies.
Status check_entry_bytes(const Entry& e, int64_t numel, const std::string& key) {
  for (Component c : e.components()) {
    const int64_t want = component_bytes(e, c, numel);
    if (static_cast<int64_t>(e.buffer(c).size) != want)
      return invalid_argument(fmt::format("entry '{}' {} holds {} bytes, its shape needs {}", key, component_name(c),
                                          e.buffer(c).size, want));
  }
  return Status::Ok();
}

const Entry* find_entry(const OptimizerState& s, const std::string& fqn, const std::string& name, int64_t* numel) {
  auto p = s.params.find(fqn);
  if (p == s.params.end()) return nullptr;
  auto e = p->second.entries.find(name);
  if (e == p->second.entries.end()) return nullptr;
  auto n = checked_numel(p->second.shape);
  if (!n.ok()) return nullptr;
  *numel = *n;
  return &e->second;
}

Status no_entry(const std::string& fqn, const std::string& name) {
  return not_found(fmt::format("no entry '{}' in the state being written", entry_key(fqn, name)));
}

// Streams one component of an entry into a buffer of exactly the size its shape implies.
Result<Buffer> read_component(CheckpointReader& reader, const std::string& fqn, const std::string& name,
                              const Entry& e, Component c, int64_t numel) {
  const int64_t want = component_bytes(e, c, numel);
  const std::string key = entry_key(fqn, name);
  std::span<std::byte> out;
  Buffer b = Buffer::allocate(static_cast<size_t>(want), &out);
  size_t at = 0;
  OPTSTATE_RETURN_IF_ERROR(reader.stream(fqn, name, c, [&](std::span<const std::byte> piece) {
    // A write streaming from this reader stops within a piece, not after a whole (maybe huge) entry.
    OPTSTATE_RETURN_IF_ERROR(check_interrupt(reader.path()));
    if (piece.size() > out.size() - at)
      return corrupt(fmt::format("{}: entry '{}' {} has more bytes than its shape allows", reader.path().string(), key,
                                 component_name(c)));
    std::memcpy(out.data() + at, piece.data(), piece.size());
    at += piece.size();
    return Status::Ok();
  }));
  if (at != out.size())
    return corrupt(fmt::format("{}: entry '{}' {} has {} bytes, expected {}", reader.path().string(), key,
                               component_name(c), at, want));
  return b;
}

class MemorySource final : public StateSource {
 public:
  explicit MemorySource(const OptimizerState& state) : state_(state), meta_(without_buffers(state)) {}
  const OptimizerState& meta() const override { return meta_; }
  Result<Entry> load(const std::string& fqn, const std::string& name) override {
    int64_t numel = 0;
    const Entry* e = find_entry(state_, fqn, name, &numel);
    if (!e) return no_entry(fqn, name);
    OPTSTATE_RETURN_IF_ERROR(check_entry_bytes(*e, numel, entry_key(fqn, name)));
    return *e;  // shares the buffers
  }

 private:
  const OptimizerState& state_;
  OptimizerState meta_;
};

class ReaderSource final : public StateSource {
 public:
  explicit ReaderSource(CheckpointReader& reader) : reader_(reader) {}
  const OptimizerState& meta() const override { return reader_.meta(); }
  Result<Entry> load(const std::string& fqn, const std::string& name) override {
    int64_t numel = 0;
    const Entry* m = find_entry(reader_.meta(), fqn, name, &numel);
    if (!m) return no_entry(fqn, name);
    Entry e = *m;
    for (Component c : e.components()) {
      OPTSTATE_ASSIGN_OR_RETURN(e.buffer(c), read_component(reader_, fqn, name, *m, c, numel));
    }
    return e;
  }

 private:
  CheckpointReader& reader_;
};

class RecodedSource final : public StateSource {
 public:
  RecodedSource(StateSource& inner, Recode how, const QuantizeOptions& q)
      : inner_(inner), how_(how), q_(q), meta_(inner.meta()) {
    for (auto& [fqn, ps] : meta_.params) {
      auto n = checked_numel(ps.shape);  // a bad shape fails the writer's check_structure
      const int64_t numel = n.ok() ? *n : 0;
      for (auto& [name, e] : ps.entries) e = recode_meta(name, e, numel, how, q);
    }
    if (how == Recode::kQuantize && has_blockwise8(meta_)) meta_.kind = "adamw8bit";
  }
  const OptimizerState& meta() const override { return meta_; }
  Result<Entry> load(const std::string& fqn, const std::string& name) override {
    OPTSTATE_RETURN_IF_ERROR(check_quantize_options(q_));
    OPTSTATE_ASSIGN_OR_RETURN(Entry e, inner_.load(fqn, name));
    int64_t numel = 0;
    if (!find_entry(inner_.meta(), fqn, name, &numel)) return no_entry(fqn, name);
    const std::string key = entry_key(fqn, name);
    OPTSTATE_RETURN_IF_ERROR(check_entry_bytes(e, numel, key));
    return recode_entry(name, e, numel, how_, q_, key);
  }

 private:
  StateSource& inner_;
  Recode how_;
  QuantizeOptions q_;
  OptimizerState meta_;
};

}  // namespace

std::unique_ptr<StateSource> memory_source(const OptimizerState& state) {
  return std::make_unique<MemorySource>(state);
}
std::unique_ptr<StateSource> reader_source(CheckpointReader& reader) { return std::make_unique<ReaderSource>(reader); }
std::unique_ptr<StateSource> recoded_source(StateSource& inner, Recode how, const QuantizeOptions& q) {
  return std::make_unique<RecodedSource>(inner, how, q);
}

Status write_checkpoint(const FormatDriver& driver, StateSource& source, const std::filesystem::path& path,
                        const WriteOptions& options) {
  if (!options.dequantize) return driver.write(source, path, options);
  auto dense = recoded_source(source, Recode::kDequantize);
  return driver.write(*dense, path, options);
}

Status write_checkpoint(const FormatDriver& driver, const OptimizerState& state, const std::filesystem::path& path,
                        const WriteOptions& options) {
  auto source = memory_source(state);
  return write_checkpoint(driver, *source, path, options);
}

Result<OptimizerState> load_all(CheckpointReader& reader) {
  OptimizerState out = reader.meta();
  for (auto& [fqn, ps] : out.params) {
    OPTSTATE_ASSIGN_OR_RETURN(int64_t numel, checked_numel(ps.shape));
    for (auto& [name, e] : ps.entries)
      for (Component c : e.components()) {
        OPTSTATE_ASSIGN_OR_RETURN(e.buffer(c), read_component(reader, fqn, name, e, c, numel));
      }
  }
  return out;
}

}  // namespace optstate
