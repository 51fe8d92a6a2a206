// The PyTorch DCP driver: reads a DCP directory (`.metadata` + `*.distcp`) written by
// torch.distributed.checkpoint.save, including torchao AdamW8bit items, with no Python; writes a DCP
// directory that dcp.load + set_state_dict accept (dcp_writer.cpp). Layout and mapping: FORMAT.md.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "dcp_driver.h"
#include "bnb_state.h"
#include "chunks.h"
#include "dcp_layout.h"
#include "hf_storage.h"
#include "optstate/io.h"
#include "optstate/quant8.h"
#include "optstate/sha256.h"
#include "optstate/torch_names.h"
#include "optstate/transform.h"
#include "optstate/zstd.h"
#include "pickle.h"
#include "megatron.h"
#include "megatron_buckets.h"
#include "megatron/megatron_layout.h"
#include "torchao/torchao_layout.h"
#include "zarr.h"
#include "zip.h"

namespace optstate::dcp {
namespace {

constexpr uint64_t kMaxPickleBytes = uint64_t{64} << 20;
// The first bytes of a large item's archive read at once: its data.pkl (a few hundred bytes for a
// tensor) and the local headers that follow it.
constexpr uint64_t kArchiveHeadBytes = uint64_t{16} << 10;
// A tensor stored permuted (channels_last, transposed) is put in logical order in memory: its
// storage record is read whole, up to this size (conv weights are far smaller).
constexpr uint64_t kMaxPermutedBytes = uint64_t{1} << 30;

// A param group's 8-bit layout as optstate's AdamW8bit records it (block 0: none recorded).
struct Plain8 {
  int64_t block = 0;
  std::string signed_map = "dynamic-signed", unsigned_map = "dynamic-unsigned";
};

struct ParsedItem {
  Payload payload;
  pickle::Pickle pickle;                      // for bytes items' values
  // A storage's zip record: where its bytes lie, how many, and the CRC-32 torch.save stored for them.
  struct Record {
    uint64_t at = 0, size = 0;  // absolute file offset, bytes
    uint32_t crc = 0;           // 0: none stored (torch.serialization.config.save.compute_crc32 off)
    bool verified = false;
    // A part of a record whose CRC-32 covers more than the part (dp_zero_gather_scatter's buffers):
    // checked by verify_shared_records, whole, rather than as it is read.
    bool shared = false;
    // Elements stored alone (zarr's chunks, DCP's Hugging Face storage): no record, no CRC-32.
    bool raw = false;
    // Read so far in order from the record's start, and its CRC-32 (a chunk whose rows lie apart in
    // the tensor, such as a tensor-parallel column shard, is read in pieces); kUnchecked once a read
    // left that order.
    uint64_t fed = 0;
    uint32_t running = 0;
    static constexpr uint64_t kUnchecked = ~uint64_t{0};
  };
  std::map<std::string, Record> storages;  // by storage key
  const InputFile* file = nullptr;
};

struct Source {
  std::string key;      // flat DCP key of the item
  const ItemMeta* item = nullptr;
  bool eight = false;
  // 8-bit state as two plain tensor items (optstate's AdamW8bit: `<entry>_codes`, `<entry>_absmax`)
  // rather than one OptimState8bit item: the absmax item; its segments index its own chunks.
  std::string absmax_key;
  const ItemMeta* absmax_item = nullptr;
  RunList values;  // dense values or 8-bit codes
  RunList absmax;
};

// fp32 main params at sorted places `at` as bit patterns of `d` (rounded to nearest even, as
// Megatron copies them into the weights): each run of consecutive places read at once by
// read_run(first place, out).
Result<std::vector<uint32_t>> main_params_as(DType d, std::span<const int64_t> at,
                                             const std::function<Status(int64_t, std::span<float>)>& read_run) {
  std::vector<uint32_t> out(at.size());
  std::vector<float> run;
  for (size_t i = 0; i < at.size();) {
    size_t j = i + 1;
    while (j < at.size() && at[j] == at[j - 1] + 1) ++j;
    run.resize(j - i);
    OPTSTATE_RETURN_IF_ERROR(read_run(at[i], run));
    for (size_t k = i; k < j; ++k) {
      const float v = run[k - i];
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      out[k] = d == DType::kBF16 ? f32_to_bf16(v) : d == DType::kF16 ? f32_to_f16(v) : bits;
    }
    i = j;
  }
  return out;
}

bool is_two_dcp_folder(const fs::path& path);
// What inspect says of a folder of two DCPs (which run saved it, what was read from where); empty
// for any other folder.
std::string two_dcp_note(const fs::path& path);

// The rank R of torch's FileSystemWriter's data file name __R_I.distcp (I: the rank's file number,
// one per writer thread); nullopt for any other name.
std::optional<int64_t> distcp_rank(std::string_view path) {
  const std::string_view name = path.substr(path.rfind('/') == std::string_view::npos ? 0 : path.rfind('/') + 1);
  constexpr std::string_view head = "__", tail = ".distcp";
  if (!name.starts_with(head) || !name.ends_with(tail)) return std::nullopt;
  const std::string_view body = name.substr(head.size(), name.size() - head.size() - tail.size());
  const size_t sep = body.find('_');
  if (sep == std::string_view::npos) return std::nullopt;
  const std::string_view rank = body.substr(0, sep), number = body.substr(sep + 1);
  auto digits = [](std::string_view t) {
    return !t.empty() && t.size() <= 9 && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (!digits(rank) || !digits(number)) return std::nullopt;
  return std::stoll(std::string(rank));
}

class DcpReader final : public CheckpointReader {
 public:
  // `zarr`: the folder is Megatron's zarr backend, its Metadata read from the arrays (zarr.h).
  DcpReader(fs::path dir, Metadata md, bool zarr = false) : dir_(std::move(dir)), md_(std::move(md)), zarr_(zarr) {}

  std::string_view format() const override { return "dcp"; }
  const fs::path& path() const override { return dir_; }
  const OptimizerState& meta() const override { return meta_; }
  // The ranks whose data files hold the items (each rank writes __R_I.distcp). torch writes an
  // item several ranks hold (DDP's replicated state) from one of them, so a run's other ranks may
  // have no file: this counts the ranks that wrote data. nullopt where a data file is otherwise named.
  std::optional<int64_t> ranks() const override {
    if (zarr_) return std::nullopt;
    std::set<int64_t> seen;
    std::string_view last;
    for (const auto& [key, loc] : md_.storage) {
      if (loc.relative_path == last || loc.relative_path == kMegatronCommon) continue;  // Megatron's common.pt
      last = loc.relative_path;
      const std::optional<int64_t> r = distcp_rank(loc.relative_path);
      if (!r && loc.raw_shape) continue;  // a model's weights in DCP's Hugging Face storage (hf_storage.h)
      if (!r) return std::nullopt;
      seen.insert(*r);
    }
    if (seen.empty()) return std::nullopt;
    return static_cast<int64_t>(seen.size());
  }
  std::string_view torchao_package() const override { return layout_.torchao_package; }
  std::span<const AdamWFlags> adamw_flags() const override {
    const bool any = std::any_of(layout_.adamw_flags.begin(), layout_.adamw_flags.end(),
                                 [](const AdamWFlags& f) { return !f.empty(); });
    return any ? std::span<const AdamWFlags>(layout_.adamw_flags) : std::span<const AdamWFlags>{};
  }
  std::span<const GroupExtras> group_extras() const override {
    const bool any = std::any_of(layout_.group_extras.begin(), layout_.group_extras.end(),
                                 [](const GroupExtras& e) { return !e.empty(); });
    return any ? std::span<const GroupExtras>(layout_.group_extras) : std::span<const GroupExtras>{};
  }
  // Whether every chunk read so far was checked against the CRC-32 torch.save stored for it (and at
  // least one was): true after a full read of a checkpoint torch saved with CRCs (its default).
  // A rank's share of a larger chunk is part of a record and cannot be checked.
  bool checksummed() const override {
    return verified_ > 0 && unverified_ == 0 && raw_reads_ == 0 && pending_ == 0 &&
           (shared_reads_ == 0 || shared_verified_);
  }
  // Where only elements stored alone went unchecked: which (every torch.save record read was).
  std::string unchecked() const override {
    if (raw_reads_ == 0 || unverified_ > 0 || pending_ > 0 || (shared_reads_ > 0 && !shared_verified_))
      return CheckpointReader::unchecked();
    return fmt::format("{} carry no checksums; every torch.save record's CRC-32 verified",
                       zarr_ ? "the zarr arrays' chunks" : "the tensors stored in safetensors files");
  }
  // dp_zero_gather_scatter's gathered buffers are read as parts of their storages' records: each
  // such record read whole here, once, against the CRC-32 torch.save stored for it.
  Status verify_shared_records() override {
    std::vector<std::byte> buf;
    bool all = !shared_records_.empty();
    for (const SharedRecord& r : shared_records_) {
      if (r.crc == 0) {  // none stored (compute_crc32 off)
        all = false;
        continue;
      }
      uint32_t crc = 0;
      for (uint64_t at = 0; at < r.size;) {
        buf.resize(static_cast<size_t>(std::min<uint64_t>(r.size - at, uint64_t{8} << 20)));
        OPTSTATE_RETURN_IF_ERROR(r.file->read_at(r.at + at, buf).with_context(r.where));
        crc = zip::crc32(buf, crc);
        at += buf.size();
      }
      if (crc != r.crc)
        return corrupt(fmt::format("{}: its data fails the CRC-32 torch.save stored (stored {:08x}, read {:08x}): "
                                   "changed or damaged after it was written", r.where, r.crc, crc));
      ++verified_;
    }
    shared_verified_ = all;
    return Status::Ok();
  }
  // Megatron-Core 0.19's integrity.json (megatron.h): each listed file read whole against its SHA-256,
  // and every file the checkpoint is read from must be listed.
  Result<std::string> verify_file_digests() override {
    std::error_code ec;
    if (!layout_.megatron || zarr_ || !fs::is_regular_file(dir_ / megatron::kIntegrityManifest, ec))
      return std::string();
    const std::string where = (dir_ / megatron::kIntegrityManifest).string();
    OPTSTATE_ASSIGN_OR_RETURN(auto text, read_small_file(dir_ / megatron::kIntegrityManifest, uint64_t{256} << 20));
    OPTSTATE_ASSIGN_OR_RETURN(
        std::vector<megatron::FileDigest> digests,
        megatron::parse_integrity_manifest(std::string_view(reinterpret_cast<const char*>(text.data()), text.size()),
                                           where));
    std::set<std::string> listed;
    for (const auto& d : digests) listed.insert(d.name);
    std::set<std::string> read{".metadata", "metadata.json"};
    if (layout_.megatron && !common_in_item_) read.insert(kMegatronCommon);
    for (const auto& [k, loc] : md_.storage) read.insert(loc.relative_path);
    for (const std::string& name : read)
      if (!listed.count(name))
        return corrupt(fmt::format("{}: {} is read but not listed in {}: the manifest is not this checkpoint's",
                                   dir_.string(), name, megatron::kIntegrityManifest));
    // Each file hashed whole by one thread (SHA-256 runs in order), the files spread over up to 8
    // threads, largest first. A finding stops the others' next files; of the files checked, the
    // first in the manifest's order with a finding is the one reported.
    std::vector<Status> found(digests.size(), Status::Ok());
    auto check = [&](const megatron::FileDigest& d, std::vector<std::byte>& buf) -> Status {
      const std::string fw = (dir_ / d.name).string();
      std::error_code fec;
      if (!fs::is_regular_file(dir_ / d.name, fec))
        return corrupt(fmt::format("{}: listed in {} but missing", fw, megatron::kIntegrityManifest));
      // the reader's own files as it holds them; any other listed file opened for this check alone
      std::optional<InputFile> own;
      const InputFile* f = nullptr;
      if (const auto it = files_.find(d.name); it != files_.end()) {
        f = &it->second;
      } else {
        OPTSTATE_ASSIGN_OR_RETURN(fs::path full, contained_path(dir_, d.name));
        OPTSTATE_ASSIGN_OR_RETURN(InputFile opened, InputFile::open(full));
        f = &own.emplace(std::move(opened));
      }
      Sha256 h;
      for (uint64_t at = 0; at < f->size();) {  // 1 MiB at a time: hashed while still in cache
        buf.resize(static_cast<size_t>(std::min<uint64_t>(f->size() - at, uint64_t{1} << 20)));
        OPTSTATE_RETURN_IF_ERROR(f->read_at(at, buf).with_context(fw));
        h.update(buf);
        at += buf.size();
      }
      if (const std::string got = h.finish_hex(); got != d.sha256)
        return corrupt(fmt::format("{}: its SHA-256 differs from the one in {} (stored {}, read {}): changed or "
                                   "damaged after Megatron saved it",
                                   fw, megatron::kIntegrityManifest, d.sha256.substr(0, 16), got.substr(0, 16)));
      return Status::Ok();
    };
    std::vector<size_t> order(digests.size());
    std::vector<uint64_t> sizes(digests.size(), 0);
    for (size_t i = 0; i < digests.size(); ++i) {
      order[i] = i;
      if (const auto it = files_.find(digests[i].name); it != files_.end()) {
        sizes[i] = it->second.size();
      } else {
        std::error_code sec;
        const auto n = fs::file_size(dir_ / digests[i].name, sec);
        sizes[i] = sec ? 0 : n;
      }
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::vector<std::exception_ptr> thrown(digests.size());
    auto work = [&] {
      std::vector<std::byte> buf;
      for (size_t k; !failed.load() && (k = next.fetch_add(1)) < order.size();) {
        try {
          found[order[k]] = check(digests[order[k]], buf);
        } catch (...) {  // std::bad_alloc: rethrown on the calling thread, as a one-thread check throws it
          thrown[order[k]] = std::current_exception();
          failed = true;
        }
        if (!found[order[k]].ok()) failed = true;
      }
    };
    const size_t threads = std::min<size_t>({std::max(1u, std::thread::hardware_concurrency()), 8, order.size()});
    std::vector<std::thread> pool;
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
    for (size_t i = 0; i < digests.size(); ++i) {
      if (thrown[i]) std::rethrow_exception(thrown[i]);
      if (!found[i].ok()) return found[i];
    }
    return fmt::format("{}: the SHA-256 of all {} files verified", megatron::kIntegrityManifest, digests.size());
  }
  std::vector<std::string> read_notes() const override { return value_notes_; }
  std::vector<std::string> not_read() const override {
    std::vector<std::string> out;
    for (const auto& [top, n] : not_read_) out.push_back(fmt::format("{} ({} item{})", top, n, n == 1 ? "" : "s"));
    out.insert(out.end(), notes_.begin(), notes_.end());
    return out;
  }

  // Reads straight into `out`, only the segments that overlap [begin, end).
  Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin, int64_t end,
                    std::span<std::byte> out) override {
    auto it = sources_.find({fqn, entry});
    if (it == sources_.end())
      return not_found(fmt::format("{}: no entry '{}'", dir_.string(), entry_key(fqn, entry)));
    const Source& src = it->second;
    const RunList& segs = c == Component::kAbsmax ? src.absmax : src.values;
    const int64_t count = segs.count();
    const int64_t size = component_elem_size(meta_.params.at(fqn).entries.at(entry), c);
    if (static_cast<int64_t>(out.size()) != (end - begin) * size || begin < 0 || end > count)
      return invalid_argument(fmt::format("{}: range [{}, {}) of entry '{}' does not fit", dir_.string(), begin, end,
                                          entry_key(fqn, entry)));
    return read_into(src, c, size, begin, end, out);
  }

  // Elements [begin, end) of one component of a source (`size` bytes an element) into `out`. The
  // rows of a column shard that fall in the range lie one after another in its chunk: they are
  // read with one pread a batch and put in place, not one a row (a row can be a few hundred
  // bytes). Other runs one by one: 8-bit chunks read as values, tensors stored permuted.
  Status read_into(const Source& src, Component c, int64_t size, int64_t begin, int64_t end,
                   std::span<std::byte> out) {
    const RunList& segs = c == Component::kAbsmax ? src.absmax : src.values;
    auto one_run = [&](const Segment& s) -> Status {
      const int64_t a = std::max(begin, s.begin), b = std::min(end, s.begin + s.count);
      if (a >= b) return Status::Ok();
      const auto part = out.subspan(static_cast<size_t>((a - begin) * size), static_cast<size_t>((b - a) * size));
      OPTSTATE_ASSIGN_OR_RETURN(const bool dq, dequantized_segment(src, s, c, a - s.begin, b - s.begin, filling(part)));
      if (dq) return Status::Ok();
      OPTSTATE_ASSIGN_OR_RETURN(const bool pm, permuted_segment(src, s, c, a - s.begin, b - s.begin, filling(part)));
      if (pm) return Status::Ok();
      OPTSTATE_ASSIGN_OR_RETURN(auto loc, segment_source(src, s, c));
      const auto [file, at, elem, record] = loc;
      if (elem != size)
        return corrupt(fmt::format("{}: item '{}' holds {}-byte elements where {} are needed", dir_.string(), src.key,
                                   elem, size));
      const uint64_t from = at + static_cast<uint64_t>((a - s.begin) * elem);
      const auto dst = out.subspan(static_cast<size_t>((a - begin) * elem), static_cast<size_t>((b - a) * elem));
      OPTSTATE_RETURN_IF_ERROR(file->read_at(from, dst).with_context(fmt::format("item '{}'", src.key)));
      if (crc_due(*record, from, dst.size()))
        OPTSTATE_RETURN_IF_ERROR(crc_result(src, s, c, *record, zip::crc32(dst, record->running), dst.size()));
      return Status::Ok();
    };
    return segs.for_each_group(begin, end, [&](const Runs& g, int64_t r0, int64_t r1) -> Status {
      bool rows = r1 - r0 > 1;
      if (rows) {
        OPTSTATE_ASSIGN_OR_RETURN(rows, plain_chunk(src, c, g));
      }
      if (!rows) {
        for (int64_t r = r0; r < r1; ++r) OPTSTATE_RETURN_IF_ERROR(one_run(g.run(r)));
        return Status::Ok();
      }
      const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(kStreamPieceBytes) / (g.count * size));
      for (int64_t b0 = r0; b0 < r1; b0 += per) {
        const int64_t b1 = std::min(r1, b0 + per);
        const Segment first = g.run(b0), last = g.run(b1 - 1);
        // Chunk elements [lo, hi): from the first row's part in the range to the last row's.
        const int64_t lo = first.local + (std::max(begin, first.begin) - first.begin);
        const int64_t hi = last.local + (std::min(end, last.begin + last.count) - last.begin);
        const Segment span{first.begin, hi - lo, g.chunk, lo};
        OPTSTATE_ASSIGN_OR_RETURN(auto loc, segment_source(src, span, c));
        const auto [file, at, elem, record] = loc;
        if (elem != size)
          return corrupt(fmt::format("{}: item '{}' holds {}-byte elements where {} are needed", dir_.string(),
                                     item_key(src, c), elem, size));
        const auto bytes = static_cast<size_t>((hi - lo) * elem);
        const std::span<std::byte> buf = rows_.for_read(at, bytes);
        OPTSTATE_RETURN_IF_ERROR(file->read_at(at, buf).with_context(fmt::format("item '{}'", item_key(src, c))));
        if (crc_due(*record, at, bytes))
          OPTSTATE_RETURN_IF_ERROR(crc_result(src, span, c, *record, zip::crc32(buf, record->running), bytes));
        for (int64_t r = b0; r < b1; ++r) {
          const Segment s = g.run(r);
          const int64_t a = std::max(begin, s.begin), b = std::min(end, s.begin + s.count);
          std::memcpy(out.data() + (a - begin) * size, buf.data() + (s.local + (a - s.begin) - lo) * elem,
                      static_cast<size_t>((b - a) * elem));
        }
      }
      return Status::Ok();
    });
  }

  // Whether a group's chunk is a plain tensor stored in C order, whose rows read as bytes.
  Result<bool> plain_chunk(const Source& src, Component c, const Runs& g) {
    const Segment s0 = g.run(0);
    if (!src.eight && src.absmax_item == nullptr && c == Component::kValues) {
      OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pi, item(src.key, item_chunk(src, s0, c).offsets));
      if (pi->payload.kind != Payload::Kind::kTensor) return false;  // 8-bit, read as values
    }
    OPTSTATE_ASSIGN_OR_RETURN(auto found, segment_tensor(src, s0, c));
    return !std::get<1>(found)->permuted();
  }

  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    auto it = sources_.find({fqn, entry});
    if (it == sources_.end())
      return not_found(fmt::format("{}: no entry '{}'", dir_.string(), entry_key(fqn, entry)));
    return stream_source(it->second, c, component_elem_size(meta_.params.at(fqn).entries.at(entry), c), sink);
  }

  std::span<const ModelTensorInfo> model_tensors() const override { return model_tensors_; }
  Status stream_model_tensor(size_t index, const ByteSink& sink) const override {
    if (index >= model_sources_.size())
      return not_found(fmt::format("{}: no model tensor {}", dir_.string(), index));
    // A writer holds its source as const; reading fills only the reader's caches (open files,
    // parsed items, CRC-32 marks), as stream() does, never the state it read.
    return const_cast<DcpReader*>(this)->stream_source(model_sources_[index], Component::kValues,
                                                       dtype_size(model_tensors_[index].dtype), sink);
  }

