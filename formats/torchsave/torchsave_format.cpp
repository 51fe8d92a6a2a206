// The torch.save driver: one zip file (torch's serialization format) holding an optimizer
// state_dict — `optimizer.pt` of Hugging Face's Trainer, `torch.save(opt.state_dict(), ...)` of a
// plain loop, torchao's AdamW8bit state with its OptimState8bit subclass — read without Python,
// torch or torchao. Written back as torch.optim.AdamW's state_dict (8-bit moments dequantized), which
// `torch.load` + `optimizer.load_state_dict` take. Byte layout and mapping: FORMAT.md.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <numeric>
#include <set>

#include "dcp/bnb_state.h"
#include "dcp/chunks.h"
#include "dcp/dcp_driver.h"
#include "dcp/megatron.h"
#include "dcp/zip.h"
#include "deepspeed/deepspeed_flat.h"
#include "megatron/megatron_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "torchsave_archive.h"
#include "torchsave_reader.h"
#include "torchsave_planner.h"
#include "torchsave_ranks.h"
#include "optstate/quant8.h"
#include "optstate/transform.h"
#include "registry.h"
#include "torchsave_layout.h"

namespace optstate::torchsave {
namespace {

constexpr uint64_t kMaxPickleBytes = uint64_t{64} << 20;
// A dense tensor stored permuted (channels_last, transposed) is put in logical order in memory: its
// storage record is read whole, up to this size (conv weights are far smaller).
constexpr uint64_t kMaxPermutedBytes = uint64_t{1} << 30;

std::optional<int64_t> zero_layer_name(const std::string& name);  // below, with the ZeRO file names

}  // namespace

// Opens a torch.save archive and interprets its data.pkl (CRC-checked: it holds the
// hyperparameters and often the steps, and this is their only check).
Result<std::pair<Archive, pickle::Pickle>> open_archive(const fs::path& path) {
  const std::string where = path.string();
  OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(path));
  Archive a{path, std::move(f), {}, {}, {}};
  dcp::StorageLoc whole;
  whole.length = a.file.size();
  // LibTorch's TorchScript archives deflate their code/ records (never read here); the records
  // that are read, data.pkl and the storages, must be stored.
  OPTSTATE_ASSIGN_OR_RETURN(a.index, dcp::read_archive_index(a.file, whole, where, /*allow_compressed=*/true));
  a.index.tail = {};  // the bytes read to find the directory: not needed again (a reader of many ranks keeps an archive each)
  // data.pkl names the archive's folder; every storage is <folder>/data/<key>.
  const zip::Entry* pkl = nullptr;
  for (const zip::Entry& e : a.index.entries) {
    const auto slash = e.name.find('/');
    if (e.method != 0 && slash != std::string::npos &&
        (e.name.substr(slash) == "/data.pkl" || e.name.compare(slash, 6, "/data/") == 0))
      return corrupt(fmt::format("{}: zip entry '{}' is compressed (method {}); torch.save stores entries", where,
                                 e.name, e.method));
    if (slash != std::string::npos && e.name.substr(slash) == "/data.pkl") {
      if (pkl) return corrupt(where + ": two data.pkl records; not one torch.save archive");
      pkl = &e;
      a.prefix = e.name.substr(0, slash);
    }
    a.entries.emplace(e.name, &e - a.index.entries.data());
  }
  if (!pkl) return corrupt(where + ": a zip file, but not a torch.save archive (no <folder>/data.pkl)");
  if (pkl->size > kMaxPickleBytes) return corrupt(fmt::format("{}: data.pkl of {} bytes is too large", where, pkl->size));
  OPTSTATE_ASSIGN_OR_RETURN(const uint64_t pkl_at, a.data_at(*pkl));
  std::vector<std::byte> pb(pkl->size);
  OPTSTATE_RETURN_IF_ERROR(a.file.read_at(pkl_at, pb).with_context(where));
  OPTSTATE_RETURN_IF_ERROR(zip::check_record_crc(pb, *pkl, where));
  OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(pb, where + " data.pkl"));
  return std::pair{std::move(a), std::move(p)};
}

Result<std::vector<std::byte>> read_storage(const Archive& a, const std::string& key) {
  const std::string name = a.prefix + "/data/" + key;
  const auto it = a.entries.find(name);
  if (it == a.entries.end()) return corrupt(fmt::format("{}: storage '{}' is missing from the archive", a.path.string(), name));
  const zip::Entry& e = a.index.entries[it->second];
  if (e.size > a.file.size()) return corrupt(fmt::format("{}: storage '{}' is larger than the file", a.path.string(), name));
  OPTSTATE_ASSIGN_OR_RETURN(const uint64_t at, a.data_at(e));
  std::vector<std::byte> bytes(e.size);
  OPTSTATE_RETURN_IF_ERROR(a.file.read_at(at, bytes).with_context(a.path.string()));
  OPTSTATE_RETURN_IF_ERROR(zip::check_record_crc(bytes, e, fmt::format("{}: storage '{}'", a.path.string(), name)));
  return bytes;
}

namespace {

// A whole tensor of archive `a` as float32, as torch's .float() gives it: floats widened (f64
// rounded), integers rounded to nearest. Read with its whole storage record, CRC-32 checked.
Result<std::vector<float>> tensor_f32(const Archive& a, const dcp::TensorRef& t, const std::string& where) {
  OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(t.shape));
  auto read = read_storage(a, t.storage_key);
  if (!read.ok()) return read.status().with_context(where);
  const std::vector<std::byte>& record = *read;
  const auto elem = static_cast<uint64_t>(dtype_size(t.dtype));
  const uint64_t held = record.size() / elem;
  if (t.offset < 0 || static_cast<uint64_t>(t.offset) > held || static_cast<uint64_t>(numel) > held - t.offset)
    return corrupt(fmt::format("{}: storage '{}' holds {} bytes, too few for {} elements of {} at {}", where,
                               t.storage_key, record.size(), numel, dtype_name(t.dtype), t.offset));
  std::span<const std::byte> values =
      std::span(record).subspan(static_cast<size_t>(t.offset) * elem, static_cast<size_t>(numel) * elem);
  std::vector<std::byte> logical;
  if (t.permuted()) {
    logical.resize(values.size());
    dcp::to_logical_order(t, static_cast<int64_t>(elem), values, logical);
    values = logical;
  }
  if (dtype_info(t.dtype).is_float) return dense_to_f32(values, t.dtype, where);
  std::vector<float> out(static_cast<size_t>(numel));
  for (size_t i = 0; i < out.size(); ++i) {
    const std::byte* v = values.data() + i * elem;
    switch (t.dtype) {
      case DType::kU8: out[i] = static_cast<float>(std::to_integer<uint8_t>(*v)); break;
      case DType::kI8: out[i] = static_cast<float>(static_cast<int8_t>(std::to_integer<uint8_t>(*v))); break;
      case DType::kI32: { int32_t x; std::memcpy(&x, v, 4); out[i] = static_cast<float>(x); break; }
      case DType::kI64: { int64_t x; std::memcpy(&x, v, 8); out[i] = static_cast<float>(x); break; }
      default: return corrupt(fmt::format("{}: a {} tensor", where, dtype_name(t.dtype)));
    }
  }
  return out;
}

// Where a run of a tensor's bytes lies: its archive, offset and length, and its storage record with
// the CRC-32 torch.save stored for it. Reading the run checks that CRC where the run is all of its
// tensor and the rest of the record is no larger than the run (read too, for the check): torch's
// own tensors fill their records; FSDP2's sharded params are views into padded storages. A small
// view of a large storage, or one row-run of a column-sharded DTensor, is not checked.
struct Stored {
  size_t file = 0;
  uint64_t at = 0, bytes = 0;
  uint64_t record_at = 0, record_bytes = 0;
  uint32_t crc = 0;
  bool whole = false;  // the run is all of its tensor
  bool checked() const { return whole && crc != 0 && record_bytes - bytes <= bytes; }
  // A dense tensor stored permuted (channels_last, transposed): `at`/`bytes` are all of its
  // elements, in storage order; the run is its logical elements from `permuted_local` on.
  std::shared_ptr<const dcp::TensorRef> permuted;
  int64_t permuted_local = 0;
};

// 8-bit codes read as fp32 values: a rank's part that torchao quantized as its own tensor (blocks
// of that part) where the entry cannot be blockwise8 as a whole (other ranks' parts plain, or
// blocks that do not fall on the global tensor's).
struct Dequant {
  Stored scales;      // all of the part's scales
  int64_t local = 0;  // the run's first element within the part
  int64_t block = 0;
  const std::array<float, 256>* table = nullptr;  // the map's values, or float8_e4m3fn's (torchao's fp8)
  int bits = 8;                                   // 4: two codes a byte (torchao's 4-bit)
};

// A run of consecutive flat elements of a component (blocks, for absmax), stored consecutively;
// with `dq`, stored as 8-bit codes (`stored` is the run's codes) and read as fp32 values.
struct Piece {
  int64_t begin = 0, count = 0;
  Stored stored;
  std::optional<Dequant> dq;
};

// One rank's part of a tensor: its bytes in that rank's file and, for a DTensor, its placement;
// with `scales`, the part is 8-bit codes (`tensor`) read as fp32 values.
struct Part {
  Part(size_t file, dcp::TensorRef tensor, const std::optional<DTensorSpec>* dtensor,
       std::optional<dcp::TensorRef> scales = std::nullopt, int64_t block = 0,
       const std::array<float, 256>* table = nullptr, int bits = 8)
      : file(file), tensor(std::move(tensor)), dtensor(dtensor), scales(std::move(scales)), block(block), table(table),
        bits(bits) {}
  size_t file;
  dcp::TensorRef tensor;
  const std::optional<DTensorSpec>* dtensor;
  std::optional<dcp::TensorRef> scales;
  int64_t block;
  const std::array<float, 256>* table;  // with scales: how codes decode
  int bits;                             // with scales: 8, or 4 (two codes a byte)
};

// The pieces of a component, and the part each came from.
struct Placed {
  std::vector<Piece> pieces;
  std::vector<size_t> of;
};

// A directory of per-rank torch.save files, <prefix><rank>.pt (verl's
// optim_world_size_8_rank_3.pt, with model_world_size_8_rank_3.pt beside it): FSDP2's
// optimizer.state_dict() and model.state_dict() of DTensors, saved by every rank.
using Key = std::tuple<std::string, std::string, Component>;

bool numbered(const std::string& name, int64_t id) { return name == std::to_string(id); }

class TorchSaveReader final : public CheckpointReader {
 public:
  explicit TorchSaveReader(fs::path path) : path_(std::move(path)) {}

  // A LibTorch archive is read here (the same zip, pickle and tensors) for formats/libtorch/,
  // bitsandbytes' state_dict for formats/bitsandbytes/ and one file of torchao's for formats/torchao/.
  std::string_view format() const override {
    return libtorch_     ? "libtorch"
           : bnb_        ? "bitsandbytes"
           : torchao_    ? "torchao"
           : deepspeed_  ? "deepspeed"
           : megatron_   ? "megatron"
           : nanotron_   ? "nanotron"
                         : "torchsave";
  }
  const fs::path& path() const override { return path_; }
  const OptimizerState& meta() const override { return meta_; }
  std::vector<std::string> not_read() const override {
    std::vector<std::string> out = not_read_;
    out.insert(out.end(), encoding_notes_.begin(), encoding_notes_.end());
    out.insert(out.end(), uncarried_notes_.begin(), uncarried_notes_.end());
    return out;
  }
  std::vector<std::string> carried_not_read() const override { return not_read_; }
  bool checksummed() const override { return checksummed_ || shared_verified_; }
  const FsdpSet* fsdp() const { return fsdp_ ? &*fsdp_ : nullptr; }
  bool carries_rest() const { return carries_rest_; }
  std::vector<std::string> read_notes() const override { return value_notes_; }
  std::string_view torchao_package() const override { return torchao_package_; }
  std::span<const AdamWFlags> adamw_flags() const override { return adamw_flags_; }
  std::span<const GroupExtras> group_extras() const override { return group_extras_; }
  std::span<const ModelTensorInfo> model_tensors() const override { return model_tensors_; }
  std::optional<bool> bnb_nested() const { return bnb_nested_; }

  // Read with buffers of its own (const: a writer holds its source as const), the record's CRC-32
  // checked as the state's runs are.
  Status stream_model_tensor(size_t index, const ByteSink& sink) const override {
    if (index >= model_stored_.size())
      return not_found(fmt::format("{}: no model tensor {}", path_.string(), index));
    const Stored& s = model_stored_[index].first;  // not a structured binding: clang 14 cannot capture one
    const Archive& a = files_[s.file];
    const std::string where = fmt::format("{}: {}", a.path.string(), model_stored_[index].second);
    std::vector<std::byte> buf;
    auto read = [&](uint64_t at, uint64_t n) -> Result<std::span<const std::byte>> {
      buf.resize(static_cast<size_t>(n));
      OPTSTATE_RETURN_IF_ERROR(a.file.read_at(at, buf).with_context(where));
      return std::span<const std::byte>(buf);
    };
    auto crc_of = [&](uint64_t from, uint64_t to, uint32_t crc) -> Result<uint32_t> {
      for (uint64_t at = from; at < to;) {
        const uint64_t n = std::min<uint64_t>(kStreamPieceBytes, to - at);
        OPTSTATE_ASSIGN_OR_RETURN(const auto piece, read(at, n));
        crc = zip::crc32(piece, crc);
        at += n;
      }
      return crc;
    };
    auto check = [&](uint32_t crc) -> Status {
      if (crc == s.crc) return Status::Ok();
      return corrupt(fmt::format("{}: CRC-32 of its storage is {:08x}, the archive records {:08x}", where, crc, s.crc));
    };
    if (s.permuted) {  // stored permuted (channels_last): its record read whole, put in logical order
      const dcp::TensorRef& t = *s.permuted;
      if (s.record_bytes > kMaxPermutedBytes)
        return corrupt(fmt::format("{}: a tensor stored permuted in a storage of {} bytes; up to {} are read", where,
                                   s.record_bytes, kMaxPermutedBytes));
      OPTSTATE_ASSIGN_OR_RETURN(const auto record, read(s.record_at, s.record_bytes));
      if (s.crc != 0) OPTSTATE_RETURN_IF_ERROR(check(zip::crc32(record)));
      std::vector<std::byte> logical(static_cast<size_t>(s.bytes));
      dcp::to_logical_order(t, dtype_size(t.dtype), record.subspan(static_cast<size_t>(s.at - s.record_at),
                                                                   static_cast<size_t>(s.bytes)), logical);
      return sink_pieces(logical, sink);
    }
    uint32_t crc = 0;
    if (s.checked()) {
      OPTSTATE_ASSIGN_OR_RETURN(crc, crc_of(s.record_at, s.at, 0));
    }
    for (uint64_t done = 0; done < s.bytes;) {
      const uint64_t n = std::min<uint64_t>(kStreamPieceBytes, s.bytes - done);
      OPTSTATE_ASSIGN_OR_RETURN(const auto piece, read(s.at + done, n));
      if (s.checked()) crc = zip::crc32(piece, crc);
      OPTSTATE_RETURN_IF_ERROR(sink(piece));
      done += n;
    }
    if (!s.checked()) return Status::Ok();
    OPTSTATE_ASSIGN_OR_RETURN(crc, crc_of(s.at + s.bytes, s.record_at + s.record_bytes, crc));
    return check(crc);
  }

  Status verify_shared_records() override {
    std::set<std::pair<size_t, uint64_t>> done;  // (file, record): each read once
    bool all = true;
    std::vector<std::pair<Key, const std::vector<Piece>*>> runs;
    for (const auto& [key, pieces] : stored_) runs.emplace_back(key, &pieces);
    for (const ZeroCopy& copy : zero_copies_) runs.emplace_back(Key{copy.fqn, copy.entry, Component::kValues}, &copy.pieces);
    for (const auto& [key, pieces] : runs)
      for (const Piece& pc : *pieces) {
        const Stored& s = pc.stored;
        if (s.checked()) continue;
        if (s.crc == 0) {  // none recorded (compute_crc32 off)
          all = false;
          continue;
        }
        if (!done.emplace(s.file, s.record_at).second) continue;
        const auto& [fqn, entry, c] = key;
        OPTSTATE_ASSIGN_OR_RETURN(const uint32_t crc, record_crc(s.file, s.record_at, s.record_at + s.record_bytes, 0,
                                                                 fqn, entry, c));
        if (crc != s.crc)
          return corrupt(fmt::format("{}: CRC-32 of the storage holding {} is {:08x}, the archive records {:08x}",
                                     files_[s.file].path.string(), name_of(fqn, entry, c), crc, s.crc));
      }
    shared_verified_ = all;
    return compare_tied_copies();
  }

