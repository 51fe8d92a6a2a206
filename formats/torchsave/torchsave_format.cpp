// The torch.save driver: one zip file (torch's serialization format) holding an optimizer
// state_dict — `optimizer.pt` of Hugging Face's Trainer, `torch.save(opt.state_dict(), ...)` of a
// plain loop, torchao's AdamW8bit state with its OptimState8bit subclass — read without Python,
// torch or torchao. Written back as torch.optim.AdamW's state_dict (8-bit moments dequantized), which
// `torch.load` + `optimizer.load_state_dict` take. Byte layout and mapping: FORMAT.md.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "dcp/dcp_driver.h"
#include "dcp/zip.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "optstate/quant8.h"
#include "registry.h"
#include "torchsave_layout.h"

namespace optstate::torchsave {
namespace {

constexpr uint64_t kMaxPickleBytes = uint64_t{64} << 20;

// Where a tensor's bytes lie in the file, and the CRC-32 of its storage record where the tensor is
// the whole storage (torch's tensors are; a view of part of a storage cannot be checked alone).
struct Stored {
  uint64_t at = 0, bytes = 0;
  uint32_t crc = 0;
  bool whole = false;
  bool checked() const { return whole && crc != 0; }
};

using Key = std::tuple<std::string, std::string, Component>;

class TorchSaveReader final : public CheckpointReader {
 public:
  TorchSaveReader(fs::path path, InputFile file) : path_(std::move(path)), file_(std::move(file)) {}

  std::string_view format() const override { return "torchsave"; }
  const fs::path& path() const override { return path_; }
  const OptimizerState& meta() const override { return meta_; }
  std::vector<std::string> not_read() const override { return not_read_; }
  bool checksummed() const override { return checksummed_; }

  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    OPTSTATE_ASSIGN_OR_RETURN(const Stored* s, find(fqn, entry, c));
    uint32_t crc = 0;
    for (uint64_t done = 0; done < s->bytes;) {
      const uint64_t n = std::min<uint64_t>(kStreamPieceBytes, s->bytes - done);
      const std::span<std::byte> piece = piece_.for_read(s->at + done, n);
      OPTSTATE_RETURN_IF_ERROR(file_.read_at(s->at + done, piece).with_context(name_of(fqn, entry, c)));
      if (s->checked()) crc = zip::crc32(piece, crc);
      OPTSTATE_RETURN_IF_ERROR(sink(piece));
      done += n;
    }
    if (s->checked() && crc != s->crc)
      return corrupt(fmt::format("{}: {}: CRC-32 of its storage is {:08x}, the archive records {:08x}", path_.string(),
                                 name_of(fqn, entry, c), crc, s->crc));
    return Status::Ok();
  }

  Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin, int64_t end,
                    std::span<std::byte> out) override {
    OPTSTATE_ASSIGN_OR_RETURN(const Stored* s, find(fqn, entry, c));
    const Entry& e = meta_.params.at(fqn).entries.at(entry);
    const int64_t elem = component_elem_size(e, c);
    const auto count = static_cast<int64_t>(s->bytes) / elem;
    if (begin < 0 || end < begin || end > count || static_cast<int64_t>(out.size()) != (end - begin) * elem)
      return invalid_argument(fmt::format("{}: range [{}, {}) of {} is outside [0, {}) or does not fit", path_.string(),
                                          begin, end, name_of(fqn, entry, c), count));
    if (s->checked() && begin == 0 && end == count) return CheckpointReader::read_range(fqn, entry, c, begin, end, out);
    return file_.read_at(s->at + static_cast<uint64_t>(begin * elem), out).with_context(name_of(fqn, entry, c));
  }

  std::string locate(const std::string& fqn, const std::string& entry, Component c, int64_t index) const override {
    auto it = stored_.find({fqn, entry, c});
    if (it == stored_.end()) return path_.string();
    const Entry& e = meta_.params.at(fqn).entries.at(entry);
    return fmt::format("{} at byte {}", path_.string(), it->second.at + index * component_elem_size(e, c));
  }