  // One component of a source (an entry's, or a model tensor's; `size` bytes an element) in
  // flattened order, each whole record checked against its CRC-32. Where chunks interleave
  // (column shards), a window of the tensor at a time, each chunk's rows in it read at once.
  Status stream_source(const Source& src, Component c, int64_t size, const ByteSink& sink) {
    const RunList& segs = c == Component::kAbsmax ? src.absmax : src.values;
    if (segs.interleaved()) {
      const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(kStreamPieceBytes) / size);
      for (int64_t w = 0; w < segs.count(); w += per) {
        const int64_t n = std::min(per, segs.count() - w);
        window_.resize(static_cast<size_t>(n * size));
        OPTSTATE_RETURN_IF_ERROR(read_into(src, c, size, w, w + n, window_));
        OPTSTATE_RETURN_IF_ERROR(sink(window_));
      }
      return Status::Ok();
    }
    return segs.for_each(0, segs.count(), [&](const Segment& s) -> Status {
      OPTSTATE_ASSIGN_OR_RETURN(const bool dq, dequantized_segment(src, s, c, 0, s.count, sink));
      if (dq) return Status::Ok();
      OPTSTATE_ASSIGN_OR_RETURN(const bool pm, permuted_segment(src, s, c, 0, s.count, sink));
      if (pm) return Status::Ok();
      OPTSTATE_ASSIGN_OR_RETURN(auto loc, segment_source(src, s, c));
      auto [file, at, elem, record] = loc;
      const std::string iw = fmt::format("{}: item '{}'", dir_.string(), item_key(src, c));
      uint64_t left = static_cast<uint64_t>(s.count * elem);
      const uint64_t total = left;
      const bool check = crc_due(*record, at, left);
      uint32_t crc = record->running;
      while (left > 0) {
        const uint64_t n = std::min<uint64_t>(left, kStreamPieceBytes);
        const std::span<std::byte> piece = piece_.for_read(at, n);
        OPTSTATE_RETURN_IF_ERROR(file->read_at(at, piece).with_context(iw));
        if (check) crc = zip::crc32(piece, crc);
        OPTSTATE_RETURN_IF_ERROR(sink(piece));
        at += n;
        left -= n;
      }
      if (check) OPTSTATE_RETURN_IF_ERROR(crc_result(src, s, c, *record, crc, total));
      return Status::Ok();
    });
  }

  // Whether the bytes [at, at + bytes) about to be read continue their storage's record in order
  // from its start (the whole record, as DCP saves chunks, or the next piece of one read in pieces)
  // with a CRC-32 still to check: the caller then folds their CRC-32 into rec.running and calls
  // crc_result. A read out of that order (a rank's share of a larger chunk, a view) leaves the
  // record unchecked. Counts records checked and reads not, for checksummed().
  bool crc_due(ParsedItem::Record& rec, uint64_t at, uint64_t bytes) {
    if (bytes == 0) return false;  // nothing read: nothing to fold in or count
    if (rec.verified) {
      ++verified_;
      return false;
    }
    if (at == rec.at && rec.crc != 0 && rec.fed != 0) {  // read again from its start: checked anew
      if (rec.fed != ParsedItem::Record::kUnchecked) --pending_;
      rec.fed = 0;
      rec.running = 0;
    }
    if (rec.shared) {  // its whole record is verify_shared_records'
      ++shared_reads_;
      return false;
    }
    if (rec.raw) {
      ++raw_reads_;
      return false;
    }
    if (rec.crc == 0 || rec.fed == ParsedItem::Record::kUnchecked || at != rec.at + rec.fed ||
        bytes > rec.size - rec.fed) {
      if (rec.fed > 0 && rec.fed != ParsedItem::Record::kUnchecked) --pending_;
      rec.fed = ParsedItem::Record::kUnchecked;
      ++unverified_;
      return false;
    }
    return true;
  }

  // `crc`: the CRC-32 of the record's bytes read so far, the `bytes` just read included; checked
  // once the record is read to its end.
  Status crc_result(const Source& src, const Segment& s, Component c, ParsedItem::Record& rec, uint32_t crc,
                    uint64_t bytes) {
    if (rec.fed == 0 && bytes < rec.size) ++pending_;
    rec.fed += bytes;
    rec.running = crc;
    if (rec.fed < rec.size) return Status::Ok();
    if (bytes < rec.size) --pending_;
    ++verified_;
    if (crc != rec.crc) {
      return corrupt(fmt::format("{}: item '{}' chunk at {}: its data fails the CRC-32 torch.save stored (stored "
                                 "{:08x}, read {:08x}): changed or damaged after it was written",
                                 dir_.string(), item_key(src, c), format_shape(item_chunk(src, s, c).offsets), rec.crc, crc));
    }
    rec.verified = true;
    return Status::Ok();
  }

  // The item a component is read from: for 8-bit state kept as plain codes and absmax items
  // (optstate's AdamW8bit), the absmax comes from its own item; everything else from the entry's.
  static bool in_absmax_item(const Source& src, Component c) {
    return src.absmax_item != nullptr && c == Component::kAbsmax;
  }
  static const std::string& item_key(const Source& src, Component c) {
    return in_absmax_item(src, c) ? src.absmax_key : src.key;
  }
  // The chunk a segment reads from.
  static const ChunkMeta& item_chunk(const Source& src, const Segment& s, Component c) {
    return (in_absmax_item(src, c) ? *src.absmax_item : *src.item).chunks[s.chunk];
  }

  // Elements [from, to) of a segment (from its first) through `sink`, where the segment's chunk is
  // torchao 8-bit data in an entry read as fp32 values (a rank's part quantized alone: see
  // add_entry); false, reading nothing, for every other segment.
  Result<bool> dequantized_segment(const Source& src, const Segment& s, Component c, int64_t from, int64_t to,
                                   const ByteSink& sink) {
    if (src.eight || src.absmax_item != nullptr || c != Component::kValues) return false;
    const ChunkMeta& ch = src.item->chunks[s.chunk];
    OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pi, item(src.key, ch.offsets));
    if (pi->payload.kind != Payload::Kind::kOptimState8bit) return false;
    const std::string iw = fmt::format("{}: item '{}' chunk at {}", dir_.string(), src.key, format_shape(ch.offsets));
    if (src.item->dtype != DType::kF32)
      return corrupt(fmt::format("{}: 8-bit data where the metadata says {}", iw, dtype_name(src.item->dtype)));
    const Payload& p = pi->payload;
    const int64_t codes = p.elements(), blocks = *checked_numel(p.scale.shape);
    if (blocks <= 0 || codes % blocks) return corrupt(iw + ": codes are not a whole number of blocks");
    if (s.local + s.count > codes)
      return corrupt(fmt::format("{}: holds {} codes, the chunk needs {}", iw, codes, s.local + s.count));
    const std::array<float, 256>* table = &float8_e4m3fn_values();
    std::array<float, 256> map16{};  // torchao's 4-bit map, its 16 values first
    if (p.bits == 4) {
      ParsedItem::Record& qr = pi->storages.at(p.qmap.storage_key);
      const uint64_t qat = qr.at + static_cast<uint64_t>(p.qmap.offset) * 4;
      if (static_cast<uint64_t>(p.qmap.offset + 16) * 4 > qr.size) return corrupt(iw + ": its map lies past its storage");
      OPTSTATE_RETURN_IF_ERROR(pi->file->read_at(qat, std::as_writable_bytes(std::span(map16.data(), 16))).with_context(iw));
      table = &map16;
    } else if (!p.fp8) {
      OPTSTATE_ASSIGN_OR_RETURN(const std::string mname, map_name(*pi, iw));
      OPTSTATE_ASSIGN_OR_RETURN(const QMap map, qmap_from_name(mname));
      table = &qmap_table(map);
    }
    ParsedItem::Record& sr = pi->storages.at(p.scale.storage_key);
    std::vector<float> scales(static_cast<size_t>(blocks));
    const uint64_t scales_at = sr.at + static_cast<uint64_t>(p.scale.offset) * 4;
    if (static_cast<uint64_t>(p.scale.offset + blocks) * 4 > sr.size)
      return corrupt(fmt::format("{}: its scales lie past their storage", iw));
    OPTSTATE_RETURN_IF_ERROR(pi->file->read_at(scales_at, std::as_writable_bytes(std::span(scales))).with_context(iw));
    const auto scale_bytes = std::as_bytes(std::span(scales));
    if (crc_due(sr, scales_at, scale_bytes.size()))
      OPTSTATE_RETURN_IF_ERROR(
          crc_result(src, s, Component::kAbsmax, sr, zip::crc32(scale_bytes, sr.running), scale_bytes.size()));
    ParsedItem::Record& cr = pi->storages.at(p.codes.storage_key);
    if (static_cast<uint64_t>(p.codes.offset + p.codes_numel()) > cr.size)
      return corrupt(fmt::format("{}: its codes lie past their storage", iw));
    const uint64_t codes_at = cr.at + static_cast<uint64_t>(p.codes.offset);
    // The bytes read: one a code, or (4-bit) one per two codes, checked where they are whole bytes.
    const int64_t first = s.local + from, last = s.local + to;
    const bool bytes_whole = p.bits == 8 || (first % 2 == 0 && last % 2 == 0);
    const uint64_t byte_at = static_cast<uint64_t>(p.bits == 4 ? first / 2 : first);
    const uint64_t byte_count = static_cast<uint64_t>(p.bits == 4 ? (last - first) / 2 : last - first);
    const bool check = bytes_whole && crc_due(cr, codes_at + byte_at, byte_count);
    uint32_t crc = cr.running;
    OPTSTATE_RETURN_IF_ERROR(stream_dequantized(*pi->file, codes_at, first, last, scales, codes / blocks, *table, sink,
                                                check ? &crc : nullptr, iw, p.bits));
    if (check) OPTSTATE_RETURN_IF_ERROR(crc_result(src, s, c, cr, crc, byte_count));
    return true;
  }

  // Elements [from, to) of a segment (from its first) through `sink`, where the segment's chunk is
  // a tensor stored permuted (channels_last, transposed: TensorRef::stride); false, reading
  // nothing, for every other segment. Its storage record is read whole (and checked against its
  // CRC-32), its elements put in logical order once and kept for the next segment of it.
  Result<bool> permuted_segment(const Source& src, const Segment& s, Component c, int64_t from, int64_t to,
                                const ByteSink& sink) {
    OPTSTATE_ASSIGN_OR_RETURN(auto found, segment_tensor(src, s, c));
    const auto [pi, t, iw] = found;
    if (!t->permuted()) return false;
    const int64_t elem = dtype_size(t->dtype);
    const int64_t numel = *checked_numel(t->shape);
    ParsedItem::Record& rec = pi->storages.at(t->storage_key);
    if (permuted_.pi != pi || permuted_.key != t->storage_key) {
      if (rec.size > kMaxPermutedBytes)
        return corrupt(fmt::format("{}: a tensor stored permuted (strides {}) in a storage of {} bytes; up to {} are "
                                   "read", iw, fmt::join(t->stride, ", "), rec.size, kMaxPermutedBytes));
      std::vector<std::byte> record(rec.size);
      OPTSTATE_RETURN_IF_ERROR(pi->file->read_at(rec.at, record).with_context(iw));
      if (crc_due(rec, rec.at, rec.size))
        OPTSTATE_RETURN_IF_ERROR(crc_result(src, s, c, rec, zip::crc32(record, rec.running), rec.size));
      permuted_.bytes.resize(static_cast<size_t>(numel * elem));
      to_logical_order(*t, elem, std::span(record).subspan(static_cast<size_t>(t->offset * elem), permuted_.bytes.size()),
                       permuted_.bytes);
      permuted_.pi = pi;
      permuted_.key = t->storage_key;
    }
    OPTSTATE_RETURN_IF_ERROR(sink_pieces(std::span<const std::byte>(permuted_.bytes)
                                             .subspan(static_cast<size_t>((s.local + from) * elem),
                                                      static_cast<size_t>((to - from) * elem)),
                                         sink));
    return true;
  }

  // Where a segment's first element lies: (file, byte offset, element size, its storage's record).
  Result<std::tuple<const InputFile*, uint64_t, int64_t, ParsedItem::Record*>> segment_source(const Source& src,
                                                                                              const Segment& s,
                                                                                              Component c) {
    OPTSTATE_ASSIGN_OR_RETURN(auto found, segment_tensor(src, s, c));
    const auto [pi, t, iw] = found;
    OPTSTATE_RETURN_IF_ERROR(require_contiguous(*t, iw));
    const int64_t elem = dtype_size(t->dtype);
    ParsedItem::Record& rec = pi->storages.at(t->storage_key);
    const uint64_t at = rec.at + static_cast<uint64_t>((t->offset + s.local) * elem);
    return std::tuple{static_cast<const InputFile*>(pi->file), at, elem, &rec};
  }

  // The tensor a segment reads from, checked to be the item's kind and dtype and to hold the
  // segment: (its item, the tensor, a name for errors).
  Result<std::tuple<ParsedItem*, const TensorRef*, std::string>> segment_tensor(const Source& src, const Segment& s,
                                                                                 Component c) {
    const bool pair = src.absmax_item != nullptr;  // 8-bit as plain codes and absmax items
    const ItemMeta& im = in_absmax_item(src, c) ? *src.absmax_item : *src.item;
    const std::string& key = item_key(src, c);
    const ChunkMeta& ch = item_chunk(src, s, c);
    const std::string iw = fmt::format("{}: item '{}' chunk at {}", dir_.string(), key, format_shape(ch.offsets));
    OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pi, item(key, ch.offsets));
    const TensorRef* t = nullptr;
    if (pi->payload.kind == Payload::Kind::kTensor && (pair || (!src.eight && c == Component::kValues)))
      t = &pi->payload.tensor;
    if (pi->payload.kind == Payload::Kind::kOptimState8bit && src.eight && !pair)
      t = c == Component::kAbsmax ? &pi->payload.scale : c == Component::kCodes ? &pi->payload.codes : nullptr;
    if (!t) return corrupt(iw + ": holds a different kind of tensor than the item's first chunk");
    if ((!src.eight || pair) && t->dtype != im.dtype)
      return corrupt(fmt::format("{}: holds {} data, the metadata says {}", iw, dtype_name(t->dtype),
                                 dtype_name(im.dtype)));
    const int64_t numel = *checked_numel(t->shape);
    if (s.local + s.count > numel)
      return corrupt(fmt::format("{}: holds {} elements, the chunk needs {}", iw, numel, s.local + s.count));
    return std::tuple{pi, t, iw};
  }

  Status init() {
    const std::string where = dir_.string();
    if (std::string note = zarr_ ? std::string() : two_dcp_note(dir_); !note.empty())
      value_notes_.push_back(std::move(note));
    // Storage locations: inside the directory and inside their files, before anything is read.
    for (const auto& [k, loc] : md_.storage) {
      const std::string iw = fmt::format("{}: item '{}'", where, k.first);
      OPTSTATE_RETURN_IF_ERROR(check_transforms(loc, iw));
      OPTSTATE_ASSIGN_OR_RETURN(const InputFile* f, file(loc.relative_path, iw));
      if (loc.offset > f->size() || loc.length > f->size() - loc.offset)
        return corrupt(fmt::format("{}: bytes [{}, {}) lie beyond the end of {} ({} bytes)", iw, loc.offset,
                                   loc.offset + loc.length, f->path().string(), f->size()));
    }
    for (const auto& [key, im] : md_.items) {
      if (im.is_tensor) {
        for (const auto& ch : im.chunks)
          if (!md_.storage.count({key, ch.offsets}))
            return corrupt(fmt::format("{}: item '{}' chunk at {} has no storage record", where, key,
                                       format_shape(ch.offsets)));
      } else if (!md_.storage.count({key, {}})) {
        return corrupt(fmt::format("{}: item '{}' has no storage record", where, key));
      }
    }
    predecode();
    {
      const ParsedItem* common = nullptr;
      OPTSTATE_ASSIGN_OR_RETURN(auto megatron_common, read_megatron_common(common));
      if (megatron_common) return init_megatron(*megatron_common, *common);
      if (zarr_) return corrupt(where + ": zarr arrays without Megatron's metadata.json (sharded_backend zarr)");
    }
    // Sort the items by their place in the state dict. The optimizer's state sits under one key
    // path K ("optim" from get_state_dict, "optimizer" in torchtitan, "app.optimizers" in prime-rl,
    // whose Stateful sits under "app") in one of two layouts: nested (K.state.<fqn>.<entry>,
    // K.param_groups.<i>.<field>) or flattened (flatten_optimizer_state_dict=True:
    // K.state.<fqn>.<entry>, K.param_groups.<fqn>.<field>, no group index). The weights are
    // <P>.model.<fqn> (P: K without its last key), or <fqn> at the top level (torchtitan).
    using Path = std::vector<std::string>;
    std::map<Path, std::map<int, std::map<std::string, std::string>>> nested_groups;  // K -> group -> field
    std::map<Path, std::map<std::string, std::map<std::string, std::string>>> flat_groups;  // K -> fqn -> field
    std::map<Path, std::map<std::string, std::map<std::string, std::string>>> states;  // K -> fqn -> entry
    std::map<Path, std::map<std::string, std::string>> model_items;  // P -> fqn -> key
    std::map<std::string, std::string> top_items;                    // fqn -> key
    std::map<std::string, Path> item_path;                           // item -> its path
    std::set<Path> megatron_fsdp;  // K whose groups are Megatron-FSDP's param_to_group_meta
    auto split_last = [](const std::string& s) -> std::optional<std::pair<std::string, std::string>> {
      const auto dot = s.rfind('.');
      if (dot == std::string::npos || dot == 0 || dot + 1 == s.size()) return std::nullopt;
      return std::pair{s.substr(0, dot), s.substr(dot + 1)};
    };
    // `top`: the optimizer's state dict saved as the whole state dict (dcp.save(opt.state_dict()),
    // dcp.save(get_optimizer_state_dict(model, opt))): K is empty, tried only when no K was found
    // (a top-level key named "state" is otherwise some Stateful's, {"state": {"model", "optimizer"}}).
    auto classify = [&](bool top) -> Status {
      const size_t k_min = top ? 0 : 1;  // K's least length
      for (const auto& [key, im] : md_.items) {
        Path path;
        if (auto pl = md_.planner.find(key); pl != md_.planner.end()) path = pl->second;
        else path = split_key(key);
        if (path.empty()) return corrupt(fmt::format("{}: item '{}' has an empty path", where, key));
        item_path[key] = path;
        const size_t n = path.size();
        if (top && !(path[0] == "state" || path[0] == "param_groups" || path[0].rfind("state.", 0) == 0 ||
                     path[0].rfind("param_groups.", 0) == 0))
          continue;
        const Path head3(path.begin(), path.end() - std::min<size_t>(n, 3));  // K of K.<x>.<y>.<z>
        const Path head1(path.begin(), path.end() - 1);                       // K of K.<x>
        const std::string& last = path.back();
        if (n >= 4 + k_min && path[n - 2] == kBnbQuantState && path[n - 4] == "state") {
          // bitsandbytes' tensors nested one level down (K.state.<fqn>.__bnb_optimizer_quant_state__.state1):
          // spliced into the param's entries below, as its own key path leaves them without the planner's.
          states[Path(path.begin(), path.end() - 4)][path[n - 3] + "." + std::string(kBnbQuantState)][last] = key;
        } else if (n >= 3 + k_min && path[n - 3] == "state") {
          states[head3][path[n - 2]][last] = key;
        } else if (n >= 3 + k_min && path[n - 3] == "param_to_group_meta") {
          // Megatron-FSDP's optimizer (Megatron-LM --ckpt-format fsdp_dtensor: DistributedOptimizer's
          // sharded_param_state_fsdp_dtensor): each param its group's fields, as flattened ones
          flat_groups[head3][path[n - 2]][last] = key;
          megatron_fsdp.insert(head3);
        } else if (n >= 3 + k_min && path[n - 3] == "param_groups") {
          int g = -1;
          try {
            g = std::stoi(path[n - 2]);
          } catch (...) {
          }
          if (g < 0 || g > 100000)
            return corrupt(fmt::format("{}: item '{}' names param group '{}'", where, key, path[n - 2]));
          nested_groups[head3][g][last] = key;
        } else if (n >= 2 && path[n - 2] == "model") {  // before the flattened forms: a module may be named "state"
          model_items[Path(path.begin(), path.end() - 2)][last] = key;
        } else if (n >= 1 + k_min && last.rfind("state.", 0) == 0) {
          if (auto fe = split_last(last.substr(6))) states[head1][fe->first][fe->second] = key;
        } else if (n >= 1 + k_min && last.rfind("param_groups.", 0) == 0) {
          if (auto ff = split_last(last.substr(13))) flat_groups[head1][ff->first][ff->second] = key;
        } else if (n == 1 && im.is_tensor) {
          top_items[path[0]] = key;
        }
      }
      return Status::Ok();
    };
    OPTSTATE_RETURN_IF_ERROR(classify(false));
    if (nested_groups.empty() && flat_groups.empty() &&
        std::any_of(item_path.begin(), item_path.end(), [](const auto& kv) {
          const Path& p = kv.second;
          return (p.size() == 3 && p[0] == "param_groups") || (p.size() == 1 && p[0].rfind("param_groups.", 0) == 0);
        })) {
      states.clear();
      model_items.clear();
      top_items.clear();
      OPTSTATE_RETURN_IF_ERROR(classify(true));
    }
    const std::string bnb_suffix = "." + std::string(kBnbQuantState);
    for (auto& [k, fqns] : states)
      for (auto it = fqns.begin(); it != fqns.end();) {
        if (!it->first.ends_with(bnb_suffix)) {
          ++it;
          continue;
        }
        auto& into = fqns[it->first.substr(0, it->first.size() - bnb_suffix.size())];
        for (const auto& [ename, key] : it->second)
          if (!into.emplace(ename, key).second)
            return corrupt(fmt::format("{}: item '{}': '{}' both in '{}' and beside it", where, key, ename, kBnbQuantState));
        it = fqns.erase(it);
      }
    std::set<Path> optimizer_keys;
    for (const auto& [k, v] : nested_groups) optimizer_keys.insert(k);
    for (const auto& [k, v] : flat_groups) optimizer_keys.insert(k);
    if (optimizer_keys.empty()) {
      if (!states.empty())
        return corrupt(fmt::format("{}: optimizer state under '{}' without param_groups items", where,
                                   dotted(states.begin()->first)));
      return corrupt(fmt::format("{}: a DCP checkpoint without optimizer state (no <key>.param_groups items)", where));
    }
    if (optimizer_keys.size() > 1)
      return corrupt(fmt::format("{}: more than one optimizer state ('{}' and '{}'); optstate reads one", where,
                                 dotted(*optimizer_keys.begin()), dotted(*std::next(optimizer_keys.begin()))));
    const Path opt_key = *optimizer_keys.begin();
    if (nested_groups.count(opt_key) && flat_groups.count(opt_key))
      return corrupt(fmt::format("{}: '{}' mixes numbered and flattened (per-param) param_groups items", where,
                                 dotted(opt_key)));
    auto state_items = states[opt_key];  // a copy: numbered params are renamed below
    {
      const auto has_step = [](const auto& kv) { return kv.second.count("step") > 0; };
      const auto ng = nested_groups.find(opt_key);
      const auto fg = flat_groups.find(opt_key);
      group_step_ = std::none_of(state_items.begin(), state_items.end(), has_step) &&
                    ((ng != nested_groups.end() && std::any_of(ng->second.begin(), ng->second.end(), has_step)) ||
                     (fg != flat_groups.end() && std::any_of(fg->second.begin(), fg->second.end(), has_step)));
    }
    std::set<std::string> carried_weights;  // weight items of the params read
    // Items the canonical state holds (a DCP writer rewrites them); the rest is carried through by
    // convert DCP -> DCP (layout_.carried).
    std::set<std::string> consumed;
    auto consume_fields = [&](const std::map<std::string, std::string>& fields) {
      for (const auto& [field, key] : fields)
        if (kGroupFieldsRead.count(field)) consumed.insert(key);
    };
    auto lr_is_tensor = [&](const std::map<std::string, std::string>& fields) {
      auto lr = fields.find("lr");
      return lr != fields.end() && md_.items.at(lr->second).is_tensor;
    };
    layout_.dir = dir_;
    layout_.number = [this](const std::string& key) {
      return value_of(key, fmt::format("{}: item '{}'", dir_.string(), key));
    };
    layout_.optimizer_path = opt_key;
    layout_.item_order = md_.order;
    layout_.flattened = !nested_groups.count(opt_key);
    for (Path p = layout_.parent(); !model_items.count(layout_.model_parent()) && !p.empty();) {
      p.pop_back();
      if (model_items.count(p)) layout_.model_path = p;
    }
    std::map<std::string, std::string> weight_items = model_items[layout_.model_parent()];
    std::vector<std::optional<std::vector<std::string>>> param_names;  // numbered groups' param_names
    if (opt_key.size() == 1)
      for (const auto& [fqn, key] : top_items) weight_items.emplace(fqn, key);  // model.<fqn> first

    if (megatron_fsdp.count(opt_key)) {
      // Megatron-FSDP names the state as its model chunk's named_parameters() does, under every
      // wrapper (module.module.decoder...: the DDP adapter's, Megatron-FSDP's; Float16Module's one
      // more), the weights one or two wrappers less (their state_dict leaves some out): both read
      // without the leading 'module.' their names all share, as Megatron-Core 0.19's own
      // SwiGLU split matches keys without them (_strip_wrappers); never down to an empty name. Its
      // layout is not written back (a plain DCP is).
      const auto strip = [](auto& by_name) {
        size_t levels = 0;
        for (;; ++levels) {
          std::vector<std::string> names;
          for (const auto& kv : by_name) names.push_back(kv.first);
          if (!is_ddp_state_dict(names) || std::count(names.begin(), names.end(), "module.")) return levels;
          std::remove_reference_t<decltype(by_name)> out;
          for (auto& [name, v] : by_name) out.emplace(name.substr(7), std::move(v));
          by_name = std::move(out);
        }
      };
      const size_t state_levels = strip(flat_groups.at(opt_key));
      for (size_t i = 0; i < state_levels; ++i) {  // the state's names as the groups' (no group: refused)
        std::map<std::string, std::map<std::string, std::string>> out;
        for (auto& [name, v] : state_items) {
          if (name.rfind("module.", 0) != 0 || name.size() == 7)
            return corrupt(fmt::format("{}: param '{}' has state but no param_to_group_meta items", where, name));
          out.emplace(name.substr(7), std::move(v));
        }
        state_items = std::move(out);
      }
      const size_t weight_levels = strip(weight_items);
      layout_.megatron = true;
      value_notes_.push_back(fmt::format(
          "Megatron-FSDP's checkpoint (Megatron-LM --ckpt-format fsdp_dtensor): each param's group from "
          "'{}.param_to_group_meta'; params named without the wrappers' 'module.' ({} of the optimizer's, {} of the "
          "model's)",
          dotted(opt_key), state_levels, weight_levels));
    }

    // Param groups: hyperparameters and members.
    if (auto ng = nested_groups.find(opt_key); ng != nested_groups.end()) {
      int expect = 0;
      bool any_named = false, any_numbered = false;
      for (const auto& [g, fields] : ng->second) {
        if (g != expect++) return corrupt(fmt::format("{}: param group {} is missing", where, expect - 1));
        const std::string gw = fmt::format("{}: param group {}", where, g);
        ParamGroup pg;
        Plain8 q;
        OPTSTATE_RETURN_IF_ERROR(parse_group(fields, gw, pg, q));
        layout_.adamw_flags.push_back(group_flags(fields));
        layout_.group_extras.push_back(group_extras_of(fields, dotted(opt_key)));
        auto params = fields.find("params");
        if (params == fields.end()) return corrupt(gw + ": no params");
        OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pi, item(params->second, {}));
        auto names = as_string_list(pi->pickle, pi->pickle.root());
        if (auto numbers = names ? std::nullopt : as_int_list(pi->pickle, pi->pickle.root())) {
          // optimizer.state_dict() saved as it is: params by number, the state keyed by them
          names.emplace();
          for (int64_t n : *numbers) {
            if (n < 0) return corrupt(fmt::format("{}: param number {}", gw, n));
            names->push_back(std::to_string(n));
          }
          layout_.numbered_members.resize(static_cast<size_t>(g));  // earlier groups: empty
          layout_.numbered_members.push_back(*numbers);
          any_numbered = true;
        } else if (names && !names->empty()) {
          any_named = true;
        }
        if (!names) return corrupt(gw + ": params is neither a list of names (get_state_dict's FQNs) nor of numbers");
        if (any_named && any_numbered) return corrupt(gw + ": params named in one group and numbered in another");
        layout_.numbered = any_numbered;
        // An optimizer built from named_parameters() keeps its params' names beside their numbers.
        std::optional<std::vector<std::string>> given;
        if (auto pn = fields.find("param_names"); pn != fields.end() && any_numbered) {
          OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pni, item(pn->second, {}));
          given = as_string_list(pni->pickle, pni->pickle.root());
          if (!given || given->size() != names->size())
            return corrupt(fmt::format("{}: param_names is not a list of {} names", gw, names->size()));
        }
        if (names->empty()) given.emplace();  // nothing to name
        param_names.push_back(std::move(given));
        pg.params = *names;
        meta_.groups.push_back(std::move(pg));
        plain8_.push_back(q);
        consume_fields(fields);
      }
    } else {
      // Flattened: each param carries its group's fields; params with equal fields (hyperparameters,
      // 8-bit layout, switches and other plain keys, such as a layer's lr_scale) form one group, in
      // fqn order: torch's groups as far as the file tells them apart.
      std::set<std::string> unkept;  // extras named once each, not per param
      for (const auto& [fqn, fields] : flat_groups.at(opt_key)) {
        ParamGroup pg;
        Plain8 q;
        OPTSTATE_RETURN_IF_ERROR(parse_group(fields, fmt::format("{}: param_groups of '{}'", where, fqn), pg, q));
        AdamWFlags flags = group_flags(fields);
        GroupExtras extras = group_extras_of(fields, dotted(opt_key), &unkept);
        size_t g = 0;
        while (g < meta_.groups.size() && !(same_hyper(meta_.groups[g].hyper, pg.hyper) && plain8_[g].block == q.block &&
                                             plain8_[g].signed_map == q.signed_map &&
                                             plain8_[g].unsigned_map == q.unsigned_map &&
                                             layout_.adamw_flags[g] == flags &&
                                             same_extras(layout_.group_extras[g], extras)))
          ++g;
        if (g == meta_.groups.size()) {
          meta_.groups.push_back(std::move(pg));
          plain8_.push_back(q);
          layout_.adamw_flags.push_back(std::move(flags));
          layout_.group_extras.push_back(std::move(extras));
        }
        meta_.groups[g].params.push_back(fqn);
      }
      for (const auto& [fqn, entries] : state_items)
        if (!flat_groups.at(opt_key).count(fqn))
          return corrupt(fmt::format("{}: param '{}' has state but no param_groups items", where, fqn));
    }
    if (meta_.groups.empty()) return corrupt(fmt::format("{}: no param_groups items", where));
    if (layout_.numbered) {
      layout_.numbered_members.resize(meta_.groups.size());  // later empty groups
      layout_.numbers_kept = true;  // until name_numbered renames them
      OPTSTATE_RETURN_IF_ERROR(name_numbered(model_items[layout_.model_parent()], param_names, state_items, weight_items));
    }

    // Params: shape, dtype, step and entries.
    bool any8 = false;
    size_t shapeless = 0;  // listed params without state or weights
    std::set<std::string> listed;  // every param a group lists
    for (size_t g = 0; g < meta_.groups.size(); ++g) {
      std::vector<std::string> kept;
      for (const std::string& fqn : meta_.groups[g].params) {
        listed.insert(fqn);
        const std::string pw = fmt::format("{}: param '{}'", where, fqn);
        auto st = state_items.find(fqn);
        auto mo = weight_items.find(fqn);
        const ItemMeta* shape_src = st != state_items.end() ? first_moment(st->second) : nullptr;
        if (!shape_src && mo != weight_items.end()) shape_src = &md_.items.at(mo->second);
        if (!shape_src) {
          // State without its first moment: refused, not passed over (its items would be carried
          // by a DCP -> DCP write as the state of a param no group lists).
          if (st != state_items.end() && !st->second.empty()) {
            std::vector<std::string> names;
            for (const auto& [ename, key] : st->second) names.push_back(ename);
            return corrupt(fmt::format("{}: state ({}) without 'exp_avg' (AdamW keeps exp_avg and exp_avg_sq)", pw,
                                       fmt::join(names, ", ")));
          }
          ++shapeless;  // no state and no weights: nothing to carry, and no shape to give it
          continue;
        }
        if (meta_.params.count(fqn)) return corrupt(pw + ": listed in two param groups");
        ParamState ps;
        ps.shape = tensor_shape(*shape_src);
        ps.group = static_cast<int>(g);
        if (mo != weight_items.end()) {
          const ItemMeta& w = md_.items.at(mo->second);
          if (!w.is_tensor || tensor_shape(w) != ps.shape)
            return corrupt(fmt::format("{}: model weight's shape {} differs from its state's {}", pw,
                                       w.is_tensor ? format_shape(tensor_shape(w)) : "(not a tensor)",
                                       format_shape(ps.shape)));
          ps.param_dtype = w.dtype;
          OPTSTATE_RETURN_IF_ERROR(add_entry(fqn, kParam, mo->second, ps, any8));
          carried_weights.insert(mo->second);
          layout_.weights[fqn] = ItemName{mo->second, planner_path(mo->second)};
        }
        const bool lr_tensor = layout_.flattened ? lr_is_tensor(flat_groups.at(opt_key).at(fqn))
                                                 : lr_is_tensor(nested_groups.at(opt_key).at(static_cast<int>(g)));
        if (st != state_items.end()) {
          for (const char* m : {kExpAvg, kExpAvgSq, kMaxExpAvgSq})
            if (st->second.count(m) && st->second.count(std::string(m) + "_codes"))
              return corrupt(fmt::format("{}: '{}' is both dense and 8-bit (codes and absmax)", pw, m));
          for (const auto& [ename, key] : st->second) {
            if (ename == "step") {
              OPTSTATE_ASSIGN_OR_RETURN(double step, value_of(key, pw + " step"));
              if (!(step >= 0 && step < 9.2e18)) return corrupt(pw + ": step out of range");
              ps.step = static_cast<int64_t>(step);
              consumed.insert(key);
              continue;
            }
            if (const auto base = moment_of(ename, "_codes")) {
              auto absmax = st->second.find(*base + "_absmax");
              if (absmax == st->second.end())
                return corrupt(fmt::format("{}: '{}' without '{}_absmax'", pw, ename, *base));
              if (tensor_shape(md_.items.at(key)) != ps.shape)
                return corrupt(fmt::format("{}: '{}' has another shape", pw, ename));
              OPTSTATE_RETURN_IF_ERROR(add_plain8(fqn, *base, key, absmax->second, plain8_[g], ps, any8));
              consumed.insert(key);
              consumed.insert(absmax->second);
              continue;
            }
            if (const auto base = moment_of(ename, "_absmax")) {
              if (!st->second.count(*base + "_codes"))
                return corrupt(fmt::format("{}: '{}' without '{}_codes'", pw, ename, *base));
              continue;  // read with its codes
            }
            if (const auto moment = bnb_moment(ename)) {
              if (st->second.count(*moment))
                return corrupt(fmt::format("{}: '{}' twice (as '{}' and bitsandbytes' '{}')", pw, *moment, *moment, ename));
              if (tensor_shape(md_.items.at(key)) != ps.shape) return corrupt(fmt::format("{}: '{}' has another shape", pw, ename));
              OPTSTATE_RETURN_IF_ERROR(add_bnb(fqn, ename, st->second, ps, any8, consumed));
              continue;
            }
            if (const auto of = bnb_part_of(ename)) {
              if (!st->second.count(*of)) return corrupt(fmt::format("{}: '{}' without '{}'", pw, ename, *of));
              continue;  // read with its state tensor
            }
            if (ename != kExpAvg && ename != kExpAvgSq && ename != kMaxExpAvgSq) {
              // Per-param state the canonical state has no place for (bitsandbytes' gnorm_vec, another
              // optimizer's buffers): named, and carried through by DCP -> DCP.
              ++not_read_[fmt::format("{}.state.*.{}", dotted(opt_key), ename)];
              continue;
            }
            if (tensor_shape(md_.items.at(key)) != ps.shape) return corrupt(fmt::format("{}: '{}' has another shape", pw, ename));
            OPTSTATE_RETURN_IF_ERROR(add_entry(fqn, ename, key, ps, any8, lr_tensor));
            consumed.insert(key);
          }
          if (!ps.entries.count(kExpAvg) || !ps.entries.count(kExpAvgSq)) {
            if (st->second.count("state1") && !st->second.count("state2"))
              return corrupt(pw + ": bitsandbytes' 'state1' without 'state2': a one-state optimizer (Lion, SGD with "
                                  "momentum, RMSprop, Adagrad), not AdamW");
            if (ps.entries.size() > (ps.entries.count(kParam) ? 1u : 0u))
              return corrupt(fmt::format("{}: no '{}' (AdamW keeps exp_avg and exp_avg_sq)", pw,
                                         ps.entries.count(kExpAvg) ? kExpAvgSq : kExpAvg));
          }
        }
        if (group_step_ && st != state_items.end()) {  // one without state never stepped: 0
          const auto& fields = layout_.flattened ? flat_groups.at(opt_key).at(fqn)
                                                 : nested_groups.at(opt_key).at(static_cast<int>(g));
          if (const auto gs = fields.find("step"); gs != fields.end()) {
            OPTSTATE_ASSIGN_OR_RETURN(double step, value_of(gs->second, pw + " its group's step"));
            if (!(step >= 0 && step < 9.2e18 && step == std::floor(step)))
              return corrupt(pw + ": its group's step is not a count");
            ps.step = static_cast<int64_t>(step);
            consumed.insert(gs->second);
          }
        }
        meta_.params.emplace(fqn, std::move(ps));
        kept.push_back(fqn);
        if (layout_.flattened) consume_fields(flat_groups.at(opt_key).at(fqn));
        if (lr_tensor) layout_.tensor_lr.insert(fqn);
      }
      meta_.groups[g].params = std::move(kept);
    }
    for (const auto& [fqn, entries] : state_items)
      if (!listed.count(fqn))
        return corrupt(fmt::format("{}: param '{}' has state but no param group lists it", where, fqn));
    if (shapeless > 0)
      notes_.push_back(fmt::format("{} param{} without state or weights (never stepped: no shape in the checkpoint)",
                                   shapeless, shapeless == 1 ? "" : "s"));
    meta_.kind = any8 ? "adamw8bit" : "adamw";
    // The model dict's other tensors beside the weights (buffers, a tied weight's second name,
    // frozen params' weights), for model_tensors(): a torch.save write puts them in its model dict;
    // a DCP -> DCP write carries them as items. Where the weights are at the top level (torchtitan
    // flattens the model's state dict there), the other top-level tensors are the model's too
    // (torchtitan's llama keeps its complex64 rotary table `freqs_cis` as a persistent buffer).
    // Bytes items (a module's extra state) stay counted among what is not read.
    std::vector<std::pair<std::string, std::string>> candidates;  // name -> item key
    if (const auto mi = model_items.find(layout_.model_parent()); mi != model_items.end())
      candidates.assign(mi->second.begin(), mi->second.end());
    const bool weights_at_top = opt_key.size() == 1 && std::any_of(top_items.begin(), top_items.end(), [&](const auto& kv) {
                                  return carried_weights.count(kv.second) > 0;
                                });
    if (weights_at_top) candidates.insert(candidates.end(), top_items.begin(), top_items.end());
    std::set<std::string> exposed, exposed_names;
    for (const auto& [item_name, key] : candidates) {
      const ItemMeta& im = md_.items.at(key);
      // numbered (the model's own state_dict beside it): named as the params are (a DDP model's
      // without 'module.', a compiled one's without '_orig_mod.')
      const std::string name = layout_.numbered ? torch_param_fqn(item_name, model_ddp_prefix_) : item_name;
      if (carried_weights.count(key) || consumed.count(key) || meta_.params.count(name) || exposed_names.count(name) ||
          !im.is_tensor || im.chunks.empty())
        continue;
      // Only plain tensors of the item's dtype (its first chunk read to tell): a tensor subclass
      // optstate does not read (QLoRA's NF4Tensor base weights), or an item that does not parse,
      // stays among what is not read, carried by DCP -> DCP as it is.
      const auto first = item(key, im.chunks[0].offsets);
      if (!first.ok() || (*first)->payload.kind != Payload::Kind::kTensor || (*first)->payload.tensor.dtype != im.dtype)
        continue;
      const std::string iw = fmt::format("{}: item '{}'", where, key);
      const auto numel = checked_numel(tensor_shape(im));
      if (!numel.ok()) return corrupt(fmt::format("{}: {}", iw, numel.status().message()));
      Source src;
      src.key = key;
      src.item = &im;
      for (size_t k = 0; k < im.chunks.size(); ++k)
        OPTSTATE_RETURN_IF_ERROR(item_segments(im, k, src.values, iw));
      OPTSTATE_RETURN_IF_ERROR(src.values.seal(*numel, iw));
      model_tensors_.push_back({name, im.dtype, tensor_shape(im)});
      model_sources_.push_back(std::move(src));
      exposed.insert(key);
      exposed_names.insert(name);
    }
    // What the checkpoint holds beyond the optimizer and the weights it carries (torchtitan's
    // train_state, lr_scheduler, dataloader; a module's extra state), by key: the top-level one, or for a
    // state nested under keys (prime-rl's "app"), the one beside the optimizer's ("app.scheduler").
    const size_t depth = opt_key.size();
    for (const auto& [key, path] : item_path) {
      const bool under_optimizer = path.size() > depth && std::equal(opt_key.begin(), opt_key.end(), path.begin());
      if (under_optimizer || carried_weights.count(key) || exposed.count(key)) continue;
      ++not_read_[dotted(Path(path.begin(), path.begin() + static_cast<std::ptrdiff_t>(std::min(depth, path.size()))))];
    }
    for (const auto& [key, im] : md_.items) {
      if (consumed.count(key) || carried_weights.count(key)) continue;
      CarriedItem c{ItemName{key, planner_path(key)}, im, {}};
      if (im.is_tensor)
        for (const ChunkMeta& ch : im.chunks) c.pieces.push_back(md_.storage.at({key, ch.offsets}));
      else
        c.pieces.push_back(md_.storage.at({key, {}}));
      layout_.carried.push_back(std::move(c));
    }
    // Composer's DecoupledAdamW (under state.optimizers.DecoupledAdamW, as Composer keys its
    // optimizers by class) decays each weight by weight_decay * lr / initial_lr a step, AdamW by
    // weight_decay * lr: the same update as AdamW's with weight_decay / initial_lr at every lr,
    // read so (as the torch.save reader reads Composer's file); a DCP write in this layout writes
    // DecoupledAdamW's back (layout_.decoupled_decay).
    if (opt_key.size() >= 2 && opt_key[opt_key.size() - 2] == "optimizers" && opt_key.back() == "DecoupledAdamW") {
      if (layout_.group_extras.size() != meta_.groups.size())
        return corrupt(fmt::format("{}: '{}': {} param groups, {} groups' fields", where, dotted(opt_key),
                                   meta_.groups.size(), layout_.group_extras.size()));
      for (size_t g = 0; g < meta_.groups.size(); ++g) {
        double& wd = meta_.groups[g].hyper.weight_decay;
        std::optional<double> initial;
        for (const auto& [field, v] : layout_.group_extras[g])
          if (field == "initial_lr" && (v.kind == GroupValue::Kind::kFloat || v.kind == GroupValue::Kind::kTensor))
            initial = v.f;
          else if (field == "initial_lr" && v.kind == GroupValue::Kind::kInt)
            initial = static_cast<double>(v.i);
        SourceLayout::DecoupledDecay d{wd, wd, initial.value_or(0)};
        OPTSTATE_ASSIGN_OR_RETURN(d.read, adamw_decay_of_decoupled(wd, initial, g, fmt::format("{}: param group {}", where, g),
                                                                   value_notes_));
        wd = d.read;
        layout_.decoupled_decay.push_back(d);
      }
    }
    OPTSTATE_RETURN_IF_ERROR(find_beside());
    return check_structure(meta_, false).with_context(where);
  }

  const SourceLayout& layout() const { return layout_; }

 private:
  static constexpr const char* kMegatronCommon = "common.pt";
  static constexpr const char* kMegatronCommonItem = "common_state/shard_0_1";
  std::string common_name_ = "common.pt";  // where the common state was read from, for messages
  bool common_in_item_ = false;            // read from the common_state item (0.19 on), not common.pt
  // The optimizer keeps its step in each param group, not per param (TransformerEngine's and apex's
  // FusedAdam: Megatron-FSDP's fsdp_dtensor groups, a get_state_dict of theirs): no param's state
  // holds a 'step' and some group does. Each param's step is then its group's, not an extra key.
  bool group_step_ = false;

  // Megatron's common state (common.pt, or from Megatron-Core 0.19 the common_state item), where the
  // folder's metadata.json names its torch_dist backend (megatron.h); nullopt for any other DCP.
  // `common`: the parsed common state (its step's storage).
  Result<std::optional<megatron::Common>> read_megatron_common(const ParsedItem*& common) {
    const std::string where = dir_.string();
    std::error_code ec;
    if (!fs::is_regular_file(dir_ / "metadata.json", ec)) return std::optional<megatron::Common>{};
    OPTSTATE_ASSIGN_OR_RETURN(const InputFile* jf, file("metadata.json", where + ": metadata.json"));
    if (jf->size() > (uint64_t{1} << 20)) return std::optional<megatron::Common>{};  // no backend's own
    std::string text(jf->size(), '\0');
    OPTSTATE_RETURN_IF_ERROR(
        jf->read_at(0, std::as_writable_bytes(std::span(text.data(), text.size()))).with_context(where + "/metadata.json"));
    const std::string backend = megatron::sharded_backend(text);
    if (!(backend == (zarr_ ? "zarr" : "torch_dist"))) {
      if (!zarr_ && backend != "zarr") return std::optional<megatron::Common>{};  // a plain DCP beside some JSON
      return corrupt(fmt::format("{}: metadata.json names Megatron's '{}' backend, but the folder holds {}", where,
                                 printable(backend), zarr_ ? "zarr arrays" : "a DCP (.metadata)"));
    }
    ParsedItem* pi = nullptr;
    pickle::Ref root = pickle::kNoRef;
    if (fs::is_regular_file(dir_ / kMegatronCommon, ec)) {
      if (md_.items.count(kMegatronCommon))
        return corrupt(fmt::format("{}: an item named '{}' beside Megatron's common.pt", where, kMegatronCommon));
      OPTSTATE_ASSIGN_OR_RETURN(const InputFile* cf, file(kMegatronCommon, where + ": common.pt"));
      // read as a bytes item spanning the whole file (a torch.save archive, as DCP's bytes items are)
      md_.storage[{kMegatronCommon, {}}] = StorageLoc{kMegatronCommon, 0, cf->size(), {}, std::nullopt};
      OPTSTATE_ASSIGN_OR_RETURN(pi, item(kMegatronCommon, {}, 64));
      if (pi->payload.kind != Payload::Kind::kValue) return corrupt(where + "/common.pt: not a dict");
      root = pi->pickle.root();
      common_name_ = "common.pt";
    } else {
      // Megatron-Core 0.19 on: the same dict in the DCP, ShardedObject("common_state") saved as
      // torch.save([dict]) (a bytes item)
      if (zarr_)
        return corrupt(fmt::format("{}: a Megatron checkpoint (metadata.json: {}) without its common.pt", where, backend));
      const auto it = md_.items.find(kMegatronCommonItem);
      if (it == md_.items.end() || it->second.is_tensor)
        return corrupt(fmt::format("{}: a Megatron checkpoint (metadata.json: {}) without its common state (no "
                                   "common.pt, nor Megatron-Core 0.19's '{}' item)",
                                   where, backend, kMegatronCommonItem));
      common_name_ = fmt::format("item '{}'", kMegatronCommonItem);
      common_in_item_ = true;
      OPTSTATE_ASSIGN_OR_RETURN(pi, item(kMegatronCommonItem, {}, 64));
      const pickle::Ref r = pi->payload.kind == Payload::Kind::kValue ? pi->pickle.root() : pickle::kNoRef;
      const pickle::Value* one = r == pickle::kNoRef ? nullptr : &pi->pickle.at(r);
      if (!one || one->kind != pickle::Kind::kList || one->items.size() != 1)
        return corrupt(fmt::format("{}: {}: not [the common state dict] (Megatron-Core saves it as a list of one)",
                                   where, common_name_));
      root = one->items[0];
    }
    if (pi->pickle.dict_get(root, "optimizer") == pickle::kNoRef) {
      // verl's Megatron checkpoints keep the model, the optimizer and the RNG state in three of
      // these: global_step_N/actor/{model,optimizer,extra}/dist_ckpt/
      const fs::path verl_optimizer = dir_.parent_path().parent_path() / "optimizer" / "dist_ckpt";
      if (dir_.parent_path().filename() == "model" && fs::is_directory(verl_optimizer, ec))
        return corrupt(fmt::format("{}: a Megatron checkpoint of the model alone (verl's model/dist_ckpt/); its "
                                   "optimizer state is in {}: pass that directory",
                                   where, verl_optimizer.string()));
    }
    OPTSTATE_ASSIGN_OR_RETURN(megatron::Common c, megatron::interpret_common(pi->pickle, fmt::format("{}: {}", where,
                                                                                                   common_name_),
                                                                               root, common_name_));
    common = pi;
    return std::optional<megatron::Common>(std::move(c));
  }

  // Megatron's items (megatron.h): optimizer.state.<entry>.<key> per sharded key (prefixed
  // chained_<i>. for the i-th of a chain of optimizers), the model's weights under <key>; the groups
  // and the step from common.pt. Groups keep no members: one group takes every param of its
  // optimizer, Megatron-Core's two standard ones (wd_mult 1 and 0, alike otherwise) take them by its
  // rule (megatron::standard_no_decay); other groupings are refused.
  struct MegatronPlace {
    int64_t step = 0;
    size_t first_group = 0, groups = 1, decay = 0, no_decay = 0;  // no_decay, decay: within its groups
  };
  Result<MegatronPlace> place_megatron_optimizer(const megatron::Optimizer& o, const ParsedItem& common,
                                                 const std::string& ow) {
    MegatronPlace out;
    if (o.group_step) {
      out.step = static_cast<int64_t>(*o.group_step);
    } else if (o.step_ref != pickle::kNoRef) {
      OPTSTATE_ASSIGN_OR_RETURN(const double s, element_of(common, o.step_ref, ow + ": common_step"));
      if (!(s >= 0 && s < 9.2e18)) return corrupt(ow + ": common_step out of range");
      out.step = static_cast<int64_t>(s);
    }
    out.groups = o.groups.size();
    if (out.groups == 2) {
      out.no_decay = o.groups[0].wd_mult == 0 ? 0 : 1;
      out.decay = 1 - out.no_decay;
      auto without_wd_mult = [](const GroupExtras& e) {
        GroupExtras kept;
        for (const auto& kv : e)
          if (kv.first != "wd_mult") kept.push_back(kv);
        return kept;
      };
      Hyperparameters a = o.groups[0].hyper, b = o.groups[1].hyper;
      a.weight_decay = b.weight_decay = 0;
      if (!(o.groups[out.no_decay].wd_mult == 0 && o.groups[out.decay].wd_mult != 0 && a == b &&
            o.groups[0].flags == o.groups[1].flags &&
            same_extras(without_wd_mult(o.groups[0].extras), without_wd_mult(o.groups[1].extras))))
        return unsupported(ow + ": Megatron's two param groups are not Megatron-Core's standard ones (wd_mult 1 "
                                "and 0, alike otherwise), and Megatron saves no group's members");
    } else if (out.groups != 1) {
      return unsupported(fmt::format("{}: Megatron's {} param groups (decoupled lr, per-layer overrides): Megatron "
                                     "saves no group's members, which optstate tells only for one group or "
                                     "Megatron-Core's two standard ones",
                                     ow, out.groups));
    }
    out.first_group = meta_.groups.size();
    for (const megatron::Group& g : o.groups) {
      ParamGroup pg;
      pg.hyper = g.hyper;
      meta_.groups.push_back(std::move(pg));
      plain8_.push_back(Plain8{});
      layout_.adamw_flags.push_back(g.flags);
      layout_.group_extras.push_back(g.extras);
    }
    return out;
  }

  Status init_megatron(megatron::Common c, const ParsedItem& common) {
    const std::string where = dir_.string();
    layout_.dir = dir_;
    layout_.megatron = true;
    std::error_code ec;
    if (!zarr_ && fs::is_regular_file(dir_ / megatron::kIntegrityManifest, ec))
      value_notes_.push_back(fmt::format("{} (Megatron-LM's --verify-integrity): each file's SHA-256, which validate "
                                         "checks",
                                         megatron::kIntegrityManifest));
    if (zarr_)
      value_notes_.push_back("Megatron-Core's zarr backend (metadata.json: sharded_backend zarr): each sharded key a "
                             "zarr array of its whole tensor, its chunks read raw (zarr keeps no checksums)");
    layout_.optimizer_path = {"optimizer"};
    layout_.item_order = md_.order;
    std::map<std::string, std::map<std::string, std::string>> states;  // sharded key -> entry -> item
    std::map<std::string, size_t> chain_of;                              // sharded key -> its optimizer
    std::set<std::string> with_state;                                    // sharded keys of state items
    std::set<std::string> dp_items;  // dp_reshardable's own items (its buckets, groups), read through states
    OPTSTATE_RETURN_IF_ERROR(init_dp_reshardable(c, states, chain_of, dp_items));
    for (const auto& kv : states) with_state.insert(kv.first);
    std::vector<MegatronPlace> places;
    for (size_t i = 0; i < c.optimizers.size(); ++i) {
      const std::string ow = fmt::format("{}: {}{}", where, common_name_,
                                         c.chained ? fmt::format(" (optimizer {})", i) : std::string());
      OPTSTATE_ASSIGN_OR_RETURN(MegatronPlace place, place_megatron_optimizer(c.optimizers[i], common, ow));
      places.push_back(place);
    }
    bool any_unprefixed = false;  // a chain's item without its chained_<i>. prefix
    std::vector<std::pair<std::string, std::string>> beside_main;  // (param, its model weight item) with main params
    for (const auto& [key, im] : md_.items)
      if (auto si = megatron::state_item(key)) with_state.insert(si->key);
    for (const auto& [key, im] : md_.items) {
      if (dp_items.count(key) || (key == kMegatronCommonItem && common_in_item_)) continue;
      if (auto si = megatron::state_item(key)) {
        const std::string iw = fmt::format("{}: item '{}'", where, key);
        if (!c.chained && si->chain >= 0) return corrupt(fmt::format("{}: prefixed chained_<i>. but {} holds one optimizer", iw, common_name_));
        std::optional<size_t> unprefixed;
        if (c.chained && si->chain < 0) {
          if (c.avoid_prefix) unprefixed = megatron::unprefixed_chain(c, si->key);
          any_unprefixed = true;
          if (!unprefixed)
            return unsupported(iw + ": a chain of optimizers' item without the chained_<i>. prefix (saved with "
                                    "chained_optim_avoid_prefix) where the chain is not one dense optimizer and "
                                    "one of MoE experts: which optimizer holds it is not in the checkpoint");
        }
        const size_t chain = unprefixed ? *unprefixed : si->chain < 0 ? 0 : static_cast<size_t>(si->chain);
        if (chain >= c.optimizers.size())
          return corrupt(fmt::format("{}: optimizer {} of a chain of {}", iw, chain, c.optimizers.size()));
        if (chain_of.emplace(si->key, chain).first->second != chain)
          return corrupt(fmt::format("{}: param '{}' has state in two optimizers of the chain", iw, si->key));
        if (!states[si->key].emplace(si->entry, key).second)
          return corrupt(fmt::format("{}: '{}' of param '{}' twice", iw, si->entry, si->key));
      } else if (!(im.is_tensor && with_state.count(key))) {  // weights: below
        const auto shard = key.find("/shard_");  // a ShardedObject's parts: one name
        ++not_read_[shard == std::string::npos ? key : key.substr(0, shard)];
      }
    }
    for (const auto& [key, entries] : states) {
      const std::string pw = fmt::format("{}: param '{}'", where, key);
      const auto first = entries.find(kExpAvg);
      if (first == entries.end()) {
        std::vector<std::string> names;
        for (const auto& kv : entries) names.push_back(kv.first);
        return corrupt(fmt::format("{}: state ({}) without 'exp_avg' (AdamW keeps exp_avg and exp_avg_sq)", pw,
                                   fmt::join(names, ", ")));
      }
      const ItemMeta& shape_src = md_.items.at(first->second);
      ParamState ps;
      ps.shape = tensor_shape(shape_src);
      const MegatronPlace& place = places.at(chain_of.at(key));
      ps.step = place.step;
      ps.group = static_cast<int>(place.first_group + (place.groups == 1                                ? 0
                                                       : megatron::standard_no_decay(key, shape_src) ? place.no_decay
                                                                                                      : place.decay));
      bool any8 = false;
      // The optimizer's fp32 main params where it keeps them (the distributed optimizer's 'param',
      // the mixed-precision one's 'fp32_param'), else the model's weights.
      std::string weight_key;
      for (const char* main : {"param", "fp32_param"})
        if (const auto m = entries.find(main); m != entries.end()) {
          if (!weight_key.empty()) return corrupt(pw + ": both 'param' and 'fp32_param'");
          weight_key = m->second;
        }
      if (const auto w = md_.items.find(key); w != md_.items.end() && w->second.is_tensor) {
        if (tensor_shape(w->second) != ps.shape)
          return corrupt(fmt::format("{}: model weight's shape {} differs from its state's {}", pw,
                                     format_shape(tensor_shape(w->second)), format_shape(ps.shape)));
        if (weight_key.empty()) {
          weight_key = key;
        } else {
          ++not_read_[fmt::format("the model's {} weights, the optimizer's fp32 main params read instead",
                                  dtype_name(w->second.dtype))];
          if (!dp_items.count(weight_key)) beside_main.emplace_back(key, key);  // dp_reshardable's: placed so
        }
      }
      if (!weight_key.empty()) {
        const ItemMeta& w = md_.items.at(weight_key);
        if (!w.is_tensor || tensor_shape(w) != ps.shape)
          return corrupt(fmt::format("{}: its weights' shape {} differs from its state's {}", pw,
                                     w.is_tensor ? format_shape(tensor_shape(w)) : "(not a tensor)",
                                     format_shape(ps.shape)));
        ps.param_dtype = w.dtype;
        OPTSTATE_RETURN_IF_ERROR(add_entry(key, kParam, weight_key, ps, any8));
      }
      for (const auto& [ename, item_key] : entries) {
        if (ename == "param" || ename == "fp32_param") continue;
        if (ename != kExpAvg && ename != kExpAvgSq && ename != kMaxExpAvgSq) {
          ++not_read_[fmt::format("optimizer.state.{}.*", ename)];
          continue;
        }
        if (tensor_shape(md_.items.at(item_key)) != ps.shape)
          return corrupt(fmt::format("{}: '{}' has another shape", pw, ename));
        OPTSTATE_RETURN_IF_ERROR(add_entry(key, ename, item_key, ps, any8));
      }
      if (!ps.entries.count(kExpAvgSq)) return corrupt(fmt::format("{}: no '{}' (AdamW keeps exp_avg and exp_avg_sq)", pw, kExpAvgSq));
      if (any8) return corrupt(pw + ": 8-bit state in a Megatron checkpoint");
      meta_.groups[static_cast<size_t>(ps.group)].params.push_back(key);
      meta_.params.emplace(key, std::move(ps));
    }
    if (meta_.params.empty()) return corrupt(where + ": a Megatron checkpoint without optimizer.state items");
    for (const auto& [key, wkey] : beside_main) OPTSTATE_RETURN_IF_ERROR(check_main_params(key, wkey));
    meta_.kind = "adamw";
    if (!c.other_keys.empty())
      notes_.push_back(fmt::format("{}: {} ({})", common_in_item_ ? "common state" : "common.pt",
                                   fmt::join(c.other_keys, ", "),
                                   c.lightning ? "NeMo's Lightning checkpoint" : "Megatron's trainer state"));
    if (any_unprefixed)
      value_notes_.push_back(
          "Megatron's chain of optimizers saved its items unprefixed (chained_optim_avoid_prefix): keys under MoE "
          "experts ('.experts.') assigned to the experts' optimizer (is_expert_parallel groups), the rest to the "
          "dense one");
    for (const MegatronPlace& place : places)
      if (place.groups == 2)
        value_notes_.push_back(fmt::format(
            "Megatron saves no param group's members: assigned by Megatron-Core's standard groups, biases and "
            "1-D params (their stacked layer axes left out) in group {} (wd_mult 0), the rest in group {}",
            place.first_group + place.no_decay, place.first_group + place.decay));
    OPTSTATE_RETURN_IF_ERROR(find_beside());
    return check_structure(meta_, false).with_context(where);
  }

  // Megatron's distributed optimizer saved dp_reshardable (megatron_buckets.h): each data-parallel
  // group's param groups from its own item; each bucket's flat entries (main params, moments) placed
  // on the model's weights by their values, each param's runs made an N-D flattened item of its own
  // (ItemMeta::nd_shape) over the bucket chunks' storage, and entered in `states` as the per-key
  // items of the other forms are. `dp_items`: every item of that form, read through those.
  Status init_dp_reshardable(megatron::Common& c, std::map<std::string, std::map<std::string, std::string>>& states,
                             std::map<std::string, size_t>& chain_of, std::set<std::string>& dp_items) {
    const std::string where = dir_.string();
    auto opt_of = [&](int chain) -> std::optional<size_t> {
      const size_t i = chain < 0 ? 0 : static_cast<size_t>(chain);
      if ((chain < 0) == c.chained || i >= c.optimizers.size()) return std::nullopt;
      return i;
    };
    // dp_reshardable's per-bucket items, or dp_zero_gather_scatter's gathered buffers (flat_buffer_bounds
    // makes them bucket items: their chunks each param's part and the padding between)
    auto flat = [](const megatron::Optimizer& o) {
      return o.sharding == "dp_reshardable" || o.sharding == "dp_zero_gather_scatter";
    };
    if (std::none_of(c.optimizers.begin(), c.optimizers.end(), flat)) return Status::Ok();
    // (optimizer, group, gbuf, bucket) -> entry -> item key
    BucketItems bucket_items;
    std::map<size_t, std::set<int64_t>> groups_read;
    std::map<std::pair<size_t, int64_t>, std::string> param_states;  // (optimizer, group) -> its gathered state
    for (const auto& [key, im] : md_.items) {
      const auto slash = key.find("/shard_");
      const std::string base = slash == std::string::npos ? key : key.substr(0, slash);
      const std::string iw = fmt::format("{}: item '{}'", where, key);
      if (auto bk = megatron::bucket_key(key)) {
        const auto o = opt_of(bk->chain);
        if (!o || c.optimizers[*o].sharding != "dp_reshardable")
          return corrupt(fmt::format("{}: a dp_reshardable bucket of no optimizer saved so in {}", iw, common_name_));
        if (!im.is_tensor || im.size.size() != 1 || im.dtype != DType::kF32)
          return corrupt(iw + ": a bucket's entry that is not a flat float32 tensor");
        if (!bucket_items[{*o, bk->group, bk->gbuf, bk->bucket}].emplace(bk->entry, key).second)
          return corrupt(iw + ": a bucket's entry twice (two dtypes)");
        dp_items.insert(key);
      } else if (auto ps = megatron::param_state_key(key)) {
        const auto o = opt_of(ps->first);
        if (!o || c.optimizers[*o].sharding != "dp_zero_gather_scatter")
          return corrupt(fmt::format("{}: a dp_zero_gather_scatter state of no optimizer saved so in {}", iw, common_name_));
        if (im.is_tensor) return corrupt(iw + ": a tensor where the gathered state is saved");
        if (!param_states.emplace(std::pair{*o, ps->second}, key).second)
          return corrupt(iw + ": a data-parallel group's gathered state twice");
        dp_items.insert(key);
      } else if (auto go = megatron::group_optimizer_key(base)) {
        const auto o = opt_of(go->first);
        if (!o || !flat(c.optimizers[*o]))
          return corrupt(fmt::format("{}: a data-parallel group's optimizer of no optimizer saved so in {}", iw, common_name_));
        if (im.is_tensor) return corrupt(iw + ": a tensor where the optimizer's state dict is saved");
        OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pi, item(key, {}, 64));
        if (pi->payload.kind != Payload::Kind::kValue) return corrupt(iw + ": not the optimizer's state dict");
        OPTSTATE_ASSIGN_OR_RETURN(megatron::Optimizer g, megatron::interpret_group_optimizer(pi->pickle, iw));
        megatron::Optimizer& mine = c.optimizers[*o];
        if (mine.groups.empty()) {
          g.sharding = mine.sharding;  // dp_reshardable or dp_zero_gather_scatter, as common.pt says
          mine = std::move(g);
        } else {
          bool same = mine.groups.size() == g.groups.size() && mine.group_step == g.group_step;
          for (size_t k = 0; same && k < g.groups.size(); ++k)
            same = mine.groups[k].hyper == g.groups[k].hyper && mine.groups[k].wd_mult == g.groups[k].wd_mult;
          if (!same) return corrupt(iw + ": param groups that differ from another data-parallel group's");
        }
        groups_read[*o].insert(go->second);
        dp_items.insert(key);
      } else if (base.find("optimizer.distributed.dp_group_idx_") != std::string::npos) {
        dp_items.insert(key);  // per_bucket_numel(_unpadded), grad scaler: what the layout checks on load
      }
    }
    for (size_t i = 0; i < c.optimizers.size(); ++i)
      if (flat(c.optimizers[i]) && c.optimizers[i].groups.empty())
        return corrupt(fmt::format("{}: Megatron's distributed optimizer{} saved {} without its param "
                                   "groups (no optimizer.distributed.dp_group_idx_<G>.optimizer item)",
                                   where, c.chained ? fmt::format(" {}", i) : "", c.optimizers[i].sharding));
    // The model's weights: candidate params, a box per chunk.
    std::vector<std::string> names;
    std::vector<megatron::Box> boxes;
    std::vector<Source> weight_src;  // per weight (names), its chunks read by box
    for (const auto& [key, im] : md_.items) {
      if (!im.is_tensor || dp_items.count(key) || megatron::state_item(key) || !im.nd_shape.empty()) continue;
      if (im.dtype != DType::kF32 && im.dtype != DType::kBF16 && im.dtype != DType::kF16) continue;
      for (size_t k = 0; k < im.chunks.size(); ++k) {
        const auto n = checked_numel(im.chunks[k].sizes);
        if (!n.ok()) return corrupt(fmt::format("{}: item '{}': a chunk of no size", where, key));
        boxes.push_back(megatron::Box{names.size(), im.chunks[k].offsets, *n, im.dtype});
      }
      Source src;
      src.key = key;
      src.item = &im;
      weight_src.push_back(std::move(src));
      names.push_back(key);
    }
    std::vector<size_t> box_chunk;
    {
      std::vector<size_t> seen(names.size(), 0);
      for (const auto& b : boxes) box_chunk.push_back(seen[b.key]++);
    }
    megatron::BucketValues values;
    values.box = [&](size_t bi, std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
      const int64_t elem = dtype_size(boxes[bi].dtype);
      std::vector<uint32_t> out(at.size());
      std::vector<std::byte> run;
      for (size_t i = 0; i < at.size();) {
        size_t j = i + 1;
        while (j < at.size() && at[j] == at[j - 1] + 1) ++j;
        run.resize((j - i) * static_cast<size_t>(elem));
        const Segment seg{0, static_cast<int64_t>(j - i), box_chunk[bi], at[i]};
        const Source& ws = weight_src[boxes[bi].key];
        OPTSTATE_ASSIGN_OR_RETURN(auto loc, segment_source(ws, seg, Component::kValues));
        const auto [file, from, esize, record] = loc;
        if (esize != elem) return corrupt(fmt::format("{}: item '{}' holds elements of another size", where, ws.key));
        OPTSTATE_RETURN_IF_ERROR(file->read_at(from, run).with_context(fmt::format("item '{}'", ws.key)));
        for (size_t k = i; k < j; ++k) {
          uint32_t bits = 0;
          std::memcpy(&bits, run.data() + (k - i) * static_cast<size_t>(elem), static_cast<size_t>(elem));
          out[k] = bits;
        }
        i = j;
      }
      return out;
    };
    if (boxes.empty())
      return unsupported(where + ": Megatron's distributed optimizer saved its state flat (dp_reshardable's buckets, "
                                 "dp_zero_gather_scatter's gathered buffers: their param layout is not saved), and no "
                                 "model weights beside to place its params by (verl's optimizer/dist_ckpt/ alone); "
                                 "save it with --dist-ckpt-optim-fully-reshardable");
    OPTSTATE_RETURN_IF_ERROR(flat_buffers_as_buckets(param_states, boxes, values, bucket_items, dp_items));
    // The buckets, in each domain (optimizer, data-parallel group) Megatron's order.
    std::vector<megatron::Bucket> buckets;
    std::vector<const std::map<std::string, std::string>*> bucket_entries;
    std::vector<std::pair<size_t, int64_t>> domains;
    std::vector<Source> bucket_main;  // each bucket's main params, for placing
    for (const auto& [id, entries] : bucket_items) {
      const auto& [o, group, gbuf, bucket] = id;
      const auto param = entries.find("param");
      const std::string bw = fmt::format("{}: optimizer.distributed.dp_group_idx_{}.gbuf_idx_{}...bucket_idx_{}", where,
                                         group, gbuf, bucket);
      if (param == entries.end() || !entries.count(kExpAvg) || !entries.count(kExpAvgSq))
        return corrupt(bw + ": a bucket without 'param', 'exp_avg' and 'exp_avg_sq'");
      const ItemMeta& pm = md_.items.at(param->second);
      for (const auto& [e, k] : entries) {
        const ItemMeta& em = md_.items.at(k);
        bool same = em.size == pm.size && em.chunks.size() == pm.chunks.size();
        for (size_t j = 0; same && j < em.chunks.size(); ++j)
          same = em.chunks[j].offsets == pm.chunks[j].offsets && em.chunks[j].sizes == pm.chunks[j].sizes;
        if (!same) return corrupt(fmt::format("{}: its '{}' is chunked unlike its 'param'", bw, e));
      }
      if (domains.empty() || domains.back() != std::pair{o, group}) domains.emplace_back(o, group);
      megatron::Bucket b;
      b.name = param->second.substr(0, param->second.size() - 6);  // without ".param"
      b.domain = domains.size() - 1;
      b.buffer = gbuf;
      b.numel = pm.size[0];
      OPTSTATE_ASSIGN_OR_RETURN(Source src, plain_source(param->second, bw));
      for (const ChunkMeta& ch : pm.chunks) b.starts.push_back(ch.offsets[0]);
      std::sort(b.starts.begin(), b.starts.end());
      buckets.push_back(std::move(b));
      bucket_entries.push_back(&entries);
      bucket_main.push_back(std::move(src));
    }
    if (buckets.empty()) {
      const bool gathered = std::any_of(c.optimizers.begin(), c.optimizers.end(), [](const megatron::Optimizer& o) {
        return o.sharding == "dp_zero_gather_scatter";
      });
      return corrupt(fmt::format("{}: Megatron's distributed optimizer saved {} without its state's items (no {})",
                                 where, gathered ? "dp_zero_gather_scatter" : "dp_reshardable",
                                 gathered ? "optimizer.distributed.dp_group_idx_<G>.param_state object"
                                          : "optimizer.distributed.dp_group_idx_<G>...bucket_idx_<K> items"));
    }
    values.bucket = [&](size_t b, int64_t begin, std::span<const int64_t> at, DType d) -> Result<std::vector<uint32_t>> {
      return main_params_as(d, at, [&](int64_t from, std::span<float> run) {
        return read_plain(bucket_main[b], begin + from, begin + from + static_cast<int64_t>(run.size()),
                          std::as_writable_bytes(run));
      });
    };
    OPTSTATE_ASSIGN_OR_RETURN(auto placed, megatron::place_boxes(buckets, boxes, names, values, where));
    // Each placed weight's entries: N-D flattened items over the bucket chunks' storage.
    std::map<size_t, std::vector<size_t>> placed_of;  // weight -> its boxes
    for (size_t i = 0; i < boxes.size(); ++i)
      if (placed[i]) placed_of[boxes[i].key].push_back(i);
    for (const auto& [w, bis] : placed_of) {
      const std::string& key = names[w];
      const ItemMeta& wm = md_.items.at(key);
      const std::string pw = fmt::format("{}: param '{}'", where, key);
      const std::vector<int64_t>& box = wm.chunks[0].sizes;
      std::vector<int64_t> grid;
      for (size_t d = 0; d < box.size(); ++d) {
        if (box[d] <= 0 || wm.size[d] % box[d]) return unsupported(pw + ": its weight's chunks are not an even grid");
        grid.push_back(wm.size[d] / box[d]);
      }
      const size_t o = domains[buckets[placed[bis[0]]->bucket].domain].first;
      for (const size_t i : bis)
        if (domains[buckets[placed[i]->bucket].domain].first != o)
          return corrupt(pw + ": its parts lie in the buffers of two optimizers of the chain");
      for (const auto& [e, first_key] : *bucket_entries[placed[bis[0]]->bucket]) {
        ItemMeta syn;
        syn.is_tensor = true;
        syn.dtype = md_.items.at(first_key).dtype;
        syn.size = grid;
        syn.size.push_back(boxes[bis[0]].numel);
        syn.nd_shape = wm.size;
        const std::string syn_key = fmt::format("{} (dp_reshardable {})", key, e);
        for (const size_t i : bis) {
          const megatron::Box& bx = boxes[i];
          if (wm.chunks[box_chunk[i]].sizes != box)
            return unsupported(pw + ": its weight's chunks are not an even grid");
          const auto found = bucket_entries[placed[i]->bucket]->find(e);
          if (found == bucket_entries[placed[i]->bucket]->end())
            return corrupt(fmt::format("{}: its buckets differ in their entries ('{}')", pw, e));
          const ItemMeta& bm = md_.items.at(found->second);
          const int64_t begin = placed[i]->begin, end = begin + bx.numel;
          for (const ChunkMeta& ch : bm.chunks) {
            const int64_t cs = ch.offsets[0], ce = cs + ch.sizes[0];
            if (ce <= begin || cs >= end) continue;
            if (cs < begin || ce > end) return corrupt(fmt::format("{}: a chunk of '{}' across its bounds", pw, found->second));
            ChunkMeta sc;
            for (size_t d = 0; d < box.size(); ++d) {
              if (bx.offsets[d] % box[d]) return unsupported(pw + ": its weight's chunks are not an even grid");
              sc.offsets.push_back(bx.offsets[d] / box[d]);
              sc.sizes.push_back(1);
            }
            sc.offsets.push_back(cs - begin);
            sc.sizes.push_back(ch.sizes[0]);
            md_.storage[{syn_key, sc.offsets}] = md_.storage.at({found->second, ch.offsets});
            if (shared_items_.count(found->second)) shared_items_.insert(syn_key);  // a part of a shared record
            syn.chunks.push_back(std::move(sc));
          }
        }
        OPTSTATE_RETURN_IF_ERROR(check_nd_flattened(syn, syn.nd_shape, pw));
        if (!md_.items.emplace(syn_key, std::move(syn)).second)
          return corrupt(fmt::format("{}: an item named '{}' beside its buckets", where, syn_key));
        dp_items.insert(syn_key);
        states[key][e] = syn_key;
      }
      chain_of[key] = o;
    }
    if (placed_of.empty()) return corrupt(where + ": the optimizer's flat buffers hold no param");  // check_padding refuses first
    value_notes_.push_back(
        param_states.empty()
            ? "Megatron's distributed optimizer saved dp_reshardable (flat per-bucket buffers, whose param layout the "
              "checkpoint does not hold): each param placed where its fp32 main params round to the model's weights"
            : "Megatron's distributed optimizer saved dp_zero_gather_scatter (each data-parallel group's buffers "
              "gathered flat, whose param layout the checkpoint does not hold): each param placed where its fp32 main "
              "params round to the model's weights");
    return Status::Ok();
  }

  // dp_zero_gather_scatter (megatron::interpret_param_state): each data-parallel group's gathered
  // buffers, a flat float32 tensor per entry inside the group's ShardedObject, walked by value
  // (megatron::flat_buffer_bounds) and entered as one bucket each: an item per entry whose chunks are
  // each param's run and the padding between, stored raw where they lie in the object's archive (a
  // part of a record: its CRC-32 checked by verify_shared_records, the record read whole).
  using BucketItems = std::map<std::tuple<size_t, int64_t, int64_t, int64_t>, std::map<std::string, std::string>>;
  Status flat_buffers_as_buckets(const std::map<std::pair<size_t, int64_t>, std::string>& param_states,
                                 const std::vector<megatron::Box>& boxes, const megatron::BucketValues& values,
                                 BucketItems& bucket_items, std::set<std::string>& dp_items) {
    const std::string where = dir_.string();
    for (const auto& [og, key] : param_states) {
      const auto& [o, group] = og;
      const std::string iw = fmt::format("{}: item '{}'", where, key);
      OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pi, item(key, {}, 256));
      if (pi->payload.kind != Payload::Kind::kValue) return corrupt(iw + ": not the gathered state's dict");
      OPTSTATE_ASSIGN_OR_RETURN(const auto buffers, megatron::interpret_param_state(pi->pickle, pi->pickle.root(), iw));
      const std::string relative_path = md_.storage.at({key, {}}).relative_path;
      const std::string prefix = key.substr(0, key.find("optimizer.distributed."));  // chained_<i>.
      const InputFile* file = pi->file;
      for (const megatron::FlatBuffer& fb : buffers) {
        const std::string bw = fmt::format("{} [{}]", iw, fb.gbuf);
        const uint64_t bytes = static_cast<uint64_t>(fb.numel) * 4;
        std::map<std::string, uint64_t> first;  // entry -> its first element's file offset
        for (const auto& [e, t] : fb.entries) {
          const auto rec = pi->storages.find(t.storage_key);
          if (rec == pi->storages.end()) return corrupt(fmt::format("{} '{}': its storage is not in the archive", bw, e));
          shared_records_.push_back({file, rec->second.at, rec->second.size, rec->second.crc,
                                     fmt::format("{} '{}' (storage {})", bw, e, t.storage_key)});
          const uint64_t at = rec->second.at + static_cast<uint64_t>(t.offset) * 4;
          if (static_cast<uint64_t>(t.offset) * 4 + bytes > rec->second.size || at + bytes > file->size())
            return corrupt(fmt::format("{} '{}': its storage holds fewer than its {} elements", bw, e, fb.numel));
          first[e] = at;
        }
        const uint64_t main_at = first.at("param");
        megatron::BucketValues walk;
        walk.box = values.box;
        walk.bucket = [&](size_t, int64_t begin, std::span<const int64_t> at, DType d) -> Result<std::vector<uint32_t>> {
          return main_params_as(d, at, [&](int64_t from, std::span<float> run) {
            return file->read_at(main_at + static_cast<uint64_t>(begin + from) * 4, std::as_writable_bytes(run))
                .with_context(bw);
          });
        };
        OPTSTATE_ASSIGN_OR_RETURN(const auto bounds,
                                  megatron::flat_buffer_bounds(0, fb.numel, fb.param_dtype, boxes, walk, bw));
        for (const auto& [e, at] : first) {
          ItemMeta im;
          im.is_tensor = true;
          im.dtype = DType::kF32;
          im.size = {fb.numel};
          const std::string syn = fmt::format("{}optimizer.distributed.dp_group_idx_{}.gbuf_idx_{} (dp_zero_gather_scatter).{}",
                                              prefix, group, fb.gbuf, e);
          for (size_t k = 0; k < bounds.size(); ++k) {
            const int64_t cs = bounds[k], ce = k + 1 < bounds.size() ? bounds[k + 1] : fb.numel;
            im.chunks.push_back(ChunkMeta{{cs}, {ce - cs}});
            StorageLoc sl;
            sl.relative_path = relative_path;
            sl.offset = at + static_cast<uint64_t>(cs) * 4;
            sl.length = static_cast<uint64_t>(ce - cs) * 4;
            sl.raw_shape = std::vector<int64_t>{ce - cs};
            md_.storage[{syn, {cs}}] = std::move(sl);
          }
          if (!md_.items.emplace(syn, std::move(im)).second)
            return corrupt(fmt::format("{}: an item named '{}' beside its gathered state", where, syn));
          shared_items_.insert(syn);
          dp_items.insert(syn);
          bucket_items[{o, group, fb.gbuf, 0}][e] = syn;
        }
      }
    }
    return Status::Ok();
  }

  // The fp32 main params of `key` against the model's weights saved beside (item `wkey`): Megatron
  // copies the main params into the weights after each step (rounded to their dtype; with fp8
  // params, quantized), so at megatron::sample_places they must be near. Where most are far apart
  // (by more than an eighth, more than fp8's e4m3 rounding), the state is another param's: as
  // Megatron-Core 0.15 and 0.16 saved fully_reshardable with several DDP buckets (its gather
  // stripped the padding between buckets but sliced params at their padded offsets). Refused rather
  // than read as the param's state.
  Status check_main_params(const std::string& key, const std::string& wkey) {
    const Source& main = sources_.at({key, std::string(kParam)});
    const ItemMeta& wm = md_.items.at(wkey);
    if (main.eight || main.item->dtype != DType::kF32 ||
        (wm.dtype != DType::kBF16 && wm.dtype != DType::kF16 && wm.dtype != DType::kF32))
      return Status::Ok();
    const std::string pw = fmt::format("{}: param '{}'", dir_.string(), key);
    OPTSTATE_ASSIGN_OR_RETURN(const Source weights, plain_source(wkey, pw));
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(tensor_shape(wm)));
    const int64_t elem = dtype_size(wm.dtype);
    const auto places = megatron::sample_places(numel);
    size_t far = 0;
    std::optional<std::tuple<int64_t, float, float>> first_far;
    for (const int64_t at : places) {
      float m = 0;
      uint32_t bits = 0;
      OPTSTATE_RETURN_IF_ERROR(read_plain(main, at, at + 1, std::as_writable_bytes(std::span(&m, 1))));
      OPTSTATE_RETURN_IF_ERROR(
          read_plain(weights, at, at + 1, std::as_writable_bytes(std::span(&bits, 1)).first(static_cast<size_t>(elem))));
      const float w = wm.dtype == DType::kBF16  ? bf16_to_f32(static_cast<uint16_t>(bits))
                      : wm.dtype == DType::kF16 ? f16_to_f32(static_cast<uint16_t>(bits))
                                                : std::bit_cast<float>(bits);
      if (!(std::fabs(m - w) <= std::max(std::fabs(m), std::fabs(w)) / 8)) {  // NaN: far
        ++far;
        if (!first_far) first_far.emplace(at, m, w);
      }
    }
    if (2 * far > places.size()) {
      const auto [at, m, w] = *first_far;
      return corrupt(fmt::format(
          "{}: its fp32 main params are not the model's {} weights saved beside (apart by more than an eighth at "
          "{} of {} sampled elements; element {}: {} where the weight is {}): the optimizer's state is "
          "misplaced, as Megatron-Core 0.15 and 0.16 saved fully_reshardable with several DDP buckets (fixed "
          "after 0.16.1), or the weights are not the ones it stepped",
          pw, dtype_name(wm.dtype), far, places.size(), at, m, w));
    }
    return Status::Ok();
  }

  // Item `key` as a source of its flat elements: every chunk's runs, covering it once.
  Result<Source> plain_source(const std::string& key, const std::string& where) {
    const ItemMeta& im = md_.items.at(key);
    Source src;
    src.key = key;
    src.item = &im;
    for (size_t k = 0; k < im.chunks.size(); ++k) OPTSTATE_RETURN_IF_ERROR(item_segments(im, k, src.values, where));
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(tensor_shape(im)));
    OPTSTATE_RETURN_IF_ERROR(src.values.seal(numel, where));
    return src;
  }

  // Elements [begin, end) of a plain (dense, C-contiguous) source, read as they lie: no CRC
  // bookkeeping (the reads that place Megatron's buckets are out of order).
  Status read_plain(const Source& src, int64_t begin, int64_t end, std::span<std::byte> out) {
    const int64_t size = dtype_size(src.item->dtype);
    int64_t done = begin;
    OPTSTATE_RETURN_IF_ERROR(src.values.for_each(begin, end, [&](const Segment& s) -> Status {
      const int64_t a = std::max(begin, s.begin), b = std::min(end, s.begin + s.count);
      OPTSTATE_ASSIGN_OR_RETURN(auto loc, segment_source(src, s, Component::kValues));
      const auto [file, at, elem, record] = loc;
      if (elem != size) return corrupt(fmt::format("{}: item '{}' holds elements of another size", dir_.string(), src.key));
      const auto dst = out.subspan(static_cast<size_t>((a - begin) * size), static_cast<size_t>((b - a) * size));
      OPTSTATE_RETURN_IF_ERROR(file->read_at(at + static_cast<uint64_t>((a - s.begin) * elem), dst)
                                   .with_context(fmt::format("item '{}'", src.key)));
      done = b;
      return Status::Ok();
    }));
    if (done != end) return corrupt(fmt::format("{}: item '{}' does not cover [{}, {})", dir_.string(), src.key, begin, end));
    return Status::Ok();
  }

  // What the folder holds beside the DCP (layout_.beside), named among what is not read. Not for
  // a folder of two DCPs (Accelerate's, NeMo Automodel's), whose run state a DCP written from it is not.
  Status find_beside() {
    if (is_two_dcp_folder(dir_)) return Status::Ok();
    std::set<std::string> own{".metadata"};
    for (const auto& [k, loc] : md_.storage)  // a data file, or the folder it lies in
      own.insert(loc.relative_path.substr(0, loc.relative_path.find('/')));
    std::error_code ec;
    for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.empty() || name[0] == '.' || own.count(name) || it->path().extension() == ".distcp") continue;
      if (layout_.megatron && (name == kMegatronCommon || name == "metadata.json" || name == megatron::kIntegrityManifest))
        continue;  // its own (integrity.json: digests of these files, not carried into another)
      // zarr's lock folders (zarr.h): nothing in them
      if (zarr_ && name.ends_with(".sync") && md_.items.count(name.substr(0, name.size() - 5)) && it->is_directory(ec))
        continue;
      layout_.beside.push_back(name);
    }
    if (ec) return io_error(fmt::format("{}: {}", dir_.string(), ec.message()));
    std::sort(layout_.beside.begin(), layout_.beside.end());
    for (const std::string& name : layout_.beside)
      notes_.push_back(fmt::format("{} (beside the DCP{})", name,
                                   name == "meta.pt" ? ": Lightning's trainer state" : ""));
    return Status::Ok();
  }

  // The param group fields parse_group reads (and `params`); a DCP writer writes its own.
  static inline const std::set<std::string> kGroupFieldsRead = {
      "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "params",
      "block_size", "min_8bit_size", "exp_avg_qmap", "exp_avg_sq_qmap"};

  std::optional<PlannerPath> planner_path(const std::string& key) const {
    auto p = md_.planner.find(key);
    if (p == md_.planner.end()) return std::nullopt;
    return PlannerPath{p->second, md_.planner_index.at(key)};
  }

  static bool same_hyper(const Hyperparameters& a, const Hyperparameters& b) {
    auto bits = [](double d) {
      uint64_t u;
      std::memcpy(&u, &d, 8);
      return u;
    };
    return bits(a.lr) == bits(b.lr) && bits(a.beta1) == bits(b.beta1) && bits(a.beta2) == bits(b.beta2) &&
           bits(a.eps) == bits(b.eps) && bits(a.weight_decay) == bits(b.weight_decay) && a.amsgrad == b.amsgrad &&
           a.maximize == b.maximize;
  }

  // A param group's hyperparameters and optstate's 8-bit layout fields (not its members).
  Status parse_group(const std::map<std::string, std::string>& fields, const std::string& gw, ParamGroup& pg,
                     Plain8& q) {
    // another optimizer's group (Adafactor's eps is a pair) is named before its fields are read
    OPTSTATE_RETURN_IF_ERROR(check_torch_adam_group([&](const char* key) { return fields.count(key) > 0; }, gw));
    OPTSTATE_ASSIGN_OR_RETURN(pg.hyper.lr, number(fields, "lr", gw, std::nullopt));
    OPTSTATE_ASSIGN_OR_RETURN(pg.hyper.eps, number(fields, "eps", gw, 1e-8));
    OPTSTATE_ASSIGN_OR_RETURN(pg.hyper.weight_decay, number(fields, "weight_decay", gw, 1e-2));
    OPTSTATE_ASSIGN_OR_RETURN(double ams, number(fields, "amsgrad", gw, 0.0));
    OPTSTATE_ASSIGN_OR_RETURN(double maxi, number(fields, "maximize", gw, 0.0));
    pg.hyper.amsgrad = ams != 0;
    pg.hyper.maximize = maxi != 0;
    if (fields.count("caution")) {
      OPTSTATE_ASSIGN_OR_RETURN(const double c, number(fields, "caution", gw, 0.0));
      if (c != 0) return corrupt(gw + ": caution=True (timm's cautious AdamW masks the update): not AdamW's update");
    }
    if (fields.count("corrected_weight_decay")) {
      OPTSTATE_ASSIGN_OR_RETURN(const double c, number(fields, "corrected_weight_decay", gw, 0.0));
      if (c != 0 && pg.hyper.weight_decay != 0)
        return corrupt(gw + ": corrected_weight_decay=True (timm's AdamW decays by lr^2 / max_lr, not lr): not AdamW's update");
    }
    if (fields.count("bias_correction")) {  // apex's / TransformerEngine's FusedAdam
      OPTSTATE_ASSIGN_OR_RETURN(const double bc, number(fields, "bias_correction", gw, 1.0));
      if (bc == 0) return corrupt(gw + ": bias_correction=False: not AdamW's update");
    }
    if (fields.count("correct_bias")) {
      OPTSTATE_ASSIGN_OR_RETURN(const double cb, number(fields, "correct_bias", gw, 1.0));
      if (cb == 0) return corrupt(gw + ": correct_bias=False (transformers' AdamW without bias correction): not AdamW's update");
    }
    // torch.optim.Adam (decoupled_weight_decay False) decays by L2 in the gradient: AdamW's update
    // only without decay.
    for (const char* key : {"decoupled_weight_decay", "is_adamw"})
      if (fields.count(key)) {
        OPTSTATE_ASSIGN_OR_RETURN(const double d, number(fields, key, gw, 1.0));
        if (d == 0 && pg.hyper.weight_decay != 0)
          return corrupt(fmt::format("{}: {}=False with weight_decay {}: Adam's L2 decay, not AdamW's decoupled decay",
                                     gw, key, pg.hyper.weight_decay));
      }
    auto betas = fields.find("betas");
    if (betas == fields.end()) return corrupt(gw + ": no betas");
    OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * bi, item(betas->second, {}));
    const auto& bv = bi->pickle.at(bi->pickle.root());
    if ((bv.kind == pickle::Kind::kTuple || bv.kind == pickle::Kind::kList) && bv.items.size() == 3)
      return corrupt(gw + ": three betas (bitsandbytes' AdEMAMix, whose state1 holds two moments): not AdamW");
    if ((bv.kind != pickle::Kind::kTuple && bv.kind != pickle::Kind::kList) || bv.items.size() != 2)
      return corrupt(gw + ": betas is not two numbers");
    // numbers, or one-element tensors (torch's Tensor betas, pickled in the item with their storages)
    const auto b1 = element_of(*bi, bv.items[0], gw + " betas[0]");
    const auto b2 = element_of(*bi, bv.items[1], gw + " betas[1]");
    if (!b1.ok() || !b2.ok()) return corrupt(gw + ": betas is not two numbers");
    pg.hyper.beta1 = *b1;
    pg.hyper.beta2 = *b2;
    // optstate's AdamW8bit keeps its 8-bit layout in the group: block_size and the two map names.
    if (fields.count("block_size")) {
      OPTSTATE_ASSIGN_OR_RETURN(const double b, number(fields, "block_size", gw, std::nullopt));
      if (!(b >= 1 && b <= (1 << 20) && b == static_cast<double>(static_cast<int64_t>(b))))
        return corrupt(fmt::format("{}: block_size {} is not an integer in [1, 2^20]", gw, b));
      q.block = static_cast<int64_t>(b);
    }
    for (auto [field, name] : {std::pair{"exp_avg_qmap", &q.signed_map}, std::pair{"exp_avg_sq_qmap", &q.unsigned_map}}) {
      auto f = fields.find(field);
      if (f == fields.end()) continue;
      OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * qi, item(f->second, {}));
      auto v = as_string(qi->pickle, qi->pickle.root());
      if (!v || !qmap_from_name(*v).ok()) return corrupt(fmt::format("{}: {} is not a known map name", gw, field));
      *name = *v;
    }
    return Status::Ok();
  }

  // The group's torch.optim.AdamW switches that hold None or a bool. One that does not (or whose
  // item does not parse) is left out, as the switches are outside the state: the item is carried
  // as it was where a DCP is written, and torch's default is written elsewhere.
  AdamWFlags group_flags(const std::map<std::string, std::string>& fields) {
    AdamWFlags out;
    for (const auto& [name, fallback] : kAdamWFlagDefaults) {
      const auto f = fields.find(std::string(name));
      if (f == fields.end() || md_.items.at(f->second).is_tensor) continue;
      const Result<ParsedItem*> fi = item(f->second, {});
      if (!fi.ok()) continue;
      if (const auto v = as_flag((*fi)->pickle, (*fi)->pickle.root())) out.emplace(name, *v);
    }
    return out;
  }

  // The group's other plain keys (GroupValue): bytes items holding None, a bool, an int, a float
  // or a string, and one-element float32 tensor items. Any other (or one that does not read) is
  // named as not read (`<optimizer>.param_groups.*.<key>`), once where `named` collects them.
  GroupExtras group_extras_of(const std::map<std::string, std::string>& fields, const std::string& optimizer,
                              std::set<std::string>* named = nullptr) {
    GroupExtras out;
    for (const auto& [field, key] : fields) {
      if (known_group_key(field) || (group_step_ && field == "step")) continue;
      const ItemMeta& im = md_.items.at(key);
      std::optional<GroupValue> v;
      if (im.is_tensor) {
        if (im.dtype == DType::kF32 && im.size.size() <= 1 && (im.size.empty() || im.size[0] == 1))
          if (const Result<double> f = value_of(key, ""); f.ok()) {
            v.emplace();
            v->kind = GroupValue::Kind::kTensor;
            v->f = *f;
            v->shape = im.size;
          }
      } else if (const Result<ParsedItem*> fi = item(key, {}); fi.ok()) {
        v = as_group_value((*fi)->pickle, (*fi)->pickle.root());
      }
      if (v) {
        out.emplace_back(field, std::move(*v));
      } else if (!named || named->insert(field).second) {
        ++not_read_[fmt::format("{}.param_groups.*.{}", optimizer, field)];
      }
    }
    return out;
  }

  static bool same_extras(const GroupExtras& a, const GroupExtras& b) {
    auto same = [](const GroupValue& x, const GroupValue& y) {
      return x.kind == y.kind && x.i == y.i && std::memcmp(&x.f, &y.f, sizeof x.f) == 0 && x.s == y.s &&
             x.shape == y.shape;
    };
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [&](const auto& x, const auto& y) {
             return x.first == y.first && same(x.second, y.second);
           });
  }

  // A key path as its item keys spell it ("app.optimizers").
  static std::string dotted(const std::vector<std::string>& path) {
    std::string s;
    for (const auto& part : path) s += (s.empty() ? "" : ".") + part;
    return s;
  }

  // The item that gives a param's shape from its state: its first moment, dense, torchao's codes or
  // bitsandbytes' state1; none where the state has none.
  const ItemMeta* first_moment(const std::map<std::string, std::string>& entries) const {
    for (const char* first : {"exp_avg", "exp_avg_codes", "state1"})
      if (const auto it = entries.find(first); it != entries.end()) return &md_.items.at(it->second);
    return nullptr;
  }

  static std::vector<std::string> split_key(const std::string& key) {
    // Without planner_data (the key's path), for the usual top-level names: "<K>.state.<fqn>.<entry>",
    // "<K>.param_groups.<i>.<field>" or flattened "<K>.param_groups.<fqn>.<field>" (K: optim,
    // optimizer), "model.<fqn>"; anything else is one top-level name.
    auto starts = [&](const std::string& p) { return key.rfind(p, 0) == 0; };
    for (const std::string k : {"optim", "optimizer"}) {
      if (starts(k + ".state.")) {
        const std::string rest = key.substr(k.size() + 7);
        const auto dot = rest.rfind('.');
        if (dot != std::string::npos) return {k, "state", rest.substr(0, dot), rest.substr(dot + 1)};
      } else if (starts(k + ".param_groups.")) {
        const std::string rest = key.substr(k.size() + 14);
        const auto dot = rest.find('.');
        if (dot == std::string::npos) break;
        const std::string first = rest.substr(0, dot);
        if (!first.empty() && first.find_first_not_of("0123456789") == std::string::npos)
          return {k, "param_groups", first, rest.substr(dot + 1)};
        return {k, "param_groups." + rest};
      }
    }
    if (starts("model.")) return {"model", key.substr(6)};
    return {key};
  }

  Result<const InputFile*> file(const std::string& rel, const std::string& where) {
    auto it = files_.find(rel);
    if (it != files_.end()) return &it->second;
    auto full = contained_path(dir_, rel);
    if (!full.ok()) return corrupt(fmt::format("{}: {}", where, full.status().message()));
    auto f = InputFile::open(*full);
    if (!f.ok()) return Status(f.status().code(), fmt::format("{}: data file {}", where, f.status().message()));
    return &files_.emplace(rel, std::move(*f)).first->second;
  }

  // The name of an item's chunk in errors.
  std::string item_where(std::string_view key, std::span<const int64_t> offsets) const {
    return fmt::format("{}: item '{}'{}", dir_.string(), key,
                       offsets.empty() ? "" : " chunk at " + format_shape({offsets.begin(), offsets.end()}));
  }

  // zstd-stored items' first chunks (what opening parses) decoded on every core (up to 8) before
  // they are parsed in order: decoding is most of what reading such a checkpoint costs. Up to half
  // the made files' budget; an item that fails is left to item(), which decodes it again and
  // reports the error in its turn.
  void predecode() {
    struct Job {
      ChunkKey key;
      const StorageLoc* loc;
      const InputFile* file;
      uint64_t cap, hint;
      std::string where;
      std::optional<InputFile> out;
    };
    std::vector<Job> jobs;
    uint64_t planned = 0;
    const uint64_t budget = made_input_budget() / 2;
    for (const auto& [key, im] : md_.items) {
      if (im.is_tensor && im.chunks.empty()) continue;
      const ChunkMeta* chunk = im.is_tensor ? &im.chunks[0] : nullptr;
      const std::vector<int64_t> offsets = chunk ? chunk->offsets : std::vector<int64_t>{};
      const auto stored = md_.storage.find(ChunkView{key, offsets});
      if (stored == md_.storage.end() || stored->second.transforms.empty() || stored->second.raw_shape) continue;
      const uint64_t hint = stored_bytes_hint(im, chunk);
      planned += std::max<uint64_t>(hint, stored->second.length);
      if (planned > budget) break;
      std::string where = item_where(key, offsets);
      auto f = file(stored->second.relative_path, where);
      if (!f.ok()) continue;
      jobs.push_back(Job{{key, offsets}, &stored->second, *f, stored_bytes_cap(im, chunk), hint, std::move(where), {}});
    }
    const size_t threads = std::min<size_t>({std::max(1u, std::thread::hardware_concurrency()), 8, jobs.size()});
    if (threads < 2) return;
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < jobs.size();) {
        Job& j = jobs[i];
        try {
          auto d = decoded_item(*j.file, *j.loc, j.cap, j.hint, j.where);
          if (d.ok()) j.out.emplace(std::move(*d));
        } catch (const std::bad_alloc&) {  // left to item(), where it fails as anywhere else
        }
      }
    };
    std::vector<std::thread> pool;
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
    for (Job& j : jobs)
      if (j.out) decoded_.emplace(std::move(j.key), std::move(*j.out));
  }

  // Parses (once) the torch.save zip of one item: its data.pkl and where each storage's bytes lie.
  // `max_value_storages`: how many storages of a bytes item's value are located (for element_of).
  Result<ParsedItem*> item(const std::string& key, const std::vector<int64_t>& offsets,
                           size_t max_value_storages = 8) {
    auto cached = items_.find(ChunkView{key, offsets});
    if (cached != items_.end()) return &cached->second;
    const auto stored = md_.storage.find(ChunkView{key, offsets});
    if (stored == md_.storage.end())
      return corrupt(fmt::format("{}: item '{}' has no storage entry", dir_.string(), key));
    const std::string iw = fmt::format("{}: item '{}'{}", dir_.string(), key,
                                       offsets.empty() ? "" : " chunk at " + format_shape(offsets));
    OPTSTATE_ASSIGN_OR_RETURN(const InputFile* f, file(stored->second.relative_path, iw));
    if (stored->second.raw_shape) return raw_item(key, offsets, stored->second, f, iw);
    StorageLoc loc = stored->second;
    if (const auto pre = decoded_.find(ChunkView{key, offsets}); pre != decoded_.end()) {
      f = &pre->second;  // decoded already (predecode)
      loc = StorageLoc{loc.relative_path, 0, f->size(), {}, std::nullopt};
    } else if (!loc.transforms.empty()) {
      // Its decoded bytes are the archive, a file of their own.
      const auto im = md_.items.find(key);
      const ChunkMeta* chunk = nullptr;
      if (im != md_.items.end() && im->second.is_tensor)
        for (const ChunkMeta& ch : im->second.chunks)
          if (ch.offsets == offsets) chunk = &ch;
      const ItemMeta& meta = chunk ? im->second : ItemMeta{};
      OPTSTATE_ASSIGN_OR_RETURN(
          InputFile decoded,
          decoded_item(*f, loc, stored_bytes_cap(meta, chunk), stored_bytes_hint(meta, chunk), iw));
      f = &decoded_.emplace(ChunkKey{key, offsets}, std::move(decoded)).first->second;
      loc = StorageLoc{loc.relative_path, 0, f->size(), {}, std::nullopt};
    }
    auto read_index = read_archive_index(*f, loc, iw);
    if (!read_index.ok()) {
      // FileSystemWriter(serialization_format=SAFETENSORS) stores a rank's tensors as one
      // safetensors blob (an 8-byte header length, then its JSON) where each item's torch.save
      // archive would be; read_metadata points the chunks into it (hf_storage.h) where its
      // DCP_SHARDING_INFO places them. One without: said as what it is.
      std::byte head[9];
      if (loc.length >= 9 && f->read_at(loc.offset, head).ok() && head[8] == std::byte{'{'})
        return unsupported(fmt::format("{} is stored as safetensors without DCP_SHARDING_INFO, which would say "
                                       "where each tensor's piece lies",
                                       iw));
      return read_index.status();
    }
    ArchiveIndex index = std::move(*read_index);
    const zip::CentralDirectory& cd = index.cd;
    const std::vector<zip::Entry>& entries = index.entries;
    // torch.save puts data.pkl and the small records first, each storage's local header after
    // them: all in the first few KiB of an archive too large for the tail to hold.
    OPTSTATE_RETURN_IF_ERROR(read_archive_head(*f, loc, index, kArchiveHeadBytes, iw));
    auto locate = [&](const zip::Entry& e) -> Result<uint64_t> {
      std::byte h[30];
      OPTSTATE_RETURN_IF_ERROR(read_archive_bytes(*f, loc, index, e.local_header_offset, h, iw));
      OPTSTATE_ASSIGN_OR_RETURN(uint64_t off, zip::data_offset(h, e, cd.offset, iw));
      return loc.offset + off;
    };
    const zip::Entry* pkl = nullptr;
    std::string prefix;
    for (const auto& e : entries) {
      const auto slash = e.name.find('/');
      if (slash != std::string::npos && e.name.substr(slash) == "/data.pkl") {
        pkl = &e;
        prefix = e.name.substr(0, slash);
      }
    }
    if (!pkl) return corrupt(iw + ": not a torch.save archive (no data.pkl)");
    if (pkl->size > kMaxPickleBytes) return corrupt(iw + ": data.pkl too large");
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t pkl_at, locate(*pkl));
    std::vector<std::byte> pb(pkl->size);
    OPTSTATE_RETURN_IF_ERROR(read_archive_bytes(*f, loc, index, pkl_at - loc.offset, pb, iw));
    ParsedItem pi;
    pi.file = f;
    OPTSTATE_RETURN_IF_ERROR(zip::check_record_crc(pb, *pkl, iw));  // what it holds (lr, ...) has no other check
    OPTSTATE_ASSIGN_OR_RETURN(pi.pickle, pickle::unpickle(pb, iw + " data.pkl"));
    OPTSTATE_ASSIGN_OR_RETURN(pi.payload, interpret_payload(pi.pickle, iw));
    // A tensor's pickle is done with once interpreted: kept only for bytes items' values (a DCP of
    // a large run caches a parsed item per chunk, hundreds of thousands).
    if (pi.payload.kind != Payload::Kind::kValue) pi.pickle = pickle::Pickle{};
    std::vector<const TensorRef*> refs;
    if (pi.payload.kind == Payload::Kind::kTensor) refs = {&pi.payload.tensor};
    if (pi.payload.kind == Payload::Kind::kOptimState8bit) refs = {&pi.payload.codes, &pi.payload.scale};
    if (pi.payload.kind == Payload::Kind::kOptimState8bit && !pi.payload.fp8) refs.push_back(&pi.payload.qmap);
    for (const TensorRef* t : refs) {
      const std::string name = prefix + "/data/" + t->storage_key;
      auto e = std::find_if(entries.begin(), entries.end(), [&](const zip::Entry& x) { return x.name == name; });
      if (e == entries.end()) return corrupt(fmt::format("{}: storage '{}' is missing from the archive", iw, name));
      if (e->size < static_cast<uint64_t>(t->storage_numel) * dtype_size(t->dtype))
        return corrupt(fmt::format("{}: storage '{}' holds {} bytes, less than its {} elements", iw, name, e->size,
                                   t->storage_numel));
      OPTSTATE_ASSIGN_OR_RETURN(uint64_t at, locate(*e));
      pi.storages[t->storage_key] = {at, e->size, e->crc32, false};
    }
    // A bytes item's value may hold a few tensors (torch's Tensor betas: a tuple of two): their
    // storages, for element_of; not for a value of many (a dataloader's state, carried as it is).
    if (pi.payload.kind == Payload::Kind::kValue) {
      std::vector<const zip::Entry*> data;
      for (const auto& e : entries)
        if (e.name.rfind(prefix + "/data/", 0) == 0) data.push_back(&e);
      if (data.size() <= max_value_storages)
        for (const zip::Entry* e : data) {
          OPTSTATE_ASSIGN_OR_RETURN(uint64_t at, locate(*e));
          pi.storages[e->name.substr(prefix.size() + 6)] = {at, e->size, e->crc32, false};
        }
    }
    return &items_.emplace(std::pair{key, offsets}, std::move(pi)).first->second;
  }

  // A chunk stored as its elements alone (zarr.h): a contiguous tensor of the chunk's shape at the
  // start of its storage, which holds at least that many (zarr's edge chunks hold more).
  Result<ParsedItem*> raw_item(const std::string& key, const std::vector<int64_t>& offsets, const StorageLoc& loc,
                               const InputFile* f, const std::string& iw) {
    const auto im = md_.items.find(key);
    if (im == md_.items.end() || !im->second.is_tensor) return corrupt(iw + ": raw storage for an item without a tensor");
    const auto checked = checked_numel(*loc.raw_shape);
    if (!checked.ok()) return corrupt(fmt::format("{}: {}", iw, checked.status().message()));
    const int64_t numel = *checked;
    const uint64_t bytes = static_cast<uint64_t>(numel) * dtype_size(im->second.dtype);
    if (bytes > loc.length)
      return corrupt(fmt::format("{}: holds {} bytes, its {} elements need {}", iw, loc.length, numel, bytes));
    ParsedItem pi;
    pi.file = f;
    pi.payload.kind = Payload::Kind::kTensor;
    TensorRef& t = pi.payload.tensor;
    t.storage_key = "raw";
    t.dtype = im->second.dtype;
    t.storage_numel = numel;
    t.shape = *loc.raw_shape;
    pi.storages[t.storage_key] = {loc.offset, bytes, 0, false};
    pi.storages[t.storage_key].shared = shared_items_.count(key) > 0;
    pi.storages[t.storage_key].raw = true;
    return &items_.emplace(std::pair{key, offsets}, std::move(pi)).first->second;
  }

  // A Python number from a bytes item, or the one element of a 0-d/1-element tensor item.
  Result<double> value_of(const std::string& key, const std::string& where) {
    const ItemMeta& im = md_.items.at(key);
    const std::vector<int64_t> offsets = im.is_tensor ? (im.chunks.empty() ? std::vector<int64_t>{} : im.chunks[0].offsets)
                                                      : std::vector<int64_t>{};
    if (im.is_tensor && im.chunks.empty()) return corrupt(where + ": tensor item without chunks");
    OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pi, item(key, offsets));
    if (pi->payload.kind == Payload::Kind::kValue) {
      auto v = as_number(pi->pickle, pi->pickle.root());
      if (!v) return corrupt(where + ": not a number");
      return *v;
    }
    if (pi->payload.kind != Payload::Kind::kTensor || *checked_numel(pi->payload.tensor.shape) != 1)
      return corrupt(where + ": not a one-element tensor");
    const TensorRef& t = pi->payload.tensor;
    std::byte raw[8];
    const int64_t elem = dtype_size(t.dtype);
    const uint64_t at = pi->storages.at(t.storage_key).at + static_cast<uint64_t>(t.offset * elem);
    OPTSTATE_RETURN_IF_ERROR(pi->file->read_at(at, std::span(raw, static_cast<size_t>(elem))));
    if (const auto v = scalar_value(t.dtype, raw)) return *v;
    return corrupt(where + ": unsupported dtype for a scalar");
  }

  // A number in a parsed item's pickle, or a one-element tensor there read from the item's storage.
  Result<double> element_of(const ParsedItem& pi, pickle::Ref r, const std::string& where) {
    if (const auto v = as_number(pi.pickle, r)) return *v;
    OPTSTATE_ASSIGN_OR_RETURN(const Payload v, interpret_value(pi.pickle, r, where));
    if (v.kind != Payload::Kind::kTensor || *checked_numel(v.tensor.shape) != 1)
      return corrupt(where + ": neither a number nor a one-element tensor");
    const TensorRef& t = v.tensor;
    const auto rec = pi.storages.find(t.storage_key);
    const uint64_t elem = dtype_size(t.dtype);
    if (rec == pi.storages.end() || t.offset < 0 || static_cast<uint64_t>(t.offset) >= rec->second.size / elem)
      return corrupt(where + ": its storage does not hold it");
    std::byte raw[16];
    OPTSTATE_RETURN_IF_ERROR(pi.file->read_at(rec->second.at + static_cast<uint64_t>(t.offset) * elem,
                                              std::span(raw, static_cast<size_t>(elem))));
    if (const auto x = scalar_value(t.dtype, raw)) return *x;
    return corrupt(where + ": unsupported dtype for a scalar");
  }

  Result<double> number(const std::map<std::string, std::string>& fields, const char* name, const std::string& where,
                        std::optional<double> fallback) {
    auto it = fields.find(name);
    if (it == fields.end()) {
      if (fallback) return *fallback;
      return corrupt(fmt::format("{}: no '{}'", where, name));
    }
    return value_of(it->second, fmt::format("{} '{}'", where, name));
  }

  // Numbered params (layout_.numbered) named after the model's tensors beside them (`model`: name ->
  // item key of <parent>.model.<name>), as the torch.save driver names a {"model", "optimizer"}
  // file's: each group's params placed among the model's float tensors (norm buffers passed over)
  // in the order the state dict held them (the metadata's), their shapes the state's. Exactly one
  // placement must fit: then groups, state and weights are renamed (torch_param_fqn of the model's
  // name); else the params keep their numbers, not_read() says why, and no weights are read.
  Status name_numbered(const std::map<std::string, std::string>& model,
                       const std::vector<std::optional<std::vector<std::string>>>& param_names,
                       std::map<std::string, std::map<std::string, std::string>>& state_items,
                       std::map<std::string, std::string>& weight_items) {
    weight_items.clear();  // by number, a model name ("0" of a ParameterList) is no param's
    std::vector<std::string_view> names;
    for (const auto& [name, key] : model) names.push_back(name);
    model_ddp_prefix_ = is_ddp_state_dict(names);  // a DDP model's state_dict: 'module.' on every key
    const bool ddp = model_ddp_prefix_;
    std::map<std::string, std::string> fqn_of;   // number -> name
    std::map<std::string, std::string> weights;  // name -> item key
    auto rename = [&] {
      for (ParamGroup& pg : meta_.groups)
        for (std::string& p : pg.params) p = fqn_of.at(p);
      std::map<std::string, std::map<std::string, std::string>> renamed;
      for (auto& [number, entries] : state_items) {
        const auto f = fqn_of.find(number);
        renamed[f == fqn_of.end() ? number : f->second] = std::move(entries);  // unlisted: refused below, by number
      }
      state_items = std::move(renamed);
      weight_items = std::move(weights);
      layout_.numbers_kept = false;
    };
    // Every group's param_names (an optimizer built from named_parameters()): the names as given,
    // the weights the model's tensors of those names.
    if (!param_names.empty() && std::all_of(param_names.begin(), param_names.end(), [](const auto& n) { return n.has_value(); })) {
      std::map<std::string, std::string> model_of;  // torch_param_fqn(model name) -> item key
      for (const auto& [name, key] : model) model_of.emplace(torch_param_fqn(name, ddp), key);
      std::set<std::string> seen;
      for (size_t g = 0; g < meta_.groups.size(); ++g)
        for (size_t i = 0; i < meta_.groups[g].params.size(); ++i) {
          const std::string fqn = torch_param_fqn((*param_names[g])[i], ddp);
          if (fqn.empty() || !seen.insert(fqn).second)
            return corrupt(fmt::format("{}: param group {}: param_names names '{}' twice (or not at all)", dir_.string(),
                                       g, fqn));
          fqn_of[meta_.groups[g].params[i]] = fqn;
          if (const auto w = model_of.find(fqn); w != model_of.end()) weights.emplace(fqn, w->second);
        }
      rename();
      return Status::Ok();
    }
    if (model.empty()) return Status::Ok();  // the optimizer alone: nothing to name them by
    std::map<std::string, const std::string*> name_of_key;
    for (const auto& [name, key] : model) name_of_key.emplace(key, &name);
    std::vector<std::vector<int64_t>> shapes;
    std::vector<std::pair<const std::string*, const std::string*>> tensors;  // (name, key), in order
    for (const std::string& key : md_.order) {
      const auto it = name_of_key.find(key);
      if (it == name_of_key.end()) continue;
      const ItemMeta& im = md_.items.at(key);
      if (!im.is_tensor || !dtype_info(im.dtype).is_float || is_norm_buffer(*it->second)) continue;
      shapes.push_back(tensor_shape(im));
      tensors.emplace_back(it->second, &it->first);
    }
    std::vector<std::vector<std::optional<std::vector<int64_t>>>> groups;
    for (const ParamGroup& pg : meta_.groups) {
      auto& shapes_of_group = groups.emplace_back();
      for (const std::string& number : pg.params) {
        const auto st = state_items.find(number);
        const ItemMeta* first = st != state_items.end() ? first_moment(st->second) : nullptr;
        shapes_of_group.push_back(first ? std::optional(first->size) : std::nullopt);
      }
    }
    std::vector<std::string> model_path = layout_.model_parent();
    model_path.push_back("model");
    const std::string model_key = dotted(model_path);
    const ModelPlacement placed = place_params_in_model(groups, shapes);
    if (!placed.why.empty()) {
      notes_.push_back(fmt::format("{} (the model's tensors: {}, so params keep their numbers)", model_key, placed.why));
      return Status::Ok();
    }
    for (size_t g = 0; g < meta_.groups.size(); ++g)
      for (size_t i = 0; i < meta_.groups[g].params.size(); ++i) {
        const auto& [name, key] = tensors[placed.tensor_of[g][i]];
        const std::string fqn = torch_param_fqn(*name, ddp);
        if (!weights.emplace(fqn, *key).second) {
          notes_.push_back(fmt::format("{} (the model's tensors: two params would be named '{}', so params keep "
                                       "their numbers)", model_key, fqn));
          return Status::Ok();
        }
        fqn_of[meta_.groups[g].params[i]] = fqn;
      }
    rename();
    return Status::Ok();
  }

  Status add_entry(const std::string& fqn, const std::string& ename, const std::string& key, ParamState& ps, bool& any8,
                   bool torchao_lr = false) {
    const ItemMeta& im = md_.items.at(key);
    const std::string ew = fmt::format("{}: item '{}'", dir_.string(), key);
    if (!im.is_tensor || im.chunks.empty()) return corrupt(ew + ": not a tensor with chunks");
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(tensor_shape(im)));
    Source src;
    src.key = key;
    src.item = &im;
    Entry e;
    OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * first, item(key, im.chunks[0].offsets));
    // torchao 8-bit: codes + per-block scale + the map, in every chunk, blocks not straddling
    // chunks: blockwise8. torchao quantizes each rank's shard alone, and only one of at least 4096
    // elements in whole blocks, so other chunks may be plain; then the entry is fp32 values, the
    // 8-bit chunks read dequantized (dequantized_segment).
    // torchao's fp8 and 4-bit states (OptimStateFp8, OptimState4bit) have no canonical map: always
    // fp32 values, the state AdamW's (no 8-bit entry), each chunk read dequantized.
    const bool dequant_only = first->payload.kind == Payload::Kind::kOptimState8bit &&
                              (first->payload.fp8 || first->payload.bits == 4);
    bool blockwise = first->payload.kind == Payload::Kind::kOptimState8bit;
    if (blockwise) {
      const Payload& p = first->payload;
      const int64_t codes = p.elements(), blocks = *checked_numel(p.scale.shape);
      if (blocks <= 0 || codes % blocks) return corrupt(ew + ": codes are not a whole number of blocks");
      e.block_size = codes / blocks;
      if (dequant_only) {
        blockwise = false;
      } else {
        OPTSTATE_ASSIGN_OR_RETURN(e.qmap, map_name(*first, ew));
      }
      for (size_t k = 0; k < im.chunks.size() && blockwise; ++k) {
        OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pk, item(key, im.chunks[k].offsets));
        RunList runs;
        OPTSTATE_RETURN_IF_ERROR(item_segments(im, k, runs, ew));
        blockwise = pk->payload.kind == Payload::Kind::kOptimState8bit && !pk->payload.fp8 && pk->payload.bits == 8 &&
                    runs.groups().size() <= 1 && (runs.empty() || runs.groups()[0].rows == 1);
        if (blockwise && !runs.empty()) {  // one run: the chunk is consecutive in the tensor
          const Segment s = runs.groups()[0].run(0);
          const int64_t kb = *checked_numel(pk->payload.scale.shape);
          blockwise = kb > 0 && *checked_numel(pk->payload.codes.shape) == kb * e.block_size &&
                      s.begin % e.block_size == 0 && (s.count % e.block_size == 0 || s.begin + s.count == numel);
          OPTSTATE_RETURN_IF_ERROR(src.values.add(s, ew));
          OPTSTATE_RETURN_IF_ERROR(
              src.absmax.add(Segment{s.begin / e.block_size, (s.count + e.block_size - 1) / e.block_size, k, 0}, ew));
        }
      }
      layout_.torchao_8bit = layout_.torchao_8bit || !dequant_only;
      if (layout_.torchao_package.empty()) layout_.torchao_package = first->payload.torchao_package;
      if (blockwise) {
        e.encoding = Encoding::kBlockwise8;
        e.dtype = DType::kU8;
        src.eight = any8 = true;
        OPTSTATE_RETURN_IF_ERROR(src.values.seal(numel, ew));
        OPTSTATE_RETURN_IF_ERROR(src.absmax.seal((numel + e.block_size - 1) / e.block_size, ew + " blocks"));
      } else {
        any8 = any8 || !dequant_only;
        e = Entry{};
        src.values.clear();
        src.absmax.clear();
        if (im.dtype != DType::kF32)
          return corrupt(fmt::format("{}: 8-bit chunks, and the metadata says {}; torchao's says float32", ew,
                                     dtype_name(im.dtype)));
        for (size_t k = 0; k < im.chunks.size(); ++k)
          OPTSTATE_RETURN_IF_ERROR(item_segments(im, k, src.values, ew));
        OPTSTATE_RETURN_IF_ERROR(src.values.seal(numel, ew));
        e.dtype = DType::kF32;
      }
    } else if (first->payload.kind == Payload::Kind::kTensor) {
      if (first->payload.tensor.dtype != im.dtype)
        return corrupt(fmt::format("{}: holds {} data, the metadata says {}", ew, dtype_name(first->payload.tensor.dtype),
                                   dtype_name(im.dtype)));
      e.encoding = Encoding::kDense;
      e.dtype = im.dtype;
      for (size_t k = 0; k < im.chunks.size(); ++k)
        OPTSTATE_RETURN_IF_ERROR(item_segments(im, k, src.values, ew));
      OPTSTATE_RETURN_IF_ERROR(src.values.seal(numel, ew));
      // torchao's state (its groups keep lr as a tensor) may be 8-bit on later ranks only: such a
      // moment reads dequantized (dequantized_segment), and the state is 8-bit AdamW's, as the
      // same state read from per-rank torch.save files is. Other checkpoints are not scanned here.
      if (torchao_lr && im.dtype == DType::kF32) {
        for (size_t k = 1; k < im.chunks.size() && !any8; ++k) {
          OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pk, item(key, im.chunks[k].offsets));
          any8 = pk->payload.kind == Payload::Kind::kOptimState8bit && !pk->payload.fp8 && pk->payload.bits == 8;
          layout_.torchao_8bit = layout_.torchao_8bit || any8;
          if (any8 && layout_.torchao_package.empty()) layout_.torchao_package = pk->payload.torchao_package;
        }
      }
    } else {
      return corrupt(ew + ": neither a tensor nor torchao's OptimState8bit");
    }
    ps.entries.emplace(ename, std::move(e));
    sources_.emplace(std::pair{fqn, ename}, std::move(src));
    return Status::Ok();
  }

  // optstate's AdamW8bit state (DESIGN §6): `<entry>_codes` (uint8, the param's shape) and
  // `<entry>_absmax` (float32, one per block of the flattened param, any shape) as two plain tensor
  // items; block size and maps from the param group. The two are read independently, so their
  // chunks need not line up.
  Status add_plain8(const std::string& fqn, const std::string& ename, const std::string& codes_key,
                    const std::string& absmax_key, const Plain8& q, ParamState& ps, bool& any8) {
    const ItemMeta& ci = md_.items.at(codes_key);
    const ItemMeta& ai = md_.items.at(absmax_key);
    const std::string ew = fmt::format("{}: item '{}'", dir_.string(), codes_key);
    const std::string aw = fmt::format("{}: item '{}'", dir_.string(), absmax_key);
    if (!ci.is_tensor || ci.chunks.empty() || ci.dtype != DType::kU8) return corrupt(ew + ": not a uint8 tensor");
    if (!ai.is_tensor || ai.chunks.empty() || ai.dtype != DType::kF32) return corrupt(aw + ": not a float32 tensor");
    if (q.block == 0)
      return corrupt(fmt::format("{}: 8-bit codes, but the param group has no block_size (optstate's AdamW8bit "
                                 "records it)", ew));
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ci.size));
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t blocks, checked_numel(ai.size));
    if (blocks != (numel + q.block - 1) / q.block)
      return corrupt(fmt::format("{}: {} scales for {} codes in blocks of {} (needs {})", aw, blocks, numel, q.block,
                                 (numel + q.block - 1) / q.block));
    Source src;
    src.key = codes_key;
    src.item = &ci;
    src.absmax_key = absmax_key;
    src.absmax_item = &ai;
    src.eight = any8 = true;
    for (size_t k = 0; k < ci.chunks.size(); ++k)
      OPTSTATE_RETURN_IF_ERROR(item_segments(ci, k, src.values, ew));
    for (size_t k = 0; k < ai.chunks.size(); ++k)
      OPTSTATE_RETURN_IF_ERROR(item_segments(ai, k, src.absmax, aw));
    OPTSTATE_RETURN_IF_ERROR(src.values.seal(numel, ew));
    OPTSTATE_RETURN_IF_ERROR(src.absmax.seal(blocks, aw));
    Entry e;
    e.encoding = Encoding::kBlockwise8;
    e.dtype = DType::kU8;
    e.block_size = q.block;
    e.qmap = ename == kExpAvg ? q.signed_map : q.unsigned_map;
    ps.entries.emplace(ename, std::move(e));
    sources_.emplace(std::pair{fqn, ename}, std::move(src));
    return Status::Ok();
  }

  // bitsandbytes' state1 / state2 (bnb_state.h): fp32 values as a dense entry, or uint8 codes with
  // absmaxN (one scale per block) and qmapN (the map itself, one item), read as optstate's plain
  // codes and scales are.
  Status add_bnb(const std::string& fqn, const std::string& name, const std::map<std::string, std::string>& fields,
                 ParamState& ps, bool& any8, std::set<std::string>& consumed) {
    const std::string moment = *bnb_moment(name), key = fields.at(name);
    const ItemMeta& im = md_.items.at(key);
    const std::string ew = fmt::format("{}: item '{}'", dir_.string(), key);
    if (im.is_tensor && im.dtype != DType::kU8) {
      OPTSTATE_RETURN_IF_ERROR(add_entry(fqn, moment, key, ps, any8));
      consumed.insert(key);
      return Status::Ok();
    }
    const char n = name.back();
    const auto absmax = fields.find(fmt::format("absmax{}", n)), qmap = fields.find(fmt::format("qmap{}", n));
    if (absmax == fields.end() && fields.count(fmt::format("max{}", n)))
      return corrupt(fmt::format("{}: bitsandbytes' 8-bit state without blocks (block_wise=False: one scale per "
                                 "tensor, 'max{}') is not read; optstate reads its blockwise state", ew, n));
    if (absmax == fields.end() || qmap == fields.end())
      return corrupt(fmt::format("{}: uint8 codes without 'absmax{}' and 'qmap{}'", ew, n, n));
    const ItemMeta& qi = md_.items.at(qmap->second);
    const std::string qw = fmt::format("{}: item '{}'", dir_.string(), qmap->second);
    if (!qi.is_tensor || qi.dtype != DType::kF32 || qi.size != std::vector<int64_t>{256} || qi.chunks.size() != 1 ||
        qi.chunks[0].sizes != qi.size)
      return corrupt(qw + ": not one chunk of 256 float32 (a quantization map)");
    OPTSTATE_ASSIGN_OR_RETURN(ParsedItem * pq, item(qmap->second, qi.chunks[0].offsets));
    if (pq->payload.kind != Payload::Kind::kTensor) return corrupt(qw + ": not a tensor");
    OPTSTATE_ASSIGN_OR_RETURN(const std::string map, map_name(*pq, pq->payload.tensor, qw));
    const ItemMeta& ai = md_.items.at(absmax->second);
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(im.size));
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t blocks, checked_numel(ai.size));
    const int64_t block = bnb_block_size(numel, blocks);
    if (block == 0)
      return corrupt(fmt::format("{}: {} scales for {} codes, neither blocks of 256 nor of 2048", ew, blocks, numel));
    OPTSTATE_RETURN_IF_ERROR(add_plain8(fqn, moment, key, absmax->second, Plain8{block, map, map}, ps, any8));
    consumed.insert({key, absmax->second, qmap->second});
    return Status::Ok();
  }

  Result<std::string> map_name(const ParsedItem& pi, const std::string& where) {
    return map_name(pi, pi.payload.qmap, where);
  }

  Result<std::string> map_name(const ParsedItem& pi, const TensorRef& q, const std::string& where) {
    if (q.dtype != DType::kF32) return corrupt(where + ": quantization map is not float32");
    if (*checked_numel(q.shape) != 256) return corrupt(where + ": quantization map does not have 256 entries");
    std::array<float, 256> m;
    OPTSTATE_RETURN_IF_ERROR(pi.file->read_at(pi.storages.at(q.storage_key).at + static_cast<uint64_t>(q.offset * 4),
                                              std::as_writable_bytes(std::span(m))));
    if (const auto k = qmap_matching(m)) return std::string(qmap_name(*k));
    return corrupt(where + ": quantization map is neither the dynamic signed nor the unsigned one");
  }

  fs::path dir_;
  Metadata md_;
  OptimizerState meta_;
  std::map<std::string, InputFile> files_;
  std::map<ChunkKey, InputFile, ChunkLess> decoded_;  // transformed items' decoded bytes
  // By (key, chunk offsets), looked up without a copy of either: each chunk's is found once per
  // window of its tensor read, hundreds of thousands of times in a DCP of hundreds of ranks.
  struct ChunkHash {
    using is_transparent = void;
    template <class K>
    size_t operator()(const K& k) const {
      const ChunkView c = chunk_view(k);
      size_t h = std::hash<std::string_view>{}(c.key);
      for (int64_t o : c.offsets) h = (h ^ std::hash<int64_t>{}(o)) * 0x100000001b3ull;
      return h;
    }
  };
  struct ChunkEq {
    using is_transparent = void;
    template <class A, class B>
    bool operator()(const A& a, const B& b) const {
      const ChunkView x = chunk_view(a), y = chunk_view(b);
      return x.key == y.key && std::ranges::equal(x.offsets, y.offsets);
    }
  };
  std::unordered_map<ChunkKey, ParsedItem, ChunkHash, ChunkEq> items_;
  std::map<std::pair<std::string, std::string>, Source> sources_;
  std::vector<ModelTensorInfo> model_tensors_;  // the model dict's other tensors, and where each is read
  std::vector<Source> model_sources_;
  std::vector<Plain8> plain8_;  // per param group
  std::map<std::string, int64_t> not_read_;     // top-level key -> items not read
  std::vector<std::string> value_notes_;  // read_notes(): values read as the file does not say (Megatron's groups)
  std::vector<std::string> notes_;  // more of what is not read: why numbered params keep their numbers, ...
  bool model_ddp_prefix_ = false;   // numbered: the model's state_dict is a DDP model's (is_ddp_state_dict)
  SourceLayout layout_;
  bool zarr_ = false;
  int64_t verified_ = 0, unverified_ = 0;  // records checked against their CRC-32; reads not checked
  int64_t raw_reads_ = 0;                  // reads of elements stored alone (no CRC-32 exists)
  // Reads of parts of shared records (ParsedItem::Record::shared), and whether verify_shared_records
  // checked every such record.
  int64_t shared_reads_ = 0;
  bool shared_verified_ = false;
  struct SharedRecord {
    const InputFile* file = nullptr;
    uint64_t at = 0, size = 0;
    uint32_t crc = 0;
    std::string where;  // the item and its storage
  };
  std::vector<SharedRecord> shared_records_;
  std::set<std::string> shared_items_;  // raw items that are parts of them
  int64_t pending_ = 0;  // records read in part, in order, not yet to their end (their CRC-32 unchecked)
  ReadBuffer piece_;                             // reused between streams
  ReadBuffer rows_;                              // a column shard's rows read at once (read_into)
  std::vector<std::byte> window_;                // a window of an interleaved tensor (stream_source)
  struct {
    const ParsedItem* pi = nullptr;
    std::string key;
    std::vector<std::byte> bytes;  // in logical order
  } permuted_;                     // the last tensor stored permuted that was read
};

