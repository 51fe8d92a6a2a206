// The safetensors driver: one file, tensors named "<fqn>.<entry>" (8-bit entries as
// "<fqn>.<entry>.codes" and "<fqn>.<entry>.absmax"), the rest of the canonical state as JSON in
// __metadata__["optstate"]. Byte layout and mapping: FORMAT.md.
#include <fmt/format.h>

#include <algorithm>
#include <unordered_set>

#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "optstate/state_json.h"
#include "registry.h"
#include "safetensors_layout.h"

namespace optstate::safetensors {
namespace {

constexpr const char* kMetaKey = "optstate";

std::string tensor_name(const std::string& fqn, const std::string& entry, const Entry& e, Component c) {
  const std::string key = entry_key(fqn, entry);
  return e.encoding == Encoding::kDense ? key : key + "." + std::string(component_name(c));
}

DType component_dtype(const Entry& e, Component c) {
  return c == Component::kValues ? e.dtype : c == Component::kCodes ? DType::kU8 : DType::kF32;
}

std::vector<int64_t> component_shape(const ParamState& ps, const Entry& e, Component c) {
  if (c == Component::kAbsmax) return {component_count(e, c, *checked_numel(ps.shape))};
  return ps.shape;
}

class SafetensorsReader final : public CheckpointReader {
 public:
  SafetensorsReader(fs::path path, InputFile file, Header header, OptimizerState meta)
      : path_(std::move(path)), file_(std::move(file)), header_(std::move(header)), meta_(std::move(meta)) {}

  std::string_view format() const override { return "safetensors"; }
  const fs::path& path() const override { return path_; }
  const OptimizerState& meta() const override { return meta_; }

  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    OPTSTATE_ASSIGN_OR_RETURN(const TensorInfo* t, find(fqn, entry, c));
    for (uint64_t at = t->begin; at < t->end;) {
      const uint64_t n = std::min<uint64_t>(kStreamPieceBytes, t->end - at);
      const std::span<std::byte> piece = piece_.for_read(header_.data_start + at, n);
      OPTSTATE_RETURN_IF_ERROR(file_.read_at(header_.data_start + at, piece)
                                   .with_context(fmt::format("tensor '{}'", name_of(fqn, entry, c))));
      OPTSTATE_RETURN_IF_ERROR(sink(piece));
      at += n;
    }
    return Status::Ok();
  }

  Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin, int64_t end,
                    std::span<std::byte> out) override {
    OPTSTATE_ASSIGN_OR_RETURN(const TensorInfo* t, find(fqn, entry, c));
    const int64_t elem = dtype_size(t->dtype);
    const int64_t count = static_cast<int64_t>(t->end - t->begin) / elem;
    if (begin < 0 || end < begin || end > count || static_cast<int64_t>(out.size()) != (end - begin) * elem)
      return invalid_argument(fmt::format("{}: range [{}, {}) of tensor '{}' is outside [0, {}) or does not fit",
                                          path_.string(), begin, end, name_of(fqn, entry, c), count));
    return file_.read_at(header_.data_start + t->begin + static_cast<uint64_t>(begin * elem), out)
        .with_context(fmt::format("tensor '{}'", name_of(fqn, entry, c)));
  }

  std::string locate(const std::string& fqn, const std::string& entry, Component c, int64_t index) const override {
    auto it = header_.tensors.find(name_of(fqn, entry, c));
    if (it == header_.tensors.end()) return path_.string();
    return fmt::format("{} at byte {}", path_.string(),
                       header_.data_start + it->second.begin + index * dtype_size(it->second.dtype));
  }

 private:
  std::string name_of(const std::string& fqn, const std::string& entry, Component c) const {
    auto p = meta_.params.find(fqn);
    if (p == meta_.params.end()) return entry_key(fqn, entry);
    auto e = p->second.entries.find(entry);
    if (e == p->second.entries.end()) return entry_key(fqn, entry);
    return tensor_name(fqn, entry, e->second, c);
  }
  Result<const TensorInfo*> find(const std::string& fqn, const std::string& entry, Component c) const {
    auto it = header_.tensors.find(name_of(fqn, entry, c));
    if (it == header_.tensors.end())
      return not_found(fmt::format("{}: no tensor '{}'", path_.string(), name_of(fqn, entry, c)));
    return &it->second;
  }

  fs::path path_;
  InputFile file_;
  Header header_;
  OptimizerState meta_;
  ReadBuffer piece_;  // reused between tensors
};

class SafetensorsDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "safetensors"; }

  bool sniff(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) return false;
    auto f = InputFile::open(path);
    if (!f.ok() || f->size() < 9) return false;
    std::byte head[9];
    if (!f->read_at(0, head).ok()) return false;
    // Any length that fits the file: one over the cap is a safetensors file open() refuses by name.
    const uint64_t n = declared_header_length(std::span<const std::byte, 8>(head, 8));
    return n >= 2 && n <= f->size() - 8 && head[8] == std::byte{'{'};
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    const std::string where = path.string();
    OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(path));
    std::byte head[8];
    if (f.size() < 8) return corrupt(fmt::format("{}: too short for a safetensors file", where));
    OPTSTATE_RETURN_IF_ERROR(f.read_at(0, head));
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t n, parse_header_length(head, f.size(), where));
    std::vector<std::byte> json_bytes(n);
    OPTSTATE_RETURN_IF_ERROR(f.read_at(8, json_bytes));
    OPTSTATE_ASSIGN_OR_RETURN(Header h, parse_header(json_bytes, f.size() - 8 - n, where));
    auto meta_text = h.metadata.find(kMetaKey);
    if (meta_text == h.metadata.end())
      return corrupt(fmt::format("{}: a safetensors file without optstate metadata (__metadata__[\"{}\"]); "
                                 "it holds {} tensors but not the optimizer state's steps and hyperparameters",
                                 where, kMetaKey, h.tensors.size()));
    OPTSTATE_ASSIGN_OR_RETURN(OptimizerState meta, decode_state_meta(meta_text->second, where));
    // Every component the metadata names is a tensor of the right dtype and shape; nothing else is.
    std::unordered_set<std::string> described;
    for (const auto& [fqn, ps] : meta.params)
      for (const auto& [name, e] : ps.entries)
        for (Component c : e.components()) {
          const std::string tn = tensor_name(fqn, name, e, c);
          auto it = h.tensors.find(tn);
          if (it == h.tensors.end()) return corrupt(fmt::format("{}: tensor '{}' is missing", where, tn));
          const DType want = component_dtype(e, c);
          const auto shape = component_shape(ps, e, c);
          if (it->second.dtype != want || it->second.shape != shape)
            return corrupt(fmt::format("{}: tensor '{}' is {} {}, the metadata says {} {}", where, tn,
                                       dtype_name(it->second.dtype), format_shape(it->second.shape), dtype_name(want),
                                       format_shape(shape)));
          described.insert(tn);
        }
    if (described.size() != h.tensors.size())
      for (const auto& [tn, t] : h.tensors)
        if (!described.contains(tn))
          return corrupt(fmt::format("{}: tensor '{}' is not described by the optstate metadata", where, tn));
    return std::unique_ptr<CheckpointReader>(new SafetensorsReader(path, std::move(f), std::move(h), std::move(meta)));
  }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    const OptimizerState& meta = source.meta();
    OPTSTATE_RETURN_IF_ERROR(check_structure(meta, false));
    OPTSTATE_RETURN_IF_ERROR(check_json_numbers(meta).with_context(path.string()));
    OPTSTATE_RETURN_IF_ERROR(check_destination(path, options.overwrite));
    // The header holds every offset, so it is laid out from the metadata before any data is read.
    std::vector<std::pair<std::string, TensorInfo>> tensors;
    uint64_t at = 0;
    for (const auto& [fqn, ps] : meta.params) {
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
      for (const auto& [name, e] : ps.entries)
        for (Component c : e.components()) {
          TensorInfo t;
          t.dtype = component_dtype(e, c);
          t.shape = component_shape(ps, e, c);
          t.begin = at;
          t.end = at += static_cast<uint64_t>(component_bytes(e, c, numel));
          tensors.emplace_back(tensor_name(fqn, name, e, c), std::move(t));
        }
    }
    const std::string header = encode_header(tensors, {{kMetaKey, encode_state_meta(meta)}, {"format", "pt"}});
    // Refused before anything is written: a file no safetensors reader opens is no checkpoint.
    OPTSTATE_RETURN_IF_ERROR(check_header_size(header.size() - 8, tensors.size(), meta.params.size(), path.string()));
    OPTSTATE_ASSIGN_OR_RETURN(Staging staging, Staging::file(path));
    Status st = [&]() -> Status {
      OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(staging.path()));
      OPTSTATE_RETURN_IF_ERROR(out.write(std::as_bytes(std::span(header))));
      for (const auto& [fqn, ps] : meta.params)  // in the header's order
        for (const auto& [name, me] : ps.entries) {
          OPTSTATE_ASSIGN_OR_RETURN(const Entry e, source.load(fqn, name));
          for (Component c : me.components()) OPTSTATE_RETURN_IF_ERROR(out.write(e.buffer(c).span()));
        }
      return out.sync_and_close();
    }();
    return staging.commit(st, options.overwrite);
  }
};

}  // namespace

const FormatDriver& driver() {
  static const SafetensorsDriver d;
  return d;
}

}  // namespace optstate::safetensors