  Status init() {
    const std::string where = path_.string();
    dcp::StorageLoc whole;
    whole.length = file_.size();
    OPTSTATE_ASSIGN_OR_RETURN(dcp::ArchiveIndex index, dcp::read_archive_index(file_, whole, where));
    // data.pkl names the archive's folder; every storage is <folder>/data/<key>.
    std::string prefix;
    const zip::Entry* pkl = nullptr;
    for (const zip::Entry& e : index.entries) {
      const auto slash = e.name.find('/');
      if (slash != std::string::npos && e.name.substr(slash) == "/data.pkl") {
        if (pkl) return corrupt(where + ": two data.pkl records; not one torch.save archive");
        pkl = &e;
        prefix = e.name.substr(0, slash);
      }
      entries_.emplace(e.name, &e - index.entries.data());
    }
    if (!pkl) return corrupt(where + ": a zip file, but not a torch.save archive (no <folder>/data.pkl)");
    if (pkl->size > kMaxPickleBytes) return corrupt(fmt::format("{}: data.pkl of {} bytes is too large", where, pkl->size));
    index_ = std::move(index);
    pkl = &index_.entries[entries_.at(prefix + "/data.pkl")];
    OPTSTATE_ASSIGN_OR_RETURN(const uint64_t pkl_at, data_at(*pkl, where));
    std::vector<std::byte> pb(pkl->size);
    OPTSTATE_RETURN_IF_ERROR(file_.read_at(pkl_at, pb).with_context(where));
    // data.pkl holds the hyperparameters and often the steps: its CRC-32 is their only check.
    OPTSTATE_RETURN_IF_ERROR(zip::check_record_crc(pb, *pkl, where));
    OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(pb, where + " data.pkl"));
    OPTSTATE_ASSIGN_OR_RETURN(StateDict sd, interpret_state_dict(p, where));
    prefix_ = prefix;
    not_read_ = std::move(sd.not_read);

