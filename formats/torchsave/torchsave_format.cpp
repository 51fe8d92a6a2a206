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
#include "torchsave_reader_impl.h"

namespace optstate::torchsave {
namespace {

// dcp::kMaxArchivePickleBytes, as a DCP's .metadata (64 MiB, the cap before, refused torch's own
// files past 290,000 params). The values it makes are capped by memory (pickle::Limits::max_memory).
constexpr uint64_t kMaxPickleBytes = dcp::kMaxArchivePickleBytes;
// A dense tensor stored permuted (channels_last, transposed) is put in logical order in memory: its
// storage record is read whole, up to this size (conv weights are far smaller).
constexpr uint64_t kMaxPermutedBytes = uint64_t{1} << 30;

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

namespace detail {

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

auto TorchSaveReader::format() const -> std::string_view {
  return libtorch_     ? "libtorch"
         : bnb_        ? "bitsandbytes"
         : torchao_    ? "torchao"
         : deepspeed_  ? "deepspeed"
         : megatron_   ? "megatron"
         : nanotron_   ? "nanotron"
                       : "torchsave";
}

auto TorchSaveReader::stream_model_tensor(size_t index, const ByteSink& sink) const -> Status {
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

auto TorchSaveReader::verify_shared_records() -> Status {
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

auto TorchSaveReader::compare_tied_copies() -> Status {
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

auto TorchSaveReader::stream(const std::string& fqn, const std::string& entry, Component c,
                             const ByteSink& sink) -> Status {
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

auto TorchSaveReader::read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin,
                                 int64_t end, std::span<std::byte> out) -> Status {
  OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Piece>* pieces, find(fqn, entry, c));
  const Entry& e = meta_.params.at(fqn).entries.at(entry);
  const int64_t elem = component_elem_size(e, c);
  const int64_t count = pieces->empty() ? 0 : pieces->back().begin + pieces->back().count;
  if (begin < 0 || end < begin || end > count || static_cast<int64_t>(out.size()) != (end - begin) * elem)
    return invalid_argument(fmt::format("{}: range [{}, {}) of {} is outside [0, {}) or does not fit", path_.string(),
                                        begin, end, name_of(fqn, entry, c), count));
  return read_pieces(*pieces, elem, fqn, entry, c, begin, end, out);
}

auto TorchSaveReader::read_pieces(const std::vector<Piece>& pieces, int64_t elem, const std::string& fqn,
                                  const std::string& entry, Component c, int64_t begin, int64_t end,
                                  std::span<std::byte> out) -> Status {
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

auto TorchSaveReader::locate(const std::string& fqn, const std::string& entry, Component c,
                             int64_t index) const -> std::string {
  auto it = stored_.find({fqn, entry, c});
  if (it == stored_.end()) return path_.string();
  const Entry& e = meta_.params.at(fqn).entries.at(entry);
  for (const Piece& pc : it->second)
    if (index >= pc.begin && index < pc.begin + pc.count)
      return fmt::format("{} at byte {}", files_[pc.stored.file].path.string(),
                         pc.stored.at + (index - pc.begin) * component_elem_size(e, c));
  return path_.string();
}

auto TorchSaveReader::permuted_run(const Stored& s, int64_t from, int64_t to, const std::string& fqn,
                                   const std::string& entry, Component c, const ByteSink& sink) -> Status {
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

auto TorchSaveReader::dequantized(const Piece& pc, int64_t from, int64_t to, const std::string& fqn,
                                  const std::string& entry, Component c, const ByteSink& sink) -> Status {
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

auto TorchSaveReader::init(const std::vector<fs::path>& optim_files, const std::vector<fs::path>& model_files,
                           std::vector<std::string> not_read) -> Status {
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

auto TorchSaveReader::expose_model_tensors(const ModelDict& md, const StateDict& sd) -> Status {
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

auto TorchSaveReader::model_weights(const std::string& fqn, const std::string& source_fqn, ParamState& ps,
                                    const std::vector<std::pair<ModelDict, size_t>>& models,
                                    const std::vector<fs::path>& model_files) -> Result<bool> {
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

auto TorchSaveReader::add_weights(const std::string& fqn, ParamState& ps, const std::vector<Part>& wparts,
                                  const std::string& ww) -> Status {
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

auto TorchSaveReader::finish(const std::vector<std::pair<ModelDict, size_t>>& models,
                             const std::vector<fs::path>& model_files, size_t weights) -> Status {
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

auto TorchSaveReader::read_samples(const Archive& a, size_t file, const dcp::TensorRef& t, int64_t count,
                                   std::span<const int64_t> at,
                                   const std::string& where) -> Result<std::vector<uint32_t>> {
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

auto TorchSaveReader::flat_parts(const StateDict& sd, const ModelDict& md) -> bool {
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

auto TorchSaveReader::same_groups(const StateDict& a, const StateDict& b, const std::string& wa,
                                  const std::string& wb) -> Status {
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

auto TorchSaveReader::same_layout(const StateDict& a, const StateDict& b, const std::string& wa,
                                  const std::string& wb) -> Status {
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

auto TorchSaveReader::model_names(const StateDict& sd, const ModelDict& md, const fs::path& model0,
                                  std::map<int64_t, std::string>& rename) -> Status {
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

auto TorchSaveReader::place(const std::vector<int64_t>& shape, const std::vector<Part>& parts, const std::string& where,
                            bool dense) -> Result<Placed> {
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

auto TorchSaveReader::absmax_pieces(const Placed& codes, const std::vector<Part>& scales, int64_t numel,
                                    int64_t block) -> std::optional<std::vector<Piece>> {
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

auto TorchSaveReader::resolve_in(const Archive& a, size_t file, const dcp::TensorRef& t, int64_t count,
                                 const std::string& where, bool permuted_ok) -> Result<Stored> {
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

auto TorchSaveReader::record_crc(size_t file, uint64_t from, uint64_t to, uint32_t crc, const std::string& fqn,
                                 const std::string& entry, Component c) -> Result<uint32_t> {
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

auto TorchSaveReader::check_crc(const Stored& s, uint32_t crc, const std::string& fqn, const std::string& entry,
                                Component c) -> Status {
  if (!s.checked()) return Status::Ok();
  if (s.at + s.bytes < s.record_at + s.record_bytes) {
    OPTSTATE_ASSIGN_OR_RETURN(crc, record_crc(s.file, s.at + s.bytes, s.record_at + s.record_bytes, crc, fqn, entry, c));
  }
  if (crc == s.crc) return Status::Ok();
  return corrupt(fmt::format("{}: CRC-32 of its storage is {:08x}, the archive records {:08x}", where_of(s, fqn, entry, c),
                             crc, s.crc));
}

auto TorchSaveReader::value_of(size_t file, const Scalar& s, const std::string& where) const -> Result<double> {
  if (s.number) return *s.number;
  const dcp::TensorRef& t = *s.tensor;
  OPTSTATE_ASSIGN_OR_RETURN(const Stored st, resolve(file, t, 1, where));
  std::byte raw[8];
  if (st.bytes > sizeof raw) return corrupt(fmt::format("{}: a {} tensor where a number is needed", where, dtype_name(t.dtype)));
  OPTSTATE_RETURN_IF_ERROR(files_[file].file.read_at(st.at, std::span(raw, st.bytes)).with_context(where));
  if (const auto v = scalar_value(t.dtype, raw)) return *v;
  return corrupt(fmt::format("{}: a {} tensor where a number is needed", where, dtype_name(t.dtype)));
}

auto TorchSaveReader::map16(size_t file, const dcp::TensorRef& q,
                            const std::string& where) -> Result<const std::array<float, 256>*> {
  if (q.dtype != DType::kF32) return corrupt(where + ": quantization map is not float32");
  OPTSTATE_ASSIGN_OR_RETURN(const Stored st, resolve(file, q, 16, where + " quantization map"));
  std::array<float, 16> m;
  OPTSTATE_RETURN_IF_ERROR(files_[file].file.read_at(st.at, std::as_writable_bytes(std::span(m))).with_context(where));
  std::array<float, 256>& t = tables_.emplace_back();
  t.fill(0.0f);
  std::copy(m.begin(), m.end(), t.begin());
  return &t;
}

auto TorchSaveReader::map_name(size_t file, const dcp::TensorRef& q,
                               const std::string& where) const -> Result<std::string> {
  if (q.dtype != DType::kF32) return corrupt(where + ": quantization map is not float32");
  OPTSTATE_ASSIGN_OR_RETURN(const Stored st, resolve(file, q, 256, where + " quantization map"));
  std::array<float, 256> m;
  OPTSTATE_RETURN_IF_ERROR(files_[file].file.read_at(st.at, std::as_writable_bytes(std::span(m))).with_context(where));
  if (const auto k = qmap_matching(m)) return std::string(qmap_name(*k));
  return corrupt(where + ": quantization map is neither the dynamic signed nor the unsigned one");
}

}  // namespace detail

namespace {

using detail::TorchSaveReader;

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
      reader->set_ranks(set.optim.size());
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

Result<std::unique_ptr<CheckpointReader>> open_rank_files(const RankFileSet& parts) {
  if (parts.files.empty()) return invalid_argument(parts.dir.string() + ": no nanotron optimizer files");
  auto reader = std::make_unique<TorchSaveReader>(parts.path);
  OPTSTATE_RETURN_IF_ERROR(reader->init_rank_files(parts));
  reader->set_ranks(parts.files.size());
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