// Training runs that save the optimizer and the model as two DCPs side by side, read as one DCP:
// the optimizer's state with its params' weights.
// - Hugging Face Accelerate under FSDP with sharded state dicts (the Trainer's checkpoint-N/):
//   optimizer_0/, a DCP of {"optimizer": FSDP.optim_state_dict(...)}, beside pytorch_model_fsdp_0/,
//   a DCP of {"model": model.state_dict()};
// - NeMo Automodel (its Checkpointer's epoch_E_step_S/): optim/, a DCP of {"optim":
//   get_optimizer_state_dict(...) flattened, "sched": ...}, beside model/, get_model_state_dict(model)
//   at the top level, as torchtitan keeps its weights beside the optimizer: a DCP
//   (model_save_format: torch_save) or DCP's Hugging Face storage (safetensors, its default:
//   hf_storage.h);
// - NeMo RL (its CheckpointManager's step_N/, the policy worker's save_checkpoint into
//   policy/optimizer/ and policy/weights/): with the default DTensor worker (v2), NeMo Automodel's
//   Checkpointer's optim/ and model/ one level down (policy/optimizer/optim/, policy/weights/model/);
//   with the first one (v1), policy/optimizer/, a DCP of {"optim": {"optim":
//   get_optimizer_state_dict(...), "sched": ...}}, beside policy/weights/, a DCP of {"model":
//   get_model_state_dict(model)}. Read from step_N/ or from its policy/; a step_N/ that also holds
//   value/ (a critic's, with an optimizer of its own) is not read as the policy's: pass one of them.
struct TwoDcps {
  const char* optimizer;     // folders, relative to the one read
  const char* model;
  bool model_in_hf_storage;  // the model's part may be DCP's Hugging Face storage
  const char* run;           // whose folder it is
  const char* unless_beside = nullptr;  // a sibling folder that makes the folder another layout
};
constexpr TwoDcps kTwoDcpLayouts[] = {
    {"optimizer_0", "pytorch_model_fsdp_0", false, "Hugging Face Accelerate's"},
    {"optim", "model", true, "NeMo Automodel's"},
    {"optimizer/optim", "weights/model", true, "NeMo RL's policy/ (or value/)"},
    {"optimizer", "weights", false, "NeMo RL's policy/ (or value/)"},
    {"policy/optimizer/optim", "policy/weights/model", true, "NeMo RL's", "value"},
    {"policy/optimizer", "policy/weights", false, "NeMo RL's", "value"}};