    meta_.kind = sd.eight ? "adamw8bit" : "adamw";
    for (size_t g = 0; g < sd.groups.size(); ++g) {
      ParamGroup group;
      group.hyper = sd.groups[g].hyper;
      OPTSTATE_ASSIGN_OR_RETURN(group.hyper.lr, value_of(sd.groups[g].lr, fmt::format("{} param group {} 'lr'", where, g)));
      group.params = std::move(sd.groups[g].params);
      meta_.groups.push_back(std::move(group));
    }
    for (const ParamSpec& spec : sd.params) {
      const std::string pw = fmt::format("{} param '{}'", where, spec.fqn);
      ParamState ps;
      ps.shape = spec.shape;
      ps.group = spec.group;
      OPTSTATE_ASSIGN_OR_RETURN(const double step, value_of(spec.step, pw + " 'step'"));
      if (!(step >= 0 && step < 9.2e18) || step != std::floor(step))
        return corrupt(fmt::format("{}: step {} is not a count", pw, step));
      ps.step = static_cast<int64_t>(step);
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
      for (const auto& [name, es] : spec.entries) {
        const std::string ew = fmt::format("{} '{}'", pw, name);
        Entry e;
        e.encoding = es.encoding;
        if (es.encoding == Encoding::kDense) {
          e.dtype = es.values.dtype;
          OPTSTATE_RETURN_IF_ERROR(add(spec.fqn, name, Component::kValues, es.values, numel, ew));
        } else {
          e.dtype = DType::kU8;
          e.block_size = es.block_size;
          if (es.qmap) {
            OPTSTATE_ASSIGN_OR_RETURN(e.qmap, map_name(*es.qmap, ew));
          } else {
            e.qmap = es.qmap_name;
          }
          OPTSTATE_RETURN_IF_ERROR(add(spec.fqn, name, Component::kCodes, es.codes, numel, ew));
          OPTSTATE_RETURN_IF_ERROR(
              add(spec.fqn, name, Component::kAbsmax, es.absmax, (numel + e.block_size - 1) / e.block_size, ew + " scales"));
        }
        ps.entries.emplace(name, std::move(e));
      }
      if (spec.weight) {
        Entry w;
        w.dtype = spec.weight->dtype;
        ps.param_dtype = w.dtype;
        OPTSTATE_RETURN_IF_ERROR(add(spec.fqn, kParam, Component::kValues, *spec.weight, numel,
                                     fmt::format("{} ['model']['{}']", where, spec.fqn)));
        ps.entries.emplace(kParam, std::move(w));
      }
      meta_.params.emplace(spec.fqn, std::move(ps));
    }
    OPTSTATE_RETURN_IF_ERROR(check_structure(meta_, false).with_context(where));
    checksummed_ = std::all_of(stored_.begin(), stored_.end(), [](const auto& kv) { return kv.second.checked(); });
    return Status::Ok();
  }

 private:
  // The offset of a record's data: past its local header, which is checked against the directory.
  Result<uint64_t> data_at(const zip::Entry& e, const std::string& where) const {
    std::byte h[30];
    if (e.local_header_offset > file_.size() || file_.size() - e.local_header_offset < sizeof h)
      return corrupt(fmt::format("{}: record '{}' starts past the end of the file", where, e.name));
    OPTSTATE_RETURN_IF_ERROR(file_.read_at(e.local_header_offset, h).with_context(where));
    return zip::data_offset(h, e, index_.cd.offset, where);
  }

  // Where a tensor's `count` elements lie: its storage record, checked to hold them.
  Result<Stored> resolve(const dcp::TensorRef& t, int64_t count, const std::string& where) const {
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(t.shape));
    if (numel != count)
      return corrupt(fmt::format("{}: {} elements where {} are needed", where, numel, count));
    const std::string name = prefix_ + "/data/" + t.storage_key;
    auto it = entries_.find(name);
    if (it == entries_.end()) return corrupt(fmt::format("{}: storage '{}' is missing from the archive", where, name));
    const zip::Entry& e = index_.entries[it->second];
    const auto elem = static_cast<uint64_t>(dtype_size(t.dtype));
    if (e.size / elem < static_cast<uint64_t>(t.storage_numel))
      return corrupt(fmt::format("{}: storage '{}' holds {} bytes, less than its {} elements of {}", where, name, e.size,
                                 t.storage_numel, dtype_name(t.dtype)));
    Stored s;
    OPTSTATE_ASSIGN_OR_RETURN(const uint64_t at, data_at(e, where));
    s.at = at + static_cast<uint64_t>(t.offset) * elem;
    s.bytes = static_cast<uint64_t>(numel) * elem;
    s.crc = e.crc32;
    s.whole = t.offset == 0 && s.bytes == e.size;
    return s;
  }

  Status add(const std::string& fqn, const std::string& entry, Component c, const dcp::TensorRef& t, int64_t count,
             const std::string& where) {
    OPTSTATE_ASSIGN_OR_RETURN(Stored s, resolve(t, count, where));
    stored_.emplace(Key{fqn, entry, c}, s);
    return Status::Ok();
  }

  Result<double> value_of(const Scalar& s, const std::string& where) const {
    if (s.number) return *s.number;
    const dcp::TensorRef& t = *s.tensor;
    OPTSTATE_ASSIGN_OR_RETURN(const Stored st, resolve(t, 1, where));
    std::byte raw[8];
    if (st.bytes > sizeof raw) return corrupt(fmt::format("{}: a {} tensor where a number is needed", where, dtype_name(t.dtype)));
    OPTSTATE_RETURN_IF_ERROR(file_.read_at(st.at, std::span(raw, st.bytes)).with_context(where));
    if (const auto v = scalar_value(t.dtype, raw)) return *v;
    return corrupt(fmt::format("{}: a {} tensor where a number is needed", where, dtype_name(t.dtype)));
  }

  Result<std::string> map_name(const dcp::TensorRef& q, const std::string& where) const {
    if (q.dtype != DType::kF32) return corrupt(where + ": quantization map is not float32");
    OPTSTATE_ASSIGN_OR_RETURN(const Stored st, resolve(q, 256, where + " quantization map"));
    std::array<float, 256> m;
    OPTSTATE_RETURN_IF_ERROR(file_.read_at(st.at, std::as_writable_bytes(std::span(m))).with_context(where));
    if (const auto k = qmap_matching(m)) return std::string(qmap_name(*k));
    return corrupt(where + ": quantization map is neither the dynamic signed nor the unsigned one");
  }

  std::string name_of(const std::string& fqn, const std::string& entry, Component c) const {
    auto p = meta_.params.find(fqn);
    const bool eight = p != meta_.params.end() && p->second.entries.count(entry) &&
                       p->second.entries.at(entry).encoding == Encoding::kBlockwise8;
    return fmt::format("tensor '{}'{}", entry_key(fqn, entry), eight ? fmt::format(" ({})", component_name(c)) : "");
  }

  Result<const Stored*> find(const std::string& fqn, const std::string& entry, Component c) const {
    auto it = stored_.find({fqn, entry, c});
    if (it == stored_.end()) return not_found(fmt::format("{}: no {}", path_.string(), name_of(fqn, entry, c)));
    return &it->second;
  }

  fs::path path_;
  InputFile file_;
  dcp::ArchiveIndex index_;
  std::map<std::string, size_t> entries_;  // record name -> index_.entries
  std::string prefix_;
  OptimizerState meta_;
  std::vector<std::string> not_read_;
  std::map<Key, Stored> stored_;
  bool checksummed_ = false;
  ReadBuffer piece_;  // reused between tensors
};