  // Elements held twice (ZeroCopy: a pipeline's tied module in a later stage, a block several
  // tensor-parallel ranks hold): each copy's runs against the elements read there, window by window.
  Status compare_tied_copies() {
    constexpr int64_t kWindow = int64_t{1} << 20;  // elements
    std::vector<std::byte> a, b;
    for (const ZeroCopy& copy : zero_copies_) {
      OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Piece>* read, find(copy.fqn, copy.entry, Component::kValues));
      for (const Piece& pc : copy.pieces)
        for (int64_t at = pc.begin; at < pc.begin + pc.count; at += kWindow) {
          const int64_t to = std::min(pc.begin + pc.count, at + kWindow);
          a.resize(static_cast<size_t>((to - at) * 4));
          b.resize(a.size());
          OPTSTATE_RETURN_IF_ERROR(read_pieces(*read, 4, copy.fqn, copy.entry, Component::kValues, at, to, a));
          OPTSTATE_RETURN_IF_ERROR(read_pieces({pc}, 4, copy.fqn, copy.entry, Component::kValues, at, to, b));
          if (a == b) continue;
          size_t i = 0;
          while (std::memcmp(&a[i * 4], &b[i * 4], 4) == 0) ++i;
          float x, y;
          std::memcpy(&x, &a[i * 4], 4);
          std::memcpy(&y, &b[i * 4], 4);
          return corrupt(fmt::format("'{}' {}: {} {}'s copy differs from the copy read at element {} ({} and {}, {})",
                                     copy.fqn, copy.entry, tensor_parallel_ ? "tensor-parallel rank" : "pipeline stage",
                                     copy.stage, at + static_cast<int64_t>(i), y, x,
                                     files_[pc.stored.file].path.string()));
        }
    }
    return Status::Ok();
  }

  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Piece>* pieces, find(fqn, entry, c));
    for (const Piece& pc : *pieces) {
      if (pc.dq) {
        OPTSTATE_RETURN_IF_ERROR(dequantized(pc, 0, pc.count, fqn, entry, c, sink));
        continue;
      }
      const Stored& s = pc.stored;
      if (s.permuted) {
        OPTSTATE_RETURN_IF_ERROR(permuted_run(s, 0, pc.count, fqn, entry, c, sink));
        continue;
      }
      const Archive& a = files_[s.file];
      OPTSTATE_ASSIGN_OR_RETURN(uint32_t crc, record_prefix_crc(s, fqn, entry, c));
      for (uint64_t done = 0; done < s.bytes;) {
        const uint64_t n = std::min<uint64_t>(kStreamPieceBytes, s.bytes - done);
        const std::span<std::byte> piece = piece_.for_read(s.at + done, n);
        OPTSTATE_RETURN_IF_ERROR(a.file.read_at(s.at + done, piece).with_context(where_of(s, fqn, entry, c)));
        if (s.checked()) crc = zip::crc32(piece, crc);
        OPTSTATE_RETURN_IF_ERROR(sink(piece));
        done += n;
      }
      OPTSTATE_RETURN_IF_ERROR(check_crc(s, crc, fqn, entry, c));
    }
    return Status::Ok();
  }

  Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin, int64_t end,
                    std::span<std::byte> out) override {
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Piece>* pieces, find(fqn, entry, c));
    const Entry& e = meta_.params.at(fqn).entries.at(entry);
    const int64_t elem = component_elem_size(e, c);
    const int64_t count = pieces->empty() ? 0 : pieces->back().begin + pieces->back().count;
    if (begin < 0 || end < begin || end > count || static_cast<int64_t>(out.size()) != (end - begin) * elem)
      return invalid_argument(fmt::format("{}: range [{}, {}) of {} is outside [0, {}) or does not fit", path_.string(),
                                          begin, end, name_of(fqn, entry, c), count));
    return read_pieces(*pieces, elem, fqn, entry, c, begin, end, out);
  }

  // Elements [begin, end) of the run `pieces` (in range) into `out`.
  Status read_pieces(const std::vector<Piece>& pieces, int64_t elem, const std::string& fqn, const std::string& entry,
                     Component c, int64_t begin, int64_t end, std::span<std::byte> out) {
    for (const Piece& pc : pieces) {
      const int64_t a = std::max(begin, pc.begin), b = std::min(end, pc.begin + pc.count);
      if (a >= b) continue;
      const Stored& s = pc.stored;
      const auto dst = out.subspan(static_cast<size_t>((a - begin) * elem), static_cast<size_t>((b - a) * elem));
      if (pc.dq) {
        OPTSTATE_RETURN_IF_ERROR(dequantized(pc, a - pc.begin, b - pc.begin, fqn, entry, c, filling(dst)));
        continue;
      }
      if (s.permuted) {
        OPTSTATE_RETURN_IF_ERROR(permuted_run(s, a - pc.begin, b - pc.begin, fqn, entry, c, filling(dst)));
        continue;
      }
      OPTSTATE_RETURN_IF_ERROR(files_[s.file]
                                   .file.read_at(s.at + static_cast<uint64_t>((a - pc.begin) * elem), dst)
                                   .with_context(where_of(s, fqn, entry, c)));
      // A read of all of a tensor is checked as it is read.
      if (a == pc.begin && b == pc.begin + pc.count && s.checked()) {
        OPTSTATE_ASSIGN_OR_RETURN(const uint32_t prefix, record_prefix_crc(s, fqn, entry, c));
        OPTSTATE_RETURN_IF_ERROR(check_crc(s, zip::crc32(dst, prefix), fqn, entry, c));
      }
    }
    return Status::Ok();
  }

  std::string locate(const std::string& fqn, const std::string& entry, Component c, int64_t index) const override {
    auto it = stored_.find({fqn, entry, c});
    if (it == stored_.end()) return path_.string();
    const Entry& e = meta_.params.at(fqn).entries.at(entry);
    for (const Piece& pc : it->second)
      if (index >= pc.begin && index < pc.begin + pc.count)
        return fmt::format("{} at byte {}", files_[pc.stored.file].path.string(),
                           pc.stored.at + (index - pc.begin) * component_elem_size(e, c));
    return path_.string();
  }

  // Elements [from, to) of a run of a tensor stored permuted, through `sink`: its storage record is
  // read whole (and checked against its CRC-32), its elements put in logical order once and kept
  // for the next run of it.
  Status permuted_run(const Stored& s, int64_t from, int64_t to, const std::string& fqn, const std::string& entry,
                      Component c, const ByteSink& sink) {
    const dcp::TensorRef& t = *s.permuted;
    const auto elem = static_cast<size_t>(dtype_size(t.dtype));
    if (permuted_.ref != s.permuted.get()) {
      const std::string where = where_of(s, fqn, entry, c);
      if (s.record_bytes > kMaxPermutedBytes)
        return corrupt(fmt::format("{}: a tensor stored permuted (strides {}) in a storage of {} bytes; up to {} are "
                                   "read", where, fmt::join(t.stride, ", "), s.record_bytes, kMaxPermutedBytes));
      std::vector<std::byte> record(s.record_bytes);
      OPTSTATE_RETURN_IF_ERROR(files_[s.file].file.read_at(s.record_at, record).with_context(where));
      if (s.crc != 0 && zip::crc32(record) != s.crc)
        return corrupt(fmt::format("{}: CRC-32 of its storage is {:08x}, the archive records {:08x}", where,
                                   zip::crc32(record), s.crc));
      permuted_.bytes.resize(s.bytes);
      dcp::to_logical_order(t, static_cast<int64_t>(elem), std::span(record).subspan(s.at - s.record_at, s.bytes),
                            permuted_.bytes);
      permuted_.ref = s.permuted.get();
    }
    return sink_pieces(std::span<const std::byte>(permuted_.bytes)
                           .subspan(static_cast<size_t>(s.permuted_local + from) * elem,
                                    static_cast<size_t>(to - from) * elem),
                       sink);
  }

  // Elements [from, to) of a dequantized piece as fp32 bytes, in bounded pieces. The part's
  // scales are read whole (a 256th of its codes) and checked; the codes' CRC-32 is checked where
  // the run is their whole record and read whole.
  Status dequantized(const Piece& pc, int64_t from, int64_t to, const std::string& fqn, const std::string& entry,
                     Component c, const ByteSink& sink) {
    const Dequant& dq = *pc.dq;
    std::vector<float> scales(dq.scales.bytes / 4);
    OPTSTATE_RETURN_IF_ERROR(files_[dq.scales.file]
                                 .file.read_at(dq.scales.at, std::as_writable_bytes(std::span(scales)))
                                 .with_context(where_of(dq.scales, fqn, entry, c) + " (scales)"));
    if (dq.scales.checked()) {
      OPTSTATE_ASSIGN_OR_RETURN(const uint32_t prefix, record_prefix_crc(dq.scales, fqn, entry, c));
      OPTSTATE_RETURN_IF_ERROR(check_crc(dq.scales, zip::crc32(std::as_bytes(std::span(scales)), prefix), fqn, entry, c));
    }
    const bool check = pc.stored.checked() && from == 0 && to == pc.count;
    uint32_t crc = 0;
    if (check) {
      OPTSTATE_ASSIGN_OR_RETURN(crc, record_prefix_crc(pc.stored, fqn, entry, c));
    }
    // pc.stored.at is the run's first code, element dq.local of the part.
    const int64_t local_bytes = dq.bits == 4 ? dq.local / 2 : dq.local;
    OPTSTATE_RETURN_IF_ERROR(dcp::stream_dequantized(files_[pc.stored.file].file, pc.stored.at - static_cast<uint64_t>(local_bytes),
                                                     dq.local + from, dq.local + to, scales, dq.block, *dq.table, sink,
                                                     check ? &crc : nullptr, where_of(pc.stored, fqn, entry, c) + " (codes)",
                                                     dq.bits));
    return check ? check_crc(pc.stored, crc, fqn, entry, c) : Status::Ok();
  }

  // One file, or a per-rank set (optimizer files in rank order; the model's beside them, if any).
  Status init(const std::vector<fs::path>& optim_files, const std::vector<fs::path>& model_files,
              std::vector<std::string> not_read) {
    set_ = optim_files.size() > 1 || !model_files.empty();
    std::vector<StateDict> sds;
    std::optional<ModelDict> own_model;  // one file's model dict beside its optimizer: model_tensors()
    for (const fs::path& f : optim_files) {
      OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f));
      files_.push_back(std::move(ap.first));
      OPTSTATE_ASSIGN_OR_RETURN(StateDict sd, interpret_state_dict(ap.second, f.string()));
      if (sd.deepspeed_flat) OPTSTATE_RETURN_IF_ERROR(place_deepspeed_flat(ap.second, files_.size() - 1, sd, f.string()));
      if (!set_ && !sd.libtorch && sd.model_ref != pickle::kNoRef)
        if (auto md = interpret_model_dict(ap.second, sd.model_ref, f.string() + " " + sd.model_key); md.ok())
          own_model = std::move(*md);
      sds.push_back(std::move(sd));
    }
    // A LibTorch archive's sizes (tensors) must say what it lists.
    for (size_t f = 0; f < sds.size(); ++f)
      for (const DeclaredCount& dc : sds[f].counts) {
        OPTSTATE_ASSIGN_OR_RETURN(const double n, value_of(f, dc.value, dc.where));
        if (n != static_cast<double>(dc.listed))
          return corrupt(fmt::format("{} is {}, but {} are listed", dc.where, n, dc.listed));
      }
    const StateDict& sd0 = sds[0];
    const std::string w0 = optim_files[0].string();
    libtorch_ = sd0.libtorch;
    bnb_ = sd0.bnb;
    std::error_code ec;
    torchao_ = sd0.torchao && !fs::is_directory(path_, ec);  // formats/torchao/ sniffs files, not sets
    for (const StateDict& sd : sds) {
      if (torchao_package_.empty()) torchao_package_ = sd.torchao_package;
      if (!bnb_nested_) bnb_nested_ = sd.bnb_nested;
    }
    std::vector<std::pair<ModelDict, size_t>> models;  // (dict, archive index)
    for (const fs::path& f : model_files) {
      OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f));
      files_.push_back(std::move(ap.first));
      OPTSTATE_ASSIGN_OR_RETURN(ModelDict md, interpret_model_dict(ap.second, f.string()));
      models.emplace_back(std::move(md), files_.size() - 1);
    }
    // Ranks of one state hold DTensors (FSDP2); plain tensors beside a model of DTensors are FSDP1's
    // flat parts; files of whole state_dicts (one per epoch, say) are not a set.
    bool dtensors = false, model_dtensors = false;
    for (const StateDict& sd : sds)
      for (const ParamSpec& ps : sd.params)
        for (const auto& [name, es] : ps.entries) dtensors = dtensors || es.dtensor.has_value();
    for (const auto& [md, file] : models)
      for (const ModelTensor& t : md.tensors) model_dtensors = model_dtensors || t.dtensor.has_value();
    // A one-rank FSDP1 run's model file holds plain tensors (nothing is sharded): its optimizer's
    // tensors are still flat parts, 1-D and fewer than the model's params or shaped unlike them.
    const bool fsdp1 = !dtensors && (model_dtensors || (sds.size() == 1 && models.size() == 1 &&
                                                        flat_parts(sd0, models[0].first)));
    if (sds.size() > 1 && !dtensors && !fsdp1) {
      if (!models.empty())
        return corrupt(fmt::format("{}: {} hold plain tensors and {} no DTensors: not FSDP2's ranks, and FSDP1's "
                                   "(parts of flat parameters) are read beside model files of DTensors only "
                                   "(FullyShardedDataParallel with a device_mesh, as verl builds it; without one "
                                   "its model files hold ShardedTensors)", path_.string(), rank_pattern(optim_files),
                                   rank_pattern(model_files)));
      return corrupt(fmt::format("{}: {} holds {} files of whole optimizer state_dicts (no DTensors), not one "
                                 "state's ranks; pass one file", path_.string(), rank_pattern(optim_files),
                                 sds.size()));
    }
    // One model-parallel rank's file of Megatron-LM's legacy checkpoint, taken out of its folder
    // (formats/megatron/ reads the folder): its tensors are shards or one stage's params.
    if (const auto& a = sd0.megatron_args; a && sds.size() == 1 &&
        (a->tp_size.value_or(1) > 1 || a->pp_size.value_or(1) > 1 || a->ep_size.value_or(1) > 1))
      return unsupported(fmt::format("{}: one model-parallel rank's file of a Megatron-LM checkpoint (its args say "
                                     "tensor_model_parallel_size {}, pipeline_model_parallel_size {}, "
                                     "expert_model_parallel_size {}): its tensors are shards, one stage's params or "
                                     "one expert rank's experts; read the iteration folder it came from (iter_<N>/ "
                                     "with its mp_rank_* folders)", path_.string(), a->tp_size.value_or(1),
                                     a->pp_size.value_or(1), a->ep_size.value_or(1)));
    not_read_ = sd0.not_read;
    value_notes_ = sd0.read_notes;
    // FSDP1's ranks hold no state for params with no part on them (use_orig_params): not unread.
    std::optional<size_t> stateless_line;
    if (sd0.stateless && !fsdp1) {
      stateless_line = not_read_.size();
      not_read_.push_back(fmt::format("{} param{} without state or weights (never stepped: no shape in the file)",
                                      sd0.stateless, sd0.stateless == 1 ? "" : "s"));
    }
    for (std::string& n : not_read) not_read_.push_back(std::move(n));
    // One file: a torch.save write from it carries its groups' other keys (a scheduler's
    // 'initial_lr', which Hugging Face Trainer's optimizer.pt holds) and, where its optimizer sits
    // beside other entries ({"model", "optimizer", "epoch"}), those, when that is all it holds
    // beyond the state (per-param fields and stateless params without weights it does not carry,
    // but an optimizer per param that never stepped its param, which it carries as it is).
    // (Not Composer's DecoupledAdamW: its weight decay is read as AdamW's, which the file's is not.)
    carries_rest_ = !set_ && !libtorch_ && !sd0.decoupled_decay && !sd0.nanotron && !sd0.megatron && !sd0.deepspeed_fp16;
    for (size_t i = 0; i < not_read_.size(); ++i)
      carries_rest_ = carries_rest_ && (not_read_[i].starts_with("[") || not_read_[i].starts_with("param group ") ||
                                        (sd0.per_param && i == stateless_line));
    if (fsdp1) {
      for (size_t f = 1; f < sds.size(); ++f) OPTSTATE_RETURN_IF_ERROR(same_groups(sd0, sds[f], w0, optim_files[f].string()));
    } else {
      for (size_t f = 1; f < sds.size(); ++f) OPTSTATE_RETURN_IF_ERROR(same_layout(sd0, sds[f], w0, optim_files[f].string()));
    }

    // Names: the groups' param_names; else the model files' params in order, which torch numbers
    // the same way when the optimizer was given model.parameters().
    std::map<int64_t, std::string> rename;
    if (!models.empty() && !fsdp1) OPTSTATE_RETURN_IF_ERROR(model_names(sd0, models[0].first, model_files[0], rename));

    meta_.kind = sd0.eight ? "adamw8bit" : "adamw";
    for (size_t g = 0; g < sd0.groups.size(); ++g) {
      ParamGroup group;
      group.hyper = sd0.groups[g].hyper;
      for (size_t f = 0; f < sds.size(); ++f) {
        OPTSTATE_ASSIGN_OR_RETURN(const double lr, value_of(f, sds[f].groups[g].lr,
                                                            fmt::format("{} param group {} 'lr'", optim_files[f].string(), g)));
        if (f == 0) group.hyper.lr = lr;
        if (!same_number(lr, group.hyper.lr))
          return corrupt(fmt::format("{}: param group {} has lr {}, rank 0's file has {}", optim_files[f].string(), g, lr,
                                     group.hyper.lr));
        // betas as tensors (torch's Tensor betas) are read as lr is
        for (auto [beta, value] : {std::pair{&sds[f].groups[g].beta1, &group.hyper.beta1},
                                   std::pair{&sds[f].groups[g].beta2, &group.hyper.beta2}}) {
          if (!beta->tensor) continue;
          OPTSTATE_ASSIGN_OR_RETURN(const double b, value_of(f, *beta, fmt::format("{} param group {} 'betas'",
                                                                                   optim_files[f].string(), g)));
          if (f == 0) *value = b;
          if (!same_number(b, *value))
            return corrupt(fmt::format("{}: param group {} has a beta {}, rank 0's file has {}", optim_files[f].string(),
                                       g, b, *value));
        }
      }
      meta_.groups.push_back(std::move(group));
    }
    if (std::any_of(sd0.groups.begin(), sd0.groups.end(), [](const GroupSpec& g) { return !g.flags.empty(); }))
      for (const GroupSpec& g : sd0.groups) adamw_flags_.push_back(g.flags);
    if (std::any_of(sd0.groups.begin(), sd0.groups.end(), [](const GroupSpec& g) { return !g.extras.empty(); }))
      for (size_t g = 0; g < sd0.groups.size(); ++g) {
        GroupExtras& kept = group_extras_.emplace_back();
        for (const GroupExtraSpec& x : sd0.groups[g].extras) {
          GroupValue v = x.value;
          if (x.tensor) {  // a tensor whose element does not read is named, not kept
            const Result<double> f = value_of(0, Scalar{std::nullopt, x.tensor}, "");
            if (!f.ok()) {
              not_read_.push_back(fmt::format("param group {} '{}'", g, x.key));
              continue;
            }
            v.f = *f;
          }
          kept.emplace_back(x.key, std::move(v));
        }
      }
    if (fsdp1) {
      OPTSTATE_ASSIGN_OR_RETURN(const size_t weights, init_fsdp1(sds, optim_files, models, model_files));
      return finish(models, model_files, weights);
    }
    size_t weights = 0;
    if (dtensors && !models.empty()) fsdp_ = FsdpSet{path_, optim_files, model_files, {}, {}};
    for (size_t i = 0; i < sd0.params.size(); ++i) {
      const ParamSpec& spec = sd0.params[i];
      // The name in the files (param_names, the model's key), and the state's: torch's fqn.
      const std::string source_fqn = rename.count(spec.id) ? rename.at(spec.id) : spec.fqn;
      const std::string fqn = torch_param_fqn(source_fqn, sd0.ddp_prefix);
      OPTSTATE_RETURN_IF_ERROR(one_name(fqn, source_fqn, w0));
      if (fsdp_) fsdp_->fqn_of_id[spec.id] = fqn;
      meta_.groups[static_cast<size_t>(spec.group)].params.push_back(fqn);
      const std::string pw = fmt::format("{} param '{}'", w0, fqn);
      ParamState ps;
      ps.shape = spec.shape;
      ps.group = spec.group;
      // torchao's subclasses claim the param's dtype; weights, where the files have them, say it too.
      for (const auto& [name, es] : spec.entries)
        if (es.apparent_dtype) ps.param_dtype = *es.apparent_dtype;
      for (size_t f = 0; f < sds.size(); ++f) {
        const std::string fw = fmt::format("{} param '{}'", optim_files[f].string(), fqn);
        OPTSTATE_ASSIGN_OR_RETURN(const double step, value_of(f, sds[f].params[i].step, fw + " 'step'"));
        if (!(step >= 0 && step < 9.2e18) || step != std::floor(step))
          return corrupt(fmt::format("{}: step {} is not a count", fw, step));
        if (f == 0) ps.step = static_cast<int64_t>(step);
        if (static_cast<int64_t>(step) != ps.step)
          return corrupt(fmt::format("{}: step {}, rank 0's file has {}", fw, step, ps.step));
      }
      for (const auto& [name, es] : spec.entries) {
        const std::string ew = fmt::format("{} '{}'", pw, name);
        std::vector<const EntrySpec*> xs;  // the entry in each rank's file
        bool any8 = false, all8 = true, fp8 = false, four = false;
        for (size_t f = 0; f < sds.size(); ++f) {
          const auto& x = sds[f].params[i].entries;
          if (!x.count(name))
            return corrupt(fmt::format("{} param '{}': '{}' is missing; rank 0's file has it", optim_files[f].string(), fqn, name));
          xs.push_back(&x.at(name));
          any8 = any8 || xs.back()->encoding == Encoding::kBlockwise8;
          all8 = all8 && xs.back()->encoding == Encoding::kBlockwise8;
          fp8 = fp8 || xs.back()->fp8;  // no canonical map: read dequantized
          four = four || xs.back()->bits == 4;
        }
        all8 = all8 && !fp8 && !four;
        auto parts = [&](auto member) {
          std::vector<Part> out;
          for (size_t f = 0; f < xs.size(); ++f) out.push_back({f, (*xs[f]).*member, &xs[f]->dtensor});
          return out;
        };
        Entry e;
        if (!any8) {
          e.dtype = es.values.dtype;
          for (size_t f = 1; f < xs.size(); ++f)
            if (xs[f]->values.dtype != e.dtype)
              return corrupt(fmt::format("{} param '{}' '{}': {}, rank 0's file has {}", optim_files[f].string(), fqn, name,
                                         dtype_name(xs[f]->values.dtype), dtype_name(e.dtype)));
          OPTSTATE_ASSIGN_OR_RETURN(Placed v, place(ps.shape, parts(&EntrySpec::values), ew, /*dense=*/true));
          stored_[{fqn, name, Component::kValues}] = std::move(v.pieces);
          ps.entries.emplace(name, std::move(e));
          continue;
        }
        // 8-bit: the map of each rank's part, checked; one block size and map for the entry.
        std::vector<const std::array<float, 256>*> maps(xs.size());
        int64_t block = 0;
        std::string qmap;
        for (size_t f = 0; f < xs.size(); ++f) {
          const EntrySpec& x = *xs[f];
          if (x.encoding != Encoding::kBlockwise8) {
            if (x.values.dtype != DType::kF32)
              return corrupt(fmt::format("{} param '{}' '{}': {} beside other ranks' 8-bit parts; torchao keeps fp32",
                                         optim_files[f].string(), fqn, name, dtype_name(x.values.dtype)));
            continue;
          }
          if (x.fp8) {
            maps[f] = &dcp::float8_e4m3fn_values();
            continue;
          }
          if (x.bits == 4) {
            OPTSTATE_ASSIGN_OR_RETURN(maps[f], map16(f, *x.qmap, ew));
            continue;
          }
          std::string q = x.qmap_name;
          if (x.qmap) {
            OPTSTATE_ASSIGN_OR_RETURN(q, map_name(f, *x.qmap, ew));
          }
          OPTSTATE_ASSIGN_OR_RETURN(const QMap m, qmap_from_name(q));
          maps[f] = &qmap_table(m);
          if (qmap.empty()) block = x.block_size, qmap = q;
          if (x.block_size != block || q != qmap)
            return corrupt(fmt::format("{} param '{}' '{}': blocks of {} with map {}, another rank's file has {} with {}",
                                       optim_files[f].string(), fqn, name, x.block_size, q, block, qmap));
        }
        if (all8) {
          OPTSTATE_ASSIGN_OR_RETURN(Placed codes, place(ps.shape, parts(&EntrySpec::codes), ew));
          OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
          if (auto absmax = absmax_pieces(codes, parts(&EntrySpec::absmax), numel, block)) {
            e.encoding = Encoding::kBlockwise8;
            e.dtype = DType::kU8;
            e.block_size = block;
            e.qmap = qmap;
            stored_[{fqn, name, Component::kCodes}] = std::move(codes.pieces);
            stored_[{fqn, name, Component::kAbsmax}] = std::move(*absmax);
            ps.entries.emplace(name, std::move(e));
            continue;
          }
        }
        // 8-bit on some ranks and plain on others (torchao quantizes a shard only when it has at
        // least 4096 elements in whole blocks), or blocks that are not the global tensor's: the
        // 8-bit parts are read dequantized, the entry is fp32 values.
        std::vector<Part> dq;
        for (size_t f = 0; f < xs.size(); ++f) {
          const EntrySpec& x = *xs[f];
          if (x.encoding == Encoding::kBlockwise8) {
            dq.push_back({f, x.codes, &x.dtensor, x.absmax, x.block_size, maps[f], x.bits});
          } else {
            dq.push_back({f, x.values, &x.dtensor});
          }
        }
        OPTSTATE_ASSIGN_OR_RETURN(Placed v, place(ps.shape, dq, ew));
        stored_[{fqn, name, Component::kValues}] = std::move(v.pieces);
        e.dtype = DType::kF32;
        (fp8 ? dequantized_fp8_ : four ? dequantized_4bit_ : dequantized_).push_back(entry_key(fqn, name));
        ps.entries.emplace(name, std::move(e));
      }
      // Weights: from a "model" dict in the optimizer's files, or from the model's own files.
      std::vector<Part> wparts;
      std::string ww;
      if (spec.weight) {
        for (size_t f = 0; f < sds.size(); ++f) {
          const ParamSpec& x = sds[f].params[i];
          if (!x.weight) return corrupt(fmt::format("{}: ['model']['{}'] is missing; rank 0's file has it", optim_files[f].string(), fqn));
          wparts.push_back({f, *x.weight, &x.weight_dtensor});
        }
        ww = fmt::format("{} ['model']['{}']", w0, source_fqn);
        OPTSTATE_RETURN_IF_ERROR(add_weights(fqn, ps, wparts, ww));
      } else if (!models.empty()) {
        OPTSTATE_ASSIGN_OR_RETURN(const bool found, model_weights(fqn, source_fqn, ps, models, model_files));
        weights += found;
      }
      meta_.params.emplace(fqn, std::move(ps));
    }
    if (own_model) OPTSTATE_RETURN_IF_ERROR(expose_model_tensors(*own_model, sd0));
    return finish(models, model_files, weights);
  }

  // The model dict's tensors beside the optimizer that are no param's weights, for model_tensors():
  // plain tensors whose storage resolves, each under torch's fqn of its key unless a param or
  // another tensor has that name. What is left stays counted on not_read's line for the dict.
  Status expose_model_tensors(const ModelDict& md, const StateDict& sd) {
    std::set<std::string> taken;
    for (const auto& [fqn, ps] : meta_.params) taken.insert(fqn);
    for (const ModelTensor& t : md.tensors) {
      if (t.dtensor || sd.model_weight_keys.count(t.name)) continue;
      const auto numel = checked_numel(t.tensor.shape);
      if (!numel.ok()) continue;
      auto st = resolve(0, t.tensor, *numel, fmt::format("{} {}['{}']", path_.string(), sd.model_key, t.name),
                        /*permuted_ok=*/true);
      if (!st.ok()) continue;
      const std::string name = torch_param_fqn(t.name, sd.ddp_prefix);
      if (!taken.insert(name).second) continue;
      model_tensors_.push_back({name, t.tensor.dtype, t.tensor.shape});
      model_stored_.push_back({std::move(*st), fmt::format("{}['{}']", sd.model_key, t.name)});
    }
    if (sd.model_others_line) {
      const size_t left = sd.model_others - std::min(sd.model_others, model_tensors_.size());
      auto line = not_read_.begin() + static_cast<std::ptrdiff_t>(*sd.model_others_line);
      if (left) *line = model_others_text(sd.model_key, left);
      else not_read_.erase(line);
    }
    return Status::Ok();
  }

  // Two params of the files whose names are one fqn once the wrappers' segments are dropped
  // (torch_param_fqn) are not one state's: refused, naming both.
  Status one_name(const std::string& fqn, const std::string& source_fqn, const std::string& where) {
    const auto [it, added] = source_names_.emplace(fqn, source_fqn);
    if (added) return Status::Ok();
    return corrupt(fmt::format("{}: params '{}' and '{}' both have the name '{}' (torch.compile's, activation "
                               "checkpointing's and FSDP's segments dropped, as torch's state dicts drop them)",
                               where, it->second, source_fqn, fqn));
  }

  // The weights of `fqn` from the model's files (each rank's part, named `source_fqn` there), where
  // rank 0's has it.
  Result<bool> model_weights(const std::string& fqn, const std::string& source_fqn, ParamState& ps,
                             const std::vector<std::pair<ModelDict, size_t>>& models,
                             const std::vector<fs::path>& model_files) {
    std::vector<Part> wparts;
    for (size_t m = 0; m < models.size(); ++m) {
      const ModelTensor* t = models[m].first.find(source_fqn);
      if (!t) {
        if (m == 0) return false;
        return corrupt(fmt::format("{}: no '{}'; rank 0's model file has it", model_files[m].string(), source_fqn));
      }
      wparts.push_back({models[m].second, t->tensor, &t->dtensor});
    }
    OPTSTATE_RETURN_IF_ERROR(add_weights(fqn, ps, wparts, fmt::format("{} ['{}']", model_files[0].string(), source_fqn)));
    return true;
  }

  Status add_weights(const std::string& fqn, ParamState& ps, const std::vector<Part>& wparts, const std::string& ww) {
    Entry w;
    w.dtype = wparts[0].tensor.dtype;
    for (const Part& part : wparts)
      if (part.tensor.dtype != w.dtype || (w.dtype != DType::kF32 && w.dtype != DType::kBF16 && w.dtype != DType::kF16))
        return corrupt(fmt::format("{}: {} weights; optstate carries fp32, bf16 or fp16 weights of one dtype", ww,
                                   dtype_name(part.tensor.dtype)));
    OPTSTATE_ASSIGN_OR_RETURN(Placed v, place(ps.shape, wparts, ww, /*dense=*/true));
    stored_[{fqn, kParam, Component::kValues}] = std::move(v.pieces);
    ps.param_dtype = w.dtype;
    ps.entries.emplace(kParam, std::move(w));
    return Status::Ok();
  }

  // What every kind of file ends with: what was not read, the structure check, whether every piece
  // is checksummed.
  Status finish(const std::vector<std::pair<ModelDict, size_t>>& models, const std::vector<fs::path>& model_files,
                size_t weights) {
    if (!models.empty()) {
      const size_t others = models[0].first.tensors.size() + models[0].first.others - weights;
      if (others)
        not_read_.push_back(fmt::format("{} ({} entr{} besides the optimized params' weights)",
                                        rank_pattern(model_files), others, others == 1 ? "y" : "ies"));
    }
    if (!dequantized_.empty())
      encoding_notes_.push_back(fmt::format("the 8-bit encoding of {} ({}): 8-bit on some ranks only, or in blocks that are "
                                      "not the whole tensor's; read as fp32 values", fmt::join(dequantized_, ", "),
                                      dequantized_.size() == 1 ? "one entry" : fmt::format("{} entries", dequantized_.size())));
    if (!dequantized_4bit_.empty())
      encoding_notes_.push_back(fmt::format("torchao's 4-bit encoding of {} ({}, AdamW4bit): read as fp32 values",
                                      fmt::join(dequantized_4bit_, ", "),
                                      dequantized_4bit_.size() == 1 ? "one entry"
                                                                    : fmt::format("{} entries", dequantized_4bit_.size())));
    if (!dequantized_fp8_.empty())
      encoding_notes_.push_back(fmt::format("torchao's float8 encoding of {} ({}, AdamWFp8): read as fp32 values",
                                      fmt::join(dequantized_fp8_, ", "),
                                      dequantized_fp8_.size() == 1 ? "one entry"
                                                                   : fmt::format("{} entries", dequantized_fp8_.size())));
    OPTSTATE_RETURN_IF_ERROR(check_structure(meta_, false).with_context(path_.string()));
    checksummed_ = true;
    for (const auto& [key, pieces] : stored_)
      for (const Piece& pc : pieces) checksummed_ = checksummed_ && pc.stored.checked();
    return Status::Ok();
  }

  // DeepSpeed ZeRO's tag folder (global_step500/): every data-parallel rank's optimizer file and
  // the model states file. Each param is put together from its runs in the ranks' flat partitions,
  // in rank order: stages 1 and 2 flatten each group's params in order and split the flat group in
  // equal parts (param_slice_mappings says where each rank's runs lie); stage 3 splits every param
  // in parts of ceil(numel / world), each rank's flat group their concatenation in order. Under
  // pipeline parallelism each stage is such a set of its own, with its own optimizer and groups:
  // read as one state, each stage's groups joined to the earlier stages' of the same settings.
  // Under AutoTP each tensor-parallel rank is such a set, holding its shards of every param:
  // put together where the model states' affine maps place them.
  Status init_zero(const ZeroFiles& z) {
    deepspeed_ = true;
    set_ = true;
    meta_.kind = "adamw";
    std::vector<ZeroSlice> slices;
    for (size_t st = 0; st < z.stages.size(); ++st) {
      OPTSTATE_ASSIGN_OR_RETURN(ZeroSlice slice, read_zero_slice(z, st));
      slices.push_back(std::move(slice));
    }
    const size_t autoep_layers = slices.front().shapes.autoep_layers.size();
    if (z.tensor_parallel) {
      tensor_parallel_ = true;
      OPTSTATE_RETURN_IF_ERROR(join_tensor_parallel(z, slices));
    } else {
      std::vector<int64_t> group_steps;        // each joined group's step, as its first stage had it
      std::map<std::string, size_t> stage_of;  // each param: the stage it is read from
      for (size_t st = 0; st < slices.size(); ++st)
        OPTSTATE_RETURN_IF_ERROR(join_pipeline_stage(z, st, std::move(slices[st]), group_steps, stage_of));
      std::map<std::string, std::set<size_t>> tied;
      for (const ZeroCopy& c : zero_copies_) tied[c.fqn].insert(c.stage);
      for (const auto& [name, stages] : tied)
        value_notes_.push_back(fmt::format("'{}' is held by pipeline stages {} and {} (a tied module: DeepSpeed sums "
                                           "its gradients over the tie, so its copies are equal): stage {}'s read; "
                                           "validate compares the copies", name, stage_of.at(name),
                                           fmt::join(stages, ", "), stage_of.at(name)));
    }
    if (!z.expert_files.empty()) {
      size_t files = 0;
      for (const auto& [l, es] : z.expert_files) files += es.size();
      const size_t native = z.expert_files.size() - std::min(z.expert_files.size(), autoep_layers);
      if (native)
        value_notes_.push_back(fmt::format("DeepSpeed MoE: {} MoE layer{} experts read under their global numbers "
                                           "(expert-parallel rank e's local expert i is expert e*n+i, n experts a "
                                           "rank), each from its expert-data-parallel ranks' partitions", native,
                                           native == 1 ? "'s" : "s'"));
      if (autoep_layers)
        value_notes_.push_back(fmt::format("DeepSpeed AutoEP: {} MoE layer{} fused experts (w1, w2, w3) read whole, "
                                           "[experts, ...]: expert-parallel rank e's shard as experts e*n.. (its "
                                           "affine map), each from its expert-data-parallel ranks' partitions",
                                           autoep_layers, autoep_layers == 1 ? "'s" : "s'"));
      uncarried_notes_.push_back(fmt::format("layer_*_expert_*_model_states.pt ({} file{}: the experts' weights in "
                                             "their training dtype; the optimizer's fp32 weights are read)", files,
                                             files == 1 ? "" : "s"));
    }
    if (z.expert_optim_files)
      uncarried_notes_.push_back(fmt::format("expp_rank_*_optim_states.pt ({} file{}: under ZeRO they hold no state)",
                                             z.expert_optim_files, z.expert_optim_files == 1 ? "" : "s"));
    if (z.layer_files)  // not in a universal checkpoint either (DeepSpeed loads its weights from zero/)
      uncarried_notes_.push_back(fmt::format("layer_*-model_states.pt ({} file{}: the pipeline's module weights per "
                                             "layer, in their training dtype; the optimizer's fp32 weights are read)",
                                             z.layer_files, z.layer_files == 1 ? "" : "s"));
    return finish({}, {}, 0);
  }

  // DeepSpeed MoE without ZeRO (init_moe_stage0): a tensor that may be a param (module order), one
  // expert-parallel rank's optimizer file, and where a kind of its groups' params were placed.
  struct MoeCand {
    std::string name;
    std::vector<int64_t> shape;
    dcp::TensorRef tensor;
    size_t file = 0;
    int64_t numel = 0;
  };
  struct MoeRank {
    StateDict sd;
    std::vector<int64_t> ep;  // by group: its expert-parallel size (0: dense)
    size_t file = 0;
    // FP16_Optimizer (each group one flat fp32 master, its optimizer one flat param a group): the
    // masters' lengths and each group's flat param in sd.params (none: never stepped)
    std::vector<int64_t> numel;
    std::vector<std::optional<size_t>> flat_of;
  };
  struct MoeSpot {   // a placed tensor: its group, and its id (numbered params) or where its
    size_t cand = 0, group = 0;  // elements start in the group's flat master (FP16_Optimizer)
    int64_t id = 0, begin = 0;
  };
  struct MoePlacement {
    std::vector<MoeSpot> placed;
    std::string why;  // why none fits (an error is one of reading)
  };

  // The model dict's tensors that may be params (fp32/bf16/fp16, no buffer), in its order.
  static Result<std::vector<MoeCand>> moe_candidates(const ModelDict& md, size_t file,
                                                     const std::set<std::string, std::less<>>& buffers) {
    std::vector<MoeCand> out;
    for (const size_t i : param_candidates(md)) {
      const ModelTensor& t = md.tensors[i];
      if (t.dtensor || buffers.count(t.name)) continue;
      if (t.tensor.dtype != DType::kF32 && t.tensor.dtype != DType::kBF16 && t.tensor.dtype != DType::kF16) continue;
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t n, checked_numel(t.tensor.shape));
      out.push_back({t.name, t.tensor.shape, t.tensor, file, n});
    }
    return out;
  }

  // One expert-parallel rank's optimizer file (`world` ranks): its state_dict, each group's
  // expert-parallel size, and under FP16_Optimizer its flat groups checked.
  Result<MoeRank> read_moe_rank(const fs::path& f, int64_t world) {
    const std::string fw = f.string();
    OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f));
    files_.push_back(std::move(ap.first));
    MoeRank r;
    r.file = files_.size() - 1;
    OPTSTATE_ASSIGN_OR_RETURN(r.sd, interpret_state_dict(ap.second, fw));
    if (r.sd.optimizer_path.rfind("['optimizer']", 0) != 0 || r.sd.per_param || r.sd.libtorch || r.sd.nanotron ||
        r.sd.megatron || r.sd.decoupled_decay)
      return corrupt(fw + ": not DeepSpeed's expert-parallel optimizer file ({'optimizer': its numbered state_dict})");
    for (const ParamSpec& spec : r.sd.params)
      if (spec.fqn != std::to_string(spec.id))
        return corrupt(fmt::format("{}: param '{}' is named in the file; DeepSpeed's optimizer numbers its params",
                                   fw, spec.fqn));
    if (r.sd.eight || r.sd.bnb || r.sd.torchao)
      return corrupt(fw + ": 8-bit or torchao state; DeepSpeed MoE without ZeRO is read with AdamW's fp32 state");
    for (size_t g = 0; g < r.sd.groups.size(); ++g) {
      bool moe = false;
      std::string name;
      for (const GroupExtraSpec& x : r.sd.groups[g].extras) {
        if (x.key == "moe") moe = x.value.kind == GroupValue::Kind::kBool && x.value.i;
        if (x.key == "name" && x.value.kind == GroupValue::Kind::kString) name = x.value.s;
      }
      const int64_t ep = moe ? moe_group_ep_size(name).value_or(0) : 0;
      if (moe && (ep < 1 || world % ep))
        return corrupt(fmt::format("{} param group {}: a mixture of experts' group ('moe') named '{}', not "
                                   "ep_size_<a divisor of the {} ranks>", fw, g, name, world));
      r.ep.push_back(ep);
    }
    if (!r.sd.deepspeed_flat) return r;
    OPTSTATE_ASSIGN_OR_RETURN(FlatGroups fg, flat_groups(r.sd, r.file, fw));
    r.numel = std::move(fg.numel);
    r.flat_of = std::move(fg.flat_of);
    return r;
  }

  // Places one rank's groups of one kind (`ep`; 0: dense) among `cands`: numbered params by order
  // and shape (place_params_in_model), FP16_Optimizer's flat groups by value (place_in_flat_groups).
  Result<MoePlacement> place_moe_groups(const MoeRank& r, int64_t ep, const std::vector<const MoeCand*>& cands,
                                        const std::string& fw) {
    MoePlacement out;
    std::vector<size_t> gk;  // the kind's groups
    for (size_t g = 0; g < r.sd.groups.size(); ++g)
      if (r.ep[g] == ep) gk.push_back(g);
    if (!r.sd.deepspeed_flat) {
      std::map<int64_t, const ParamSpec*> spec_of;
      for (const ParamSpec& s : r.sd.params) spec_of[s.id] = &s;
      std::vector<std::vector<std::optional<std::vector<int64_t>>>> groups;
      for (const size_t g : gk) {
        auto& shapes_of = groups.emplace_back();
        for (const int64_t id : r.sd.member_ids[g]) {
          const auto it = spec_of.find(id);
          shapes_of.push_back(it == spec_of.end() ? std::nullopt : std::optional(it->second->shape));
        }
      }
      std::vector<std::vector<int64_t>> tensors;
      for (const MoeCand* c : cands) tensors.push_back(c->shape);
      const ModelPlacement placed = place_params_in_model(groups, tensors);
      out.why = placed.why;
      if (out.why.empty())
        for (size_t k = 0; k < gk.size(); ++k)
          for (size_t i = 0; i < r.sd.member_ids[gk[k]].size(); ++i)
            out.placed.push_back({placed.tensor_of[k][i], gk[k], r.sd.member_ids[gk[k]][i], 0});
      return out;
    }
    std::vector<int64_t> group_numels, numels;
    std::vector<std::string> names;
    std::vector<int> classes;  // tensors of one dtype round alike
    for (const size_t g : gk) group_numels.push_back(r.numel[g]);
    for (const MoeCand* c : cands) {
      numels.push_back(c->numel);
      names.push_back(c->name);
      classes.push_back(static_cast<int>(c->tensor.dtype));
    }
    const std::string ow = fmt::format("{} {}['fp32_groups_flat']", fw, r.sd.deepspeed_flat_at);
    deepspeed::FlatValues values;
    values.flat = [&](size_t k, int64_t begin, std::span<const int64_t> at, size_t c) -> Result<std::vector<uint32_t>> {
      std::vector<int64_t> shifted(at.begin(), at.end());
      for (int64_t& i : shifted) i += begin;
      OPTSTATE_ASSIGN_OR_RETURN(auto bits, read_samples(files_[r.file], r.file, r.sd.deepspeed_flat_masters[gk[k]],
                                                        r.numel[gk[k]], shifted, fmt::format("{}[{}]", ow, gk[k])));
      round_samples(bits, cands[c]->tensor.dtype);
      return bits;
    };
    values.tensor = [&](size_t c, std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
      return read_samples(files_[cands[c]->file], cands[c]->file, cands[c]->tensor, cands[c]->numel, at,
                          fmt::format("{} ['{}']", files_[cands[c]->file].path.string(), cands[c]->name));
    };
    auto placed = deepspeed::place_in_flat_groups(group_numels, numels, names, values, ow, classes);
    if (!placed.ok()) {
      if (placed.status().code() != ErrorCode::kCorrupt) return placed.status();
      out.why = placed.status().message();
      return out;
    }
    for (size_t c = 0; c < cands.size(); ++c)
      if ((*placed)[c]) out.placed.push_back({c, gk[(*placed)[c]->group], 0, (*placed)[c]->begin});
    return out;
  }

  // DeepSpeed MoE without ZeRO (stage 0; deepspeed/FORMAT.md): each expert-parallel rank's file
  // (expp_rank_E, E a rank of the largest expert-parallel group) holds its whole optimizer,
  // numbered: the dense params (alike on every rank) and its local experts, in groups of their own
  // ('moe', "ep_size_<size>"). Nothing names the numbers; each group's params are placed in order
  // and by shape (place_params_in_model, as names_from_model does for one model): a dense group's
  // among ['module']'s params, an MoE group's among the experts the rank holds of the layers of its
  // expert-parallel size, layer by layer and expert by expert in module order, named by their
  // layer_L_expert_G files (G the global number); under FP16_Optimizer (each group flat) by value
  // instead (place_moe_groups). Which size each MoE layer has is in no file: the one assignment
  // whose placements all fit is taken.
  Status init_moe_stage0(const MoeStage0Files& m) {
    deepspeed_ = true;
    set_ = true;
    meta_.kind = "adamw";
    const std::string mw = m.model.string();
    OPTSTATE_ASSIGN_OR_RETURN(auto model, open_archive(m.model));
    files_.push_back(std::move(model.first));
    const size_t model_file = files_.size() - 1;
    const pickle::Pickle& mp = model.second;
    OPTSTATE_ASSIGN_OR_RETURN(const ZeroShapes shapes, interpret_zero_model(mp, mw));
    if (!shapes.without_zero)
      return corrupt(mw + ": param_shapes set (a ZeRO run's model states) beside expp_rank_* files and no ZeRO "
                          "partitions (zero_pp_rank_*_optim_states.pt)");
    if (!shapes.autoep_layers.empty())
      return unsupported(mw + ": DeepSpeed AutoEP without ZeRO (ds_autoep_layers beside expp_rank_* files): not read; "
                              "AutoEP under ZeRO-1/2 is");
    const std::vector<int64_t>& num_experts = shapes.num_experts;
    if (num_experts.empty()) return corrupt(mw + ": no 'num_experts' list (the MoE layers' expert counts)");
    const pickle::Ref dpw = mp.dict_get(mp.root(), "dp_world_size");
    if (dpw == pickle::kNoRef || mp.at(dpw).kind != pickle::Kind::kInt || mp.at(dpw).i < 1 ||
        mp.at(dpw).i > (int64_t{1} << 24))
      return corrupt(mw + ": 'dp_world_size' is not a count of ranks");
    const int64_t world = mp.at(dpw).i;
    OPTSTATE_ASSIGN_OR_RETURN(const ModelDict dense, interpret_model_dict(mp, mp.dict_get(mp.root(), "module"),
                                                                          mw + " ['module']"));
    std::set<std::string, std::less<>> buffers;  // DeepSpeed's ['buffer_names']: the module's buffers
    if (const pickle::Ref b = mp.dict_get(mp.root(), "buffer_names"); b != pickle::kNoRef && mp.at(b).kind != pickle::Kind::kNone) {
      const auto names = dcp::as_string_list(mp, b);
      if (!names) return corrupt(mw + " ['buffer_names']: not a list of strings");
      buffers.insert(names->begin(), names->end());
    }
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<MoeCand> dense_cands, moe_candidates(dense, model_file, buffers));

    // Every layer's expert files, and no others; each expert's tensors that may be params (in its
    // state_dict's order: the expert module's).
    std::map<std::pair<size_t, int64_t>, std::vector<MoeCand>> expert;  // (layer, global number)
    size_t expert_files = 0, expert_others = 0;
    for (size_t l = 0; l < num_experts.size(); ++l) {
      const auto files = m.experts.find(static_cast<int64_t>(l));
      for (int64_t g = 0; g < num_experts[l]; ++g) {
        if (files == m.experts.end() || !files->second.count(g))
          return corrupt(fmt::format("{}: no layer_{}_expert_{}_mp_rank_00_model_states.pt (MoE layer {} of {} "
                                     "experts, num_experts in {})", m.dir.string(), l, g, l, num_experts[l], mw));
        const fs::path& f = files->second.at(g);
        OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f));
        files_.push_back(std::move(ap.first));
        OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(ap.second, f.string()));
        const std::string mark = fmt::format("deepspeed_moe.experts.deepspeed_experts.{}.", g);
        auto& tensors = expert[{l, g}];
        OPTSTATE_ASSIGN_OR_RETURN(tensors, moe_candidates(md, files_.size() - 1, {}));
        for (const MoeCand& t : tensors)
          if (t.name.find(mark) == std::string::npos)
            return corrupt(fmt::format("{}: '{}' is not a tensor of expert {} (<layer>.{}<param>)", f.string(), t.name, g,
                                       mark));
        expert_others += md.tensors.size() + md.others - tensors.size();
        ++expert_files;
      }
    }
    for (const auto& [l, es] : m.experts)
      if (l < 0 || static_cast<size_t>(l) >= num_experts.size() || es.rbegin()->first >= num_experts[static_cast<size_t>(l)])
        return corrupt(fmt::format("{}: layer_{}_expert_{}_mp_rank_00_model_states.pt, past the {} MoE layers' experts "
                                   "num_experts [{}] in {} lists", m.dir.string(), l, es.rbegin()->first,
                                   num_experts.size(), fmt::join(num_experts, ", "), mw));

    // Each expert-parallel rank's optimizer, its groups' expert-parallel sizes (0: dense).
    std::vector<MoeRank> ranks;
    for (const fs::path& f : m.optim) {
      OPTSTATE_ASSIGN_OR_RETURN(MoeRank r, read_moe_rank(f, world));
      ranks.push_back(std::move(r));
    }
    const int64_t ep_max = *std::max_element(ranks[0].ep.begin(), ranks[0].ep.end());
    if (ep_max == 0)
      return corrupt(m.optim[0].string() + ": no param group of experts ('moe', as DeepSpeed's "
                                           "split_params_into_different_moe_groups_for_optimizer makes them)");
    if (static_cast<int64_t>(ranks.size()) != ep_max)
      return corrupt(fmt::format("{}: {} expp_rank_* files, and the largest expert-parallel group has {} ranks "
                                 "(ep_size_{})", m.dir.string(), ranks.size(), ep_max, ep_max));
    // The global rank that wrote expp_rank_e (its expert-data-parallel rank 0), and its rank in an
    // expert-parallel group of `ep` ranks: consecutive ranks a group, or W/ep apart
    // (use_data_before_expert_parallelism).
    auto ep_rank = [&](size_t e, int64_t ep) {
      const int64_t r = shapes.data_before_expert ? static_cast<int64_t>(e) * (world / ep_max) : static_cast<int64_t>(e);
      return shapes.data_before_expert ? r / (world / ep) : r % ep;
    };

    std::set<int64_t> sizes;
    for (const int64_t ep : ranks[0].ep)
      if (ep) sizes.insert(ep);
    // The experts rank e holds of the layers of size `ep` (layer_ep: each layer's size).
    auto expert_cands = [&](size_t e, int64_t ep, const std::vector<int64_t>& layer_ep, std::vector<const MoeCand*>& out) {
      out.clear();
      for (size_t l = 0; l < num_experts.size(); ++l) {
        if (layer_ep[l] != ep) continue;
        const int64_t n = num_experts[l] / ep, q = ep_rank(e, ep);
        for (int64_t i = 0; i < n; ++i)
          for (const MoeCand& t : expert.at({l, q * n + i})) out.push_back(&t);
      }
    };
    // Each layer's expert-parallel size: every assignment of the groups' sizes that divide its
    // expert count, tried on rank 0's file (at most 4096).
    std::vector<std::vector<int64_t>> choices(num_experts.size());
    size_t assignments = 1;
    for (size_t l = 0; l < num_experts.size(); ++l) {
      for (const int64_t ep : sizes)
        if (num_experts[l] % ep == 0) choices[l].push_back(ep);
      if (choices[l].empty())
        return corrupt(fmt::format("{}: MoE layer {} has {} experts (num_experts), which no expert-parallel size of "
                                   "the groups ({}) divides", mw, l, num_experts[l], fmt::join(sizes, ", ")));
      assignments *= choices[l].size();
      if (assignments > 4096)
        return unsupported(fmt::format("{}: more than 4096 ways to give the {} MoE layers the groups' expert-parallel "
                                       "sizes ({}): not tried", mw, num_experts.size(), fmt::join(sizes, ", ")));
    }
    std::vector<std::vector<int64_t>> fits;
    std::string why;
    std::vector<const MoeCand*> ts;
    for (size_t a = 0; a < assignments; ++a) {
      std::vector<int64_t> layer_ep(num_experts.size());
      for (size_t l = 0, k = a; l < num_experts.size(); k /= choices[l].size(), ++l) layer_ep[l] = choices[l][k % choices[l].size()];
      bool ok = true;
      for (const int64_t ep : sizes) {
        expert_cands(0, ep, layer_ep, ts);
        OPTSTATE_ASSIGN_OR_RETURN(const MoePlacement pl, place_moe_groups(ranks[0], ep, ts, m.optim[0].string()));
        if (!pl.why.empty()) {
          if (why.empty()) why = fmt::format("the groups of ep_size_{}: {}", ep, pl.why);
          ok = false;
          break;
        }
      }
      if (ok) fits.push_back(layer_ep);
    }
    if (fits.size() != 1)
      return corrupt(fmt::format("{}: {} of the MoE layers' expert-parallel sizes fits the param groups of experts "
                                 "(placed in order and by shape among the experts' files){}", m.optim[0].string(),
                                 fits.empty() ? "no assignment" : "more than one assignment",
                                 fits.empty() ? " (" + why + ")" : fmt::format(" ([{}] and [{}])",
                                                                              fmt::join(fits[0], ", "),
                                                                              fmt::join(fits[1], ", "))));
    const std::vector<int64_t>& layer_ep = fits[0];

    // Groups: rank 0's; another rank's matched by name and settings (DeepSpeed orders the MoE
    // groups by a set of their names, so ranks may list them in other orders), the k-th alike of
    // each to the k-th.
    auto settings = [](const GroupSpec& g, int64_t ep) {
      std::vector<std::string> keys;
      for (const GroupExtraSpec& x : g.extras) keys.push_back(x.key);
      return fmt::format("{} {} {} {} {} {} {} [{}]", ep, g.hyper.beta1, g.hyper.beta2, g.hyper.eps,
                         g.hyper.weight_decay, g.hyper.amsgrad, g.hyper.maximize, fmt::join(keys, ","));
    };
    std::vector<std::vector<size_t>> group_of(ranks.size());  // rank's group -> rank 0's
    for (size_t e = 0; e < ranks.size(); ++e) {
      const MoeRank& r = ranks[e];
      const std::string fw = m.optim[e].string();
      if (r.sd.groups.size() != ranks[0].sd.groups.size())
        return corrupt(fmt::format("{}: {} param groups; {} has {}", fw, r.sd.groups.size(), m.optim[0].string(),
                                   ranks[0].sd.groups.size()));
      std::map<std::string, std::vector<size_t>> free;
      for (size_t g = ranks[0].sd.groups.size(); g-- > 0;)
        free[settings(ranks[0].sd.groups[g], ranks[0].ep[g])].push_back(g);
      for (size_t g = 0; g < r.sd.groups.size(); ++g) {
        auto& left = free[settings(r.sd.groups[g], r.ep[g])];
        if (left.empty())
          return corrupt(fmt::format("{} param group {}: no group of {} has its settings", fw, g, m.optim[0].string()));
        group_of[e].push_back(left.back());
        left.pop_back();
      }
    }
    std::vector<double> decays;
    for (size_t g = 0; g < ranks[0].sd.groups.size(); ++g) {
      const GroupSpec& gs = ranks[0].sd.groups[g];
      ParamGroup group;
      group.hyper = gs.hyper;
      OPTSTATE_ASSIGN_OR_RETURN(group.hyper.lr, value_of(ranks[0].file, gs.lr, fmt::format("{} param group {} 'lr'",
                                                                                         m.optim[0].string(), g)));
      decays.push_back(group.hyper.weight_decay);
      meta_.groups.push_back(std::move(group));
      adamw_flags_.push_back(gs.flags);
      GroupExtras& kept = group_extras_.emplace_back();
      for (const GroupExtraSpec& x : gs.extras) {
        if (!x.tensor) kept.emplace_back(x.key, x.value);
        else not_read_.push_back(fmt::format("{} param group {} '{}'", m.optim[0].string(), g, x.key));
      }
    }
    OPTSTATE_RETURN_IF_ERROR(check_zero_decay(shapes, decays, mw));
    for (size_t e = 1; e < ranks.size(); ++e)
      for (size_t g = 0; g < ranks[e].sd.groups.size(); ++g) {
        const size_t g0 = group_of[e][g];
        OPTSTATE_ASSIGN_OR_RETURN(const double lr, value_of(ranks[e].file, ranks[e].sd.groups[g].lr,
                                                            fmt::format("{} param group {} 'lr'", m.optim[e].string(), g)));
        if (!same_number(lr, meta_.groups[g0].hyper.lr))
          return corrupt(fmt::format("{} param group {}: lr {}, its group in {} has {}", m.optim[e].string(), g, lr,
                                     m.optim[0].string(), meta_.groups[g0].hyper.lr));
      }

    // Each rank's params: rank 0's dense ones and every rank's experts, named and read.
    std::vector<const MoeCand*> dense_ptrs;
    for (const MoeCand& c : dense_cands) dense_ptrs.push_back(&c);
    const bool masters = ranks[0].sd.deepspeed_fp16, flat = ranks[0].sd.deepspeed_flat;
    size_t stateless = 0, dense_weights = 0, expert_copies = 0;
    static const std::optional<DTensorSpec> plain;
    for (size_t e = 0; e < ranks.size(); ++e) {
      const MoeRank& r = ranks[e];
      const std::string fw = m.optim[e].string();
      if (r.sd.deepspeed_fp16 != masters || r.sd.deepspeed_flat != flat)
        return corrupt(fmt::format("{}: another optimizer wrapper than {}'s ({})", fw, m.optim[0].string(),
                                   flat ? "FP16_Optimizer's flat groups" : masters ? "FP16_UnfusedOptimizer's" : "none"));
      std::vector<std::pair<MoeSpot, const MoeCand*>> all;  // (placement, its tensor), dense ones first
      if (e == 0) {
        OPTSTATE_ASSIGN_OR_RETURN(const MoePlacement pl, place_moe_groups(r, 0, dense_ptrs, fw));
        if (!pl.why.empty())
          return corrupt(fmt::format("{}: its dense param groups placed among {} ['module']'s params: {}", fw, mw, pl.why));
        for (const MoeSpot& x : pl.placed) all.emplace_back(x, dense_ptrs[x.cand]);
      }
      for (const int64_t ep : sizes) {
        expert_cands(e, ep, layer_ep, ts);
        OPTSTATE_ASSIGN_OR_RETURN(const MoePlacement pl, place_moe_groups(r, ep, ts, fw));
        if (!pl.why.empty())
          return corrupt(fmt::format("{}: its groups of ep_size_{} placed among its experts (MoE layers' sizes [{}]): {}",
                                     fw, ep, fmt::join(layer_ep, ", "), pl.why));
        for (const MoeSpot& x : pl.placed) all.emplace_back(x, ts[x.cand]);
      }
      // in each group's order (torch numbers a group's params in its order; a flat master packs them)
      std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
        return std::tie(a.first.group, a.first.id, a.first.begin) < std::tie(b.first.group, b.first.id, b.first.begin);
      });
      std::map<int64_t, const ParamSpec*> spec_of;
      for (const ParamSpec& s : r.sd.params) spec_of[s.id] = &s;
      for (const auto& item : all) {
        const MoeSpot& x = item.first;  // not structured bindings: clang 14 cannot capture them (view)
        const MoeCand* cand = item.second;
        const std::string& fqn = cand->name;
        const bool is_expert = r.ep[x.group] != 0;
        // an expert of a layer of a smaller expert-parallel size than the largest: rank e's copy
        // of what an earlier rank of its expert-data-parallel group holds (stepped alike)
        if (is_expert && meta_.params.count(fqn)) {
          ++expert_copies;
          continue;
        }
        // the state: the param's own (numbered), or its run of its group's flat param
        const ParamSpec* spec = nullptr;
        if (!flat) {
          const auto sp = spec_of.find(x.id);
          if (sp == spec_of.end()) {
            ++stateless;
            continue;
          }
          spec = sp->second;
        }
        OPTSTATE_RETURN_IF_ERROR(one_name(fqn, fqn, fw));
        const std::string pw = flat ? fmt::format("{} param group {} elements {}.. ('{}')", fw, x.group, x.begin, fqn)
                                    : fmt::format("{} param {} ('{}')", fw, x.id, fqn);
        auto view = [&](dcp::TensorRef t) {  // the param's run of a flat tensor
          if (!flat) return t;
          t.offset += x.begin;
          t.shape = cand->shape;
          t.stride.clear();
          return t;
        };
        const ParamSpec* state = !flat ? spec : r.flat_of[x.group] ? &r.sd.params[*r.flat_of[x.group]] : nullptr;
        ParamState ps;
        ps.shape = cand->shape;
        ps.group = static_cast<int>(group_of[e][x.group]);
        if (state) {
          if (!flat && state->shape != cand->shape) return internal_error(pw + ": placed at another shape");
          OPTSTATE_ASSIGN_OR_RETURN(const double step, value_of(r.file, state->step, pw + " 'step'"));
          if (!(step >= 0 && step < 9.2e18) || step != std::floor(step))
            return corrupt(fmt::format("{}: step {} is not a count", pw, step));
          ps.step = static_cast<int64_t>(step);
          for (const auto& [name, es] : state->entries) {
            if (es.encoding != Encoding::kDense || es.dtensor)
              return corrupt(fmt::format("{} '{}': not a plain tensor", pw, name));
            OPTSTATE_ASSIGN_OR_RETURN(Placed v, place(ps.shape, {Part(r.file, view(es.values), &es.dtensor)},
                                                      fmt::format("{} '{}'", pw, name), /*dense=*/true));
            stored_[{fqn, name, Component::kValues}] = std::move(v.pieces);
            Entry en;
            en.dtype = es.values.dtype;
            ps.entries.emplace(name, std::move(en));
          }
        }
        // Weights: the wrapper's fp32 masters; else the module's (dense) or the expert file's.
        if (flat) {
          OPTSTATE_RETURN_IF_ERROR(add_weights(fqn, ps, {Part(r.file, view(r.sd.deepspeed_flat_masters[x.group]), &plain)},
                                               fmt::format("{} {}['fp32_groups_flat'][{}] ('{}')", fw,
                                                           r.sd.deepspeed_flat_at, x.group, fqn)));
        } else if (masters) {
          if (!spec->weight) return corrupt(pw + ": no fp32 master in ['optimizer']['fp32_groups']");
          OPTSTATE_RETURN_IF_ERROR(add_weights(fqn, ps, {Part(r.file, *spec->weight, &plain)},
                                               fmt::format("{} ['optimizer']['fp32_groups'] ('{}')", fw, fqn)));
        } else {
          OPTSTATE_RETURN_IF_ERROR(add_weights(fqn, ps, {Part(cand->file, cand->tensor, &plain)},
                                               fmt::format("{} ['{}']", files_[cand->file].path.string(), fqn)));
          dense_weights += !is_expert;
        }
        meta_.groups[ps.group].params.push_back(fqn);
        meta_.params.emplace(fqn, std::move(ps));
      }
    }

    // What is not read, and how the state was read.
    for (const std::string& n : shapes.not_read) {
      if (n.rfind("['module']", 0) == 0) continue;  // below
      not_read_.push_back(mw + " " + n);
    }
    const size_t module_entries = dense.tensors.size() + dense.others;
    if (masters || flat) {
      not_read_.push_back(fmt::format("{} ['module'] ({} entries: the dense params' weights and buffers in their "
                                      "training dtype; the fp32 masters are read)", mw, module_entries));
    } else if (module_entries > dense_weights) {
      not_read_.push_back(fmt::format("{} ['module'] ({} entr{} besides the optimized params' weights)", mw,
                                      module_entries - dense_weights, module_entries - dense_weights == 1 ? "y" : "ies"));
    }
    for (const std::string& n : ranks[0].sd.not_read) not_read_.push_back(m.optim[0].string() + " " + n);
    if (stateless)
      not_read_.push_back(fmt::format("{} param{} without state (never stepped: no shape in the files)", stateless,
                                      stateless == 1 ? "" : "s"));
    if ((masters || flat) && expert_files)
      uncarried_notes_.push_back(fmt::format("layer_*_expert_*_model_states.pt ({} file{}: the experts' weights in "
                                             "their training dtype; the fp32 masters are read)", expert_files,
                                             expert_files == 1 ? "" : "s"));
    else if (expert_others)
      uncarried_notes_.push_back(fmt::format("layer_*_expert_*_model_states.pt ({} entr{} besides the experts' params)",
                                             expert_others, expert_others == 1 ? "y" : "ies"));
    if (ranks.size() > 1)
      uncarried_notes_.push_back(fmt::format("expp_rank_1.._{}: their dense params (copies of expp_rank_0's: every "
                                             "rank steps them alike){}", ranks.size() - 1,
                                             expert_copies ? fmt::format(", and {} params of experts an earlier file "
                                                                         "holds too (layers of a smaller expert-"
                                                                         "parallel size)", expert_copies) : ""));
    value_notes_.push_back(fmt::format(
        "DeepSpeed MoE without ZeRO: each expert-parallel rank's numbered params named by order and shape after "
        "['module'] (dense) and its experts' layer_L_expert_G files (MoE layers' expert-parallel sizes [{}]); "
        "experts under their global numbers (rank e's local expert i is e*n+i), the dense params from expp_rank_0{}",
        fmt::join(layer_ep, ", "),
        flat ? "; FP16_Optimizer's flat groups: each param placed in its group's fp32 master where the master rounds "
               "to its weights (the module's, the experts' files'), its moments and master the flat tensors' run there"
        : masters ? "; the wrapper's fp32 masters (['optimizer']['fp32_groups']) read as the weights" : ""));
    return finish({}, {}, 0);
  }

  // Another copy of elements read elsewhere: a tied module's copy in a later pipeline stage
  // (DeepSpeed's TiedLayerSpec: the same name, stepped alike), or a tensor-parallel rank's copy
  // of a block every rank holds (AutoTP: a replicated param, stepped alike on each). `pieces` are
  // runs of the entry's elements in its order; validate compares them with what is read there.
  struct ZeroCopy {
    std::string fqn, entry;
    size_t stage = 0;
    std::vector<Piece> pieces;
  };

  // One model-parallel rank's ZeRO set (a pipeline stage, or a tensor-parallel rank) as read:
  // its groups (settings with the lr read; the step of each group's first flat param) and its
  // params in order, each entry's runs in the rank's own (local) element order.
  struct ZeroSliceParam {
    std::string name;
    std::vector<int64_t> shape;
    size_t group = 0;
    int64_t step = 0;
    std::map<std::string, std::vector<Piece>> entries;
  };
  struct ZeroSlice {
    std::vector<Hyperparameters> hyper;            // by param group
    std::vector<std::optional<int64_t>> step;      // by param group
    std::vector<ZeroSliceParam> params;
    ZeroShapes shapes;
  };

  // DeepSpeed MoE's experts as its ZeRO files hold them: each MoE group ('moe', "ep_size_E") lists
  // one expert-parallel rank's local experts, <prefix>deepspeed_moe.experts.deepspeed_experts.<i>.<rest>
  // with i < n; every expert-parallel rank e holds its own under the same names, and DeepSpeed
  // numbers them e*n+i (its layer_L_expert_<e*n+i> files). Each layer (prefix): its E and n (its
  // experts may sit in several groups: one per client group, all of one E),
  // checked against num_experts (n*E by layer) and the experts' files.
  struct ZeroExperts {
    struct Layer {
      std::string prefix;
      int64_t ep_size = 0, local_experts = 0;
    };
    std::vector<Layer> layers;  // by the groups' order
    std::map<std::string, std::pair<std::string, std::pair<int64_t, std::string>>> local;  // name -> prefix, (i, rest)
    int64_t experts = 0;                                                                     // all layers'
    // AutoEP's fused expert params: name -> the whole tensor's shape ([experts, ...]); each
    // expert-parallel rank e's shard is its experts e*n .. e*n+n-1, one block, as its map says.
    std::map<std::string, std::vector<int64_t>> autoep;
  };
  // An AutoEP param's map as DeepSpeed 0.19 writes it without folding (expert_tensor_parallel_size
  // 1): every expert-parallel rank e one piece, its whole shard (the param's shape in param_shapes),
  // at experts e*n.. of the whole; anything else (folded AutoEP+AutoTP) is refused.
  static Result<std::vector<int64_t>> autoep_whole_shape(const std::string& name, const std::vector<int64_t>& shard,
                                                         int64_t ep, const ZeroShapes::AutoEpLayer& layer,
                                                         const AffineMap& m, const std::string& mw) {
    auto contiguous = [](const std::vector<int64_t>& shape) {
      std::vector<int64_t> strides(shape.size(), 1);
      for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
      return strides;
    };
    const std::string pw = fmt::format("{}: AutoEP's '{}'", mw, name);
    if (layer.ep_size != ep)
      return corrupt(fmt::format("{}: in a group of expert-parallel size {}, its layer's ep_size {}", pw, ep, layer.ep_size));
    const std::vector<int64_t>& whole = m.logical_shape;
    if (shard.empty() || whole.size() != shard.size() || shard[0] != layer.num_local_experts ||
        whole[0] != layer.num_experts || !std::equal(shard.begin() + 1, shard.end(), whole.begin() + 1))
      return corrupt(fmt::format("{}: shape [{}] of {} local experts, whole [{}] of {}", pw, fmt::join(shard, ", "),
                                 layer.num_local_experts, fmt::join(whole, ", "), layer.num_experts));
    const int64_t numel = *checked_numel(shard);
    if (m.ranks.size() != static_cast<size_t>(ep) || m.ranks.rbegin()->first != ep - 1)
      return corrupt(fmt::format("{}: a map of {} ranks for {} expert-parallel ranks", pw, m.ranks.size(), ep));
    for (const auto& [e, ar] : m.ranks) {
      const bool one_block = ar.shard_shape == shard && ar.pieces.size() == 1 && ar.pieces[0].shape == shard &&
                             ar.pieces[0].locations == std::vector<int64_t>{e} && ar.pieces[0].scale == 1.0 &&
                             ar.pieces[0].dest_offset == 0 && ar.pieces[0].dest_strides == contiguous(shard) &&
                             ar.pieces[0].source_strides == contiguous(whole) && ar.pieces[0].source_offset == e * numel;
      if (!one_block)
        return corrupt(fmt::format("{}: expert-parallel rank {}'s map is not its shard whole as experts {} to {} "
                                   "(AutoEP folded with AutoTP?): not read", pw, e, e * layer.num_local_experts,
                                   (e + 1) * layer.num_local_experts - 1));
    }
    return whole;
  }
  static Result<ZeroExperts> zero_experts(const ZeroFiles& z, const ZeroRank& r0, const ZeroShapes& shapes,
                                          const std::string& mw) {
    ZeroExperts out;
    const bool moe = std::any_of(r0.groups.begin(), r0.groups.end(), [](const ZeroGroup& zg) { return zg.ep_size; });
    if (!moe) {
      if (!z.expert_files.empty() || !shapes.num_experts.empty())
        return corrupt(fmt::format("{}: MoE layers (num_experts, layer_*_expert_* files), but no param group of experts "
                                   "('moe', as DeepSpeed's split_params_into_different_moe_groups_for_optimizer makes "
                                   "them), which DeepSpeed's ZeRO requires", mw));
      return out;
    }
    if (shapes.num_experts.empty())
      return corrupt(mw + ": param groups of experts ('moe'), but no 'num_experts' list of the MoE layers");
    constexpr std::string_view marker = "deepspeed_moe.experts.deepspeed_experts.";
    std::map<std::string, size_t> layer_of;  // prefix -> layers
    std::map<std::string, std::set<int64_t>> ids;
    for (size_t g = 0; g < r0.groups.size(); ++g) {
      if (!r0.groups[g].ep_size) continue;
      for (const auto& param : shapes.groups[g]) {
        const std::string& name = param.first;  // not a structured binding: the lambda below takes it
        const std::vector<int64_t>& shape = param.second;
        if (const auto am = shapes.autoep_maps.params.find(name); am != shapes.autoep_maps.params.end()) {
          const auto layer = std::find_if(shapes.autoep_layers.begin(), shapes.autoep_layers.end(), [&](const auto& l) {
            return name.rfind(l.prefix + ".", 0) == 0 && name.find('.', l.prefix.size() + 1) == std::string::npos;
          });
          if (layer == shapes.autoep_layers.end())
            return corrupt(fmt::format("{}: AutoEP's map of '{}', which is under no layer's expert_key_prefix", mw, name));
          OPTSTATE_ASSIGN_OR_RETURN(out.autoep[name],
                                    autoep_whole_shape(name, shape, *r0.groups[g].ep_size, *layer, am->second, mw));
          continue;
        }
        const auto m = name.find(marker);
        const size_t digits = m == std::string::npos ? 0 : m + marker.size();
        size_t end = digits;
        while (end < name.size() && end - digits < 7 && name[end] >= '0' && name[end] <= '9') ++end;
        if (m == std::string::npos || end == digits || end >= name.size() || name[end] != '.')
          return corrupt(fmt::format("{} param group {}: '{}' in a group of experts ('moe'), but not an expert of a "
                                     "DeepSpeed MoE layer (<layer>.{}<i>.<param>)", mw, r0.groups[g].param_group, name,
                                     marker));
        const std::string prefix = name.substr(0, digits);
        const int64_t i = std::stoll(name.substr(digits, end - digits));
        const int64_t ep = *r0.groups[g].ep_size;
        auto [at, fresh] = layer_of.emplace(prefix, out.layers.size());
        if (fresh) out.layers.push_back({prefix, ep, 0});
        if (out.layers[at->second].ep_size != ep)
          return corrupt(fmt::format("{}: MoE layer '{}' has experts in groups of expert-parallel sizes {} and {}", mw,
                                     prefix, out.layers[at->second].ep_size, ep));
        ids[prefix].insert(i);
        out.local[name] = {prefix, {i, name.substr(end)}};
      }
    }
    std::vector<int64_t> held, want = shapes.num_experts;
    for (const ZeroShapes::AutoEpLayer& layer : shapes.autoep_layers) held.push_back(layer.num_experts);
    for (ZeroExperts::Layer& layer : out.layers) {
      const auto& local = ids[layer.prefix];
      layer.local_experts = static_cast<int64_t>(local.size());
      if (*local.rbegin() != layer.local_experts - 1)
        return corrupt(fmt::format("{}: MoE layer '{}' lists local experts {}, not 0 to {}", mw, layer.prefix,
                                   fmt::join(local, ", "), layer.local_experts - 1));
      held.push_back(layer.local_experts * layer.ep_size);
    }
    std::sort(held.begin(), held.end());
    std::sort(want.begin(), want.end());
    if (held != want)
      return corrupt(fmt::format("{}: num_experts [{}] by MoE layer, but the groups of experts hold layers of [{}] "
                                 "experts (local experts times expert-parallel size; AutoEP's num_experts)", mw,
                                 fmt::join(shapes.num_experts, ", "), fmt::join(held, ", ")));
    // Every layer's expert files, and no others: a checkpoint DeepSpeed would resume from.
    for (size_t l = 0; l < shapes.num_experts.size(); ++l) {
      const auto files = z.expert_files.find(static_cast<int64_t>(l));
      for (int64_t e = 0; e < shapes.num_experts[l]; ++e)
        if (files == z.expert_files.end() || !files->second.count(e))
          return corrupt(fmt::format("{}: no layer_{}_expert_{}_mp_rank_00_model_states.pt (MoE layer {} of {} "
                                     "experts, num_experts in {})", z.dir.string(), l, e, l, shapes.num_experts[l], mw));
      out.experts += shapes.num_experts[l];
    }
    for (const auto& [l, es] : z.expert_files)
      if (l < 0 || static_cast<size_t>(l) >= shapes.num_experts.size() || *es.rbegin() >= shapes.num_experts[l])
        return corrupt(fmt::format("{}: layer_{}_expert_{}_mp_rank_00_model_states.pt, past the {} MoE layers' experts "
                                   "num_experts [{}] in {} lists", z.dir.string(), l, *es.rbegin(),
                                   shapes.num_experts.size(), fmt::join(shapes.num_experts, ", "), mw));
    return out;
  }

  // DeepSpeed orders the MoE groups by a set of their names (split_params_into_different_moe_groups_
  // for_optimizer), so ranks run with other hash seeds (torchrun's processes) save them in other
  // orders: `zr`'s MoE groups are put in rank 0's order. Each is rank 0's group of its expert-parallel
  // size and settings whose params (param_shapes, rank 0's) hold all of its runs; candidates are
  // taken by elimination, any still open (no runs to tell) in order. Dense groups keep their place.
  static Status align_moe_groups(ZeroRank& zr, const ZeroRank& r0, const ZeroShapes& shapes, const std::string& wf) {
    const size_t n = r0.groups.size();
    if (zr.stage == 3 || zr.groups.size() != n || shapes.groups.size() != n) return Status::Ok();  // refused after
    if (std::none_of(zr.groups.begin(), zr.groups.end(), [](const ZeroGroup& zg) { return zg.ep_size; }))
      return Status::Ok();
    std::vector<std::set<size_t>> candidates(n);
    std::set<size_t> taken;
    for (size_t j = 0; j < n; ++j) {
      const ZeroGroup& zg = zr.groups[j];
      if (!zg.ep_size) {
        candidates[j] = {j};
        continue;
      }
      for (size_t g = 0; g < n; ++g) {
        if (r0.groups[g].ep_size != zg.ep_size) continue;
        Hyperparameters x = zg.group.hyper, y = r0.groups[g].group.hyper;
        x.lr = y.lr = 0;  // compared once aligned, as read
        if (!(x == y)) continue;
        std::set<std::string> names;
        for (const auto& [name, shape] : shapes.groups[g]) names.insert(name);
        if (std::all_of(zg.fragments.begin(), zg.fragments.end(), [&](const ZeroFragment& fr) {
              return names.count(fr.name) > 0;
            }))
          candidates[j].insert(g);
      }
    }
    std::vector<std::optional<size_t>> to(n);
    for (bool progress = true; progress;) {
      progress = false;
      for (size_t j = 0; j < n; ++j) {
        if (to[j]) continue;
        for (const size_t t : taken) candidates[j].erase(t);
        if (candidates[j].size() == 1) {
          to[j] = *candidates[j].begin();
          taken.insert(*to[j]);
          progress = true;
        }
      }
    }
    for (size_t j = 0; j < n; ++j) {
      if (to[j]) continue;
      for (const size_t t : taken) candidates[j].erase(t);
      if (candidates[j].empty())
        return corrupt(fmt::format("{} flat param {}: a group of experts (ep_size_{}) that is none of rank 0's file's "
                                   "of its expert-parallel size, settings and params", wf, j,
                                   zr.groups[j].ep_size.value_or(0)));
      to[j] = *candidates[j].begin();
      taken.insert(*to[j]);
    }
    std::vector<ZeroGroup> groups(n);
    for (size_t j = 0; j < n; ++j) {
      groups[*to[j]] = std::move(zr.groups[j]);
      groups[*to[j]].param_group = r0.groups[*to[j]].param_group;
    }
    zr.groups = std::move(groups);
    return Status::Ok();
  }

  // A pipeline's layer files (layer_<L>-model_states.pt in z.dir): layer -> key -> shape.
  using LayerShapes = std::map<int64_t, std::map<std::string, std::vector<int64_t>>>;
  static Result<LayerShapes> read_layer_shapes(const ZeroFiles& z) {
    LayerShapes layers;
    std::error_code ec;
    size_t seen = 0;
    for (fs::directory_iterator it(z.dir, ec), end; !ec && it != end; it.increment(ec)) {
      if (++seen > (size_t{1} << 20)) return corrupt(z.dir.string() + ": more than 2^20 entries");
      const std::string name = it->path().filename().string();
      const auto tp = zero_layer_name(name);
      if (!tp) continue;
      if (*tp != -1)
        return unsupported(fmt::format("{}: a tensor-parallel rank's layer file beside a pipeline under bf16 without "
                                       "ZeRO (Megatron-DeepSpeed's tensor parallelism): not read", it->path().string()));
      const int64_t layer = std::stoll(name.substr(6, name.size() - 6 - 16));  // layer_<L>-model_states.pt
      OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(it->path()));
      OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(ap.second, it->path().string()));
      auto& keys = layers[layer];
      for (const ModelTensor& t : md.tensors) keys[t.name] = t.dtensor ? t.dtensor->global_shape : t.tensor.shape;
    }
    if (ec) return io_error(fmt::format("{}: {}", z.dir.string(), ec.message()));
    return layers;
  }

  // DeepSpeed's pipeline under bf16 without ZeRO (BF16_Optimizer): the model states name no param's
  // shape (param_shapes None). Each flat param's params are its ranks' fragments (named; in flat
  // order: rank by rank, each from its start), their shapes the pipeline's layer files' tensors:
  // '<L>.<key>' is layer_<L>-model_states.pt's <key>; a tied module's 'tied_modules.<name>.<key>'
  // the <key> of the layer files that hold one of its element count (all of one shape).
  Status shapes_from_layer_files(const ZeroFiles& z, const std::vector<ZeroRank>& ranks, ZeroShapes& shapes,
                                 const std::string& mw, bool pipeline) {
    if (!pipeline || z.layer_files == 0)
      return corrupt(mw + ": param_shapes is None and the optimizer's state_dict is beside it: DeepSpeed without ZeRO "
                          "whose bf16_zero_pp_rank_* files name no param's shape, and no pipeline layer files "
                          "(layer_*-model_states.pt) to take the shapes from: not read");
    // The layer files are read once for every stage (each stage's slice calls this).
    if (!layer_shapes_) {
      OPTSTATE_ASSIGN_OR_RETURN(layer_shapes_, read_layer_shapes(z));
    }
    const auto& layers = *layer_shapes_;
    auto layer_file = [](int64_t layer) { return fmt::format("layer_{:02d}-model_states.pt", layer); };
    auto shape_of = [&](const std::string& name, int64_t numel) -> Result<std::vector<int64_t>> {
      const std::string pw = fmt::format("{}: '{}' (param_shapes is None)", mw, name);
      constexpr std::string_view tied = "tied_modules.";
      if (name.starts_with(tied)) {
        const size_t dot = name.find('.', tied.size());
        if (dot == std::string::npos || dot + 1 >= name.size())
          return corrupt(pw + ": a tied module's param is named 'tied_modules.<name>.<key>'");
        const std::string key = name.substr(dot + 1);
        std::map<std::vector<int64_t>, int64_t> found;  // shape -> a layer holding it
        for (const auto& [layer, keys] : layers) {
          const auto k = keys.find(key);
          if (k == keys.end()) continue;
          const auto n = checked_numel(k->second);
          if (n.ok() && *n == numel) found.emplace(k->second, layer);
        }
        if (found.empty())
          return corrupt(fmt::format("{}: no pipeline layer file holds a '{}' of its {} elements", pw, key, numel));
        if (found.size() > 1)
          return corrupt(fmt::format("{}: {} and {} hold a '{}' of its {} elements, shaped {} and {}: which is the tied "
                                     "module's cannot be told", pw, layer_file(found.begin()->second),
                                     layer_file(std::next(found.begin())->second), key, numel,
                                     format_shape(found.begin()->first), format_shape(std::next(found.begin())->first)));
        return found.begin()->first;
      }
      const size_t dot = name.find('.');
      const std::string digits = dot == std::string::npos ? "" : name.substr(0, dot);
      if (digits.empty() || digits.size() > 7 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
        return unsupported(pw + ": not a pipeline layer's param ('<layer>.<key>' or 'tied_modules.<name>.<key>'), "
                                "whose shape a layer file would give");
      const int64_t layer = std::stoll(digits);
      const std::string key = name.substr(dot + 1);
      const auto l = layers.find(layer);
      if (l == layers.end()) return corrupt(fmt::format("{}: no {} in {}", pw, layer_file(layer), z.dir.string()));
      const auto k = l->second.find(key);
      if (k == l->second.end()) return corrupt(fmt::format("{}: {} holds no '{}'", pw, layer_file(layer), key));
      return k->second;
    };
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    shapes.groups.clear();
    for (size_t g = 0; g < ranks[0].groups.size(); ++g) {
      std::map<std::string, std::pair<int64_t, int64_t>> runs;  // name -> (first element in the group, elements)
      int64_t offset = 0;
      for (const ZeroRank& zr : ranks) {
        const ZeroGroup& zg = zr.groups.at(g);
        for (const ZeroFragment& fr : zg.fragments) {
          if (fr.start < 0 || fr.numel < 0 || fr.start > kMax - offset) return corrupt(mw + ": a fragment past any file");
          auto [it, fresh] = runs.try_emplace(fr.name, offset + fr.start, 0);
          it->second.first = std::min(it->second.first, offset + fr.start);
          if (fr.numel > kMax - it->second.second) return corrupt(mw + ": a fragment past any file");
          it->second.second += fr.numel;
        }
        const int64_t part = zg.master.shape.empty() ? 0 : zg.master.shape[0];
        if (part < 0 || part > kMax - offset) return corrupt(mw + ": a partition past any file");
        offset += part;
      }
      std::vector<std::tuple<int64_t, std::string, int64_t>> order;
      for (const auto& [name, run] : runs) order.emplace_back(run.first, name, run.second);
      std::sort(order.begin(), order.end());
      auto& params = shapes.groups.emplace_back();
      for (const auto& [at, name, numel] : order) {
        OPTSTATE_ASSIGN_OR_RETURN(auto shape, shape_of(name, numel));
        params.emplace_back(name, std::move(shape));
      }
    }
    const std::string note = "DeepSpeed's pipeline without ZeRO (BF16_Optimizer) saves no param_shapes: each param's "
                             "shape read from the pipeline's layer files (layer_<L>-model_states.pt; a tied module's "
                             "from the layer files holding a tensor of its name and size)";
    if (std::find(value_notes_.begin(), value_notes_.end(), note) == value_notes_.end()) value_notes_.push_back(note);
    return Status::Ok();
  }

  Result<ZeroSlice> read_zero_slice(const ZeroFiles& z, size_t st) {
    const ZeroStage& zs = z.stages[st];
    const bool pipeline = (z.stages.size() > 1 || z.layer_files > 0) && !z.tensor_parallel;
    const std::string slice_name = z.tensor_parallel ? "tensor-parallel rank" : "pipeline stage";
    const size_t world = zs.optim.size(), base = files_.size();
    std::vector<ZeroRank> ranks;
    for (const fs::path& f : zs.optim) {
      OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f));
      files_.push_back(std::move(ap.first));
      OPTSTATE_ASSIGN_OR_RETURN(ZeroRank zr, interpret_zero_optim(ap.second, f.string()));
      ranks.push_back(std::move(zr));
    }
    const ZeroRank& r0 = ranks[0];
    const bool stage3 = r0.stage == 3;
    if (pipeline && stage3)
      return corrupt(zs.optim[0].string() + ": ZeRO stage 3 beside pipeline layer files (DeepSpeed's pipeline takes "
                                            "stages 0 and 1)");
    OPTSTATE_ASSIGN_OR_RETURN(auto model, open_archive(zs.model));
    const std::string mw = zs.model.string();
    ZeroSlice out;
    OPTSTATE_ASSIGN_OR_RETURN(out.shapes, interpret_zero_model(model.second, mw));
    if (out.shapes.without_zero) OPTSTATE_RETURN_IF_ERROR(shapes_from_layer_files(z, ranks, out.shapes, mw, pipeline));
    const ZeroShapes& shapes = out.shapes;
    if (shapes.groups.size() != r0.groups.size())
      return corrupt(fmt::format("{}: {} flat params in param_shapes, {} in the optimizer's files", mw,
                                 shapes.groups.size(), r0.groups.size()));
    for (size_t f = 1; f < world; ++f)
      OPTSTATE_RETURN_IF_ERROR(align_moe_groups(ranks[f], r0, shapes, zs.optim[f].string()));
    for (size_t f = 0; f < world; ++f) {
      const ZeroRank& zr = ranks[f];
      const std::string wf = zs.optim[f].string();
      if (zr.partitions != static_cast<int64_t>(world))
        return corrupt(fmt::format("{}: partition_count {}, but {} holds {} ranks' optimizer files{}", wf, zr.partitions,
                                   z.dir.string(), world,
                                   z.stages.size() > 1 ? fmt::format(" of {} {}", slice_name, st) : ""));
      if ((zr.stage == 3) != stage3 || zr.param_groups != r0.param_groups || zr.groups.size() != r0.groups.size())
        return corrupt(fmt::format("{}: ZeRO stage {} with {} param groups ({} flat params), rank 0's file stage {} with "
                                   "{} ({})", wf, zr.stage, zr.param_groups, zr.groups.size(), r0.stage,
                                   r0.param_groups, r0.groups.size()));
      for (size_t g = 0; g < zr.groups.size(); ++g) {
        std::set<std::string> a, b;
        for (const auto& [n, t] : zr.groups[g].moments) a.insert(n);
        for (const auto& [n, t] : r0.groups[g].moments) b.insert(n);
        Hyperparameters x = zr.groups[g].group.hyper, y = r0.groups[g].group.hyper;
        x.lr = y.lr = 0;  // compared below, as read
        if (a != b || !(x == y) || zr.groups[g].param_group != r0.groups[g].param_group ||
            zr.groups[g].ep_size != r0.groups[g].ep_size)
          return corrupt(fmt::format("{} flat param {}: group, moments or hyperparameters other than rank 0's file's", wf, g));
      }
    }
    // What DeepSpeed 0.15+ records of the grid (older ones record only mp_world_size: pp x tp).
    const auto slices = static_cast<int64_t>(z.stages.size());
    const int64_t want_tp = z.tensor_parallel ? slices : 1, want_pp = pipeline ? slices : 1;
    if (shapes.tp_degree && *shapes.tp_degree != want_tp)
      return corrupt(fmt::format("{}: tp_degree {}, but {} holds {} model-parallel ranks' files{}", mw,
                                 *shapes.tp_degree, z.dir.string(), slices,
                                 z.layer_files ? " and a pipeline's layer files" : ""));
    if ((shapes.pp_degree && *shapes.pp_degree != want_pp) || (shapes.mp_world_size && *shapes.mp_world_size != slices))
      return corrupt(fmt::format("{}: {} model-parallel ranks (pp_degree {}), but {} holds {} {}s' files", mw,
                                 shapes.mp_world_size.value_or(-1), shapes.pp_degree.value_or(-1), z.dir.string(),
                                 slices, pipeline ? "stage" : "rank"));
    std::vector<double> decay(r0.param_groups);
    for (const ZeroGroup& zg : r0.groups) decay[zg.param_group] = zg.group.hyper.weight_decay;
    OPTSTATE_RETURN_IF_ERROR(check_zero_decay(shapes, decay, mw));
    OPTSTATE_ASSIGN_OR_RETURN(const ZeroExperts experts, zero_experts(z, r0, shapes, mw));
    for (const auto& lines : {shapes.not_read, r0.not_read})
      for (const std::string& n : lines)
        if (std::find(not_read_.begin(), not_read_.end(), n) == not_read_.end()) not_read_.push_back(n);
    bool bnb_partitions = false;  // some moments are bitsandbytes' 8-bit codes
    out.hyper.resize(r0.param_groups);
    out.step.resize(r0.param_groups);
    for (const ZeroGroup& zg : r0.groups) out.hyper[zg.param_group] = zg.group.hyper;
    std::vector<double> lr_of(r0.param_groups, 0.0);
    // Each flat param (g): a param group's, or under ZeRO-3 one of its sub-groups, in group order.
    for (size_t g = 0; g < r0.groups.size(); ++g) {
      const size_t pg = r0.groups[g].param_group;
      const std::string gw = z.stages.size() > 1 ? fmt::format("{} {} {} param group {}", z.dir.string(), slice_name, st, pg)
                                                 : fmt::format("{} param group {}", z.dir.string(), pg);
      std::optional<int64_t> step;  // this flat param's
      for (size_t f = 0; f < world; ++f) {
        const ZeroGroup& zg = ranks[f].groups[g];
        const std::string fw = fmt::format("{} param group {}{}", zs.optim[f].string(), pg,
                                           r0.groups.size() == r0.param_groups ? "" : fmt::format(" flat param {}", g));
        OPTSTATE_ASSIGN_OR_RETURN(const double lr, value_of(base + f, zg.group.lr, fw + " 'lr'"));
        OPTSTATE_ASSIGN_OR_RETURN(const double sv, value_of(base + f, zg.step, fw + " 'step'"));
        if (!(sv >= 0 && sv < 9.2e18) || sv != std::floor(sv)) return corrupt(fmt::format("{}: step {} is not a count", fw, sv));
        if (f == 0) {
          if (!out.step[pg]) {  // the group's first flat param
            lr_of[pg] = lr;
            out.step[pg] = static_cast<int64_t>(sv);
          }
          step = static_cast<int64_t>(sv);
        }
        if (lr != lr_of[pg] || static_cast<int64_t>(sv) != *step)
          return corrupt(fmt::format("{}: lr {} and step {}, rank 0's file {} and {}", fw, lr, sv, lr_of[pg], *step));
      }
      out.hyper[pg].lr = lr_of[pg];
      // Every rank's runs of each param: (rank, first element in the rank's partition, count).
      // An MoE group's params are each expert-parallel rank's own experts, named as its local ones:
      // read per expert-parallel rank from its expert-data-parallel ranks, under global names.
      const auto& local_params = shapes.groups[g];
      const std::optional<int64_t> ep = r0.groups[g].ep_size;
      std::vector<std::pair<std::string, std::vector<int64_t>>> params;  // as read: global names
      std::vector<std::pair<std::vector<size_t>, std::map<std::string, std::string>>> shares;  // holders, local -> read
      std::map<std::string, size_t> share_of;  // an expert's global name -> its expert-parallel rank
      if (!ep) {
        params = local_params;
        std::vector<size_t> all(world);
        std::iota(all.begin(), all.end(), size_t{0});
        std::map<std::string, std::string> same;
        for (const auto& [name, shape] : local_params) same[name] = name;
        shares.emplace_back(std::move(all), std::move(same));
      } else {
        const auto e_size = static_cast<size_t>(*ep), edp = world / e_size;
        for (size_t e = 0; e < e_size; ++e) {
          std::vector<size_t> holders;
          for (size_t k = 0; k < edp; ++k) holders.push_back(shapes.data_before_expert ? e * edp + k : e + k * e_size);
          shares.emplace_back(std::move(holders), std::map<std::string, std::string>{});
        }
        // AutoEP's fused experts: each expert-parallel rank's shard is the next block of the whole.
        for (const auto& [name, shape] : local_params) {
          const auto whole = experts.autoep.find(name);
          if (whole == experts.autoep.end()) continue;
          for (size_t e = 0; e < e_size; ++e) shares[e].second[name] = name;
          params.emplace_back(name, whole->second);
        }
        // Layer by layer (in the group's order), each expert-parallel rank's experts in turn.
        for (const ZeroExperts::Layer& layer : experts.layers)
          for (size_t e = 0; e < e_size; ++e)
            for (const auto& [name, shape] : local_params) {
              const auto at = experts.local.find(name);
              if (at == experts.local.end() || at->second.first != layer.prefix) continue;
              const std::string global = layer.prefix + std::to_string(static_cast<int64_t>(e) * layer.local_experts +
                                                                       at->second.second.first) + at->second.second.second;
              shares[e].second[name] = global;
              share_of[global] = e;
              params.emplace_back(global, shape);
            }
      }
      std::map<std::string, std::vector<std::tuple<size_t, int64_t, int64_t>>> runs;
      std::vector<int64_t> partition(world);
      for (size_t f = 0; f < world; ++f) partition[f] = ranks[f].groups[g].master.shape[0];
      if (stage3) {
        int64_t offset = 0;
        const auto w = static_cast<int64_t>(world);
        for (const auto& [name, shape] : params) {
          const int64_t numel = *checked_numel(shape), part = (numel + w - 1) / w;
          // Checked before it is added: a partition is no larger than its file, so nothing overflows.
          for (size_t f = 0; f < world; ++f)
            if (part > partition[f] - offset)
              return corrupt(fmt::format("{}: '{}' ends past element {} of the flat partition, which holds {}",
                                         zs.optim[f].string(), name, offset, partition[f]));
          for (size_t f = 0; f < world; ++f) {
            const int64_t count = std::clamp<int64_t>(numel - static_cast<int64_t>(f) * part, 0, part);
            if (count > 0) runs[name].emplace_back(f, offset, count);
          }
          offset += part;
        }
      } else {
        for (const auto& [holders, named] : shares)
          for (const size_t f : holders) {
            std::vector<ZeroFragment> frags = ranks[f].groups[g].fragments;
            std::sort(frags.begin(), frags.end(), [](const auto& a, const auto& b) { return a.start < b.start; });
            int64_t end = 0;
            for (const ZeroFragment& fr : frags) {
              const std::string fw = fmt::format("{} param group {} '{}'", zs.optim[f].string(), g, fr.name);
              const auto read_as = named.find(fr.name);
              if (read_as == named.end()) return corrupt(fw + ": mapped, but the model states' param_shapes do not list it");
              if (fr.start < end || fr.numel > partition[f] - fr.start)
                return corrupt(fmt::format("{}: run [{}, {}) overlaps another or leaves the partition of {}", fw,
                                           fr.start, fr.start + fr.numel, partition[f]));
              end = fr.start + fr.numel;
              if (fr.numel > 0) runs[read_as->second].emplace_back(f, fr.start, fr.numel);
            }
          }
      }
      // bitsandbytes' 8-bit moments of this flat param (codes whose blocks count from each rank's
      // partition start): each rank's scales and map, found once for all its params.
      std::map<std::pair<size_t, std::string>, Dequant> dequant;  // (rank, entry)
      for (size_t f = 0; f < world; ++f)
        for (const auto& [entry, q] : ranks[f].groups[g].quant) {
          const std::string qw = fmt::format("{} flat param {} '{}' in {}", gw, g, entry, zs.optim[f].string());
          OPTSTATE_ASSIGN_OR_RETURN(const std::string map, map_name(base + f, q.qmap, qw + " map"));
          OPTSTATE_ASSIGN_OR_RETURN(const QMap m, qmap_from_name(map));
          OPTSTATE_ASSIGN_OR_RETURN(const Stored scales, resolve(base + f, q.absmax, q.absmax.shape[0], qw + " absmax"));
          dequant[{f, entry}] = Dequant{scales, 0, q.block, &qmap_table(m)};
        }
      if (!dequant.empty()) bnb_partitions = true;
      for (const auto& [name, shape] : params) {
        const int64_t numel = *checked_numel(shape);
        const std::string pw = fmt::format("{} '{}'", gw, name);
        int64_t covered = 0;
        for (const auto& [f, local, count] : runs[name]) covered += count;
        if (experts.autoep.count(name)) {  // each expert-parallel rank's runs must be its whole shard
          for (size_t e = 0; e < shares.size(); ++e) {
            int64_t held = 0;
            for (const auto& [f, local, count] : runs[name])
              if (std::count(shares[e].first.begin(), shares[e].first.end(), f)) held += count;
            if (held * static_cast<int64_t>(shares.size()) != numel)
              return corrupt(fmt::format("{}: expert-parallel rank {}'s ranks ({}) hold {} elements of its shard of {}",
                                         pw, e, fmt::join(shares[e].first, ", "), held,
                                         numel / static_cast<int64_t>(shares.size())));
          }
        }
        if (covered != numel)
          return corrupt(fmt::format("{}: the ranks' partitions hold {} of its {} elements{}", pw, covered, numel,
                                     share_of.count(name)
                                         ? fmt::format(" (expert-parallel rank {}: ranks {}, as ds_config's "
                                                       "use_data_before_expert_parallelism {} lays them out)",
                                                       share_of.at(name), fmt::join(shares[share_of.at(name)].first, ", "),
                                                       shapes.data_before_expert)
                                         : ""));
        ZeroSliceParam sp{name, shape, pg, *step, {}};
        std::vector<std::string> entries;
        for (const auto& [n, t] : r0.groups[g].moments) entries.push_back(n);
        entries.push_back(kParam);  // the fp32 master weights
        for (const std::string& entry : entries) {
          std::vector<Piece> pieces;
          int64_t begin = 0;
          for (const auto& [f, local, count] : runs[name]) {
            const ZeroGroup& zg = ranks[f].groups[g];
            const dcp::TensorRef& t = entry == kParam ? zg.master : zg.moments.at(entry);
            OPTSTATE_ASSIGN_OR_RETURN(const Stored whole, resolve(base + f, t, t.shape[0],
                                                                  fmt::format("{} '{}' in {}", pw, entry,
                                                                              zs.optim[f].string())));
            const auto dq = dequant.find({f, entry});
            const uint64_t elem = dq == dequant.end() ? 4 : 1;  // fp32 values, or 8-bit codes
            Piece pc{begin, count, whole, std::nullopt};
            pc.stored.at += static_cast<uint64_t>(local) * elem;
            pc.stored.bytes = static_cast<uint64_t>(count) * elem;
            pc.stored.whole = whole.whole && pc.stored.bytes == whole.bytes;
            if (dq != dequant.end()) {  // read as fp32 values, map[code] * absmax[block] of the partition
              pc.dq = dq->second;
              pc.dq->local = local;
            }
            pieces.push_back(pc);
            begin += count;
          }
          sp.entries[entry] = std::move(pieces);
        }
        out.params.push_back(std::move(sp));
      }
    }
    const std::string bnb_line = "bitsandbytes' 8-bit encoding of the moments (its AdamW8bit under ZeRO: blocks of each "
                                 "rank's flat partition, not of each param): read as fp32 values";
    if (bnb_partitions && std::find(not_read_.begin(), not_read_.end(), bnb_line) == not_read_.end())
      not_read_.push_back(bnb_line);
    return out;
  }

  // A pipeline stage's slice joined to the state: stage 0's groups in order, whatever they hold; a
  // later stage's group joins the first of the same settings not taken by another of its groups
  // (on its first param that is not a tied copy), or is a group of its own.
  Status join_pipeline_stage(const ZeroFiles& z, size_t st, ZeroSlice slice, std::vector<int64_t>& group_steps,
                             std::map<std::string, size_t>& stage_of) {
    const bool pipeline = z.stages.size() > 1 || z.layer_files > 0;
    std::vector<std::optional<size_t>> joined(slice.hyper.size());
    std::set<size_t> taken;  // joined groups this stage's groups took
    auto gw_of = [&](size_t pg) {
      return pipeline ? fmt::format("{} stage {} param group {}", z.dir.string(), st, pg)
                      : fmt::format("{} param group {}", z.dir.string(), pg);
    };
    auto join = [&](size_t pg) -> Result<size_t> {
      if (joined[pg]) return *joined[pg];
      const Hyperparameters& h = slice.hyper[pg];
      size_t j = meta_.groups.size();
      if (st > 0)
        for (size_t k = 0; k < meta_.groups.size(); ++k)
          if (!taken.count(k) && meta_.groups[k].hyper == h) {
            j = k;
            break;
          }
      const int64_t step = slice.step[pg].value_or(0);
      if (j == meta_.groups.size()) {
        ParamGroup group;
        group.hyper = h;
        meta_.groups.push_back(std::move(group));
        group_steps.push_back(step);
      } else if (group_steps[j] != step) {
        return corrupt(fmt::format("{}: step {}, and the group of the same settings of an earlier pipeline stage step {}",
                                   gw_of(pg), step, group_steps[j]));
      }
      taken.insert(j);
      joined[pg] = j;
      return j;
    };
    if (st == 0)
      for (size_t pg = 0; pg < slice.hyper.size(); ++pg)
        if (slice.step[pg]) OPTSTATE_RETURN_IF_ERROR(join(pg).status());
    for (ZeroSliceParam& sp : slice.params) {
      const std::string pw = fmt::format("{} '{}'", gw_of(sp.group), sp.name);
      // A name an earlier stage holds: a tied module's copy (TiedLayerSpec), the same tensor.
      const auto earlier = meta_.params.find(sp.name);
      if (earlier != meta_.params.end()) {
        const size_t other = stage_of.at(sp.name);
        if (other == st || earlier->second.shape != sp.shape)
          return corrupt(fmt::format("{}: shape [{}], and '{}' of {} has shape [{}]", pw, fmt::join(sp.shape, ", "),
                                     sp.name, other == st ? "another group" : fmt::format("stage {}", other),
                                     fmt::join(earlier->second.shape, ", ")));
        if (earlier->second.entries.size() != sp.entries.size())
          return corrupt(fmt::format("{}: {} entries, its copy in stage {} {}", pw, sp.entries.size(), other,
                                     earlier->second.entries.size()));
        for (const auto& [entry, pieces] : sp.entries)
          if (!earlier->second.entries.count(entry))
            return corrupt(fmt::format("{}: '{}', which its copy in stage {} has not", pw, entry, other));
        if (earlier->second.step != sp.step)
          return corrupt(fmt::format("{}: step {}, its copy in stage {} step {}", pw, sp.step, other, earlier->second.step));
        for (auto& [entry, pieces] : sp.entries) zero_copies_.push_back({sp.name, entry, st, std::move(pieces)});
        continue;
      }
      OPTSTATE_ASSIGN_OR_RETURN(const size_t j, join(sp.group));
      ParamState ps;
      ps.shape = sp.shape;
      ps.group = static_cast<int>(j);
      ps.step = sp.step;
      for (auto& [entry, pieces] : sp.entries) {
        stored_[{sp.name, entry, Component::kValues}] = std::move(pieces);
        ps.entries.emplace(entry, Entry{});  // fp32 values
      }
      meta_.groups[j].params.push_back(sp.name);
      meta_.params.emplace(sp.name, std::move(ps));
      stage_of[sp.name] = st;
    }
    return Status::Ok();
  }

  // DeepSpeed's AutoTP: every tensor-parallel rank's slice holds every param (its shard), in the
  // same groups; each param's shards put together where rank 0's model states' affine map places
  // them (a block held by several ranks read from the first, the others' copies compared by
  // validate).
  Status join_tensor_parallel(const ZeroFiles& z, std::vector<ZeroSlice>& slices) {
    const size_t tp = slices.size();
    const std::string mw = z.stages[0].model.string();
    const ZeroShapes& s0 = slices[0].shapes;
    if (!s0.autotp)
      return corrupt(fmt::format(
          "{}: {} tensor-parallel ranks' files, and no affine_map in universal_checkpoint_info ({}): the shards' "
          "layout is in no file, not read", mw, tp,
          s0.uc_info ? "its name patterns, Megatron-DeepSpeed's or AutoTP's before DeepSpeed recorded affine maps, say "
                       "along which dim some params are split, not where each rank's shard lies nor which params "
                       "every rank holds whole"
                     : "DeepSpeed's AutoTP records one, which says where each rank's shard lies; there is none"));
    const AutoTpMaps& maps = *s0.autotp;
    for (size_t r = 1; r < tp; ++r) {
      const ZeroSlice& sr = slices[r];
      const std::string rw = z.stages[r].model.string();
      if (sr.hyper.size() != slices[0].hyper.size() || sr.params.size() != slices[0].params.size())
        return corrupt(fmt::format("{}: {} param groups and {} params, tensor-parallel rank 0's {} and {}", rw,
                                   sr.hyper.size(), sr.params.size(), slices[0].hyper.size(), slices[0].params.size()));
      for (size_t g = 0; g < sr.hyper.size(); ++g)
        if (!(sr.hyper[g] == slices[0].hyper[g]) || sr.step[g] != slices[0].step[g])
          return corrupt(fmt::format("{}: param group {}'s settings or step differ from tensor-parallel rank 0's", rw, g));
    }
    for (size_t g = 0; g < slices[0].hyper.size(); ++g) {
      ParamGroup group;
      group.hyper = slices[0].hyper[g];
      meta_.groups.push_back(std::move(group));
    }
    constexpr int64_t kMaxRuns = int64_t{1} << 24;  // runs of one entry
    for (size_t i = 0; i < slices[0].params.size(); ++i) {
      const ZeroSliceParam& p0 = slices[0].params[i];
      const std::string pw = fmt::format("{} '{}'", z.dir.string(), p0.name);
      if (const auto un = maps.unsupported.find(p0.name); un != maps.unsupported.end())
        return corrupt(fmt::format("{}: DeepSpeed's AutoTP could not describe its shards ({}): not read", pw, un->second));
      const auto mi = maps.params.find(p0.name);
      if (mi == maps.params.end()) return corrupt(fmt::format("{}: no affine map in {}", pw, mw));
      const AffineMap& m = mi->second;
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(m.logical_shape));
      // Each rank's runs: (first element in the whole tensor, first in the rank's shard, count).
      struct Run {
        int64_t whole, shard, count;
        size_t rank;
        bool copy;  // a block an earlier rank of its locations holds too
      };
      std::vector<Run> runs;
      for (size_t r = 0; r < tp; ++r) {
        const ZeroSliceParam& pr = slices[r].params[i];
        const std::string rw = fmt::format("{} (tensor-parallel rank {})", pw, r);
        if (pr.name != p0.name || pr.group != p0.group || pr.step != p0.step || pr.entries.size() != p0.entries.size())
          return corrupt(fmt::format("{}: '{}' of group {} at step {} where rank 0 has this param of group {} at step {}",
                                     rw, pr.name, pr.group, pr.step, p0.group, p0.step));
        const auto ar = m.ranks.find(static_cast<int64_t>(r));
        if (ar == m.ranks.end() || ar->second.shard_shape != pr.shape)
          return corrupt(fmt::format("{}: shard [{}] in param_shapes, the affine map's [{}]", rw, fmt::join(pr.shape, ", "),
                                     ar == m.ranks.end() ? "no entry" : fmt::format("{}", fmt::join(ar->second.shard_shape, ", "))));
        const int64_t shard_numel = *checked_numel(pr.shape);
        for (const AffinePiece& pc : ar->second.pieces) {
          if (pc.scale != 1.0)
            return corrupt(fmt::format("{}: a piece held times {} (DeepSpeed's scaled pieces, whose moments and settings "
                                       "would need rescaling, which DeepSpeed itself refuses): not read", rw, pc.scale));
          if (std::find(pc.locations.begin(), pc.locations.end(), static_cast<int64_t>(r)) == pc.locations.end())
            return corrupt(fmt::format("{}: a piece of rank {}'s map whose locations do not name it", rw, r));
          const bool copy = *std::min_element(pc.locations.begin(), pc.locations.end()) != static_cast<int64_t>(r);
          OPTSTATE_RETURN_IF_ERROR(affine_runs(pc, numel, shard_numel, rw,
                                               [&](int64_t whole, int64_t shard, int64_t count) -> Status {
            if (!runs.empty()) {
              Run& last = runs.back();
              if (last.rank == r && last.copy == copy && last.whole + last.count == whole &&
                  last.shard + last.count == shard) {
                last.count += count;
                return Status::Ok();
              }
            }
            if (static_cast<int64_t>(runs.size()) >= kMaxRuns)
              return corrupt(fmt::format("{}: more than 2^24 runs", rw));
            runs.push_back({whole, shard, count, r, copy});
            return Status::Ok();
          }));
        }
      }
      // The blocks read cover the whole tensor once.
      std::vector<size_t> order;
      for (size_t k = 0; k < runs.size(); ++k)
        if (!runs[k].copy) order.push_back(k);
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return runs[a].whole < runs[b].whole; });
      int64_t end = 0;
      for (size_t k : order) {
        if (runs[k].whole != end)
          return corrupt(fmt::format("{}: the affine map's pieces {} element {} of the whole tensor", pw,
                                     runs[k].whole < end ? "cover twice" : "leave out", std::min(end, runs[k].whole)));
        end += runs[k].count;
      }
      if (end != numel)
        return corrupt(fmt::format("{}: the affine map's pieces cover {} of its {} elements", pw, end, numel));
      // and each rank's pieces its shard once: no shard element read for two places
      std::vector<size_t> by_shard(runs.size());
      std::iota(by_shard.begin(), by_shard.end(), size_t{0});
      std::sort(by_shard.begin(), by_shard.end(), [&](size_t a, size_t b) {
        return std::pair(runs[a].rank, runs[a].shard) < std::pair(runs[b].rank, runs[b].shard);
      });
      std::vector<int64_t> read_of(tp, 0);  // each rank's shard elements read, in order
      for (size_t k : by_shard) {
        const Run& run = runs[k];
        if (run.shard != read_of[run.rank])
          return corrupt(fmt::format("{} (tensor-parallel rank {}): the affine map's pieces {} element {} of its shard",
                                     pw, run.rank, run.shard < read_of[run.rank] ? "read twice" : "leave out",
                                     std::min(read_of[run.rank], run.shard)));
        read_of[run.rank] += run.count;
      }
      for (size_t r = 0; r < tp; ++r)
        if (read_of[r] != *checked_numel(slices[r].params[i].shape))
          return corrupt(fmt::format("{} (tensor-parallel rank {}): the affine map's pieces read {} of its shard's {} "
                                     "elements", pw, r, read_of[r], *checked_numel(slices[r].params[i].shape)));
      ParamState ps;
      ps.shape = m.logical_shape;
      ps.group = static_cast<int>(p0.group);
      ps.step = p0.step;
      for (const auto& entry_pieces : p0.entries) {
        const std::string& entry = entry_pieces.first;  // not a structured binding: clang 14 cannot capture one
        // A run of shard elements [shard, shard + count) of rank r, as the pieces of its slice.
        auto place = [&](const Run& run, std::vector<Piece>& out) -> Status {
          const std::vector<Piece>& local = slices[run.rank].params[i].entries.at(entry);
          auto it = std::upper_bound(local.begin(), local.end(), run.shard,
                                     [](int64_t at, const Piece& pc) { return at < pc.begin; });
          if (it == local.begin()) return internal_error(pw + ": a run before the shard's first piece");
          --it;
          for (int64_t at = run.shard; at < run.shard + run.count; ++it) {
            if (it == local.end() || at < it->begin || at >= it->begin + it->count)
              return corrupt(fmt::format("{} '{}': tensor-parallel rank {}'s shard holds no element {}", pw, entry,
                                         run.rank, at));
            if (it->dq || it->stored.permuted)
              return corrupt(fmt::format("{} '{}': 8-bit moments under AutoTP are not read", pw, entry));
            const int64_t n = std::min(run.shard + run.count, it->begin + it->count) - at;
            Piece pc{run.whole + (at - run.shard), n, it->stored, std::nullopt};
            pc.stored.at += static_cast<uint64_t>(at - it->begin) * 4;
            pc.stored.bytes = static_cast<uint64_t>(n) * 4;
            pc.stored.whole = it->stored.whole && pc.stored.bytes == it->stored.bytes;
            out.push_back(pc);
            at += n;
          }
          return Status::Ok();
        };
        std::vector<Piece> pieces;
        for (size_t k : order) OPTSTATE_RETURN_IF_ERROR(place(runs[k], pieces));
        for (size_t r = 1; r < tp; ++r) {
          std::vector<Piece> copies;
          for (const Run& run : runs)
            if (run.copy && run.rank == r) OPTSTATE_RETURN_IF_ERROR(place(run, copies));
          if (!copies.empty()) zero_copies_.push_back({p0.name, entry, r, std::move(copies)});
        }
        stored_[{p0.name, entry, Component::kValues}] = std::move(pieces);
        ps.entries.emplace(entry, Entry{});  // fp32 values
      }
      meta_.groups[p0.group].params.push_back(p0.name);
      meta_.params.emplace(p0.name, std::move(ps));
    }
    value_notes_.push_back(fmt::format("{} tensor-parallel ranks (DeepSpeed's AutoTP): each param's shards put together "
                                       "where the affine map of {} places them; the blocks several ranks hold are read "
                                       "from the first, and validate compares the others' copies", tp, mw));
    return Status::Ok();
  }

  // The contiguous runs of an affine piece: emit(first element in the whole tensor, first element
  // in the shard, count), each checked to lie in both. A piece's rows are runs where its innermost
  // strides are 1 on both sides, else single elements.
  template <typename Emit>
  static Status affine_runs(const AffinePiece& pc, int64_t numel, int64_t shard_numel, const std::string& where,
                            Emit&& emit) {
    const size_t n = pc.shape.size();
    int64_t total = 1;
    for (int64_t d : pc.shape) {
      if (d < 0) return corrupt(where + ": a piece of negative size");
      if (d == 0) return Status::Ok();
      if (total > (int64_t{1} << 40) / d) return corrupt(where + ": a piece past 2^40 elements");
      total *= d;
    }
    // Bounds: the extremes of each side's offsets (strides may be negative) within the tensor.
    auto check_side = [&](int64_t offset, const std::vector<int64_t>& strides, int64_t limit, const char* side) -> Status {
      __int128 lo = offset, hi = offset;
      for (size_t k = 0; k < n; ++k) {
        const __int128 span = static_cast<__int128>(strides[k]) * (pc.shape[k] - 1);
        (span < 0 ? lo : hi) += span;
      }
      if (lo < 0 || hi >= limit)
        return corrupt(fmt::format("{}: a piece reaching past the {} tensor's {} elements", where, side, limit));
      return Status::Ok();
    };
    OPTSTATE_RETURN_IF_ERROR(check_side(pc.source_offset, pc.source_strides, numel, "whole"));
    OPTSTATE_RETURN_IF_ERROR(check_side(pc.dest_offset, pc.dest_strides, shard_numel, "shard"));
    const bool rows = n > 0 && pc.source_strides[n - 1] == 1 && pc.dest_strides[n - 1] == 1;
    const int64_t run = rows ? pc.shape[n - 1] : 1;
    const size_t outer = rows ? n - 1 : n;
    std::vector<int64_t> idx(outer, 0);
    for (int64_t emitted = 0; emitted < total; emitted += run) {
      int64_t src = pc.source_offset, dst = pc.dest_offset;
      for (size_t k = 0; k < outer; ++k) {
        src += idx[k] * pc.source_strides[k];
        dst += idx[k] * pc.dest_strides[k];
      }
      OPTSTATE_RETURN_IF_ERROR(emit(src, dst, run));
      for (size_t k = outer; k-- > 0;) {
        if (++idx[k] < pc.shape[k]) break;
        idx[k] = 0;
      }
    }
    return Status::Ok();
  }

  // Elements `at` of tensor `t` (of `count` elements) in archive `a` (file `file`), as bit patterns
  // (2 or 4 bytes, widened): the samples the placements by value compare.
  static Result<std::vector<uint32_t>> read_samples(const Archive& a, size_t file, const dcp::TensorRef& t, int64_t count,
                                                    std::span<const int64_t> at, const std::string& where) {
    OPTSTATE_ASSIGN_OR_RETURN(const Stored s, resolve_in(a, file, t, count, where));
    const int64_t elem = dtype_size(t.dtype);
    if (elem > 4) return internal_error(where + ": samples of more than 4 bytes");
    std::vector<uint32_t> out(at.size());
    for (size_t i = 0; i < at.size(); ++i) {
      if (at[i] < 0 || at[i] >= count) return internal_error(where + ": a sample outside the tensor");
      std::array<std::byte, 4> b{};
      OPTSTATE_RETURN_IF_ERROR(a.file.read_at(s.at + static_cast<uint64_t>(at[i] * elem),
                                              std::span(b.data(), static_cast<size_t>(elem))));
      std::memcpy(&out[i], b.data(), static_cast<size_t>(elem));
    }
    return out;
  }
  // fp32 bit patterns rounded to `to` (bf16, f16: round to nearest even; f32 kept), as the model's
  // weights are its fp32 main params rounded.
  static void round_samples(std::vector<uint32_t>& bits, DType to) {
    for (uint32_t& b : bits) {
      float v;
      std::memcpy(&v, &b, 4);
      b = to == DType::kBF16 ? f32_to_bf16(v) : to == DType::kF16 ? f32_to_f16(v) : b;
    }
  }

  // DeepSpeed's FP16_Optimizer (its fused form, without ZeRO) in the torch.save file `where`
  // (archive `fi`, pickle `p`): the inner optimizer's one flat param a group and the flat fp32
  // masters split into the model's params where deepspeed::place_in_flat_groups finds them; their
  // entries and weights become views of the flat tensors, numbered group by group as torch numbers
  // a group's params.
  // FP16_Optimizer's flat groups in the state_dict of archive `fi` (`where` names it): each group
  // one flat fp32 master (its length) and at most one flat param of that length with dense state
  // (its index in sd.params; none: the group never stepped).
  struct FlatGroups {
    std::vector<int64_t> numel;
    std::vector<std::optional<size_t>> flat_of;
  };
  Result<FlatGroups> flat_groups(const StateDict& sd, size_t fi, const std::string& where) {
    const std::string ow = fmt::format("{} {}", where, sd.deepspeed_flat_at);
    const size_t groups = sd.groups.size();
    if (sd.deepspeed_flat_masters.size() != groups || sd.member_ids.size() != groups)
      return corrupt(fmt::format("{}['fp32_groups_flat']: {} flat masters, the optimizer has {} param groups", ow,
                                 sd.deepspeed_flat_masters.size(), groups));
    FlatGroups out;
    out.numel.resize(groups);
    out.flat_of.assign(groups, std::nullopt);
    for (size_t g = 0; g < groups; ++g) {
      const std::string mw = fmt::format("{}['fp32_groups_flat'][{}]", ow, g);
      if (sd.member_ids[g].size() != 1)
        return corrupt(fmt::format("{}['optimizer_state_dict'] param group {}: {} params; FP16_Optimizer gives its "
                                   "optimizer one flat param a group", ow, g, sd.member_ids[g].size()));
      OPTSTATE_ASSIGN_OR_RETURN(out.numel[g], checked_numel(sd.deepspeed_flat_masters[g].shape));
      OPTSTATE_RETURN_IF_ERROR(resolve(fi, sd.deepspeed_flat_masters[g], out.numel[g], mw).status());
    }
    for (size_t k = 0; k < sd.params.size(); ++k) {
      const ParamSpec& ps = sd.params[k];
      const size_t g = static_cast<size_t>(ps.group);
      const std::string pw = fmt::format("{}['optimizer_state_dict'] param group {}'s flat param", ow, g);
      if (g >= groups || out.flat_of[g]) return internal_error(pw + ": listed twice");
      if (ps.shape != std::vector<int64_t>{out.numel[g]})
        return corrupt(fmt::format("{}: state of shape {}, its flat master's is [{}]", pw, format_shape(ps.shape),
                                   out.numel[g]));
      for (const auto& [name, es] : ps.entries)
        if (es.encoding != Encoding::kDense || es.dtensor)
          return corrupt(fmt::format("{}: '{}' is not a plain tensor (FP16_Optimizer's fused optimizers keep dense "
                                     "fp32 moments)", pw, name));
      out.flat_of[g] = k;
    }
    return out;
  }

  Status place_deepspeed_flat(const pickle::Pickle& p, size_t fi, StateDict& sd, const std::string& where) {
    const std::string ow = fmt::format("{} {}", where, sd.deepspeed_flat_at);
    const size_t groups = sd.groups.size();
    OPTSTATE_ASSIGN_OR_RETURN(const FlatGroups fg, flat_groups(sd, fi, where));
    const std::vector<int64_t>& group_numels = fg.numel;
    std::vector<const ParamSpec*> flat_of(groups, nullptr);
    for (size_t g = 0; g < groups; ++g)
      if (fg.flat_of[g]) flat_of[g] = &sd.params[*fg.flat_of[g]];
    if (sd.model_ref == pickle::kNoRef)
      return corrupt(ow + ": DeepSpeed's FP16_Optimizer without the model beside it (['module']), whose weights place "
                          "the params in its flat masters");
    const std::string model_at = fmt::format("{} {}", where, sd.model_key);
    OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(p, sd.model_ref, model_at));
    std::set<std::string, std::less<>> buffers;  // DeepSpeed's ['buffer_names']: the module's buffers
    if (const pickle::Ref b = p.dict_get(p.root(), "buffer_names"); b != pickle::kNoRef && p.at(b).kind != pickle::Kind::kNone) {
      const auto names = dcp::as_string_list(p, b);
      if (!names) return corrupt(where + " ['buffer_names']: not a list of strings");
      buffers.insert(names->begin(), names->end());
    }
    // The candidates: the module's fp32/bf16/fp16 tensors that may be params and are no buffer.
    std::vector<size_t> cand;
    std::vector<int64_t> numels;
    std::vector<std::string> names;
    for (const size_t t : param_candidates(md)) {
      const ModelTensor& mt = md.tensors[t];
      if (mt.dtensor || buffers.count(mt.name)) continue;
      if (mt.tensor.dtype != DType::kF16 && mt.tensor.dtype != DType::kBF16 && mt.tensor.dtype != DType::kF32) continue;
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t n, checked_numel(mt.tensor.shape));
      cand.push_back(t);
      numels.push_back(n);
      names.push_back(mt.name);
    }
    deepspeed::FlatValues values;
    values.flat = [&](size_t g, int64_t begin, std::span<const int64_t> at, size_t c) -> Result<std::vector<uint32_t>> {
      std::vector<int64_t> shifted(at.begin(), at.end());
      for (int64_t& i : shifted) i += begin;
      OPTSTATE_ASSIGN_OR_RETURN(auto bits, read_samples(files_[fi], fi, sd.deepspeed_flat_masters[g], group_numels[g],
                                                        shifted, fmt::format("{}['fp32_groups_flat'][{}]", ow, g)));
      round_samples(bits, md.tensors[cand[c]].tensor.dtype);
      return bits;
    };
    values.tensor = [&](size_t c, std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
      return read_samples(files_[fi], fi, md.tensors[cand[c]].tensor, numels[c], at,
                          fmt::format("{}['{}']", model_at, names[c]));
    };
    std::vector<int> classes;  // tensors of one dtype round alike
    for (const size_t t : cand) classes.push_back(static_cast<int>(md.tensors[t].tensor.dtype));
    OPTSTATE_ASSIGN_OR_RETURN(const auto placed, deepspeed::place_in_flat_groups(group_numels, numels, names, values,
                                                                                 ow + "['fp32_groups_flat']", classes));
    std::vector<ParamSpec> params;
    std::vector<std::vector<int64_t>> member_ids(groups);
    std::set<std::string> weights_read;
    size_t frozen = 0;
    for (size_t g = 0; g < groups; ++g) sd.groups[g].params.clear();
    for (size_t g = 0; g < groups; ++g)
      for (size_t c = 0; c < cand.size(); ++c) {
        if (!placed[c] || placed[c]->group != g) continue;
        const ModelTensor& mt = md.tensors[cand[c]];
        auto view = [&](dcp::TensorRef t) {
          t.offset += placed[c]->begin;
          t.shape = mt.tensor.shape;
          t.stride.clear();
          return t;
        };
        ParamSpec spec;
        spec.fqn = mt.name;
        spec.id = static_cast<int64_t>(params.size());
        spec.group = static_cast<int>(g);
        spec.shape = mt.tensor.shape;
        if (const ParamSpec* flat = flat_of[g]) {
          spec.step = flat->step;
          for (const auto& [name, es] : flat->entries) {
            EntrySpec part = es;
            part.values = view(es.values);
            spec.entries.emplace(name, std::move(part));
          }
        } else {
          spec.step.number = 0;  // the group never stepped: no moments, the master as its weights
        }
        spec.weight = view(sd.deepspeed_flat_masters[g]);
        member_ids[g].push_back(spec.id);
        sd.groups[g].params.push_back(spec.fqn);
        weights_read.insert(mt.name);
        params.push_back(std::move(spec));
      }
    for (size_t c = 0; c < cand.size(); ++c) frozen += placed[c] ? 0 : 1;
    sd.stateless = 0;
    for (size_t g = 0; g < groups; ++g) sd.stateless += flat_of[g] ? 0 : member_ids[g].size();
    sd.params = std::move(params);
    sd.member_ids = std::move(member_ids);
    sd.members = sd.params.size();
    sd.model_weight_keys = weights_read;
    sd.model_others = md.tensors.size() + md.others - weights_read.size();
    if (sd.model_others) {
      sd.model_others_line = sd.not_read.size();
      sd.not_read.push_back(model_others_text(sd.model_key, sd.model_others));
    }
    if (frozen)
      sd.not_read.push_back(fmt::format("{} model tensor{} in no param group's flat master (frozen params, or params "
                                        "not given to the optimizer)", frozen, frozen == 1 ? "" : "s"));
    sd.read_notes.push_back(fmt::format(
        "DeepSpeed's FP16_Optimizer keeps each param group flat ({}['fp32_groups_flat'], no param's place): each "
        "param found in module order where its fp32 master rounds to the module's weights ({}), read as the weights",
        sd.deepspeed_flat_at, sd.model_key));
    return Status::Ok();
  }

  // Megatron's distributed optimizer in its legacy checkpoint: `f.path` (model_optim_rng.pt) holds
  // the model's state_dict, which names the params, and the param groups (no members) with the
  // step; `f.distrib` (distrib_optim.pt, kept as this file's archive) each DDP buffer's main params
  // and moments, flat, each param where megatron::place_in_buffer finds it. Read as the StateDict
  // of a torch.save file: entries and weights are views of the buffers.
  Result<StateDict> megatron_distributed_state(const RankFileSet::File& f) {
    const std::string mw = f.path.string(), dw = f.distrib.string();
    OPTSTATE_ASSIGN_OR_RETURN(auto model_ap, open_archive(f.path));
    OPTSTATE_ASSIGN_OR_RETURN(auto distrib_ap, open_archive(f.distrib));
    const pickle::Pickle& mp = model_ap.second;
    const pickle::Pickle& dp = distrib_ap.second;
    const Archive& model_archive = model_ap.first;
    StateDict sd;
    sd.megatron = true;
    sd.megatron_args = megatron_args_of(mp);
    sd.optimizer_path = "['optimizer']";
    const auto* root_items = mp.at(mp.root()).kind == pickle::Kind::kDict ? &mp.at(mp.root()).items : nullptr;
    if (!root_items) return corrupt(mw + ": data.pkl is not Megatron's trainer dict");
    for (size_t k = 0; k + 1 < root_items->size(); k += 2) {
      const auto key = dcp::as_string(mp, (*root_items)[k]);
      if (!key || (*key != "model" && *key != "optimizer")) sd.not_read.push_back(fmt::format("['{}']", key ? *key : "?"));
    }
    // The optimizer's groups (no members) and step; under a mixture of experts Megatron's chain of
    // optimizers, a list: the dense params' and the experts', each with its own groups and buffers.
    const pickle::Ref opt_ref = mp.dict_get(mp.root(), "optimizer");
    std::vector<pickle::Ref> opt_refs{opt_ref};
    if (opt_ref != pickle::kNoRef && mp.at(opt_ref).kind == pickle::Kind::kList)
      opt_refs.assign(mp.at(opt_ref).items.begin(), mp.at(opt_ref).items.end());
    const bool chain = opt_refs.size() != 1 || (opt_ref != pickle::kNoRef && mp.at(opt_ref).kind == pickle::Kind::kList);
    if (opt_refs.empty() || opt_refs.size() > 16)
      return corrupt(fmt::format("{} ['optimizer']: a chain of {} optimizers", mw, opt_refs.size()));
    struct Part {
      dcp::megatron::Optimizer opt;
      std::string where;
      bool experts = false;             // the experts' optimizer of the chain
      size_t decay = 0, no_decay = 0;   // its groups among sd.groups (sd.groups.size(): none)
    };
    std::vector<Part> opts;
    std::set<bool> kinds;
    for (size_t i = 0; i < opt_refs.size(); ++i) {
      Part part;
      part.where = chain ? fmt::format("{} ['optimizer'][{}]", mw, i) : mw + " ['optimizer']";
      OPTSTATE_ASSIGN_OR_RETURN(part.opt, dcp::megatron::interpret_legacy_optimizer(mp, opt_refs[i], part.where));
      if (!part.opt.group_step)
        return corrupt(part.where + ": the distributed optimizer's param groups hold no 'step'");
      const auto& groups = part.opt.groups;
      for (size_t g = 0; g < groups.size(); ++g)
        if (groups[g].expert_parallel != groups[0].expert_parallel)
          return corrupt(fmt::format("{}: param groups of the experts (is_expert_parallel) beside groups of dense "
                                     "params; Megatron's chain gives each its own optimizer", part.where));
      part.experts = !groups.empty() && groups[0].expert_parallel;
      if (part.experts && !chain)
        return corrupt(part.where + ": the experts' param groups (is_expert_parallel) alone, without the chain of "
                                    "the dense params' optimizer and the experts'");
      if (!kinds.insert(part.experts).second)
        return unsupported(fmt::format("{}: a second optimizer of {} in Megatron's chain; optstate reads a chain of the "
                                       "dense params' optimizer and the experts'", part.where,
                                       part.experts ? "experts' params" : "dense params"));
      const size_t none = std::numeric_limits<size_t>::max(), base = sd.groups.size();
      part.decay = part.no_decay = none;
      for (size_t g = 0; g < groups.size(); ++g) {
        const dcp::megatron::Group& mg = groups[g];
        for (const auto& [key, v] : mg.extras)
          if ((key == "is_decoupled_lr" && v.kind == GroupValue::Kind::kBool && v.i != 0) ||
              (key == "lr_mult" && ((v.kind == GroupValue::Kind::kFloat && v.f != 1) || (v.kind == GroupValue::Kind::kInt && v.i != 1))))
            return unsupported(fmt::format("{} param group {}: {} (a group of its own lr); Megatron keeps no group's "
                                           "members, and optstate places params by Megatron-Core's standard groups "
                                           "only (weight decay or none)", part.where, g, key));
        size_t& slot = mg.wd_mult == 0 ? part.no_decay : part.decay;
        if (slot != none)
          return unsupported(fmt::format("{}: param groups {} and {} are both {}; optstate places params by "
                                         "Megatron-Core's standard groups only (weight decay or none)", part.where,
                                         slot - base, g,
                                         mg.wd_mult == 0 ? "without weight decay" : "with weight decay"));
        slot = sd.groups.size();
        GroupSpec gs;
        gs.hyper = mg.hyper;
        gs.flags = mg.flags;
        gs.lr.number = mg.hyper.lr;
        gs.beta1.number = mg.hyper.beta1;
        gs.beta2.number = mg.hyper.beta2;
        for (const auto& [key, v] : mg.extras) gs.extras.push_back({key, v, std::nullopt});
        sd.groups.push_back(std::move(gs));
      }
      opts.push_back(std::move(part));
    }
    // the model, or under a virtual pipeline its chunks (the buffers of all of them, in chunk order)
    ModelSource models;
    if (const pickle::Ref model = mp.dict_get(mp.root(), "model"); model != pickle::kNoRef) {
      models.parts.push_back({model, "['model']", ""});
    } else {
      OPTSTATE_ASSIGN_OR_RETURN(const auto chunks, megatron_model_chunks(mp, mw));
      if (!chunks) return corrupt(mw + ": no ['model'], whose weights place the params in the buffers");
      models = *chunks;
      sd.megatron_chunks = models.parts.size();
      std::erase_if(sd.not_read, [&](const std::string& n) {
        return std::any_of(models.parts.begin(), models.parts.end(), [&](const auto& part) { return part.key == n; });
      });
    }
    OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_source(mp, models, mw));
    sd.model_ref = models.parts[0].dict;
    sd.model_key = models.key();

    // distrib_optim.pt: {"buckets_coalesced": True, <buffer>: {(param dtype, grad dtype): {"param",
    // "exp_avg", "exp_avg_sq": flat fp32, "numel_unpadded": int}}}
    const pickle::Ref dtop = dp.root();
    const bool listed = dp.at(dtop).kind == pickle::Kind::kList;
    std::vector<pickle::Ref> states{dtop};
    if (listed) states.assign(dp.at(dtop).items.begin(), dp.at(dtop).items.end());
    if (listed != chain || states.size() != opts.size())
      return corrupt(fmt::format("{}: {}; {} ['optimizer'] holds {}", dw,
                                 listed ? fmt::format("a list of {} optimizers' states", states.size())
                                        : "one optimizer's state",
                                 mw, chain ? fmt::format("a chain of {} optimizers", opts.size()) : "one optimizer"));
    files_.push_back(std::move(distrib_ap.first));
    const size_t fi = files_.size() - 1;
    std::vector<bool> taken(md.tensors.size(), false);
    int64_t id = 0;
    std::set<size_t> unplaced;  // model tensors of a buffer's dtype that no buffer holds
    for (size_t oi = 0; oi < opts.size(); ++oi) {
      const Part& part = opts[oi];
      const pickle::Ref droot = states[oi];
      const std::string sw = chain ? fmt::format("{} [{}]", dw, oi) : dw;
      if (dp.at(droot).kind == pickle::Kind::kNone) {
        // the dense params' state saved by data-parallel rank 0, in expert rank 0's folder
        if (part.experts || f.ep == 0)
          return corrupt(fmt::format("{}: None, where the {}' state belongs (each expert rank's folder holds its "
                                     "experts', expert rank 0's the dense params')", sw,
                                     part.experts ? "experts" : "dense params"));
        continue;
      }
      OPTSTATE_ASSIGN_OR_RETURN(const auto buffers, dcp::megatron::interpret_param_state(dp, droot, sw));
      for (const dcp::megatron::FlatBuffer& fb : buffers) {
        const std::string bw = fmt::format("{} [{}]", sw, fb.gbuf);
        const DType param_dtype = fb.param_dtype;
        const int64_t numel = fb.numel;
        std::map<std::string, dcp::TensorRef> flat;
        for (const auto& [e, t] : fb.entries) {
          OPTSTATE_RETURN_IF_ERROR(resolve(fi, t, numel, fmt::format("{} '{}'", bw, e)).status());
          flat.emplace(e, t);
        }
        // the model's tensors of the buffer's dtype, in module order (a param is in one buffer)
        std::vector<size_t> cand;
        std::vector<int64_t> numels;
        std::vector<std::string> names;
        for (size_t t = 0; t < md.tensors.size(); ++t) {
          const ModelTensor& mt = md.tensors[t];
          if (taken[t] || mt.tensor.dtype != param_dtype || mt.dtensor) continue;
          if (chain && megatron::is_expert_param(mt.name) != part.experts) continue;  // the chain's other optimizer's
          OPTSTATE_ASSIGN_OR_RETURN(const int64_t tn, checked_numel(mt.tensor.shape));
          cand.push_back(t);
          numels.push_back(tn);
          names.push_back(mt.name);
        }
        megatron::BufferValues values;
        values.buffer = [&](std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
          OPTSTATE_ASSIGN_OR_RETURN(auto bits, read_samples(files_[fi], fi, flat.at(kParam), numel, at, bw + " 'param'"));
          round_samples(bits, param_dtype);
          return bits;
        };
        values.tensor = [&](size_t c, std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
          const ModelTensor& mt = md.tensors[cand[c]];
          const auto chunk = models.parts.size() > 1 ? megatron::chunk_of(mt.name) : std::nullopt;
          return read_samples(model_archive, 0, mt.tensor, numels[c], at,
                              chunk ? fmt::format("{} ['model{}']['{}']", mw, chunk->chunk, chunk->rest)
                                    : fmt::format("{} ['model']['{}']", mw, mt.name));
        };
        OPTSTATE_ASSIGN_OR_RETURN(const auto placed, megatron::place_in_buffer(numel, numels, names, values, bw));
        for (size_t c = 0; c < cand.size(); ++c) {
          if (!placed[c]) {
            unplaced.insert(cand[c]);
            continue;
          }
          const ModelTensor& mt = md.tensors[cand[c]];
          taken[cand[c]] = true;
          unplaced.erase(cand[c]);
          ParamSpec spec;
          spec.fqn = mt.name;
          spec.id = id++;
          const bool no_wd = mt.name.ends_with(".bias") || mt.tensor.shape.size() == 1;
          const size_t g = no_wd ? part.no_decay : part.decay;
          if (g == std::numeric_limits<size_t>::max())
            return corrupt(fmt::format("{}: '{}' takes a param group {} weight decay by Megatron-Core's rule, and the "
                                       "optimizer has none", part.where, mt.name, no_wd ? "without" : "with"));
          spec.group = static_cast<int>(g);
          spec.shape = mt.tensor.shape;
          spec.step.number = *part.opt.group_step;
          auto view = [&](const char* e) {
            dcp::TensorRef t = flat.at(e);
            t.offset += *placed[c];
            t.shape = mt.tensor.shape;
            t.stride.clear();
            return t;
          };
          for (const char* e : {kExpAvg, kExpAvgSq}) {
            EntrySpec es;
            es.values = view(e);
            spec.entries.emplace(e, std::move(es));
          }
          spec.weight = view(kParam);
          sd.groups[g].params.push_back(spec.fqn);
          sd.model_weight_keys.insert(mt.name);
          sd.params.push_back(std::move(spec));
        }
      }
    }
    if (sd.params.empty()) return corrupt(dw + ": no buffer holds a param of the model's");
    std::sort(sd.params.begin(), sd.params.end(), [](const ParamSpec& a, const ParamSpec& b) { return a.id < b.id; });
    sd.members = sd.params.size();
    const size_t others = md.tensors.size() + md.others - sd.params.size();
    sd.model_others = others;
    if (others) {
      sd.model_others_line = sd.not_read.size();
      sd.not_read.push_back(model_others_text(sd.model_key, others));
    }
    if (const size_t frozen = unplaced.size())
      sd.not_read.push_back(fmt::format("{} model tensor{} in no buffer of the distributed optimizer (frozen params)",
                                        frozen, frozen == 1 ? "" : "s"));
    sd.read_notes.push_back("Megatron's distributed optimizer keeps no param's place: each param found in its DDP "
                            "buffer (distrib_optim.pt) where its fp32 main params round to the model's weights, read "
                            "as the weights");
    sd.read_notes.push_back("Megatron saves no param group's members; its standard groups take them by Megatron-Core's "
                            "rule (no weight decay for biases and 1-D params)");
    if (chain)
      sd.read_notes.push_back(fmt::format("Megatron's chain of {} optimizers (['optimizer']: the dense params' and the "
                                          "MoE experts', each with its own buffers) read as one state, their param "
                                          "groups one after another", opts.size()));
    return sd;
  }

  // nanotron's optimizer files: each stage's params from its files, their groups the stage's (its
  // first file's; every data-parallel rank's file has the same groups, holding the params with a
  // run there), each param's runs put together where ZeRO-1 split it.
  Status init_rank_files(const RankFileSet& np) {
    nanotron_ = !np.megatron;
    megatron_ = np.megatron;
    set_ = true;
    const std::string dir = np.dir.string();
    std::vector<StateDict> sds;
    std::set<std::string> unread;
    size_t megatron_others = 0;      // Megatron's model dicts' entries beside the weights read, every stage's
    std::string megatron_others_key;  // ... and where they are ("['model']")
    for (const RankFileSet::File& f : np.files) {
      const std::string fw = f.path.string();
      StateDict sd;
      if (!f.distrib.empty()) {
        OPTSTATE_ASSIGN_OR_RETURN(sd, megatron_distributed_state(f));
      } else {
        OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(f.path));
        if (np.megatron && ap.second.dict_get(ap.second.root(), "optimizer") == pickle::kNoRef)
          return corrupt(fw + ": Megatron's trainer dict without 'optimizer' (saved with --no-save-optim, or a "
                              "release of the weights alone): no optimizer state to read");
        if (const auto a = np.megatron ? megatron_args_of(ap.second) : std::nullopt; a && a->distributed_optimizer.value_or(false))
          return corrupt(fmt::format("{}: its args say use_distributed_optimizer True, and no distrib_optim.pt (the "
                                     "distributed optimizer's state) is beside it", fw));
        files_.push_back(std::move(ap.first));
        OPTSTATE_ASSIGN_OR_RETURN(sd, interpret_state_dict(ap.second, fw));
      }
      if (np.megatron) {
        // Megatron's trainer dict: the optimizer's at ['optimizer'] (its plain optimizer) or
        // ['optimizer']['optimizer'] (mixed precision), every stepped param named by the model dict
        if (sd.optimizer_path.empty() || sd.per_param || sd.libtorch || sd.nanotron || sd.model_ref == pickle::kNoRef)
          return corrupt(fmt::format("{}: not Megatron's model_optim_rng.pt (the optimizer's state_dict beside the "
                                     "model's)", fw));
        if (sd.megatron_args) {
          const auto& a = *sd.megatron_args;
          if (a.tp_size && *a.tp_size != np.megatron_ranks)
            return corrupt(fmt::format("{}: its args say tensor_model_parallel_size {}; {} holds {} tensor-parallel "
                                       "rank{}", fw, *a.tp_size, dir, np.megatron_ranks,
                                       np.megatron_ranks == 1 ? "" : "s"));
          if (a.distributed_optimizer && !*a.distributed_optimizer && !f.distrib.empty())
            return corrupt(fmt::format("{}: its args say use_distributed_optimizer False, and a distrib_optim.pt is "
                                       "beside it", fw));
          if (a.ep_size && *a.ep_size != np.megatron_experts)
            return corrupt(fmt::format("{}: its args say expert_model_parallel_size {}; {} holds {} expert-parallel "
                                       "rank{}", fw, *a.ep_size, dir, np.megatron_experts,
                                       np.megatron_experts == 1 ? "" : "s"));
          if (a.etp_size && *a.etp_size != a.tp_size.value_or(1) && a.num_experts.value_or(0) > 0)
            return unsupported(fmt::format("{}: its args say expert_tensor_parallel_size {} beside "
                                           "tensor_model_parallel_size {}: the experts split over other ranks than "
                                           "the dense layers, which optstate does not read", fw, *a.etp_size,
                                           a.tp_size.value_or(1)));
          if (a.vp_size.value_or(1) > 1 && sd.megatron_chunks != static_cast<size_t>(*a.vp_size))
            return corrupt(fmt::format("{}: its args say virtual_pipeline_model_parallel_size {}, and it holds {} model "
                                       "chunk{} (model0, model1, ...)", fw, *a.vp_size, sd.megatron_chunks,
                                       sd.megatron_chunks == 1 ? "" : "s"));
          if (a.pp_size && *a.pp_size != np.megatron_stages)
            return corrupt(fmt::format("{}: its args say pipeline_model_parallel_size {}; {} holds {} pipeline "
                                       "stage{}", fw, *a.pp_size, dir, np.megatron_stages,
                                       np.megatron_stages == 1 ? "" : "s"));
        }
        for (const ParamSpec& spec : sd.params)
          if (!spec.entries.empty() && !sd.model_weight_keys.count(spec.fqn))
            return corrupt(fmt::format("{}: param {} of the optimizer is not placed among the model's tensors{}", fw,
                                       spec.fqn, sd.not_read.empty() ? "" : " (" + sd.not_read.back() + ")"));
        // a pipeline stage's layers numbered on from the stages before it, an expert rank's experts
        // from its first
        const auto off = np.layer_offsets.find(f.pp);
        if (off != np.layer_offsets.end() || f.expert_offset || np.megatron_chunked) {
          auto global = [&](const std::string& name) {
            return megatron::global_name(name, off == np.layer_offsets.end() ? nullptr : &off->second, f.expert_offset,
                                         np.megatron_chunked);
          };
          for (ParamSpec& spec : sd.params) spec.fqn = global(spec.fqn);
          for (GroupSpec& g : sd.groups)
            for (std::string& n : g.params) n = global(n);
        }
      } else if (!sd.nanotron || !sd.optimizer_path.empty() || sd.per_param || sd.libtorch) {
        return corrupt(fmt::format("{}: not nanotron's optimizer state_dict (its params named by 'names' beside "
                                   "'state' and 'param_groups')", fw));
      }
      if (sd.eight || sd.bnb || sd.torchao)
        return corrupt(fmt::format("{}: 8-bit or torchao state; {}'s AdamW is torch's", fw,
                                   np.megatron ? "Megatron" : "nanotron"));
      // (an expert rank's dense params and what is beside them are expert rank 0's; Megatron's
      // model dicts' other entries counted over the stages, in one line)
      for (size_t i = 0; i < sd.not_read.size(); ++i) {
        if (np.megatron && sd.model_others_line == i) {
          if (!f.dense_elsewhere && f.tp == 0) megatron_others += sd.model_others;
          if (megatron_others_key.empty()) megatron_others_key = sd.model_key;
          continue;
        }
        if (!f.dense_elsewhere && unread.insert(sd.not_read[i]).second) not_read_.push_back(sd.not_read[i]);
      }
      for (const std::string& n : sd.read_notes)
        if (std::find(value_notes_.begin(), value_notes_.end(), n) == value_notes_.end()) value_notes_.push_back(n);
      sds.push_back(std::move(sd));
    }
    if (megatron_others) not_read_.push_back(model_others_text(megatron_others_key, megatron_others));
    for (const std::string& n : np.not_read) not_read_.push_back(n);
    meta_.kind = "adamw";
    // Groups: each stage's own, its files' alike but for members.
    std::map<int64_t, size_t> base;  // stage -> its first group
    std::map<int64_t, size_t> first_file;  // stage -> its data-parallel rank 0's file
    for (size_t f = 0; f < np.files.size(); ++f) {
      const int64_t pp = np.files[f].pp;
      const std::string fw = np.files[f].path.string();
      const StateDict& sd = sds[f];
      // Megatron's stages each hold the optimizer's same groups: read as one set (the first stage's)
      if (!first_file.count(pp) && np.megatron && pp > 0 && first_file.count(0) &&
          sds[first_file[0]].groups.size() == sd.groups.size()) {
        bool same = true;
        const StateDict& s0 = sds[first_file[0]];
        for (size_t g = 0; g < sd.groups.size() && same; ++g) {
          const Hyperparameters &x = s0.groups[g].hyper, &y = sd.groups[g].hyper;
          same = same_number(x.beta1, y.beta1) && same_number(x.beta2, y.beta2) && same_number(x.eps, y.eps) &&
                 same_number(x.weight_decay, y.weight_decay) && x.amsgrad == y.amsgrad && x.maximize == y.maximize &&
                 s0.groups[g].extras.size() == sd.groups[g].extras.size();
          for (size_t k = 0; same && k < sd.groups[g].extras.size(); ++k)
            same = s0.groups[g].extras[k].key == sd.groups[g].extras[k].key;
        }
        if (same) {
          first_file[pp] = f;
          base[pp] = base[0];
        }
      }
      if (!first_file.count(pp)) {
        first_file[pp] = f;
        base[pp] = meta_.groups.size();
        for (size_t g = 0; g < sd.groups.size(); ++g) {
          ParamGroup group;
          group.hyper = sd.groups[g].hyper;
          OPTSTATE_ASSIGN_OR_RETURN(group.hyper.lr, value_of(f, sd.groups[g].lr, fmt::format("{} param group {} 'lr'", fw, g)));
          meta_.groups.push_back(std::move(group));
          adamw_flags_.push_back(sd.groups[g].flags);
          GroupExtras& kept = group_extras_.emplace_back();
          for (const GroupExtraSpec& x : sd.groups[g].extras) {
            if (!x.tensor) kept.emplace_back(x.key, x.value);
            else not_read_.push_back(fmt::format("{} param group {} '{}'", fw, g, x.key));
          }
        }
        continue;
      }
      const StateDict& s0 = sds[first_file[pp]];
      const std::string w0 = np.files[first_file[pp]].path.string();
      if (sd.groups.size() != s0.groups.size())
        return corrupt(fmt::format("{}: {} param groups; {} (the same pipeline stage) has {}", fw, sd.groups.size(), w0,
                                   s0.groups.size()));
      for (size_t g = 0; g < sd.groups.size(); ++g) {
        const Hyperparameters &x = s0.groups[g].hyper, &y = sd.groups[g].hyper;
        OPTSTATE_ASSIGN_OR_RETURN(const double lr, value_of(f, sd.groups[g].lr, fmt::format("{} param group {} 'lr'", fw, g)));
        if (!same_number(lr, meta_.groups[base[pp] + g].hyper.lr) || !same_number(x.beta1, y.beta1) ||
            !same_number(x.beta2, y.beta2) || !same_number(x.eps, y.eps) || !same_number(x.weight_decay, y.weight_decay) ||
            x.amsgrad != y.amsgrad || x.maximize != y.maximize)
          return corrupt(fmt::format("{}: param group {}'s hyperparameters differ from {}'s", fw, g, w0));
      }
    }
    // Each param: its specs in the files that hold it, in file order.
    std::vector<std::string> order;
    std::map<std::string, std::vector<std::pair<size_t, const ParamSpec*>>> held;
    std::map<std::string, std::set<int64_t>> tied_stages;  // a param's other stages
    std::set<size_t> tied_groups;                           // the groups of those copies
    size_t never_stepped = 0;
    for (size_t f = 0; f < sds.size(); ++f)
      for (const ParamSpec& spec : sds[f].params) {
        if (np.tied_copies.count({np.files[f].pp, spec.fqn})) {
          if (np.files[f].tp == 0)
            value_notes_.push_back(fmt::format("'{}' of pipeline stage {} is the first stage's "
                                               "embedding.word_embeddings.weight tied to it (equal weights and "
                                               "moments: Megatron sums their gradients): read once, as the embedding",
                                               spec.fqn, np.files[f].pp));
          continue;
        }
        // an expert rank's dense params: expert rank 0's (the driver checked them alike)
        if (np.files[f].dense_elsewhere && !megatron::is_expert_param(spec.fqn)) continue;
        if (spec.entries.empty()) {  // weights without state: never stepped
          never_stepped += np.files[f].dp == 0 && np.files[f].tp == 0;
          continue;
        }
        auto& specs = held[spec.fqn];
        if (specs.empty()) order.push_back(spec.fqn);
        // A param tied across stages (SmolLM's embeddings: the input embedding on the first, the
        // output head on the last) is stepped on each, its gradients summed over the tie, so its
        // copies are equal: the first stage's is read.
        if (!specs.empty() && np.files[specs[0].first].pp != np.files[f].pp) {
          tied_stages[spec.fqn].insert(np.files[f].pp);
          tied_groups.insert(base[np.files[f].pp] + static_cast<size_t>(spec.group));
          continue;
        }
        specs.emplace_back(f, &spec);
      }
    for (const auto& [name, stages] : tied_stages)
      value_notes_.push_back(fmt::format("'{}' is in the files of pipeline stages {} and {} (tied across them: "
                                         "nanotron steps each copy alike): stage {}'s read", name,
                                         np.files[held[name][0].first].pp, fmt::join(stages, ", "),
                                         np.files[held[name][0].first].pp));
    if (never_stepped)
      not_read_.push_back(fmt::format("{} param{} with fp32 weights and no state (never stepped)", never_stepped,
                                      never_stepped == 1 ? "" : "s"));
    for (const std::string& name : order) {
      const auto& specs = held[name];
      const auto& [f0, s0] = specs[0];
      const std::string pw = fmt::format("{} param '{}'", dir, name);
      const auto sh = np.sharded.find(name);
      const RankFileSet::Sharded* sharded = sh == np.sharded.end() ? nullptr : &sh->second;
      if (np.tp_size > 1 && !sharded && !np.replicated.count(name))
        return corrupt(fmt::format("{}: the model folder has no file of it, so whether tensor parallelism shards it "
                                   "(and where) is not known", pw));
      ParamState ps;
      ps.group = static_cast<int>(base[np.files[f0].pp] + static_cast<size_t>(s0->group));
      // A piece of a file's tensor: (file, spec, its first element in the tensor, in the whole, count).
      std::vector<std::tuple<size_t, const ParamSpec*, int64_t, int64_t, int64_t>> pieces;
      for (const auto& [f, spec] : specs) {
        const RankFileSet::File& file = np.files[f];
        const std::string fw = fmt::format("{} param '{}'", file.path.string(), name);
        if (!sharded && file.tp != 0) continue;  // a replica of tensor-parallel rank 0's
        // The rank's local tensor: its shape and where its elements go.
        std::vector<int64_t> local_shape;
        std::vector<RankFileSet::Run> runs;
        if (sharded) {
          const auto it = sharded->by_tp.find(file.tp);
          if (it == sharded->by_tp.end())
            return corrupt(fmt::format("{}: the model folder has no shard of it for tensor-parallel rank {}", fw, file.tp));
          local_shape = it->second.first;
          runs = it->second.second;
        } else if (np.zero) {
          const auto z = np.zero->find(name);
          const auto m = np.shapes.find(name);
          if (z != np.zero->end()) {
            local_shape = z->second.shape;
          } else if (m != np.shapes.end()) {
            local_shape = m->second;
          } else {
            return corrupt(fmt::format("{}: optimizer_config.json places no run of it (it holds rank 0's pipeline "
                                       "stage only), and the model folder has no file of it to shape it", fw));
          }
        } else {
          local_shape = spec->shape;
        }
        OPTSTATE_ASSIGN_OR_RETURN(const int64_t local_numel, checked_numel(local_shape));
        if (!sharded) runs = {{0, 0, local_numel}};
        // Its part of that tensor: all of it, or ZeRO-1's run of it for the file's data-parallel rank.
        int64_t start = 0, end = local_numel;
        if (np.zero) {
          const auto z = np.zero->find(name);
          const auto split = z != np.zero->end() && !sharded ? z->second.runs : np.zero_rule(local_numel);
          const auto r = split.find(file.dp);
          if (r == split.end())
            return corrupt(fmt::format("{}: held, but {} gives data-parallel rank {} no run of it", fw,
                                       z != np.zero->end() && !sharded ? "optimizer_config.json" : "nanotron's ZeRO-1 split",
                                       file.dp));
          std::tie(start, end) = r->second;
          if (start < 0 || end > local_numel || start > end)
            return corrupt(fmt::format("{}: run [{}, {}) outside its {} elements", fw, start, end, local_numel));
          if (spec->shape != std::vector<int64_t>{end - start})
            return corrupt(fmt::format("{}: shape {}, its run [{}, {}) of {} has {} elements", fw,
                                       format_shape(spec->shape), start, end,
                                       z != np.zero->end() && !sharded ? "optimizer_config.json" : "nanotron's ZeRO-1 split",
                                       end - start));
        } else if (spec->shape != local_shape) {
          return corrupt(fmt::format("{}: shape {}, its shard's is {}", fw, format_shape(spec->shape),
                                     format_shape(local_shape)));
        }
        for (const RankFileSet::Run& r : runs) {
          const int64_t lo = std::max(r.local, start), hi = std::min(r.local + r.count, end);
          if (lo < hi) pieces.emplace_back(f, spec, lo - start, r.global + (lo - r.local), hi - lo);
        }
        if (!sharded && ps.shape.empty()) ps.shape = local_shape;
      }
      if (sharded) ps.shape = sharded->shape;
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
      std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return std::get<3>(a) < std::get<3>(b); });
      int64_t at = 0;
      for (const auto& [f, spec, local, global, count] : pieces) {
        if (global != at)
          return corrupt(fmt::format("{}: its ranks' files {} element {} of it", pw, global < at ? "hold twice" : "leave out",
                                     std::min(global, at)));
        at += count;
      }
      if (at != numel)
        return corrupt(fmt::format("{}: its ranks' files hold {} of its {} elements", pw, at, numel));
      std::optional<int64_t> step;
      for (const auto& [f, spec] : specs) {
        const std::string fw = fmt::format("{} param '{}'", np.files[f].path.string(), name);
        if (base[np.files[f].pp] + static_cast<size_t>(spec->group) != static_cast<size_t>(ps.group))
          return corrupt(fmt::format("{}: in param group {}, {} has it in group {}", fw, spec->group,
                                     np.files[f0].path.string(), s0->group));
        OPTSTATE_ASSIGN_OR_RETURN(const double st, value_of(f, spec->step, fw + " 'step'"));
        if (!(st >= 0 && st < 9.2e18) || st != std::floor(st)) return corrupt(fmt::format("{}: step {} is not a count", fw, st));
        if (step && *step != static_cast<int64_t>(st))
          return corrupt(fmt::format("{}: step {}, another rank's file has {}", fw, st, *step));
        step = static_cast<int64_t>(st);
        if (spec->entries.size() != s0->entries.size() || spec->weight.has_value() != s0->weight.has_value())
          return corrupt(fmt::format("{}: other entries than {} has", fw, np.files[f0].path.string()));
      }
      ps.step = *step;
      std::vector<std::string> entries;
      for (const auto& [entry, es] : s0->entries) entries.push_back(entry);
      if (s0->weight) entries.push_back(kParam);  // the fp32 weights (gradient_accumulator)
      for (const std::string& entry : entries) {
        std::vector<Piece> stored;
        Entry e;
        for (const auto& [f, spec, local, global, count] : pieces) {
          const std::string ew = fmt::format("{} param '{}' '{}'", np.files[f].path.string(), name, entry);
          const dcp::TensorRef* t = nullptr;
          if (entry == kParam) {
            t = &*spec->weight;
          } else {
            const auto it = spec->entries.find(entry);
            if (it == spec->entries.end()) return corrupt(ew + ": missing");
            if (it->second.encoding != Encoding::kDense || it->second.dtensor) return corrupt(ew + ": not a plain tensor");
            t = &it->second.values;
          }
          if (stored.empty()) e.dtype = t->dtype;
          if (t->dtype != e.dtype || (e.dtype != DType::kF32 && e.dtype != DType::kBF16 && e.dtype != DType::kF16))
            return corrupt(fmt::format("{}: {}; optstate reads fp32, bf16 or fp16 of one dtype", ew, dtype_name(t->dtype)));
          if (t->shape != spec->shape)
            return corrupt(fmt::format("{}: shape {}, its state's is {}", ew, format_shape(t->shape), format_shape(spec->shape)));
          OPTSTATE_ASSIGN_OR_RETURN(const Stored whole, resolve(f, *t, *checked_numel(t->shape), ew));
          const auto elem = static_cast<uint64_t>(dtype_size(t->dtype));
          Piece pc{global, count, whole, std::nullopt};
          pc.stored.at += static_cast<uint64_t>(local) * elem;
          pc.stored.bytes = static_cast<uint64_t>(count) * elem;
          pc.stored.whole = whole.whole && pc.stored.bytes == whole.bytes;
          stored.push_back(pc);
        }
        stored_[{name, entry, Component::kValues}] = std::move(stored);
        if (entry == kParam) ps.param_dtype = e.dtype;
        ps.entries.emplace(entry, std::move(e));
      }
      OPTSTATE_RETURN_IF_ERROR(one_name(name, name, dir));
      meta_.groups[static_cast<size_t>(ps.group)].params.push_back(name);
      meta_.params.emplace(name, std::move(ps));
    }
    // A group that held only tied copies (nanotron's group per param) is left out, the others renumbered.
    std::vector<int> renumber(meta_.groups.size());
    size_t kept = 0;
    for (size_t g = 0; g < meta_.groups.size(); ++g) {
      renumber[g] = static_cast<int>(kept);
      if (tied_groups.count(g) && meta_.groups[g].params.empty()) continue;
      if (kept != g) {
        meta_.groups[kept] = std::move(meta_.groups[g]);
        adamw_flags_[kept] = std::move(adamw_flags_[g]);
        group_extras_[kept] = std::move(group_extras_[g]);
      }
      ++kept;
    }
    meta_.groups.resize(kept);
    adamw_flags_.resize(kept);
    group_extras_.resize(kept);
    for (auto& [name, ps] : meta_.params) ps.group = renumber[static_cast<size_t>(ps.group)];
    return finish({}, {}, 0);
  }

  // A DeepSpeed universal checkpoint (`dir`: zero/optimizer_state.pt, zero/<param>/{fp32,exp_avg,
  // exp_avg_sq,step}.pt, the model states file `model`): groups and their params from the model
  // states' param_shapes, hyperparameters from optimizer_state.pt, each param's tensors whole.
  Status init_universal(const fs::path& dir, const fs::path& model) {
    deepspeed_ = true;
    const fs::path opt_file = dir / "zero" / "optimizer_state.pt";
    OPTSTATE_ASSIGN_OR_RETURN(auto opt, open_archive(opt_file));
    OPTSTATE_ASSIGN_OR_RETURN(const UniversalOptimizer uo, interpret_universal_optimizer(opt.second, opt_file.string()));
    const std::vector<GroupSpec>& groups = uo.groups;
    files_.push_back(std::move(opt.first));
    const size_t opt_index = files_.size() - 1;
    OPTSTATE_ASSIGN_OR_RETURN(auto ms, open_archive(model));
    OPTSTATE_ASSIGN_OR_RETURN(const ZeroShapes shapes, interpret_zero_model(ms.second, model.string()));
    // param_shapes lists each flat param's params: one per group, or ZeRO-3's sub-groups.
    const size_t flats = uo.group_of_flat.empty() ? groups.size() : uo.group_of_flat.size();
    if (shapes.groups.size() != flats)
      return corrupt(fmt::format("{}: {} flat params in param_shapes, {} in {}", model.string(), shapes.groups.size(),
                                 flats, opt_file.string()));
    std::vector<double> decay;
    for (const GroupSpec& g : groups) decay.push_back(g.hyper.weight_decay);
    OPTSTATE_RETURN_IF_ERROR(check_zero_decay(shapes, decay, model.string()));
    not_read_ = shapes.not_read;
    // A pipeline's stages (ds_to_universal copies each stage's mp_rank_SS_model_states.pt): their
    // params, in stage order, in the groups of stage 0's settings (optimizer_state.pt holds stage
    // 0's; DeepSpeed gives each stage's group g those).
    std::error_code ec;
    std::vector<ZeroShapes> stage_shapes;
    std::vector<fs::path> stage_models{model};
    stage_shapes.push_back(shapes);
    // Under tensor parallelism (AutoTP) the files are its ranks': rank 0's names every param, and
    // its affine map their whole shapes (its param_shapes are its shards').
    const bool tensor_parallel = shapes.tp_degree.value_or(1) > 1;
    if (tensor_parallel && !shapes.autotp)
      return corrupt(fmt::format("{}: tp_degree {} and no affine_map: the params' whole shapes are in no file",
                                 model.string(), *shapes.tp_degree));
    for (int s = 1; !tensor_parallel && model.filename() == "mp_rank_00_model_states.pt" && s < (1 << 16); ++s) {
      const fs::path next = dir / fmt::format("mp_rank_{:02d}_model_states.pt", s);
      if (!fs::is_regular_file(next, ec)) break;
      OPTSTATE_ASSIGN_OR_RETURN(auto ns, open_archive(next));
      OPTSTATE_ASSIGN_OR_RETURN(ZeroShapes more, interpret_zero_model(ns.second, next.string()));
      if (more.groups.size() != flats)
        return corrupt(fmt::format("{}: {} param groups in param_shapes, {} in {}", next.string(), more.groups.size(),
                                   flats, opt_file.string()));
      if (more.tp_degree && *more.tp_degree != 1)
        return corrupt(fmt::format("{}: tp_degree {}: tensor-parallel checkpoints are not read (a pipeline's stages "
                                   "are)", next.string(), *more.tp_degree));
      OPTSTATE_RETURN_IF_ERROR(check_zero_decay(more, decay, next.string()));
      for (const std::string& n : more.not_read)
        if (std::find(not_read_.begin(), not_read_.end(), n) == not_read_.end()) not_read_.push_back(n);
      stage_shapes.push_back(std::move(more));
      stage_models.push_back(next);
    }
    std::map<std::string, size_t> stage_of;
    std::map<std::string, std::set<size_t>> tied;
    meta_.kind = "adamw";
    for (const GroupSpec& spec : groups) {
      ParamGroup group;
      group.hyper = spec.hyper;
      group.hyper.lr = *spec.lr.number;
      meta_.groups.push_back(group);
    }
    for (size_t stage = 0; stage < stage_shapes.size(); ++stage)
    for (size_t flat = 0; flat < flats; ++flat) {
      const size_t g = uo.group_of_flat.empty() ? flat : uo.group_of_flat[flat];
      const ParamGroup& group = meta_.groups[g];
      const std::string mw = stage_models[stage].string();
      for (auto [name, shape] : stage_shapes[stage].groups[flat]) {
        if (tensor_parallel) {
          const auto m = shapes.autotp->params.find(name);
          if (m == shapes.autotp->params.end())
            return corrupt(fmt::format("{}: '{}' has no affine map (its whole shape)", mw, name));
          shape = m->second.logical_shape;
        } else if (const auto e = stage_shapes[stage].autoep_maps.params.find(name);
                   e != stage_shapes[stage].autoep_maps.params.end()) {
          // AutoEP's fused experts: param_shapes holds rank 0's [local experts, ...]; its map the whole
          const auto& whole = e->second.logical_shape;
          if (whole.size() != shape.size() || shape.empty() || !std::equal(shape.begin() + 1, shape.end(), whole.begin() + 1))
            return corrupt(fmt::format("{}: AutoEP's '{}' of shape [{}], whole [{}] in its map", mw, name,
                                       fmt::join(shape, ", "), fmt::join(whole, ", ")));
          shape = whole;
        }
        const fs::path pdir = dir / "zero" / name;
        const std::string pw = fmt::format("{} '{}'", (dir / "zero").string(), name);
        if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
          return corrupt(fmt::format("{}: param name '{}' is no folder name", mw, name));
        if (const auto earlier = meta_.params.find(name); earlier != meta_.params.end()) {
          // a tied module's copy in a later stage: one param of the universal checkpoint
          if (stage_of.at(name) == stage || earlier->second.shape != shape || earlier->second.group != static_cast<int>(g))
            return corrupt(fmt::format("{}: param '{}' is listed twice", mw, name));
          tied[name].insert(stage);
          continue;
        }
        stage_of[name] = stage;
        OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(shape));
        ParamState ps;
        ps.shape = shape;
        ps.group = static_cast<int>(g);
        std::vector<std::pair<std::string, std::string>> files = {{kParam, "fp32.pt"}};
        const bool moments = fs::is_regular_file(pdir / "exp_avg.pt", ec) || fs::is_regular_file(pdir / "exp_avg_sq.pt", ec);
        if (moments) {
          files.insert(files.end(), {{kExpAvg, "exp_avg.pt"}, {kExpAvgSq, "exp_avg_sq.pt"}});
          if (group.hyper.amsgrad) files.emplace_back(kMaxExpAvgSq, "max_exp_avg_sq.pt");
        }
        for (const auto& [entry, file] : files) {
          const fs::path f = pdir / file;
          if (!fs::is_regular_file(f, ec)) return corrupt(fmt::format("{}: no {}", pw, file));
          OPTSTATE_ASSIGN_OR_RETURN(auto a, open_archive(f));
          OPTSTATE_ASSIGN_OR_RETURN(const dcp::TensorRef t, interpret_universal_tensor(a.second, f.string()));
          files_.push_back(std::move(a.first));
          OPTSTATE_ASSIGN_OR_RETURN(const Stored whole, resolve(files_.size() - 1, t, numel, f.string()));
          stored_[{name, entry, Component::kValues}] = {Piece{0, numel, whole, std::nullopt}};
          ps.entries.emplace(entry, Entry{});  // fp32 values
        }
        if (moments) {
          const fs::path f = pdir / "step.pt";
          double st = 0;
          if (fs::is_regular_file(f, ec)) {
            OPTSTATE_ASSIGN_OR_RETURN(auto a, open_archive(f));
            OPTSTATE_ASSIGN_OR_RETURN(const Scalar step, interpret_universal_step(a.second, f.string()));
            files_.push_back(std::move(a.first));
            OPTSTATE_ASSIGN_OR_RETURN(st, value_of(files_.size() - 1, step, f.string()));
          } else if (const auto gs = uo.steps.find(flat); gs != uo.steps.end()) {  // ZeRO-3's: its flat param's
            OPTSTATE_ASSIGN_OR_RETURN(st, value_of(opt_index, gs->second,
                                                   fmt::format("{} flat param {} step", opt_file.string(), flat)));
          } else {
            return corrupt(pw + ": no step.pt, and " + opt_file.string() + " holds no step for its group");
          }
          if (!(st >= 0 && st < 9.2e18) || st != std::floor(st)) return corrupt(fmt::format("{}: step {} is not a count", pw, st));
          ps.step = static_cast<int64_t>(st);
        }
        meta_.groups[g].params.push_back(name);
        meta_.params.emplace(name, std::move(ps));
      }
    }
    for (const auto& [name, stages] : tied)
      value_notes_.push_back(fmt::format("'{}' is in the param_shapes of pipeline stages {} and {} (a tied module): "
                                         "one param", name, stage_of.at(name), fmt::join(stages, ", ")));
    return finish({}, {}, 0);
  }

  // "optim_world_size_2_rank_*.pt" for a per-rank set's files (their shared name, the rank as *).
  static std::string rank_pattern(const std::vector<fs::path>& files) {
    if (files.empty()) return "";
    const std::string name = files[0].filename().string();
    const auto rn = rank_name(name);
    return files.size() > 1 && rn ? rn->prefix + "*" + rn->ext : name;
  }

 private:
  // FSDP1's per-rank files (verl's FSDP strategy: FullyShardedDataParallel's optimizer.state_dict()
  // and, under SHARDED_STATE_DICT, model.state_dict() of DTensors): the optimizer steps plain 1-D
  // parts of flat parameters, which the model's DTensors (names in module order, shapes) place.
  // use_orig_params=True: one optimizer param per model param, each rank holding the run of it that
  // falls in its part of the unit's flat parameter (or none, and then no state), runs in rank
  // order; use_orig_params=False: one optimizer param per FSDP unit (match_flat_units), rank r
  // holding elements [r * shard, (r + 1) * shard) of it. Gives the number of params whose weights
  // came from the model's files.
  Result<size_t> init_fsdp1(const std::vector<StateDict>& sds, const std::vector<fs::path>& optim_files,
                            const std::vector<std::pair<ModelDict, size_t>>& models,
                            const std::vector<fs::path>& model_files) {
    const size_t world = sds.size();
    const std::string w0 = optim_files[0].string();
    if (models.size() != world)
      return corrupt(fmt::format("{}: {} optimizer files of FSDP1 (plain parts of flat parameters) and {} model files; "
                                 "each rank's model file places its part", path_.string(), world, models.size()));
    bool model_dtensors = false;
    for (const ModelTensor& t : models[0].first.tensors) model_dtensors = model_dtensors || t.dtensor.has_value();
    // The model's params: its distinct DTensors in order (buffers are plain; a one-rank run's
    // file, all plain, gives every tensor: buffers there would not add up). FSDP1 saves a tied
    // weight (lm_head tied to the embedding) once per name, as two objects; FSDP flattened it once.
    // A later DTensor whose every rank's part is a whole storage record of the same size and CRC-32
    // as an earlier one of its shape is such a copy: left out where the params do not add up with it.
    std::vector<const ModelTensor*> all;
    std::set<pickle::Ref> seen;
    for (const ModelTensor& t : models[0].first.tensors)
      if ((t.dtensor || !model_dtensors) && seen.insert(t.ref).second) all.push_back(&t);
    std::vector<bool> tied(all.size(), false);
    std::set<std::pair<std::vector<int64_t>, std::vector<std::pair<uint32_t, uint64_t>>>> signatures;
    for (size_t j = 0; j < all.size(); ++j)
      if (auto sig = record_signature(models, all[j]->name))
        tied[j] = !signatures.emplace(global_shape(*all[j]), std::move(*sig)).second;
    const size_t copies = static_cast<size_t>(std::count(tied.begin(), tied.end(), true));
    const size_t members = sds[0].members;
    std::vector<const ModelTensor*> params;
    std::vector<std::string> names;
    std::vector<int64_t> numels;
    auto take = [&](bool without_copies) -> Status {
      params.clear();
      names.clear();
      numels.clear();
      for (size_t j = 0; j < all.size(); ++j) {
        if (without_copies && tied[j]) continue;
        OPTSTATE_ASSIGN_OR_RETURN(const int64_t n, checked_numel(global_shape(*all[j])));
        params.push_back(all[j]);
        names.push_back(all[j]->name);
        numels.push_back(n);
      }
      return Status::Ok();
    };
    OPTSTATE_RETURN_IF_ERROR(take(copies > 0 && members == all.size() - copies));
    const std::string where = fmt::format("{} ({} beside {})", path_.string(), rank_pattern(optim_files),
                                          rank_pattern(model_files));
    // Each rank's state by optimizer param id; dense 1-D fp32/bf16 parts only.
    std::vector<std::map<int64_t, const ParamSpec*>> by_id(world);
    for (size_t f = 0; f < world; ++f)
      for (const ParamSpec& ps : sds[f].params) {
        const std::string pw = fmt::format("{} param {}", optim_files[f].string(), ps.id);
        for (const auto& [name, es] : ps.entries) {
          if (es.encoding != Encoding::kDense)
            return corrupt(fmt::format("{} '{}': 8-bit state in FSDP1's files (flat parameters) is not read", pw, name));
          if (es.values.shape.size() != 1)
            return corrupt(fmt::format("{} '{}': shape {}; FSDP1's parts of flat parameters are 1-D", pw, name,
                                       format_shape(es.values.shape)));
        }
        by_id[f][ps.id] = &ps;
      }
    // Where each param lies: (optimizer param, offset in it), and each optimizer param's per-rank runs.
    const bool orig = members == params.size();
    std::vector<std::pair<int64_t, int64_t>> at(params.size());
    std::vector<int64_t> shard;  // flat: elements per rank of each unit
    if (orig) {
      for (size_t j = 0; j < params.size(); ++j) at[j] = {static_cast<int64_t>(j), 0};
    } else {
      if (members == 0 || members > params.size())
        return corrupt(fmt::format("{}: the optimizer steps {} params, the model has {}: not FSDP1's flat parameters "
                                   "of this model", where, members, params.size()));
      for (size_t u = 0; u < members; ++u) {
        for (size_t f = 0; f < world; ++f) {
          auto it = by_id[f].find(static_cast<int64_t>(u));
          if (it == by_id[f].end() || !it->second->entries.count(kExpAvg))
            return corrupt(fmt::format("{}: flat parameter {} has no exp_avg; every rank steps every FSDP unit",
                                       optim_files[f].string(), u));
          const int64_t n = it->second->entries.at(kExpAvg).values.shape[0];
          if (f == 0) shard.push_back(n);
          if (n != shard[u])
            return corrupt(fmt::format("{}: flat parameter {} holds {} elements, rank 0's {}; FSDP1 pads every "
                                       "rank's part to one size", optim_files[f].string(), u, n, shard[u]));
        }
      }
      auto units = match_flat_units(names, numels, shard, static_cast<int64_t>(world), where);
      if (!units.ok() && copies > 0) {  // with the tied copies left out
        OPTSTATE_RETURN_IF_ERROR(take(true));
        auto again = match_flat_units(names, numels, shard, static_cast<int64_t>(world), where);
        if (again.ok()) units = std::move(again);
        else OPTSTATE_RETURN_IF_ERROR(take(false));
      }
      if (!units.ok()) return units.status();
      at.resize(params.size());
      for (size_t j = 0; j < params.size(); ++j) at[j] = {units->unit_of[j], units->offset[j]};
      if (model_dtensors) {  // what a writer for another world size needs: each unit's params in order
        FsdpSet set{path_, optim_files, model_files, {}, std::vector<std::vector<FsdpSet::FlatParam>>(members)};
        std::vector<std::pair<std::pair<int64_t, int64_t>, size_t>> order;  // ((unit, offset), param)
        for (size_t j = 0; j < params.size(); ++j) order.push_back({at[j], j});
        std::sort(order.begin(), order.end());
        for (const auto& [place, j] : order)
          set.flat_units[static_cast<size_t>(place.first)].push_back({torch_param_fqn(names[j]), numels[j]});
        fsdp_ = std::move(set);
      }
    }
    size_t weights = 0, groupless = 0;
    for (size_t j = 0; j < params.size(); ++j) {
      const std::string fqn = torch_param_fqn(names[j]);
      OPTSTATE_RETURN_IF_ERROR(one_name(fqn, names[j], where));
      const int64_t id = at[j].first, offset = at[j].second, numel = numels[j];
      const std::string pw = fmt::format("{} param '{}'", where, fqn);
      ParamState ps;
      ps.shape = global_shape(*params[j]);
      // Every rank's run of this param, in rank order: (rank, begin in the rank's part, count).
      std::vector<std::tuple<size_t, int64_t, int64_t>> runs;
      std::set<std::string> entries;
      std::optional<int> group;
      std::optional<int64_t> step;
      int64_t covered = 0;
      for (size_t f = 0; f < world; ++f) {
        auto it = by_id[f].find(id);
        if (it == by_id[f].end()) continue;  // use_orig_params: no part of this param on this rank
        const ParamSpec& spec = *it->second;
        const std::string fw = fmt::format("{} param {} ('{}')", optim_files[f].string(), id, fqn);
        std::set<std::string> here;
        int64_t part = -1;
        for (const auto& [name, es] : spec.entries) {
          here.insert(name);
          if (part < 0) part = es.values.shape[0];
          if (es.values.shape[0] != part)
            return corrupt(fmt::format("{}: '{}' holds {} elements, its other moments {}", fw, name, es.values.shape[0], part));
        }
        if (part < 0) continue;
        if (orig && part > numel)  // a flat parameter's part (shard) was checked by match_flat_units
          return corrupt(fmt::format("{}: {} elements of a param of {}", fw, part, numel));
        if (entries.empty()) entries = here;
        if (here != entries)
          return corrupt(fmt::format("{}: moments {} where another rank's file has {}", fw, fmt::join(here, ", "),
                                     fmt::join(entries, ", ")));
        OPTSTATE_ASSIGN_OR_RETURN(const double st, value_of(f, spec.step, fw + " 'step'"));
        if (!(st >= 0 && st < 9.2e18) || st != std::floor(st)) return corrupt(fmt::format("{}: step {} is not a count", fw, st));
        if (step && *step != static_cast<int64_t>(st))
          return corrupt(fmt::format("{}: step {}, another rank's file has {}", fw, st, *step));
        step = static_cast<int64_t>(st);
        if (group && *group != spec.group)
          return corrupt(fmt::format("{}: in param group {}, another rank's file has it in {}", fw, spec.group, *group));
        group = spec.group;
        if (orig) {
          if (part > 0) runs.emplace_back(f, 0, part);
          covered += part;
        } else {
          const int64_t lo = std::max(offset, static_cast<int64_t>(f) * part);
          const int64_t hi = std::min(offset + numel, static_cast<int64_t>(f + 1) * part);
          if (lo < hi) runs.emplace_back(f, lo - static_cast<int64_t>(f) * part, hi - lo);
          covered += std::max<int64_t>(0, hi - lo);
        }
      }
      if (!group) {
        // No state on any rank (never stepped, or frozen): weights only, where the group is clear.
        if (meta_.groups.size() != 1) {
          ++groupless;
          continue;
        }
        group = 0;
      } else if (covered != numel) {
        return corrupt(fmt::format("{}: the ranks' parts hold {} of its {} elements", pw, covered, numel));
      }
      ps.group = *group;
      ps.step = step.value_or(0);
      for (const std::string& name : entries) {
        Entry e;
        std::vector<Piece> pieces;
        int64_t begin = 0;
        for (const auto& [f, local, count] : runs) {
          const EntrySpec& es = by_id[f].at(id)->entries.at(name);
          if (pieces.empty()) e.dtype = es.values.dtype;
          if (es.values.dtype != e.dtype || (e.dtype != DType::kF32 && e.dtype != DType::kBF16))
            return corrupt(fmt::format("{} '{}': {} in {}; FSDP1's moments are fp32 (or bf16) alike", pw, name,
                                       dtype_name(es.values.dtype), optim_files[f].string()));
          OPTSTATE_ASSIGN_OR_RETURN(Stored whole, resolve(f, es.values, es.values.shape[0],
                                                           fmt::format("{} '{}' in {}", pw, name, optim_files[f].string())));
          const auto elem = static_cast<uint64_t>(dtype_size(e.dtype));
          Piece pc{begin, count, whole, std::nullopt};
          pc.stored.at += static_cast<uint64_t>(local) * elem;
          pc.stored.bytes = static_cast<uint64_t>(count) * elem;
          pc.stored.whole = whole.whole && pc.stored.bytes == whole.bytes;
          pieces.push_back(pc);
          begin += count;
        }
        stored_[{fqn, name, Component::kValues}] = std::move(pieces);
        ps.entries.emplace(name, std::move(e));
      }
      OPTSTATE_ASSIGN_OR_RETURN(const bool found, model_weights(fqn, names[j], ps, models, model_files));
      weights += found;
      meta_.groups[static_cast<size_t>(ps.group)].params.push_back(fqn);
      meta_.params.emplace(fqn, std::move(ps));
    }
    if (groupless)
      not_read_.push_back(fmt::format("{} param{} without state on any rank (frozen, or never stepped), whose group "
                                      "the files do not say", groupless, groupless == 1 ? "" : "s"));
    return weights;
  }

  static const std::vector<int64_t>& global_shape(const ModelTensor& t) {
    return t.dtensor ? t.dtensor->global_shape : t.tensor.shape;
  }

  // One optimizer file beside one plain model file: FSDP1's flat parts (every moment 1-D, params
  // numbered) when the optimizer has fewer params than the model's tensors, or a moment of a param
  // that the model has with more than one dim.
  static bool flat_parts(const StateDict& sd, const ModelDict& md) {
    bool reshaped = false;
    for (const ParamSpec& ps : sd.params) {
      if (!numbered(ps.fqn, ps.id)) return false;
      for (const auto& [name, es] : ps.entries) {
        if (es.encoding != Encoding::kDense || es.values.shape.size() != 1) return false;
        if (ps.id >= 0 && static_cast<size_t>(ps.id) < md.tensors.size() &&
            md.tensors[static_cast<size_t>(ps.id)].tensor.shape.size() > 1)
          reshaped = true;
      }
    }
    return !sd.params.empty() && (sd.members < md.tensors.size() || reshaped);
  }

  // What the archives tell of model tensor `name`'s bytes without reading them: each rank's part's
  // storage record (CRC-32, size) where the part is that whole record; none where one is not.
  std::optional<std::vector<std::pair<uint32_t, uint64_t>>> record_signature(
      const std::vector<std::pair<ModelDict, size_t>>& models, const std::string& name) const {
    std::vector<std::pair<uint32_t, uint64_t>> sig;
    for (const auto& [md, file] : models) {
      const ModelTensor* t = md.find(name);
      if (!t) return std::nullopt;
      const Archive& ar = files_[file];
      auto it = ar.entries.find(ar.prefix + "/data/" + t->tensor.storage_key);
      const auto numel = checked_numel(t->tensor.shape);
      if (it == ar.entries.end() || !numel.ok() || t->tensor.offset != 0 || t->tensor.storage_numel != *numel)
        return std::nullopt;
      const zip::Entry& e = ar.index.entries[it->second];
      if (e.size != static_cast<uint64_t>(*numel) * static_cast<uint64_t>(dtype_size(t->tensor.dtype))) return std::nullopt;
      sig.emplace_back(e.crc32, e.size);
    }
    return sig;
  }

  // Betas as files hold them: NaN where a tensor's value is still to be read (adamw_group), which
  // the read compares across the files then.
  // FSDP1's ranks: the same groups (hyperparameters, member count) in every file; which params
  // have state differs between ranks under use_orig_params.
  static Status same_groups(const StateDict& a, const StateDict& b, const std::string& wa, const std::string& wb) {
    if (a.groups.size() != b.groups.size() || a.members != b.members)
      return corrupt(fmt::format("{}: {} param groups of {} params; {} has {} of {}: not one optimizer's ranks", wb,
                                 b.groups.size(), b.members, wa, a.groups.size(), a.members));
    for (size_t g = 0; g < a.groups.size(); ++g) {
      const Hyperparameters &x = a.groups[g].hyper, &y = b.groups[g].hyper;
      if (!same_number(x.beta1, y.beta1) || !same_number(x.beta2, y.beta2) || !same_number(x.eps, y.eps) ||
          !same_number(x.weight_decay, y.weight_decay) || x.amsgrad != y.amsgrad || x.maximize != y.maximize)
        return corrupt(fmt::format("{}: param group {}'s hyperparameters differ from {}'s", wb, g, wa));
    }
    return Status::Ok();
  }

  // Every rank's file must hold the same groups (members and hyperparameters) and the same params.
  static Status same_layout(const StateDict& a, const StateDict& b, const std::string& wa, const std::string& wb) {
    if (a.groups.size() != b.groups.size() || a.params.size() != b.params.size() || a.members != b.members)
      return corrupt(fmt::format("{}: {} param groups and {} params with state; {} has {} and {}: not one optimizer's "
                                 "ranks", wb, b.groups.size(), b.params.size(), wa, a.groups.size(), a.params.size()));
    for (size_t g = 0; g < a.groups.size(); ++g) {
      const Hyperparameters &x = a.groups[g].hyper, &y = b.groups[g].hyper;
      if (a.groups[g].params != b.groups[g].params || !same_number(x.beta1, y.beta1) || !same_number(x.beta2, y.beta2) ||
          !same_number(x.eps, y.eps) || !same_number(x.weight_decay, y.weight_decay) || x.amsgrad != y.amsgrad ||
          x.maximize != y.maximize)
        return corrupt(fmt::format("{}: param group {} differs from {}'s (members or hyperparameters)", wb, g, wa));
    }
    for (size_t i = 0; i < a.params.size(); ++i)
      if (a.params[i].id != b.params[i].id || a.params[i].shape != b.params[i].shape)
        return corrupt(fmt::format("{}: param id {} of shape {}; {} has id {} of shape {} there", wb, b.params[i].id,
                                   format_shape(b.params[i].shape), wa, a.params[i].id, format_shape(a.params[i].shape)));
    return Status::Ok();
  }

  // Numbered params named after the model's (names_from_model: the distinct DTensors of its
  // state_dict, each group's params among them in order; torch numbered the optimizer's params so
  // when it was given model.parameters() or filters of named_parameters()). Where they do not fit
  // one way, the params keep their numbers and the model files are named as not read.
  Status model_names(const StateDict& sd, const ModelDict& md, const fs::path& model0,
                     std::map<int64_t, std::string>& rename) {
    for (const ParamSpec& ps : sd.params)
      if (!numbered(ps.fqn, ps.id)) return Status::Ok();  // named by param_names
    std::map<int64_t, std::vector<int64_t>> shape_of;
    for (const ParamSpec& ps : sd.params) shape_of.emplace(ps.id, ps.shape);
    ModelNames names = names_from_model(md, sd.member_ids, shape_of);
    if (!names.why.empty()) {
      not_read_.push_back(fmt::format("{} (the model's files: {}, so params keep their numbers)",
                                      model0.filename().string(), names.why));
      return Status::Ok();
    }
    for (const ParamSpec& ps : sd.params) rename[ps.id] = names.by_id.at(ps.id);
    return Status::Ok();
  }

  // Places the ranks' parts of a component in the global tensor of `shape` as pieces: a plain
  // tensor (every rank holds all of it: rank 0's is read), or a DTensor on every rank, each part
  // where its mesh coordinate puts it (the mesh's shape is what the ranks' coordinates span), with
  // every element held by exactly one part.
  // `dense`: the parts are dense values (not 8-bit codes, whose blocks follow their storage order),
  // which may be stored permuted.
  Result<Placed> place(const std::vector<int64_t>& shape, const std::vector<Part>& parts, const std::string& where,
                       bool dense = false) {
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(shape));
    const bool sharded = parts[0].dtensor->has_value();
    for (const Part& part : parts)
      if (part.dtensor->has_value() != sharded)
        return corrupt(where + ": a DTensor in some ranks' files and a plain tensor in others'");
    Placed out;
    // A part's bytes: values, or codes and its scales.
    auto resolve_part = [&](const Part& part, int64_t count, const std::string& pw) -> Result<std::pair<Stored, Stored>> {
      const bool four = part.scales && part.bits == 4;  // two codes a byte
      if (four && count % 2) return corrupt(fmt::format("{}: an odd number ({}) of 4-bit codes", pw, count));
      OPTSTATE_ASSIGN_OR_RETURN(Stored v, resolve(part.file, part.tensor, four ? count / 2 : count, pw,
                                                  dense && !part.scales));
      Stored sc;
      if (part.scales) {
        OPTSTATE_ASSIGN_OR_RETURN(sc, resolve(part.file, *part.scales, (count + part.block - 1) / part.block, pw + " scales"));
      }
      return std::pair{v, sc};
    };
    auto piece = [&](size_t k, int64_t begin, int64_t count, int64_t local, const std::pair<Stored, Stored>& st) -> Status {
      const Part& part = parts[k];
      const auto elem = static_cast<uint64_t>(dtype_size(part.tensor.dtype));
      const bool four = part.scales && part.bits == 4;
      if (four && (local % 2 || count % 2))
        return corrupt(fmt::format("{}: a run of 4-bit codes [{}, {}) that splits a byte", where, local, local + count));
      Piece pc{begin, count, st.first, std::nullopt};
      if (pc.stored.permuted) {
        pc.stored.permuted_local = local;  // at and bytes stay all of the tensor: it is read whole
        pc.stored.whole = false;           // checked by permuted_run, not as a run
      } else {
        pc.stored.at += static_cast<uint64_t>(four ? local / 2 : local) * elem;
        pc.stored.bytes = static_cast<uint64_t>(four ? count / 2 : count) * elem;
        pc.stored.whole = st.first.whole && pc.stored.bytes == st.first.bytes;
      }
      if (part.scales) pc.dq = Dequant{st.second, local, part.block, part.table, part.bits};
      out.pieces.push_back(pc);
      out.of.push_back(k);
      return Status::Ok();
    };
    if (!sharded) {
      OPTSTATE_ASSIGN_OR_RETURN(const auto st, resolve_part(parts[0], numel, where));
      if (numel > 0) OPTSTATE_RETURN_IF_ERROR(piece(0, 0, numel, 0, st));
      return out;
    }
    const DTensorSpec& d0 = **parts[0].dtensor;
    std::vector<int64_t> mesh(d0.coordinate.size(), 1);
    std::set<std::vector<int64_t>> coords;
    for (const Part& part : parts) {
      const DTensorSpec& d = **part.dtensor;
      if (d.placements != d0.placements || d.global_shape != shape)
        return corrupt(fmt::format("{}: {}'s DTensor is placed or shaped differently than rank 0's", where,
                                   files_[part.file].path.filename().string()));
      for (size_t k = 0; k < mesh.size(); ++k) mesh[k] = std::max(mesh[k], d.coordinate[k] + 1);
      if (!coords.insert(d.coordinate).second)
        return corrupt(fmt::format("{}: two files hold mesh position {}", where, format_shape(d.coordinate)));
    }
    int64_t positions = 1;
    for (int64_t m : mesh) positions = std::min<int64_t>(positions * m, int64_t{1} << 40);
    // A part's elements: its tensor's, or (torchao's 4-bit codes, two a byte) twice its bytes.
    auto elements = [](const Part& part) -> Result<int64_t> {
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t n, checked_numel(part.tensor.shape));
      return part.scales && part.bits == 4 ? 2 * n : n;
    };
    const auto local = elements(parts[0]);
    if (!set_ && (positions > 1 || !local.ok() || *local != numel))
      return corrupt(fmt::format("{}: one rank's shard of a DTensor (local {} of {}, mesh position {}): this file is "
                                 "one rank's part; pass the directory that holds every rank's file", where,
                                 format_shape(parts[0].tensor.shape), format_shape(shape), format_shape(d0.coordinate)));
    if (positions != static_cast<int64_t>(parts.size()))
      return corrupt(fmt::format("{}: the ranks' files hold {} of the {} positions of a mesh of {}", where, parts.size(),
                                 positions, format_shape(mesh)));
    dcp::RunList segs;
    std::vector<std::pair<Stored, Stored>> stored(parts.size());
    for (size_t k = 0; k < parts.size(); ++k) {
      const Part& part = parts[k];
      const std::string rw = fmt::format("{} in {}", where, files_[part.file].path.filename().string());
      OPTSTATE_ASSIGN_OR_RETURN(Box box, dtensor_box(**part.dtensor, mesh, rw));
      if (box.replica) continue;  // another rank holds the same box
      const bool four = part.scales && part.bits == 4;  // flat codes: their count is what must agree
      if (four ? *elements(part) != *checked_numel(box.sizes) : part.tensor.shape != box.sizes)
        return corrupt(fmt::format("{}: local tensor {}, its mesh position {} on a mesh of {} gives {}", rw,
                                   format_shape(part.tensor.shape), format_shape((*part.dtensor)->coordinate),
                                   format_shape(mesh), format_shape(box.sizes)));
      OPTSTATE_ASSIGN_OR_RETURN(stored[k], resolve_part(part, *checked_numel(box.sizes), rw));
      OPTSTATE_RETURN_IF_ERROR(dcp::chunk_segments(shape, {box.offsets, box.sizes}, k, segs, rw));
    }
    OPTSTATE_RETURN_IF_ERROR(segs.seal(numel, where));
    OPTSTATE_RETURN_IF_ERROR(segs.for_each(0, numel, [&](const dcp::Segment& sg) {
      return piece(sg.chunk, sg.begin, sg.count, sg.local, stored[sg.chunk]);
    }));
    return out;
  }

  // The scales of 8-bit codes placed as `codes`, where that gives blockwise8 state of the global
  // tensor: each part's codes one flat run that starts on a block boundary (torchao quantizes a
  // shard as its own tensor), its scales that run's blocks. Null where it does not.
  std::optional<std::vector<Piece>> absmax_pieces(const Placed& codes, const std::vector<Part>& scales, int64_t numel,
                                                  int64_t block) {
    std::vector<Piece> out;
    std::set<size_t> seen;
    for (size_t k = 0; k < codes.pieces.size(); ++k) {
      const Piece& pc = codes.pieces[k];
      if (!seen.insert(codes.of[k]).second || pc.begin % block != 0 ||
          (pc.count % block != 0 && pc.begin + pc.count != numel))
        return std::nullopt;
      const int64_t blocks = (pc.count + block - 1) / block;
      const Part& part = scales[codes.of[k]];
      auto s = resolve(part.file, part.tensor, blocks, "scales");
      if (!s.ok()) return std::nullopt;
      out.push_back({pc.begin / block, blocks, *s, std::nullopt});
    }
    return out;
  }

  // Where a tensor's `count` elements lie in archive `file`: its storage record, checked to hold them.
  // `permuted_ok`: a dense tensor stored permuted is read (Stored::permuted); elsewhere refused.
  Result<Stored> resolve(size_t file, const dcp::TensorRef& t, int64_t count, const std::string& where,
                         bool permuted_ok = false) const {
    return resolve_in(files_[file], file, t, count, where, permuted_ok);
  }
  // The same in archive `a` (a file outside files_ too: `file` names it in the Stored).
  static Result<Stored> resolve_in(const Archive& a, size_t file, const dcp::TensorRef& t, int64_t count,
                                   const std::string& where, bool permuted_ok = false) {
    if (!permuted_ok) OPTSTATE_RETURN_IF_ERROR(dcp::require_contiguous(t, where));
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(t.shape));
    if (numel != count)
      return corrupt(fmt::format("{}: {} elements where {} are needed", where, numel, count));
    const std::string name = a.prefix + "/data/" + t.storage_key;
    auto it = a.entries.find(name);
    if (it == a.entries.end()) return corrupt(fmt::format("{}: storage '{}' is missing from the archive", where, name));
    const zip::Entry& e = a.index.entries[it->second];
    const auto elem = static_cast<uint64_t>(dtype_size(t.dtype));
    if (e.size / elem < static_cast<uint64_t>(t.storage_numel) ||
        static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(numel) > static_cast<uint64_t>(t.storage_numel))
      return corrupt(fmt::format("{}: storage '{}' holds {} bytes, too few for {} elements of {} at {}", where, name,
                                 e.size, numel, dtype_name(t.dtype), t.offset));
    Stored s;
    s.file = file;
    OPTSTATE_ASSIGN_OR_RETURN(s.record_at, a.data_at(e));
    s.record_bytes = e.size;
    s.at = s.record_at + static_cast<uint64_t>(t.offset) * elem;
    s.bytes = static_cast<uint64_t>(numel) * elem;
    s.crc = e.crc32;
    s.whole = true;
    if (t.permuted()) s.permuted = std::make_shared<const dcp::TensorRef>(t);
    return s;
  }

  // The CRC-32 of the record's bytes before the run (a view's offset into its storage), to start
  // the run's check with; 0 where the run is not checked.
  Result<uint32_t> record_prefix_crc(const Stored& s, const std::string& fqn, const std::string& entry, Component c) {
    if (!s.checked() || s.at == s.record_at) return 0u;
    return record_crc(s.file, s.record_at, s.at, 0, fqn, entry, c);
  }

  // CRC-32 `crc` continued over the file's bytes [from, to).
  Result<uint32_t> record_crc(size_t file, uint64_t from, uint64_t to, uint32_t crc, const std::string& fqn,
                              const std::string& entry, Component c) {
    for (uint64_t at = from; at < to;) {
      const uint64_t n = std::min<uint64_t>(kStreamPieceBytes, to - at);
      const std::span<std::byte> piece = pad_.for_read(at, n);
      OPTSTATE_RETURN_IF_ERROR(files_[file].file.read_at(at, piece).with_context(
          fmt::format("{}: {} (the rest of its storage)", files_[file].path.string(), name_of(fqn, entry, c))));
      crc = zip::crc32(piece, crc);
      at += n;
    }
    return crc;
  }

  // Finishes a run's check: `crc` covers the record up to the run's end; the rest of the record
  // (a view's padding) is read into it, and the whole must be what torch.save stored.
  Status check_crc(const Stored& s, uint32_t crc, const std::string& fqn, const std::string& entry, Component c) {
    if (!s.checked()) return Status::Ok();
    if (s.at + s.bytes < s.record_at + s.record_bytes) {
      OPTSTATE_ASSIGN_OR_RETURN(crc, record_crc(s.file, s.at + s.bytes, s.record_at + s.record_bytes, crc, fqn, entry, c));
    }
    if (crc == s.crc) return Status::Ok();
    return corrupt(fmt::format("{}: CRC-32 of its storage is {:08x}, the archive records {:08x}", where_of(s, fqn, entry, c),
                               crc, s.crc));
  }

  std::string where_of(const Stored& s, const std::string& fqn, const std::string& entry, Component c) const {
    return fmt::format("{}: {}", files_[s.file].path.string(), name_of(fqn, entry, c));
  }

  Result<double> value_of(size_t file, const Scalar& s, const std::string& where) const {
    if (s.number) return *s.number;
    const dcp::TensorRef& t = *s.tensor;
    OPTSTATE_ASSIGN_OR_RETURN(const Stored st, resolve(file, t, 1, where));
    std::byte raw[8];
    if (st.bytes > sizeof raw) return corrupt(fmt::format("{}: a {} tensor where a number is needed", where, dtype_name(t.dtype)));
    OPTSTATE_RETURN_IF_ERROR(files_[file].file.read_at(st.at, std::span(raw, st.bytes)).with_context(where));
    if (const auto v = scalar_value(t.dtype, raw)) return *v;
    return corrupt(fmt::format("{}: a {} tensor where a number is needed", where, dtype_name(t.dtype)));
  }

  // torchao's 4-bit map (16 fp32 values) as a table the dequantizer indexes by code.
  Result<const std::array<float, 256>*> map16(size_t file, const dcp::TensorRef& q, const std::string& where) {
    if (q.dtype != DType::kF32) return corrupt(where + ": quantization map is not float32");
    OPTSTATE_ASSIGN_OR_RETURN(const Stored st, resolve(file, q, 16, where + " quantization map"));
    std::array<float, 16> m;
    OPTSTATE_RETURN_IF_ERROR(files_[file].file.read_at(st.at, std::as_writable_bytes(std::span(m))).with_context(where));
    std::array<float, 256>& t = tables_.emplace_back();
    t.fill(0.0f);
    std::copy(m.begin(), m.end(), t.begin());
    return &t;
  }

  Result<std::string> map_name(size_t file, const dcp::TensorRef& q, const std::string& where) const {
    if (q.dtype != DType::kF32) return corrupt(where + ": quantization map is not float32");
    OPTSTATE_ASSIGN_OR_RETURN(const Stored st, resolve(file, q, 256, where + " quantization map"));
    std::array<float, 256> m;
    OPTSTATE_RETURN_IF_ERROR(files_[file].file.read_at(st.at, std::as_writable_bytes(std::span(m))).with_context(where));
    if (const auto k = qmap_matching(m)) return std::string(qmap_name(*k));
    return corrupt(where + ": quantization map is neither the dynamic signed nor the unsigned one");
  }

  std::string name_of(const std::string& fqn, const std::string& entry, Component c) const {
    auto p = meta_.params.find(fqn);
    const bool eight = p != meta_.params.end() && p->second.entries.count(entry) &&
                       p->second.entries.at(entry).encoding == Encoding::kBlockwise8;
    return fmt::format("tensor '{}'{}", entry_key(fqn, entry), eight ? fmt::format(" ({})", component_name(c)) : "");
  }

  Result<const std::vector<Piece>*> find(const std::string& fqn, const std::string& entry, Component c) const {
    auto it = stored_.find({fqn, entry, c});
    if (it == stored_.end()) return not_found(fmt::format("{}: no {}", path_.string(), name_of(fqn, entry, c)));
    return &it->second;
  }

  fs::path path_;
  bool set_ = false;       // a per-rank set (a directory), not one file
  bool carries_rest_ = false;  // one file whose other entries a torch.save write from it carries
  std::vector<std::string> value_notes_;  // read_notes(): values read as other than they stand (Composer's decay)
  // A bf16 pipeline without ZeRO: its layer files' shapes (shapes_from_layer_files), read once.
  std::optional<LayerShapes> layer_shapes_;
  std::optional<FsdpSet> fsdp_;  // FSDP2 (or FSDP1, flat parameters) set with the model's files: what a writer of it needs
  bool libtorch_ = false;  // a LibTorch optimizer archive
  bool bnb_ = false;       // bitsandbytes' state: formats/bitsandbytes/ writes it
  bool torchao_ = false;   // one file of torchao's state: formats/torchao/ writes it
  std::string_view torchao_package_;  // where its torchao subclasses were defined (a kTorchaoOptimPackages view)
  std::vector<GroupExtras> group_extras_;  // each group's other keys, where the file keeps some
  std::vector<AdamWFlags> adamw_flags_;  // each group's AdamW switches, where the file keeps some
  std::optional<bool> bnb_nested_;    // bitsandbytes' state: nested in __bnb_optimizer_quant_state__ or not
  bool deepspeed_ = false; // a DeepSpeed ZeRO checkpoint: formats/deepspeed/ sniffs it
  std::vector<ZeroCopy> zero_copies_;  // a pipeline's tied modules' later copies, AutoTP's replicas
  bool tensor_parallel_ = false;         // zero_copies_ holds tensor-parallel ranks' copies
  bool nanotron_ = false;  // a nanotron checkpoint's optimizer files: formats/nanotron/ sniffs them
  bool megatron_ = false;  // a Megatron-LM legacy checkpoint's rank files: formats/megatron/ sniffs them
  bool shared_verified_ = false;  // verify_shared_records covered every record the pieces read
  std::vector<Archive> files_;
  OptimizerState meta_;
  std::vector<std::string> not_read_;
  std::vector<std::string> encoding_notes_;  // encodings read as fp32 values: in not_read(), not carried
  std::vector<std::string> uncarried_notes_;  // files beside that a carrying write leaves (a pipeline's layer files)
  std::map<Key, std::vector<Piece>> stored_;
  std::map<std::string, std::string> source_names_;  // a param's fqn -> its name in the files (one_name)
  std::vector<ModelTensorInfo> model_tensors_;        // expose_model_tensors
  std::vector<std::pair<Stored, std::string>> model_stored_;  // each one's bytes, and its key for messages
  std::vector<std::string> dequantized_;      // 8-bit entries read as fp32 values
  std::vector<std::string> dequantized_fp8_;  // torchao's fp8 entries, read as fp32 values
  std::vector<std::string> dequantized_4bit_;  // torchao's 4-bit entries, read as fp32 values
  std::deque<std::array<float, 256>> tables_;  // torchao's 4-bit maps (16 values), where parts point
  bool checksummed_ = false;
  ReadBuffer piece_;  // reused between tensors
  struct {
    const dcp::TensorRef* ref = nullptr;  // its Stored::permuted
    std::vector<std::byte> bytes;         // in logical order
  } permuted_;                            // the last tensor stored permuted that was read
  ReadBuffer pad_;    // a view's storage around it, read for its record's CRC-32
};