const TwoDcps* two_dcp_layout(const fs::path& path) {
  std::error_code ec;
  if (fs::exists(path / ".metadata", ec)) return nullptr;
  for (const TwoDcps& l : kTwoDcpLayouts)
    if ((!l.unless_beside || !fs::exists(path / l.unless_beside, ec)) &&
        fs::is_regular_file(path / l.optimizer / ".metadata", ec) &&
        (fs::is_regular_file(path / l.model / ".metadata", ec) ||
         (l.model_in_hf_storage && hf_storage::is_hf_storage_folder(path / l.model))))
      return &l;
  return nullptr;
}

bool is_two_dcp_folder(const fs::path& path) { return two_dcp_layout(path) != nullptr; }

std::string two_dcp_note(const fs::path& path) {
  const TwoDcps* l = two_dcp_layout(path);
  if (!l) return {};
  std::error_code ec;
  const bool hf = !fs::exists(path / l->model / ".metadata", ec);
  return fmt::format("{} folder: the optimizer's DCP {}/ read with the model's weights in {}/ ({})", l->run,
                     l->optimizer, l->model,
                     hf ? "DCP's Hugging Face storage: safetensors files, no checksums" : "a DCP");
}

// Megatron's zarr backend (zarr.h): a folder without .metadata whose metadata.json names it.
bool is_megatron_zarr(const fs::path& path) {
  std::error_code ec;
  if (fs::exists(path / ".metadata", ec) || !fs::is_regular_file(path / "metadata.json", ec)) return false;
  const auto bytes = read_small_file(path / "metadata.json", uint64_t{1} << 20);
  return bytes.ok() &&
         megatron::sharded_backend(std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size())) == "zarr";
}