// The state as torch.optim.AdamW holds it: every entry dense, 8-bit moments as fp32.
OptimizerState dense_view(const OptimizerState& meta) {
  OptimizerState out = meta;
  for (auto& [fqn, ps] : out.params)
    for (auto& [name, e] : ps.entries)
      if (e.encoding == Encoding::kBlockwise8) {
        e.encoding = Encoding::kDense;
        e.dtype = DType::kF32;
        e.block_size = 0;
        e.qmap.clear();
      }
  return out;
}

class TorchSaveDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "torchsave"; }

  // A zip whose first record is <folder>/data.pkl: torch.save writes data.pkl first.
  bool sniff(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) return false;
    auto f = InputFile::open(path);
    if (!f.ok() || f->size() < 30) return false;
    std::byte h[30 + 256];
    const size_t n = static_cast<size_t>(std::min<uint64_t>(sizeof h, f->size()));
    if (!f->read_at(0, std::span(h, n)).ok()) return false;
    if (std::memcmp(h, "PK\x03\x04", 4) != 0) return false;
    const size_t name_len = static_cast<size_t>(h[26]) | static_cast<size_t>(h[27]) << 8;
    if (name_len < 9 || 30 + name_len > n) return false;
    const std::string_view name(reinterpret_cast<const char*>(h + 30), name_len);
    return name.ends_with("/data.pkl");
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(path));
    auto reader = std::make_unique<TorchSaveReader>(path, std::move(f));
    OPTSTATE_RETURN_IF_ERROR(reader->init());
    return std::unique_ptr<CheckpointReader>(std::move(reader));
  }

  bool keeps_blockwise8() const override { return false; }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    const OptimizerState& meta = source.meta();
    OPTSTATE_RETURN_IF_ERROR(check_structure(meta, false));
    const std::vector<std::string> order = param_order(meta);
    if (order.size() != meta.params.size() || std::set(order.begin(), order.end()).size() != order.size())
      return invalid_argument("torchsave: every param must be in exactly one param group (torch numbers them by it)");
    // Storage keys in the order the data is written: per param, its weights, step and moments.
    StorageKeys keys;
    for (size_t i = 0; i < order.size(); ++i) {
      const ParamState& ps = meta.params.at(order[i]);
      const auto id = static_cast<int64_t>(i);
      for (const auto& [name, e] : ps.entries)
        if (name != kParam && name != kExpAvg && name != kExpAvgSq && name != kMaxExpAvgSq)
          return invalid_argument(fmt::format("param '{}': entry '{}' has no place in torch.optim.AdamW's state", order[i], name));
      if (ps.entries.count(kParam)) keys.key[{id, kParam}] = std::to_string(keys.key.size());
      if (!ps.entries.count(kExpAvg)) {
        if (ps.entries.size() > ps.entries.count(kParam))
          return invalid_argument(fmt::format("param '{}': moments without exp_avg", order[i]));
        continue;
      }
      // torch.optim.AdamW keeps the step as a float32 tensor: exact up to 2^24 (where its own
      // counter stops); a larger one would be rounded, so it is refused instead.
      if (ps.step > (int64_t{1} << 24))
        return invalid_argument(fmt::format("param '{}': step {} is beyond what torch.optim.AdamW's float32 step "
                                            "holds exactly (2^24)", order[i], ps.step));
      keys.key[{id, "step"}] = std::to_string(keys.key.size());
      for (const char* m : {kExpAvg, kExpAvgSq, kMaxExpAvgSq})
        if (ps.entries.count(m)) keys.key[{id, m}] = std::to_string(keys.key.size());
    }
    const std::string pkl = encode_state_dict(dense_view(meta), keys);
    OPTSTATE_RETURN_IF_ERROR(check_destination(path, options.overwrite));
    OPTSTATE_ASSIGN_OR_RETURN(fs::path staging, make_staging_path(path));
    Status st = [&]() -> Status {
      OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(staging));
      dcp::ArchiveWriter archive(out);
      OPTSTATE_RETURN_IF_ERROR(archive.begin(std::as_bytes(std::span(pkl))));
      for (size_t i = 0; i < order.size(); ++i) {
        const std::string& fqn = order[i];
        const ParamState& ps = meta.params.at(fqn);
        const auto id = static_cast<int64_t>(i);
        OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
        auto entry = [&](const char* name) -> Status {
          if (!ps.entries.count(name)) return Status::Ok();
          OPTSTATE_ASSIGN_OR_RETURN(const Entry e, source.load(fqn, name));
          if (e.encoding == Encoding::kDense) return archive.storage(keys.key.at({id, name}), e.values.span());
          OPTSTATE_ASSIGN_OR_RETURN(QMap m, qmap_from_name(e.qmap));
          std::vector<float> dq(static_cast<size_t>(numel));
          dequantize_blockwise({reinterpret_cast<const uint8_t*>(e.codes.data), e.codes.size},
                               {reinterpret_cast<const float*>(e.absmax.data), e.absmax.size / 4}, e.block_size, m, dq);
          return archive.storage(keys.key.at({id, name}), std::as_bytes(std::span(dq)));
        };
        OPTSTATE_RETURN_IF_ERROR(entry(kParam));
        if (!ps.entries.count(kExpAvg)) continue;
        const float step = static_cast<float>(ps.step);
        OPTSTATE_RETURN_IF_ERROR(archive.storage(keys.key.at({id, "step"}), std::as_bytes(std::span(&step, 1))));
        for (const char* m : {kExpAvg, kExpAvgSq, kMaxExpAvgSq}) OPTSTATE_RETURN_IF_ERROR(entry(m));
      }
      OPTSTATE_RETURN_IF_ERROR(archive.finish().status());
      OPTSTATE_RETURN_IF_ERROR(out.sync_and_close());
      return publish_file(staging, path, options.overwrite);
    }();
    return st.ok() ? st : abandon_staging(staging, path, st);
  }
};

}  // namespace

const FormatDriver& driver() {
  static const TorchSaveDriver d;
  return d;
}

}  // namespace optstate::torchsave