size_t find_optim(const std::string& prefix) {
  std::string lower = prefix;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return lower.find("optim");
}

constexpr size_t kMaxDirEntries = size_t{1} << 20;
constexpr int64_t kMaxRanks = int64_t{1} << 20;

struct RankSet {
  std::vector<fs::path> optim, model;
  std::vector<std::string> others;  // what else the directory holds, for not_read
};

Result<RankSet> rank_set(const fs::path& dir) {
  const std::string where = dir.string();
  std::map<std::pair<std::string, std::string>, std::map<int64_t, fs::path>> groups;  // (prefix, ext) -> rank -> file
  std::vector<std::string> other;
  std::error_code ec;
  size_t seen = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (++seen > kMaxDirEntries) return corrupt(fmt::format("{}: more than {} entries", where, kMaxDirEntries));
    const std::string name = it->path().filename().string();
    const auto rn = it->is_regular_file(ec) ? rank_name(name) : std::nullopt;
    if (rn && rn->rank < kMaxRanks) {
      groups[{rn->prefix, rn->ext}][rn->rank] = it->path();
    } else {
      other.push_back(name);
    }
  }
  if (ec) return io_error(fmt::format("{}: {}", where, ec.message()));
  auto pattern = [](const std::pair<std::string, std::string>& g) { return g.first + "*" + g.second; };
  std::vector<std::pair<std::string, std::string>> optim;
  for (const auto& [g, files] : groups)
    if (find_optim(g.first) != std::string::npos) optim.push_back(g);
  if (optim.empty())
    return corrupt(fmt::format("{}: no per-rank optimizer files (<name with 'optim'><rank>.pt)", where));
  if (optim.size() > 1) {
    std::vector<std::string> names;
    for (const auto& g : optim) names.push_back(pattern(g));
    return corrupt(fmt::format("{}: holds {} sets of per-rank optimizer files ({}); optstate reads a directory with one",
                               where, optim.size(), fmt::join(names, ", ")));
  }
  RankSet out;
  const auto& og = optim[0];
  const auto& files = groups.at(og);
  const auto n = static_cast<int64_t>(files.size());
  std::optional<int64_t> world;  // what the name says: ..._world_size_8_...
  if (const auto at = og.first.find("world_size_"); at != std::string::npos) {
    size_t e = at + 11;
    while (e < og.first.size() && std::isdigit(static_cast<unsigned char>(og.first[e]))) ++e;
    if (e > at + 11 && e - at - 11 <= 7) world = std::stoll(og.first.substr(at + 11, e - at - 11));
  }
  const int64_t expect = std::max(world.value_or(n), files.rbegin()->first + 1);
  for (int64_t r = 0; r < expect; ++r)
    if (!files.count(r))
      return corrupt(fmt::format("{}: rank {}'s file {}{}{} is missing ({} of {} ranks' files found)", where, r, og.first,
                                 r, og.second, n, expect));
  for (const auto& [r, f] : files) out.optim.push_back(f);
  // The model's files: the same name with "model" for "optim".
  std::string mprefix = og.first;
  mprefix.replace(find_optim(mprefix), 5, "model");
  auto mg = groups.find({mprefix, og.second});
  if (mg != groups.end()) {  // every rank's, as for the optimizer's: they name and place the params
    for (int64_t r = 0; r < n; ++r)
      if (!mg->second.count(r))
        return corrupt(fmt::format("{}: rank {}'s model file {}{}{} is missing ({} of {} ranks' files found)", where, r,
                                   mprefix, r, og.second, mg->second.size(), n));
    if (static_cast<int64_t>(mg->second.size()) != n)
      return corrupt(fmt::format("{}: {} model files {}*{} for {} ranks' optimizer files", where, mg->second.size(),
                                 mprefix, og.second, n));
    for (const auto& [r, f] : mg->second) out.model.push_back(f);
  }
  for (const auto& [g, fs_] : groups)
    if (g != og && (mg == groups.end() || g != mg->first))
      out.others.push_back(fmt::format("{} ({} file{})", pattern(g), fs_.size(), fs_.size() == 1 ? "" : "s"));
  if (!other.empty()) {
    std::sort(other.begin(), other.end());
    const size_t shown = std::min<size_t>(other.size(), 4);
    out.others.push_back(fmt::format("{} other entr{} ({}{})", other.size(), other.size() == 1 ? "y" : "ies",
                                     fmt::join(other.begin(), other.begin() + static_cast<long>(shown), ", "),
                                     other.size() > shown ? ", ..." : ""));
  }
  return out;
}