// A DCP's own folder: torch's (.metadata), a training run's two DCPs, Megatron's zarr backend.
bool is_dcp_folder(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) &&
         (fs::is_regular_file(path / ".metadata", ec) || is_two_dcp_folder(path) || is_megatron_zarr(path));
}

// A Megatron-LM save folder (--save): its tracker names the iteration folder Megatron's
// load_checkpoint reads (iter_<N>/ or release/, never a path). That folder where it is a DCP
// (--ckpt-format torch_dist, zarr, fsdp_dtensor); nullopt otherwise (the legacy format's rank
// folders are the megatron driver's).
std::optional<fs::path> megatron_tracked_dcp(const fs::path& path) {
  auto it = ::optstate::megatron::tracked_iteration(path);
  return it && is_dcp_folder(*it) ? it : std::nullopt;
}

Result<Metadata> read_metadata(const fs::path& dir) {
  const std::string where = (dir / ".metadata").string();
  OPTSTATE_ASSIGN_OR_RETURN(auto bytes, read_small_file(dir / ".metadata", kMaxMetadataBytes));
  pickle::Limits limits;
  limits.share_immutables = true;  // read, never emitted again
  OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(bytes, where, limits));
  OPTSTATE_ASSIGN_OR_RETURN(Metadata md, interpret_metadata(p, where));
  // FileSystemWriter(serialization_format=SAFETENSORS): the tensors in a safetensors blob per file
  OPTSTATE_RETURN_IF_ERROR(hf_storage::resolve_safetensors_blobs(dir, md).status());
  return md;
}

// The two DCPs of such a folder as one: every item under its own key (Accelerate's two hold
// "optimizer.*" and "model.*", NeMo Automodel's "optim.*" and "sched.*" beside the model's own FQNs;
// a key in both is an error naming it), each storage's file relative to the folder.
Result<Metadata> two_dcp_metadata(const fs::path& folder, const TwoDcps& layout) {
  Metadata all;
  for (const char* part : {layout.optimizer, layout.model}) {
    std::error_code ec;
    const bool hf = part == layout.model && !fs::exists(folder / part / ".metadata", ec);
    OPTSTATE_ASSIGN_OR_RETURN(Metadata md, hf ? hf_storage::read_hf_storage_folder(folder / part)
                                              : read_metadata(folder / part));
    for (auto& [key, im] : md.items)
      if (!all.items.emplace(key, std::move(im)).second)
        return corrupt(fmt::format("{}: item '{}' is in both {}/ and {}/", folder.string(), key, layout.optimizer,
                                   layout.model));
    for (auto& [k, loc] : md.storage) {
      loc.relative_path = std::string(part) + "/" + loc.relative_path;
      all.storage.emplace(k, std::move(loc));
    }
    all.planner.merge(md.planner);
    all.planner_index.merge(md.planner_index);
  }
  return all;
}

class DcpDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "dcp"; }

  // A DCP's folder, or a Megatron-LM save folder whose tracker names one.
  bool sniff(const fs::path& path) const override {
    std::error_code ec;
    return is_dcp_folder(path) || (fs::is_directory(path, ec) && megatron_tracked_dcp(path).has_value());
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& given) const override {
    std::error_code ec;
    if (!fs::is_directory(given, ec)) return not_found(fmt::format("{}: not a directory", given.string()));
    const std::optional<fs::path> tracked = is_dcp_folder(given) ? std::nullopt : megatron_tracked_dcp(given);
    const fs::path& path = tracked ? *tracked : given;
    const bool zarr = !fs::exists(path / ".metadata", ec) && is_megatron_zarr(path);
    const TwoDcps* two = zarr ? nullptr : two_dcp_layout(path);
    OPTSTATE_ASSIGN_OR_RETURN(Metadata md, zarr  ? zarr::read_zarr_folder(path)
                                           : two ? two_dcp_metadata(path, *two)
                                                 : read_metadata(path));
    auto reader = std::make_unique<DcpReader>(path, std::move(md), zarr);
    OPTSTATE_RETURN_IF_ERROR(reader->init());
    if (tracked)
      reader->add_located_note(fmt::format("Megatron-LM's save folder: {} names {}/, the iteration read",
                                        ::optstate::megatron::kTrackerFile, tracked->filename().string()));
    return std::unique_ptr<CheckpointReader>(std::move(reader));
  }

  // A folder of two DCPs is a training run's (Accelerate's trainer_state.json, RNG states and
  // scheduler, NeMo Automodel's config.yaml, dataloader and RNG states beside them), as is a
  // Megatron-LM save folder: a write never replaces either.
  bool replaceable(const fs::path& path) const override {
    return !is_two_dcp_folder(path) && (is_dcp_folder(path) || !megatron_tracked_dcp(path));
  }
  bool keeps_blockwise8() const override { return false; }
  bool writes_blockwise8(const WriteOptions& options) const override {
    return writes_torchao_items(options, options.source ? source_layout(*options.source) : nullptr);
  }
  OptimizerState kept_by_write(const OptimizerState& state, const WriteOptions& options) const override {
    if (!writes_blockwise8(options)) return state;  // 8-bit moments dequantized: the values hash is kept
    // torchao's: lr a float32 tensor, the subclass's dtype the param's, moments that are not items fp32
    return torchao::kept_state(state, [&](const std::string& moment, const Entry& e, const ParamState& ps) {
      return fits_torchao_items(moment, e, ps.shape, options.world_size);
    });
  }
  std::vector<std::string> write_notes(const OptimizerState& kept, const WriteOptions& options) const override {
    return writes_blockwise8(options) ? torchao_package_notes(kept, options) : std::vector<std::string>{};
  }
  // --to 8bit quantizes as torchao steps 8-bit state: whole blocks only.
  QuantizeOptions quantize_rule(const QuantizeOptions& q) const override {
    QuantizeOptions whole = q;
    whole.whole_blocks = true;
    return whole;
  }
  bool shards() const override { return true; }
  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    return write_dcp(source, path, options, options.source ? source_layout(*options.source) : nullptr);
  }
  bool carries(const CheckpointReader& source, const fs::path&) const override { return source_layout(source) != nullptr; }
  bool keeps_group_extras() const override { return true; }
  bool keeps_model_tensors() const override { return true; }
};

}  // namespace