bool is_zip(const fs::path& path) {
  auto f = InputFile::open(path);
  std::byte h[4];
  return f.ok() && f->size() >= 30 && f->read_at(0, h).ok() && std::memcmp(h, "PK\x03\x04", 4) == 0;
}

// torch.save's legacy format (torch before 1.6, or _use_new_zipfile_serialization=False): not a zip
// but pickles in a row, the first torch's magic number (0x1950a86a20f9469cfc6c as a LONG1), after
// the protocol header.
bool is_legacy_torch_save(const fs::path& path) {
  static constexpr unsigned char kMagic[12] = {0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
  auto f = InputFile::open(path);
  std::byte h[14];
  return f.ok() && f->size() >= sizeof h && f->read_at(0, h).ok() && h[0] == std::byte{0x80} &&
         std::memcmp(h + 2, kMagic, sizeof kMagic) == 0;
}

class TorchSaveDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "torchsave"; }
  // A per-rank set is written with the source's model files; one file framed reads back as
  // framed_read_back says.
  OptimizerState kept_by_write(const OptimizerState& state, const WriteOptions& options) const override {
    return options.source && fsdp_set(*options.source) ? state : framed_read_back(state, options);
  }
  std::vector<std::string> write_notes(const OptimizerState& kept, const WriteOptions& options) const override {
    return options.source && fsdp_set(*options.source) ? std::vector<std::string>{} : framed_read_back_notes(kept, options);
  }

  // A zip whose first record is <folder>/data.pkl: torch.save writes data.pkl first (LibTorch's
  // torch::save writes the storages first: formats/libtorch/ sniffs those, and opens them here).
  // A directory: a file of a per-rank set is there (an "optim" name ending in its rank, .pt), so
  // that one without rank 0's file is named as such rather than taken for no checkpoint.
  bool sniff(const fs::path& path) const override {
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      size_t seen = 0;
      for (fs::directory_iterator it(path, ec), end; !ec && it != end && ++seen <= 4096; it.increment(ec)) {
        const auto rn = rank_name(it->path().filename().string());
        if (rn && find_optim(rn->prefix) != std::string::npos && is_zip(it->path())) return true;
      }
      return false;
    }
    return is_torch_save_of(path, Family::kTorch) || is_legacy_torch_save(path);
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::is_directory(path, ec) && is_legacy_torch_save(path))
      return unsupported(fmt::format(
          "{}: a torch.save file in the legacy format (torch before 1.6, or _use_new_zipfile_serialization=False), "
          "which optstate does not read; torch.load it and torch.save it again (the zip format, torch's default)",
          path.string()));
    auto reader = std::make_unique<TorchSaveReader>(path);
    if (fs::is_directory(path, ec)) {
      OPTSTATE_ASSIGN_OR_RETURN(RankSet set, rank_set(path));
      OPTSTATE_RETURN_IF_ERROR(reader->init(set.optim, set.model, std::move(set.others)));
    } else {
      OPTSTATE_RETURN_IF_ERROR(reader->init({path}, {}, {}));
    }
    return std::unique_ptr<CheckpointReader>(std::move(reader));
  }

  bool keeps_blockwise8() const override { return false; }
  // A per-rank set lives in a training run's folder (verl's holds extra_state_*.pt, huggingface/,
  // ...): not optstate's to replace. A single file is.
  bool replaceable(const fs::path& path) const override {
    std::error_code ec;
    return !fs::is_directory(path, ec);
  }

  // FSDP2's per-rank files are written again for another world size (from such a set: its files
  // give the layout); otherwise one file.
  bool shards() const override { return true; }
  // Such a set's other files (extra_state_*, fsdp_config.json, huggingface/) go with it.
  // So does one file's {"model", "optimizer", "epoch", ...} (write_carrying).
  bool keeps_group_extras() const override { return true; }
  // A file written from a DCP holds its buffers and tied names in the model dict (write_framed).
  bool keeps_model_tensors() const override { return true; }
  bool carries(const CheckpointReader& source, const fs::path& path) const override {
    return fsdp_set(source) ? !is_single_file(path) : carries_file(source);
  }
  static bool is_single_file(const fs::path& path) {
    const std::string ext = path.extension().string();
    return ext == ".pt" || ext == ".pth" || ext == ".bin";
  }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    const OptimizerState& meta = source.meta();
    OPTSTATE_RETURN_IF_ERROR(check_structure(meta, false));
    const FsdpSet* set = options.source ? fsdp_set(*options.source) : nullptr;
    if (set && !is_single_file(path)) {
      OPTSTATE_RETURN_IF_ERROR(check_destination(path, options.overwrite));
      OPTSTATE_ASSIGN_OR_RETURN(Staging staging, Staging::directory(path));
      return staging.commit(write_fsdp_ranks(source, *options.source, *set, staging.path(), options.world_size),
                            options.overwrite);
    }
    std::error_code ec;
    if (!set && options.source && options.source->format() == "torchsave" && options.world_size != 1 &&
        fs::is_directory(options.source->path(), ec))
      return unsupported(fmt::format(
          "{}: --world-size {}: {} is a per-rank set optstate reads but does not write for another world size "
          "(FSDP1's with use_orig_params, whose params' places in the flat parameters the files do not say, or "
          "with one param per FSDP unit, which the files cannot tell from it; a "
          "one-rank FSDP1 run's, whose model file holds no DTensors; optimizer files without the model's); FSDP2's "
          "and FSDP1's (flat parameters) with the model's DTensors beside them are written", path.string(), options.world_size, options.source->path().string()));
    if (options.world_size != 1)
      return invalid_argument(fmt::format(
          "{}: --world-size {}: a torch.save file is one state; per-rank files (FSDP2's, verl's) are written for "
          "another world size from such a folder of them, into a folder (a DST without .pt)",
          path.string(), options.world_size));
    const std::vector<std::string> order = param_order(meta);
    if (order.size() != meta.params.size() || std::set(order.begin(), order.end()).size() != order.size())
      return invalid_argument("torchsave: every param must be in exactly one param group (torch numbers them by it)");
    for (size_t i = 0; i < order.size(); ++i) {
      const ParamState& ps = meta.params.at(order[i]);
      for (const auto& [name, e] : ps.entries)
        if (name != kParam && name != kExpAvg && name != kExpAvgSq && name != kMaxExpAvgSq)
          return invalid_argument(fmt::format("param '{}': entry '{}' has no place in torch.optim.AdamW's state", order[i], name));
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
    }
    // Entry after entry, 8-bit moments dequantized as they are written (SpecWriter); carrying a
    // training loop's file's other entries where the source is one (write_carrying).
    return write_framed(source, path, options, [&](pickle::Writer& w, const SpecSink& add, const FrameOptions& fo) {
      return plan_adamw_frame(meta, w, add, fo);
    });
  }
};

}  // namespace

std::optional<RankName> rank_name(const std::string& filename) {
  RankName n;
  const auto dot = filename.rfind('.');
  if (dot == std::string::npos) return std::nullopt;
  n.ext = filename.substr(dot);
  if (n.ext != ".pt" && n.ext != ".pth") return std::nullopt;
  size_t d = dot;
  while (d > 0 && std::isdigit(static_cast<unsigned char>(filename[d - 1]))) --d;
  if (d == dot || dot - d > 7) return std::nullopt;
  n.prefix = filename.substr(0, d);
  n.rank = std::stoll(filename.substr(d, dot - d));
  return n;
}

const FsdpSet* fsdp_set(const CheckpointReader& reader) {
  const auto* r = dynamic_cast<const TorchSaveReader*>(&reader);
  return r ? r->fsdp() : nullptr;
}

std::optional<bool> bnb_nested(const CheckpointReader& reader) {
  const auto* r = dynamic_cast<const TorchSaveReader*>(&reader);
  return r ? r->bnb_nested() : std::nullopt;
}

bool carries_file(const CheckpointReader& reader) {
  const auto* r = dynamic_cast<const TorchSaveReader*>(&reader);
  return r && r->carries_rest();
}

const FormatDriver& driver() {
  static const TorchSaveDriver d;
  return d;
}