Status check_transforms(const StorageLoc& loc, const std::string& where) {
  for (const std::string& d : loc.transforms) {
    const auto slash = d.find('/');
    const std::string_view name = std::string_view(d).substr(0, slash);
    const std::string_view version = slash == std::string::npos ? std::string_view{} : std::string_view(d).substr(slash + 1);
    if (name != "stream.zstd" || version.substr(0, version.find('.')) != "1")
      return unsupported(fmt::format("{} is stored through the transform '{}', which optstate does not decode (it "
                                     "decodes torch's stream.zstd/1)", where, printable(d)));
    if (!zstd_available())
      return unsupported(fmt::format("{} is zstd-compressed (stream.zstd), and this optstate was built without libzstd "
                                     "(OPTSTATE_WITH_ZSTD)", where));
  }
  return Status::Ok();
}

uint64_t stored_bytes_cap(const ItemMeta& im, const ChunkMeta* chunk) {
  constexpr uint64_t kArchiveSlack = uint64_t{16} << 20;
  constexpr uint64_t kBytesItemCap = uint64_t{1} << 30;
  if (!chunk) return kBytesItemCap;
  uint64_t bytes = static_cast<uint64_t>(dtype_size(im.dtype));
  for (int64_t n : chunk->sizes) {
    if (n < 0 || (n > 0 && bytes > (uint64_t{1} << 62) / static_cast<uint64_t>(n))) return uint64_t{1} << 62;
    bytes *= static_cast<uint64_t>(n);
  }
  return 2 * bytes + kArchiveSlack;
}

uint64_t stored_bytes_hint(const ItemMeta& im, const ChunkMeta* chunk) {
  if (!chunk) return 0;
  const uint64_t cap = stored_bytes_cap(im, chunk);
  return cap >= (uint64_t{1} << 62) ? 0 : (cap - (uint64_t{16} << 20)) / 2 + (uint64_t{64} << 10);
}

Result<InputFile> decoded_item(const InputFile& file, const StorageLoc& loc, uint64_t max_out, uint64_t size_hint,
                               const std::string& where) {
  OPTSTATE_RETURN_IF_ERROR(check_transforms(loc, where));
  // Each descriptor a zstd layer: decoded once per layer (torch writes one).
  const size_t layers = loc.transforms.size();
  const InputFile* src = &file;
  const uint64_t offset = loc.offset, length = loc.length;
  return InputFile::made(fmt::format("{} (decoded)", where),
                         [src, offset, length, max_out, size_hint, layers, where]() -> Result<ByteVector> {
                           OPTSTATE_ASSIGN_OR_RETURN(ByteVector bytes,
                                                     zstd_decode_range(*src, offset, length, max_out, where, size_hint));
                           for (size_t k = 1; k < layers; ++k) {
                             ZstdDecoder dec(max_out, where);
                             OPTSTATE_RETURN_IF_ERROR(dec.feed(bytes));
                             OPTSTATE_ASSIGN_OR_RETURN(bytes, dec.finish());
                           }
                           return bytes;
                         });
}

Result<ArchiveIndex> read_archive_index(const InputFile& file, const StorageLoc& loc, const std::string& where,
                                        bool allow_compressed) {
  ArchiveIndex index;
  index.tail.resize(std::min<uint64_t>(loc.length, zip::kMaxTailBytes));
  OPTSTATE_RETURN_IF_ERROR(
      file.read_at(loc.offset + loc.length - index.tail.size(), index.tail).with_context(where));
  OPTSTATE_ASSIGN_OR_RETURN(index.cd, zip::find_central_directory(index.tail, loc.length, where));
  if (index.cd.size > kMaxPickleBytes) return corrupt(where + ": zip central directory too large");
  std::vector<std::byte> cdb(index.cd.size);
  OPTSTATE_RETURN_IF_ERROR(read_archive_bytes(file, loc, index, index.cd.offset, cdb, where));
  OPTSTATE_ASSIGN_OR_RETURN(index.entries, zip::parse_central_directory(cdb, index.cd, where, allow_compressed));
  return index;
}

Status read_archive_head(const InputFile& file, const StorageLoc& loc, ArchiveIndex& index, uint64_t bytes,
                         const std::string& where) {
  const uint64_t tail_at = loc.length - index.tail.size();
  if (tail_at == 0) return Status::Ok();
  index.head.resize(std::min(bytes, tail_at));
  return file.read_at(loc.offset, index.head).with_context(where);
}

Status read_archive_bytes(const InputFile& file, const StorageLoc& loc, const ArchiveIndex& index, uint64_t at,
                          std::span<std::byte> out, const std::string& where) {
  if (at > loc.length || out.size() > loc.length - at)
    return corrupt(fmt::format("{}: {} bytes at offset {} run past the archive's {} bytes", where, out.size(), at,
                               loc.length));
  if (out.empty()) return Status::Ok();  // (an empty record's span may be null, which memcpy may not take)
  const uint64_t tail_at = loc.length - index.tail.size();
  if (at >= tail_at) {
    std::memcpy(out.data(), index.tail.data() + (at - tail_at), out.size());
  } else if (at + out.size() <= index.head.size()) {
    std::memcpy(out.data(), index.head.data() + at, out.size());
  } else {
    return file.read_at(loc.offset + at, out).with_context(where);
  }
  return Status::Ok();
}

Result<std::string_view> written_torchao_package(const WriteOptions& options) {
  if (!options.torchao_package.empty()) {
    for (std::string_view package : kTorchaoOptimPackages)
      if (options.torchao_package == package) return package;  // the table's view: it outlives the options
    return invalid_argument(fmt::format("'{}' defines no torchao optimizer state: torchao.optim, or "
                                        "torchao.prototype.low_bit_optim before torchao 0.11",
                                        printable(options.torchao_package)));
  }
  if (options.source && is_torchao_package(options.source->torchao_package())) return options.source->torchao_package();
  return kTorchaoDefaultPackage;
}

std::vector<std::string> torchao_package_notes(const OptimizerState& kept, const WriteOptions& options) {
  const auto written = written_torchao_package(options);
  bool eight = false;
  for (const auto& [fqn, ps] : kept.params)
    for (const auto& [name, e] : ps.entries) eight = eight || e.encoding == Encoding::kBlockwise8;
  if (!written.ok() || !eight) return {};
  const std::string_view package = *written;
  const std::string_view source = options.source ? options.source->torchao_package() : std::string_view{};
  if (package != kTorchaoDefaultPackage)
    return {fmt::format("8-bit moments are {}'s OptimState8bit{}, which torchao before 0.11 loads; for torchao 0.11 "
                       "and later: --torchao-package {}", package, source == package ? " (as the source's)" : "",
                       kTorchaoDefaultPackage)};
  if (!source.empty() && source != package)
    return {fmt::format("8-bit moments are {}'s OptimState8bit, which torchao 0.11 and later loads (the source's "
                        "were {}'s, torchao before 0.11: --torchao-package {} keeps them)", package, source, source)};
  return {};
}

const SourceLayout* source_layout(const CheckpointReader& reader) {
  const auto* dcp = dynamic_cast<const DcpReader*>(&reader);
  // Megatron's layout is not written back (its items are keyed by its own model's sharded keys):
  // a DCP written from one is a plain one.
  return dcp && !dcp->layout().megatron ? &dcp->layout() : nullptr;
}

const FormatDriver& driver() {
  static const DcpDriver d;
  return d;
}

}  // namespace optstate::dcp