Status write_file(const fs::path& path, bool overwrite, std::string_view pkl,
                  const std::function<Status(dcp::ArchiveWriter&)>& storages) {
  OPTSTATE_RETURN_IF_ERROR(check_destination(path, overwrite));
  OPTSTATE_ASSIGN_OR_RETURN(Staging staging, Staging::file(path));
  return staging.commit(write_archive(staging.path(), pkl, storages), overwrite);
}

Status write_archive(const fs::path& path, std::string_view pkl,
                     const std::function<Status(dcp::ArchiveWriter&)>& storages) {
  OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(path));
  dcp::ArchiveWriter archive(out);
  OPTSTATE_RETURN_IF_ERROR(archive.begin(std::as_bytes(std::span(pkl))));
  OPTSTATE_RETURN_IF_ERROR(storages(archive));
  OPTSTATE_RETURN_IF_ERROR(archive.finish().status());
  return out.sync_and_close();
}

std::optional<std::string> first_zip_record(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  auto f = InputFile::open(path);
  if (!f.ok() || f->size() < 30) return std::nullopt;
  std::byte h[30 + 256];
  const size_t n = static_cast<size_t>(std::min<uint64_t>(sizeof h, f->size()));
  if (!f->read_at(0, std::span(h, n)).ok()) return std::nullopt;
  if (std::memcmp(h, "PK\x03\x04", 4) != 0) return std::nullopt;
  const size_t name_len = static_cast<size_t>(h[26]) | static_cast<size_t>(h[27]) << 8;
  if (30 + name_len > n) return std::nullopt;
  return std::string(reinterpret_cast<const char*>(h + 30), name_len);
}

bool is_torch_save_of(const fs::path& path, Family family) {
  const auto first = first_zip_record(path);
  return first && first->size() > 9 && first->ends_with("/data.pkl") && state_family(path) == family;
}

Family state_family(const fs::path& path) {
  // data.pkl's bytes, found through the central directory (torch.save's local headers leave the
  // sizes to a data descriptor).
  auto f = InputFile::open(path);
  if (!f.ok() || f->size() < 30) return Family::kTorch;
  const uint64_t tail_n = std::min<uint64_t>(f->size(), zip::kMaxTailBytes);
  std::vector<std::byte> tail(static_cast<size_t>(tail_n));
  if (!f->read_at(f->size() - tail_n, tail).ok()) return Family::kTorch;
  const auto cd = zip::find_central_directory(tail, f->size(), "");
  if (!cd.ok() || cd->size > (uint64_t{64} << 20) || cd->offset > f->size() || cd->size > f->size() - cd->offset)
    return Family::kTorch;
  std::vector<std::byte> dir(static_cast<size_t>(cd->size));
  if (!f->read_at(cd->offset, dir).ok()) return Family::kTorch;
  const auto entries = zip::parse_central_directory(dir, *cd, "", true);
  if (!entries.ok()) return Family::kTorch;
  for (const zip::Entry& e : *entries) {
    if (!e.name.ends_with("/data.pkl") || e.method != 0) continue;
    std::byte h[30];
    if (!f->read_at(e.local_header_offset, h).ok()) return Family::kTorch;
    const auto at = zip::data_offset(h, e, cd->offset, "");
    if (!at.ok()) return Family::kTorch;
    // The keys come early: a model dict before the optimizer's takes ~100 bytes a weight.
    constexpr uint64_t kLook = uint64_t{8} << 20;
    std::string pkl(static_cast<size_t>(std::min<uint64_t>(e.size, kLook)), '\0');
    if (!f->read_at(*at, std::as_writable_bytes(std::span(pkl))).ok()) return Family::kTorch;
    // Keys as whole pickled strings (protocol 2's BINUNICODE, or SHORT_BINUNICODE), not inside a
    // longer name.
    auto has = [&](std::string_view key) {
      const std::string bin = std::string("X") + char(key.size()) + std::string(3, '\0') + std::string(key);
      const std::string sbin = std::string("\x8c") + char(key.size()) + std::string(key);
      return pkl.find(bin) != std::string::npos || pkl.find(sbin) != std::string::npos;
    };
    if (has("state1") && has("state2")) return Family::kBitsandbytes;
    // torchao's moments: its tensor subclasses, by their GLOBAL (module, name), in either package.
    for (std::string_view package : dcp::kTorchaoOptimPackages)
      if (pkl.find("c" + std::string(package) + ".subclass_") != std::string::npos) return Family::kTorchao;
    // No 8-bit moment (every param below torchao's 4096 elements): torchao's groups, told by the
    // interpretation (lr a tensor, no 'maximize'); only looked for where 'maximize' is absent.
    if (has("maximize") || e.size > kLook) return Family::kTorch;
    const auto p = pickle::unpickle(std::as_bytes(std::span(pkl)), path.string());
    if (!p.ok()) return Family::kTorch;
    const auto sd = interpret_state_dict(*p, path.string());
    return sd.ok() && sd->torchao ? Family::kTorchao : Family::kTorch;
  }
  return Family::kTorch;
}

namespace {

// Writes storages as a plan's StorageSpecs describe them, from `source` (one entry held at a time:
// a spec's components follow each other). write_carrying copies the source file's own records itself.
class SpecWriter {
 public:
  SpecWriter(StateSource& source, const CheckpointReader* model_from) : source_(source), model_from_(model_from) {}

  Status write(dcp::ArchiveWriter& archive, const std::string& key, const StorageSpec& s) {
    switch (s.what) {
      case StorageSpec::What::kModelTensor:
        return model_tensor(archive, key, s.index);
      case StorageSpec::What::kScalar:
        return archive.storage(key, std::as_bytes(std::span(&s.scalar, 1)));
      case StorageSpec::What::kQMap: {
        OPTSTATE_ASSIGN_OR_RETURN(const QMap m, qmap_from_name(s.qmap));
        return archive.storage(key, std::as_bytes(std::span(qmap_table(m))));
      }
      case StorageSpec::What::kComponent:
      case StorageSpec::What::kF32Values: break;
    }
    if (loaded_key_ != entry_key(s.fqn, s.entry)) {
      loaded_ = Entry{};
      OPTSTATE_ASSIGN_OR_RETURN(loaded_, source_.load(s.fqn, s.entry));
      loaded_key_ = entry_key(s.fqn, s.entry);
    }
    if (s.what == StorageSpec::What::kF32Values) {
      const auto ps = source_.meta().params.find(s.fqn);
      if (ps == source_.meta().params.end()) return internal_error(fmt::format("{}: not in the state", loaded_key_));
      OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps->second.shape));
      OPTSTATE_ASSIGN_OR_RETURN(const std::span<const float> values, entry_f32_span(loaded_, numel, loaded_key_, scratch_));
      return archive.storage(key, std::as_bytes(values));
    }
    return archive.storage(key, loaded_.buffer(s.component).span());
  }

 private:
  // The source's model tensor `index`, streamed into its storage: exactly its bytes, or an error
  // naming it (the staged file is then removed).
  Status model_tensor(dcp::ArchiveWriter& archive, const std::string& key, size_t index) {
    const std::span<const ModelTensorInfo> tensors =
        model_from_ ? model_from_->model_tensors() : std::span<const ModelTensorInfo>{};
    if (index >= tensors.size()) return internal_error(fmt::format("model tensor {}: no source holds it", index));
    const ModelTensorInfo& t = tensors[index];
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(t.shape));
    OPTSTATE_RETURN_IF_ERROR(archive.begin_storage(key, static_cast<uint64_t>(numel) * dtype_size(t.dtype)));
    OPTSTATE_RETURN_IF_ERROR(stream_model_tensor_exactly(*model_from_, index, [&](std::span<const std::byte> piece) {
      return archive.append(piece);
    }));
    return archive.end_storage();
  }

  StateSource& source_;
  const CheckpointReader* model_from_;
  std::string loaded_key_;
  Entry loaded_;
  std::vector<float> scratch_;  // its values widened or dequantized, where they are not fp32
};

}  // namespace

Status write_plan(StateSource& source, const fs::path& path, bool overwrite, const Plan& plan,
                  const CheckpointReader* model_from) {
  return write_file(path, overwrite, plan.data_pkl, [&](dcp::ArchiveWriter& archive) -> Status {
    SpecWriter specs(source, model_from);
    for (size_t i = 0; i < plan.storages.size(); ++i)
      OPTSTATE_RETURN_IF_ERROR(specs.write(archive, std::to_string(i), plan.storages[i]));
    return Status::Ok();
  });
}

Status write_framed(StateSource& source, const fs::path& path, const WriteOptions& options, const PlanFrame& frame) {
  if (options.source && carries_file(*options.source))
    return write_carrying(source, *options.source, path, options.overwrite, frame);
  FrameOptions fo;
  if (options.source) {
    fo.adamw_flags = options.source->adamw_flags();
    fo.group_extras = options.source->group_extras();
    // The model's other tensors (a DCP's buffers and tied names) go into the model dict beside the
    // weights, so the file's strict model.load_state_dict finds every key.
    fo.model_tensors = options.source->model_tensors();
    for (const ModelTensorInfo& t : fo.model_tensors)
      if (source.meta().params.count(t.name))
        return invalid_argument(fmt::format("{}: '{}' is both a param of the state and another of the model's "
                                            "tensors in {}", path.string(), t.name, options.source->path().string()));
  }
  OPTSTATE_ASSIGN_OR_RETURN(const Plan plan, plan_of(frame, fo));
  return write_plan(source, path, options.overwrite, plan, options.source);
}

namespace {
// Whether a framed write of `kept` holds a model dict of its own whose every key begins with
// 'module.'.
bool framed_ddp_keys(const OptimizerState& kept, const WriteOptions& options) {
  if (options.source && carries_file(*options.source)) return false;  // the source's own keys
  std::vector<std::string_view> keys;
  for (const auto& [fqn, ps] : kept.params)
    if (ps.entries.count(kParam)) keys.push_back(fqn);
  if (options.source)
    for (const ModelTensorInfo& t : options.source->model_tensors()) keys.push_back(t.name);
  return is_ddp_state_dict(keys);
}
}  // namespace

OptimizerState framed_read_back(OptimizerState kept, const WriteOptions& options) {
  if (!framed_ddp_keys(kept, options)) return kept;
  std::map<std::string, ParamState> params;
  for (auto& [fqn, ps] : kept.params) params.emplace(torch_param_fqn(fqn, true), std::move(ps));
  kept.params = std::move(params);
  for (ParamGroup& g : kept.groups)
    for (std::string& fqn : g.params) fqn = torch_param_fqn(fqn, true);
  return kept;
}

std::vector<std::string> framed_read_back_notes(const OptimizerState& kept, const WriteOptions& options) {
  // `kept` is named as it reads back: what was written is named as the source names it.
  if (!framed_ddp_keys(options.source ? options.source->meta() : kept, options)) return {};
  return {"every key of its model dict begins with 'module.', which reads as DDP's prefix (torch's "
          "consume_prefix_in_state_dict_if_present, optstate): its params read back without it"};
}

Status write_carrying(StateSource& source, const CheckpointReader& from, const fs::path& path, bool overwrite,
                      const PlanFrame& frame) {
  const OptimizerState& meta = source.meta();
  const std::string where = from.path().string();
  OPTSTATE_ASSIGN_OR_RETURN(auto ap, open_archive(from.path()));
  const pickle::Pickle& p = ap.second;
  OPTSTATE_ASSIGN_OR_RETURN(const StateDict sd, interpret_state_dict(p, where));
  if (sd.optimizer_ref == pickle::kNoRef) return internal_error(where + ": no optimizer dict to replace");
  // Each weight the state holds replaces the model's tensor of its name (torch's fqn of the key:
  // a compiled model's '_orig_mod.' keys stay the file's).
  std::map<pickle::Ref, std::string> weight_of;  // the model dict's value -> param fqn
  std::map<std::string, pickle::Ref, std::less<>> model_values;
  if (const auto* items = sd.model_ref == pickle::kNoRef ? nullptr : dict_items(p, sd.model_ref))
    for (size_t k = 0; k + 1 < items->size(); k += 2)
      if (const auto name = dcp::as_string(p, (*items)[k]))
        model_values.emplace(torch_param_fqn(*name, sd.ddp_prefix), (*items)[k + 1]);
  for (const auto& [fqn, ps] : meta.params) {
    if (!ps.entries.count(kParam)) continue;
    const auto it = model_values.find(fqn);
    if (it == model_values.end())
      return invalid_argument(fmt::format("{}: param '{}' has weights, but the model's dict in {} has no such name",
                                          path.string(), fqn, where));
    weight_of.emplace(it->second, fqn);
  }
  // The source's groups: its optimizer's, or each per-param optimizer's one.
  std::vector<pickle::Ref> source_groups;
  std::vector<std::pair<pickle::Ref, pickle::Ref>> source_optimizers;  // per param: (key, state_dict)
  if (sd.per_param) {
    const auto* items = dict_items(p, sd.optimizer_ref);
    for (size_t k = 1; items && k < items->size(); k += 2)
      if (const auto* gs = list_items(p, p.dict_get((*items)[k], "param_groups")); gs && !gs->empty()) {
        source_groups.push_back((*gs)[0]);
        source_optimizers.emplace_back((*items)[k - 1], (*items)[k]);
      }
  } else if (const auto* gs = list_items(p, p.dict_get(sd.optimizer_ref, "param_groups"))) {
    source_groups.assign(gs->begin(), gs->end());
  }
  const std::vector<pickle::Ref>* groups = &source_groups;
  if (groups->size() != meta.groups.size())
    return invalid_argument(fmt::format("{}: {} param groups, {} has {}: not the state read from it", path.string(),
                                        meta.groups.size(), where, groups->size()));
  // An optimizer per param: each group the one param of the source's optimizer under its name, or
  // none where that optimizer never stepped its param (carried as it is).
  for (size_t g = 0; g < source_optimizers.size(); ++g) {
    const std::vector<std::string>& params = meta.groups[g].params;
    const auto name = dcp::as_string(p, source_optimizers[g].first);
    const auto* state = dict_items(p, p.dict_get(source_optimizers[g].second, "state"));
    if (params.size() > 1)
      return invalid_argument(fmt::format("{}: a param group of {} params; {} holds an optimizer per param "
                                          "(torchtune's optimizer in backward), one param each", path.string(),
                                          params.size(), where));
    if (params.empty() ? state && !state->empty() : !name || params[0] != *name)
      return invalid_argument(fmt::format("{}: param group {} is not the optimizer of '{}' in {}: not the state "
                                          "read from it", path.string(), g, name ? *name : "?", where));
  }
  Planner<StorageSpec> planner(p, where);
  OPTSTATE_ASSIGN_OR_RETURN(
      const Planned<StorageSpec> planned,
      planner.run([&](pickle::Writer& w, pickle::Ref r, Planned<StorageSpec>& out,
                      const Planner<StorageSpec>::Carry& carry) -> Result<bool> {
        const SpecSink add = [&](StorageSpec s) {
          out.storages.emplace_back(std::move(s));
          return std::to_string(out.storages.size() - 1);
        };
        if (const auto it = weight_of.find(r); it != weight_of.end()) {
          const ParamState& ps = meta.params.at(it->second);
          dcp::encode_tensor(w, ps.entries.at(kParam).dtype, ps.shape, add(StorageSpec::of_component(it->second, kParam)));
          return true;
        }
        if (r != sd.optimizer_ref) return false;
        // The source's group keys that are no optimizer's field: plain ones (a scheduler's
        // 'initial_lr') written by value as any write keeps them, the rest carried as they are.
        Status carried = Status::Ok();
        FrameOptions fo;
        fo.optimizer_only = true;
        fo.per_param = sd.per_param;
        fo.stateless_optimizer = [&](size_t g) {
          if (carried.ok()) carried = carry(source_optimizers.at(g).first);
          if (carried.ok()) carried = carry(source_optimizers.at(g).second);
        };
        fo.adamw_flags = from.adamw_flags();
        fo.group_extras = from.group_extras();
        fo.group_extra = [&](size_t g) {
          const auto* items = dict_items(p, (*groups)[g]);
          const GroupExtras* by_value = dcp::source_extras(fo.group_extras, groups->size(), g);
          for (size_t k = 0; items && k + 1 < items->size() && carried.ok(); k += 2) {
            const auto key = dcp::as_string(p, (*items)[k]);
            if (key && dcp::known_group_key(*key)) continue;
            if (key && by_value && std::any_of(by_value->begin(), by_value->end(),
                                               [&](const auto& kv) { return kv.first == *key; }))
              continue;
            carried = carry((*items)[k]);
            if (carried.ok()) carried = carry((*items)[k + 1]);
          }
        };
        OPTSTATE_RETURN_IF_ERROR(frame(w, add, fo));
        OPTSTATE_RETURN_IF_ERROR(carried);
        return true;
      }));
  return write_file(path, overwrite, planned.pkl, [&](dcp::ArchiveWriter& archive) -> Status {
    SpecWriter specs(source, &from);
    for (size_t k = 0; k < planned.storages.size(); ++k) {
      const std::string key = std::to_string(k);
      if (const auto* old_key = std::get_if<std::string>(&planned.storages[k])) {
        OPTSTATE_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, read_storage(ap.first, *old_key));
        OPTSTATE_RETURN_IF_ERROR(archive.storage(key, bytes));
        continue;
      }
      OPTSTATE_RETURN_IF_ERROR(specs.write(archive, key, std::get<StorageSpec>(planned.storages[k])));
    }
    return Status::Ok();
  });
}

namespace {

// A file name's number field: 1 to 7 decimal digits.
std::optional<int64_t> name_number(std::string_view d) {
  if (d.empty() || d.size() > 7 || !std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::stoll(std::string(d));
}

// "zero_pp_rank_R_mp_rank_MM_optim_states.pt" ("bf16_" before it under bf16): (bf16, R, MM).
std::optional<std::tuple<bool, int64_t, int64_t>> zero_optim_name(std::string name) {
  const bool bf16 = name.rfind("bf16_", 0) == 0;
  if (bf16) name = name.substr(5);
  constexpr std::string_view head = "zero_pp_rank_", mid = "_mp_rank_", tail = "_optim_states.pt";
  if (name.rfind(head, 0) != 0 || !name.ends_with(tail)) return std::nullopt;
  name = name.substr(head.size(), name.size() - head.size() - tail.size());
  const auto m = name.find(mid);
  if (m == std::string::npos) return std::nullopt;
  const auto r = name_number(name.substr(0, m)), mp = name_number(name.substr(m + mid.size()));
  if (!r || !mp) return std::nullopt;
  return std::tuple{bf16, *r, *mp};
}

// The tag folder a `latest` file names (DeepSpeed's save_checkpoint writes it beside the tags), or
// `path` itself.
fs::path zero_tag_dir(const fs::path& path) {
  std::error_code ec;
  const fs::path latest = path / "latest";
  if (!fs::is_regular_file(latest, ec) || fs::file_size(latest, ec) > 256) return path;
  std::ifstream in(latest);
  std::string tag;
  std::getline(in, tag);
  while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.back()))) tag.pop_back();
  if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos) return path;
  return fs::is_directory(path / tag, ec) ? path / tag : path;
}

// "layer_XX-model_states.pt" (a pipeline's layer, no tensor parallelism): -1;
// "layer_XX-model_YY-model_states.pt" (Megatron-DeepSpeed's, tensor-parallel rank YY): YY; else nullopt.
std::optional<int64_t> zero_layer_name(const std::string& name) {
  constexpr std::string_view head = "layer_", tail = "-model_states.pt", mid = "-model_";
  if (name.rfind(head, 0) != 0 || !name.ends_with(tail) || name.size() <= head.size() + tail.size()) return std::nullopt;
  const std::string body = name.substr(head.size(), name.size() - head.size() - tail.size());
  auto digits = [](std::string_view d) {
    return !d.empty() && d.size() <= 7 && std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (digits(body)) return -1;
  const auto m = body.find(mid);
  if (m == std::string::npos || !digits(std::string_view(body).substr(0, m)) ||
      !digits(std::string_view(body).substr(m + mid.size())))
    return std::nullopt;
  return std::stoll(body.substr(m + mid.size()));
}

// "layer_L_expert_E_mp_rank_MM_model_states.pt" (DeepSpeed MoE: one expert's weights, its global
// number E in MoE layer L): {L, E, MM}; else nullopt.
std::optional<std::array<int64_t, 3>> zero_expert_name(const std::string& name) {
  constexpr std::string_view head = "layer_", mid = "_expert_", mp = "_mp_rank_", tail = "_model_states.pt";
  if (name.rfind(head, 0) != 0 || !name.ends_with(tail)) return std::nullopt;
  const std::string_view body = std::string_view(name).substr(head.size(), name.size() - head.size() - tail.size());
  const auto a = body.find(mid), b = body.find(mp);
  if (a == std::string_view::npos || b == std::string_view::npos || b < a + mid.size()) return std::nullopt;
  const std::string_view parts[] = {body.substr(0, a), body.substr(a + mid.size(), b - a - mid.size()),
                                    body.substr(b + mp.size())};
  std::array<int64_t, 3> out{};
  for (size_t i = 0; i < 3; ++i) {
    if (parts[i].empty() || parts[i].size() > 7 ||
        !std::all_of(parts[i].begin(), parts[i].end(), [](char c) { return c >= '0' && c <= '9'; }))
      return std::nullopt;
    out[i] = std::stoll(std::string(parts[i]));
  }
  return out;
}

}  // namespace

// The ZeRO files of the tag folder at (or named by `latest` in) `path`; nullopt where it holds none.
Result<std::optional<ZeroFiles>> zero_files(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::optional<ZeroFiles>{};
  ZeroFiles z;
  z.dir = zero_tag_dir(path);
  std::map<int64_t, std::map<int64_t, fs::path>> files;  // mp rank -> dp rank -> file
  std::set<bool> kinds;
  std::set<int64_t> layer_tp;  // the tensor-parallel ranks layer files name (-1: none)
  std::string expert_mp;       // an expert file of a model-parallel rank other than 0
  size_t seen = 0;
  for (fs::directory_iterator it(z.dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (++seen > (size_t{1} << 20)) return corrupt(z.dir.string() + ": more than 2^20 entries");
    const std::string name = it->path().filename().string();
    if (name.rfind("expp_rank_", 0) == 0 && name.ends_with("_optim_states.pt")) ++z.expert_optim_files;
    if (const auto e = zero_expert_name(name)) {
      if ((*e)[2] != 0) expert_mp = name;
      if (!z.expert_files[(*e)[0]].insert((*e)[1]).second)
        return corrupt(fmt::format("{}: two files of MoE layer {}'s expert {}", z.dir.string(), (*e)[0], (*e)[1]));
      continue;
    }
    if (const auto tp = zero_layer_name(name)) {
      layer_tp.insert(*tp);
      ++z.layer_files;
    }
    const auto parsed = zero_optim_name(name);
    if (!parsed) continue;
    const auto [bf16, rank, mprank] = *parsed;
    kinds.insert(bf16);
    if (!files[mprank].emplace(rank, it->path()).second)
      return corrupt(fmt::format("{}: two optimizer files of rank {} (mp_rank_{:02d})", z.dir.string(), rank, mprank));
  }
  if (ec) return io_error(fmt::format("{}: {}", z.dir.string(), ec.message()));
  if (files.empty() && z.expert_optim_files)
    return invalid_argument(z.dir.string() + ": DeepSpeed MoE without ZeRO (stage 0: each expert-parallel rank's "
                                             "optimizer in expp_rank_*_optim_states.pt), not ZeRO-1/2 partitions: a universal "
                                             "checkpoint is written from those only (DeepSpeed loads no other); "
                                             "optstate reads this one: convert it to another format");
  if (files.empty() && !z.expert_files.empty())
    return corrupt(z.dir.string() + ": DeepSpeed MoE experts' files (layer_*_expert_*) without ZeRO partitions or "
                                    "expp_rank_*_optim_states.pt files (stage 0's optimizer): the optimizer's files are "
                                    "missing");
  if (!expert_mp.empty() || (!z.expert_files.empty() && !files.empty() && files.rbegin()->first > 0))
    return corrupt(fmt::format("{}: {}: DeepSpeed MoE beside model parallelism (a pipeline's stages or tensor-parallel "
                               "ranks, whose experts split other ways): not read", z.dir.string(),
                               expert_mp.empty() ? "experts' files beside mp_rank_01 files" : expert_mp));
  if (files.empty()) {
    if (fs::is_regular_file(z.dir / "mp_rank_00_model_states.pt", ec))
      return invalid_argument(z.dir.string() + ": a DeepSpeed checkpoint without ZeRO (stage 0: the optimizer's "
                                               "state sits in mp_rank_00_model_states.pt, no ZeRO partitions)");
    return std::optional<ZeroFiles>{};
  }
  if (kinds.size() > 1)
    return corrupt(z.dir.string() + ": optimizer files with and without the bf16_ prefix; one run's are alike");
  // Several model-parallel ranks are a pipeline's stages where layer files say so (a PipelineModule
  // saves each layer's weights apart) and none names a tensor-parallel rank; otherwise tensor
  // parallelism (Megatron-DeepSpeed's, DeepSpeed's AutoTP), whose params are split by rules the
  // files do not hold.
  const int64_t last_mp = files.rbegin()->first;
  if (layer_tp.size() > 1 || (!layer_tp.empty() && *layer_tp.begin() >= 0))
    return corrupt(fmt::format("{}: model-parallel ranks (mp_rank_{:02d}, layer files of tensor-parallel ranks): "
                               "Megatron-DeepSpeed's tensor-parallel ZeRO checkpoints are not read (a pipeline's "
                               "stages are, and DeepSpeed's AutoTP ranks)", z.dir.string(), last_mp));
  z.tensor_parallel = layer_tp.empty() && last_mp > 0;
  const size_t world = files.begin()->second.size();
  for (int64_t s = 0; s <= last_mp; ++s) {
    const auto stage = files.find(s);
    if (stage == files.end())
      return corrupt(fmt::format("{}: no optimizer files of pipeline stage {} (zero_pp_rank_*_mp_rank_{:02d}_optim_states.pt) "
                                 "among {} stages' files", z.dir.string(), s, s, last_mp + 1));
    const auto& ranks = stage->second;
    ZeroStage zs;
    for (int64_t r = 0; r < static_cast<int64_t>(std::max(world, ranks.size())); ++r) {
      if (!ranks.count(r))
        return corrupt(fmt::format("{}: no optimizer file of rank {} (zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt) "
                                   "among {} ranks' files", z.dir.string(), r, r, s, std::max(world, ranks.size())));
      zs.optim.push_back(ranks.at(r));
    }
    const std::string model = fmt::format("mp_rank_{:02d}_model_states.pt", s);
    const std::string zero3 = fmt::format("zero_pp_rank_0_mp_rank_{:02d}_model_states.pt", s);  // ZeRO-3's, per rank
    if (fs::is_regular_file(z.dir / model, ec)) zs.model = z.dir / model;
    else if (fs::is_regular_file(z.dir / zero3, ec)) zs.model = z.dir / zero3;
    if (zs.model.empty())
      return corrupt(fmt::format("{}: no model states file ({}, or ZeRO-3's {}), which names the params",
                                 z.dir.string(), model, zero3));
    z.stages.push_back(std::move(zs));
  }
  return std::optional<ZeroFiles>{std::move(z)};
}

namespace {

// A DeepSpeed universal checkpoint's folder and its model states file: `path` itself, or the folder
// its `latest_universal` names (ds_to_universal writes that file beside its output).
std::optional<std::pair<fs::path, fs::path>> universal_dir(const fs::path& path) {
  std::error_code ec;
  auto at = [&](const fs::path& dir) -> std::optional<std::pair<fs::path, fs::path>> {
    if (!fs::is_regular_file(dir / "zero" / "optimizer_state.pt", ec)) return std::nullopt;
    for (const char* model : {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"})
      if (fs::is_regular_file(dir / model, ec)) return std::pair{dir, dir / model};
    return std::nullopt;
  };
  if (auto u = at(path)) return u;
  if (!fs::is_regular_file(path / "latest_universal", ec) || fs::file_size(path / "latest_universal", ec) > 4096)
    return std::nullopt;
  std::ifstream f(path / "latest_universal");
  std::string tag;
  std::getline(f, tag);
  if (tag.empty() || tag.find('/') != std::string::npos || tag == "." || tag == "..") return std::nullopt;
  return at(path / tag);
}

}  // namespace

bool is_deepspeed_checkpoint(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  if (universal_dir(path)) return true;
  const fs::path dir = zero_tag_dir(path);
  size_t seen = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end && ++seen <= 4096; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // ZeRO's partitions, or MoE's expert-parallel optimizers without ZeRO (moe_stage0_files)
    if (zero_optim_name(name) || (name.rfind("expp_rank_", 0) == 0 && name.ends_with("_optim_states.pt"))) return true;
  }
  // Stage 0's tag folder (the optimizer inside the model states file: zero_stage0_file).
  return fs::is_regular_file(dir / "mp_rank_00_model_states.pt", ec);
}

Result<ZeroUniversalParts> zero_universal_parts(const fs::path& path) {
  if (universal_dir(path))
    return invalid_argument(path.string() + ": already a universal checkpoint (DeepSpeed loads it on any world size)");
  OPTSTATE_ASSIGN_OR_RETURN(const auto z, zero_files(path));
  if (!z) return invalid_argument(path.string() + ": no DeepSpeed ZeRO optimizer files (zero_pp_rank_*_optim_states.pt)");
  const fs::path& file = z->optim().at(0);
  const std::string where = file.string();
  OPTSTATE_ASSIGN_OR_RETURN(auto opened, open_archive(file));
  const pickle::Pickle& p = opened.second;
  // What the reader makes of it: the stage, and whose optimizer ZeRO wraps.
  OPTSTATE_ASSIGN_OR_RETURN(const ZeroRank zr, interpret_zero_optim(p, where));
  if (zr.stage == 3)
    return invalid_argument(where + ": a ZeRO-3 checkpoint; optstate writes universal checkpoints of ZeRO-1/2 ones");
  // bitsandbytes' optimizer wrapped by ZeRO: a universal checkpoint would hold fp32 moments, which
  // it does not load (ds_to_universal does not convert its state either).
  if (zr.bnb)
    return invalid_argument(where + ": the optimizer DeepSpeed wraps is bitsandbytes' (state1/state2); a universal "
                                    "checkpoint holds fp32 exp_avg/exp_avg_sq, which its optimizer does not load. "
                                    "optstate reads the state (as fp32 moments): convert it to another format");
  const pickle::Ref osd = p.dict_get(p.root(), "optimizer_state_dict");
  const pickle::Ref base = p.dict_get(osd, "base_optimizer_state");
  const pickle::Ref groups = base == pickle::kNoRef ? pickle::kNoRef : p.dict_get(base, "param_groups");
  if (groups == pickle::kNoRef || p.at(groups).kind != pickle::Kind::kList)
    return corrupt(where + ": no base_optimizer_state.param_groups (a list)");
  pickle::Writer w;
  w.empty_dict();
  w.mark();
  const pickle::Refs& items = p.at(osd).items;
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    const pickle::Value& key = p.at(items[k]);
    if (key.kind == pickle::Kind::kStr && (key.s == "base_optimizer_state" || key.s == "param_slice_mappings" ||
                                           key.s == "single_partition_of_fp32_groups" || key.s == "param_groups"))
      continue;
    OPTSTATE_RETURN_IF_ERROR(pickle::emit(w, p, items[k], where));
    OPTSTATE_RETURN_IF_ERROR(pickle::emit(w, p, items[k + 1], where + " optimizer_state_dict"));
  }
  w.str("param_groups");
  OPTSTATE_RETURN_IF_ERROR(pickle::emit(w, p, groups, where + " param_groups"));
  w.setitems_from_mark();
  ZeroUniversalParts parts{z->dir, z->model(), {}, w.finish(), {}, {}, false, {}};
  for (const ZeroStage& st : z->stages) parts.stage_model_states.push_back(st.model);
  // A step kept as a number (DeepSpeed's CPU Adam: an int); the reader gives a never-stepped flat
  // param the number 0, but then no step.pt is written.
  parts.int_step = !zr.groups.empty() && zr.groups[0].step.number.has_value();

  // The module's tensors that no param group holds: ds_to_universal writes them as fp32.pt too.
  const std::string mw = z->model().string();
  OPTSTATE_ASSIGN_OR_RETURN(auto model, open_archive(z->model()));
  OPTSTATE_ASSIGN_OR_RETURN(const ZeroShapes shapes, interpret_zero_model(model.second, mw));
  // A pipeline's BF16_Optimizer without ZeRO: DeepSpeed (0.19.8) resumes neither its own checkpoint
  // of it nor a universal one (stage 0's load hands the optimizer one dict where it wants a list
  // per rank: KeyError), so none is written.
  if (shapes.without_zero)
    return invalid_argument(mw + ": a pipeline under bf16 without ZeRO (BF16_Optimizer, param_shapes None): DeepSpeed "
                                 "loads no universal checkpoint into it (nor its own checkpoint: its stage-0 load fails); "
                                 "optstate reads the state: convert it to another format");
  // DeepSpeed MoE layers take their experts from layer_*_expert_* files, which a universal
  // checkpoint has none of; AutoEP's universal checkpoint (ds_to_universal's: expert tensors whole,
  // the model states rewritten with the layers' metadata) is read, not written.
  if (!shapes.autoep_layers.empty())
    return invalid_argument(z->dir.string() + ": DeepSpeed AutoEP's experts: its universal checkpoint is "
                                              "ds_to_universal's (which optstate reads), not written by optstate; "
                                              "convert to another format");
  if (!z->expert_files.empty())
    return invalid_argument(z->dir.string() + ": DeepSpeed MoE layers' experts, which DeepSpeed does not load from a "
                                              "universal checkpoint; optstate reads them: convert to another format");
  if (shapes.autotp)  // ds_to_universal writes these whole, with no cat_dim
    for (const auto& [name, m] : shapes.autotp->params) parts.affine_params.insert(name);
  std::set<std::string> grouped;
  for (const auto& group : shapes.groups)
    for (const auto& [name, shape] : group) grouped.insert(name);
  auto refs = std::make_shared<std::vector<dcp::TensorRef>>();
  if (const pickle::Ref module = model.second.dict_get(model.second.root(), "module");
      module != pickle::kNoRef && model.second.at(module).kind != pickle::Kind::kNone) {
    OPTSTATE_ASSIGN_OR_RETURN(const ModelDict md, interpret_model_dict(model.second, module, mw + " ['module']"));
    for (const ModelTensor& t : md.tensors) {
      if (grouped.count(t.name)) continue;
      if (t.dtensor) return corrupt(fmt::format("{} ['module']: '{}' is a DTensor", mw, t.name));
      parts.module_only.push_back({t.name, t.tensor.shape});
      refs->push_back(t.tensor);
    }
  }
  auto archive = std::make_shared<Archive>(std::move(model.first));
  parts.module_values = [archive, refs, mw, names = parts.module_only](size_t i) -> Result<std::vector<float>> {
    if (i >= refs->size()) return internal_error("module tensor index out of range");
    return tensor_f32(*archive, (*refs)[i], fmt::format("{} ['module']['{}']", mw, names[i].name));
  };
  return parts;
}

Result<std::optional<fs::path>> zero_stage0_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::optional<fs::path>{};
  const fs::path dir = zero_tag_dir(path);
  std::vector<std::string> model_parallel;  // mp_rank_NN (NN > 0) model states, a pipeline's layer files
  size_t seen = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (++seen > (size_t{1} << 20)) return corrupt(dir.string() + ": more than 2^20 entries");
    const std::string name = it->path().filename().string();
    // ZeRO's partitions, or MoE's files: zero_files' (which reads or refuses them)
    if (zero_optim_name(name) || zero_expert_name(name) || name.rfind("expp_rank_", 0) == 0)
      return std::optional<fs::path>{};
    if (zero_layer_name(name) ||
        (name.rfind("mp_rank_", 0) == 0 && name.ends_with("_model_states.pt") && name != "mp_rank_00_model_states.pt"))
      model_parallel.push_back(name);
  }
  if (ec) return io_error(fmt::format("{}: {}", dir.string(), ec.message()));
  const fs::path file = dir / "mp_rank_00_model_states.pt";
  if (!fs::is_regular_file(file, ec)) return std::optional<fs::path>{};
  if (!model_parallel.empty()) {
    std::sort(model_parallel.begin(), model_parallel.end());
    if (zero_layer_name(model_parallel.front()))  // "layer_*" sorts before "mp_rank_*"
      return unsupported(fmt::format("{}: a DeepSpeed pipeline without ZeRO in fp32 or fp16 (its layer files, {}, and "
                                     "each stage's optimizer inside its mp_rank_*_model_states.pt, its params numbered: "
                                     "which layers each stage holds is in no file): not read; under bf16 (its "
                                     "BF16_Optimizer's bf16_zero_pp_rank_* files) it is", dir.string(),
                                     model_parallel.front()));
    return corrupt(fmt::format("{}: a DeepSpeed checkpoint without ZeRO beside model-parallel ranks' files ({}): not "
                               "read (each rank's optimizer sits in its model states file, split by rules no file "
                               "holds)", dir.string(), model_parallel.front()));
  }
  return std::optional<fs::path>{file};
}

Result<std::optional<MoeStage0Files>> moe_stage0_files(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::optional<MoeStage0Files>{};
  MoeStage0Files out;
  out.dir = zero_tag_dir(path);
  std::map<int64_t, fs::path> optim;
  std::string other_mp;  // a file of a model-parallel rank other than 0, or a pipeline's layer file
  size_t seen = 0;
  for (fs::directory_iterator it(out.dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (++seen > (size_t{1} << 20)) return corrupt(out.dir.string() + ": more than 2^20 entries");
    const std::string name = it->path().filename().string();
    if (zero_optim_name(name)) return std::optional<MoeStage0Files>{};  // ZeRO's: zero_files reads them
    if (const auto e = zero_expert_name(name)) {
      if ((*e)[2] != 0) other_mp = name;
      out.experts[(*e)[0]][(*e)[1]] = it->path();
      continue;
    }
    constexpr std::string_view head = "expp_rank_", mid = "_mp_rank_", tail = "_optim_states.pt";
    if (name.rfind(head, 0) == 0 && name.ends_with(tail)) {
      const std::string body = name.substr(head.size(), name.size() - head.size() - tail.size());
      const auto m = body.find(mid);
      const auto e = m == std::string::npos ? std::nullopt : name_number(body.substr(0, m));
      const auto mp = m == std::string::npos ? std::nullopt : name_number(body.substr(m + mid.size()));
      if (!e || !mp) return corrupt(fmt::format("{}: {} is not expp_rank_<E>_mp_rank_<MM>_optim_states.pt", out.dir.string(), name));
      if (*mp != 0) other_mp = name;
      if (!optim.emplace(*e, it->path()).second)
        return corrupt(fmt::format("{}: two optimizer files of expert-parallel rank {}", out.dir.string(), *e));
      continue;
    }
    if (zero_layer_name(name) ||
        (name.rfind("mp_rank_", 0) == 0 && name.ends_with("_model_states.pt") && name != "mp_rank_00_model_states.pt"))
      other_mp = name;
  }
  if (ec) return io_error(fmt::format("{}: {}", out.dir.string(), ec.message()));
  if (optim.empty()) return std::optional<MoeStage0Files>{};
  if (!other_mp.empty())
    return corrupt(fmt::format("{}: {}: DeepSpeed MoE beside model parallelism (a pipeline's stages or tensor-parallel "
                               "ranks, whose experts split other ways): not read", out.dir.string(), other_mp));
  for (const auto& [e, file] : optim) {
    if (e != static_cast<int64_t>(out.optim.size()))
      return corrupt(fmt::format("{}: no expp_rank_{}_mp_rank_00_optim_states.pt (expert-parallel rank {}'s optimizer) "
                                 "beside expp_rank_{}'s", out.dir.string(), out.optim.size(), out.optim.size(), e));
    out.optim.push_back(file);
  }
  out.model = out.dir / "mp_rank_00_model_states.pt";
  if (!fs::is_regular_file(out.model, ec))
    return corrupt(fmt::format("{}: no mp_rank_00_model_states.pt (the dense params' weights and the MoE layers' "
                               "expert counts) beside the expp_rank_*_optim_states.pt files", out.dir.string()));
  return std::optional<MoeStage0Files>(std::move(out));
}

Result<std::unique_ptr<CheckpointReader>> open_deepspeed(const fs::path& path) {
  if (const auto u = universal_dir(path)) {
    auto reader = std::make_unique<TorchSaveReader>(path);
    OPTSTATE_RETURN_IF_ERROR(reader->init_universal(u->first, u->second));
    return std::unique_ptr<CheckpointReader>(std::move(reader));
  }
  // Without ZeRO (stage 0): the optimizer in the model states file, which every data-parallel rank
  // holds whole (rank 0 saves it): read as that torch.save file.
  OPTSTATE_ASSIGN_OR_RETURN(const auto stage0, zero_stage0_file(path));
  if (stage0) return open_file(*stage0);
  OPTSTATE_ASSIGN_OR_RETURN(const auto moe0, moe_stage0_files(path));
  if (moe0) {
    auto reader = std::make_unique<TorchSaveReader>(path);
    OPTSTATE_RETURN_IF_ERROR(reader->init_moe_stage0(*moe0));
    return std::unique_ptr<CheckpointReader>(std::move(reader));
  }
  OPTSTATE_ASSIGN_OR_RETURN(const auto z, zero_files(path));
  if (!z) return invalid_argument(path.string() + ": no DeepSpeed ZeRO optimizer files (zero_pp_rank_*_optim_states.pt)");
  auto reader = std::make_unique<TorchSaveReader>(path);
  OPTSTATE_RETURN_IF_ERROR(reader->init_zero(*z));
  return std::unique_ptr<CheckpointReader>(std::move(reader));
}

Result<std::unique_ptr<CheckpointReader>> open_rank_files(const RankFileSet& parts) {
  if (parts.files.empty()) return invalid_argument(parts.dir.string() + ": no nanotron optimizer files");
  auto reader = std::make_unique<TorchSaveReader>(parts.path);
  OPTSTATE_RETURN_IF_ERROR(reader->init_rank_files(parts));
  return std::unique_ptr<CheckpointReader>(std::move(reader));
}

Result<MegatronSizes> read_megatron_sizes(const fs::path& file) {
  OPTSTATE_ASSIGN_OR_RETURN(const auto ap, open_archive(file));
  const auto a = megatron_args_of(ap.second);
  if (!a) return MegatronSizes{};
  return MegatronSizes{a->tp_size, a->pp_size, a->ep_size, a->etp_size, a->num_experts};
}

Result<std::unique_ptr<CheckpointReader>> open_file(const fs::path& path) {
  auto reader = std::make_unique<TorchSaveReader>(path);
  OPTSTATE_RETURN_IF_ERROR(reader->init({path}, {}, {}));
  return std::unique_ptr<CheckpointReader>(std::move(reader));
}

}  // namespace optstate::torchsave
