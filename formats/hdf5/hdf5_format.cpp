// The HDF5 driver: one file, a group per parameter, a dataset per dense entry, a subgroup with
// `codes` and `absmax` datasets per 8-bit entry; chunked, fletcher32 per chunk, optional
// gzip+shuffle. Attributes say what everything is, for h5py users; the root attribute "optstate"
// holds the canonical metadata (JSON) the reader trusts after checking it against the datasets.
// Layout: FORMAT.md.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <hdf5.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "optstate/state_json.h"
#include "hdf5_layout.h"
#include "registry.h"

namespace optstate::hdf5 {
namespace {

constexpr const char* kFormatTag = "optstate-hdf5";
constexpr int kLayoutVersion = 1;
constexpr uint64_t kChunkTargetBytes = uint64_t{1} << 20;
constexpr uint64_t kMaxMetaBytes = uint64_t{256} << 20;

// libhdf5 (Debian's serial build) is not thread-safe: every call goes through this lock.
std::recursive_mutex& hdf5_mutex() {
  static std::recursive_mutex mu;
  return mu;
}

// Before the first other HDF5 call. Errors come back as Status, not printed. No library shutdown at
// exit: a file whose write failed (disk full, EFBIG) cannot be flushed, so its close fails and
// leaves it half-closed, and libhdf5's exit handler then crashes closing it again (1.10). Files
// that were written are closed, flushed and fsynced before write() returns; nothing is lost.
void start_hdf5() {
  static std::once_flag once;
  std::call_once(once, [] {
    H5dont_atexit();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  });
}

// The most metadata (object headers, B-tree nodes, chunk indexes) a reader's file caches.
constexpr size_t kMetadataCacheBytes = size_t{1} << 20;

// An HDF5 identifier closed on scope exit.
class Id {
 public:
  Id() = default;
  explicit Id(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Id(Id&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Id& operator=(Id&& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
    return *this;
  }
  ~Id() {
    if (id_ >= 0 && close_) close_(id_);
  }
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }
  // Closes now, for the callers that must know whether closing worked (a file's last writes).
  herr_t close() {
    const herr_t r = id_ >= 0 && close_ ? close_(id_) : 0;
    id_ = -1;
    return r;
  }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

// Why the last HDF5 call failed, from the innermost entry of libhdf5's error stack: for a write the
// operating system's message ("No space left on device"), else HDF5's own description; "" if none.
std::string hdf5_cause() {
  std::string cause;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned, const H5E_error2_t* e, void* out) -> herr_t {
        if (e->desc && *e->desc) *static_cast<std::string*>(out) = e->desc;  // downward: the last is innermost
        return 0;
      },
      &cause);
  // sec2 writes say "... errno = 28, error message = 'No space left on device', buf = ...".
  if (const size_t at = cause.find("error message = '"); at != std::string::npos) {
    const size_t from = at + 17, to = cause.find('\'', from);
    if (to != std::string::npos) return cause.substr(from, to - from);
  }
  return cause.size() > 200 ? cause.substr(0, 200) + "..." : cause;
}

// An I/O error naming `where` and what failed, with libhdf5's cause when it gives one.
Status hdf5_failure(const std::string& where, std::string_view what) {
  const std::string cause = hdf5_cause();
  return io_error(fmt::format("{}{}{}{}{}", where, where.empty() ? "" : ": ", what, cause.empty() ? "" : ": ", cause));
}

std::string component_path(const std::string& fqn, const std::string& entry, const Entry& e, Component c) {
  const std::string base = "/" + fqn + "/" + entry;
  return e.encoding == Encoding::kDense ? base : base + "/" + std::string(component_name(c));
}

// The file type of a component; 16-bit floats are raw u16 in HDF5 1.10 (no bf16/f16 type there),
// with a "dtype" attribute saying what they are.
hid_t file_type(DType d) {
  switch (d) {
    case DType::kF32: return H5T_IEEE_F32LE;
    case DType::kF64: return H5T_IEEE_F64LE;
    case DType::kBF16:
    case DType::kF16: return H5T_STD_U16LE;
    case DType::kU8: return H5T_STD_U8LE;
    case DType::kI8: return H5T_STD_I8LE;
    case DType::kI32: return H5T_STD_I32LE;
    case DType::kI64: return H5T_STD_I64LE;
    case DType::kI16: return H5T_STD_I16LE;
    case DType::kBool: return H5T_STD_U8LE;
    default: break;  // complex, float8, uint16..64: no entry is (check_structure: entries are float)
  }
  return H5T_STD_U8LE;
}

DType component_dtype(const Entry& e, Component c) {
  return c == Component::kValues ? e.dtype : c == Component::kCodes ? DType::kU8 : DType::kF32;
}

std::vector<hsize_t> component_dims(const ParamState& ps, const Entry& e, Component c) {
  if (c == Component::kAbsmax) return {static_cast<hsize_t>(component_count(e, c, *checked_numel(ps.shape)))};
  return std::vector<hsize_t>(ps.shape.begin(), ps.shape.end());
}

Status set_string_attr(hid_t obj, const char* name, const std::string& value) {
  Id type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<size_t>(1, value.size()));
  H5Tset_strpad(type.get(), H5T_STR_NULLPAD);
  Id space(H5Screate(H5S_SCALAR), H5Sclose);
  Id attr(H5Acreate2(obj, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.ok() || H5Awrite(attr.get(), type.get(), value.empty() ? "" : value.data()) < 0)
    return hdf5_failure("", fmt::format("cannot write attribute '{}'", name));
  return Status::Ok();
}

Status set_i64_attr(hid_t obj, const char* name, int64_t value) {
  Id space(H5Screate(H5S_SCALAR), H5Sclose);
  Id attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.ok() || H5Awrite(attr.get(), H5T_NATIVE_INT64, &value) < 0)
    return hdf5_failure("", fmt::format("cannot write attribute '{}'", name));
  return Status::Ok();
}

Status set_shape_attr(hid_t obj, const char* name, const std::vector<int64_t>& shape) {
  const hsize_t n = shape.size();
  Id space(n ? H5Screate_simple(1, &n, nullptr) : H5Screate(H5S_NULL), H5Sclose);
  Id attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.ok() || (n && H5Awrite(attr.get(), H5T_NATIVE_INT64, shape.data()) < 0))
    return hdf5_failure("", fmt::format("cannot write attribute '{}'", name));
  return Status::Ok();
}

// A fixed- or variable-length string attribute, read with a size cap.
Result<std::string> get_string_attr(hid_t obj, const char* name, const std::string& where) {
  if (H5Aexists(obj, name) <= 0) return corrupt(fmt::format("{}: attribute '{}' is missing", where, name));
  Id attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Id type(H5Aget_type(attr.get()), H5Tclose);
  if (!attr.ok() || !type.ok() || H5Tget_class(type.get()) != H5T_STRING)
    return corrupt(fmt::format("{}: attribute '{}' is not a string", where, name));
  Id space(H5Aget_space(attr.get()), H5Sclose);
  if (H5Sget_simple_extent_type(space.get()) != H5S_SCALAR)
    return corrupt(fmt::format("{}: attribute '{}' is not a scalar", where, name));
  // The memory type takes the stored character set: libhdf5 converts no string between ASCII and
  // UTF-8, and h5py stores a Python str as a variable-length UTF-8 string.
  const H5T_cset_t cset = H5Tget_cset(type.get());
  if (cset != H5T_CSET_ASCII && cset != H5T_CSET_UTF8)
    return corrupt(fmt::format("{}: attribute '{}' has an unknown character set", where, name));
  if (H5Tis_variable_str(type.get()) > 0) {
    Id mem(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mem.get(), H5T_VARIABLE);
    H5Tset_cset(mem.get(), cset);
    char* s = nullptr;
    if (H5Aread(attr.get(), mem.get(), &s) < 0 || !s)
      return corrupt(fmt::format("{}: cannot read attribute '{}'", where, name));
    const size_t n = strnlen(s, kMaxMetaBytes + 1);
    std::string out(s, std::min<size_t>(n, kMaxMetaBytes));
    H5free_memory(s);
    if (n > kMaxMetaBytes)  // not cut short and read as something else
      return corrupt(fmt::format("{}: attribute '{}' is over {} MiB", where, name, kMaxMetaBytes >> 20));
    return out;
  }
  const size_t size = H5Tget_size(type.get());
  if (size == 0 || size > kMaxMetaBytes)
    return corrupt(fmt::format("{}: attribute '{}' of {} bytes is out of range", where, name, size));
  std::string out(size, '\0');
  Id mem(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mem.get(), size);
  H5Tset_strpad(mem.get(), H5T_STR_NULLPAD);
  H5Tset_cset(mem.get(), cset);
  if (H5Aread(attr.get(), mem.get(), out.data()) < 0)
    return corrupt(fmt::format("{}: cannot read attribute '{}'", where, name));
  out.resize(strnlen(out.data(), out.size()));
  return out;
}

class Hdf5Reader final : public CheckpointReader {
 public:
  // Datasets without fletcher32 (optstate writes it on every one; a dataset rewritten by another
  // tool, h5py's default, has none): how many of how many, and the first.
  struct Unchecked {
    int64_t count = 0, of = 0;
    std::string first;
  };
  // A chunked dataset with fletcher32 or a compressor (deflate or szip): what each chunk a read
  // covers is checked for before H5Dread (check_chunks). Filter indices are places in the pipeline
  // (a chunk's filter mask bit says that filter was skipped for it).
  struct ChunkChecks {
    std::vector<hsize_t> chunk;          // the chunk's shape
    std::optional<unsigned> fletcher32;  // a stored chunk holds at least its 4 bytes
    std::optional<unsigned> compressor;  // the chunk decompresses to at most inflate_limit bytes
    H5Z_filter_t compressor_id = H5Z_FILTER_DEFLATE;
    std::vector<unsigned> fletcher32_after;  // after the compressor: their 4 bytes come off first
    uint64_t inflate_limit = 0;
    std::unordered_set<uint64_t> inflated;   // chunks (row-major numbers) whose inflated size was checked
  };
  using ChunkedDatasets = std::unordered_map<std::string, ChunkChecks>;
  Hdf5Reader(fs::path path, Id file, OptimizerState meta, Unchecked unchecked, ChunkedDatasets chunked)
      : path_(std::move(path)),
        file_(std::move(file)),
        meta_(std::move(meta)),
        unchecked_(std::move(unchecked)),
        chunked_(std::move(chunked)) {}

  std::string_view format() const override { return "hdf5"; }
  bool checksummed() const override { return unchecked_.count == 0; }
  std::string unchecked() const override {
    return fmt::format("{} of {} datasets {} no fletcher32 checksum, the first '{}'", unchecked_.count, unchecked_.of,
                       unchecked_.count == 1 ? "has" : "have", unchecked_.first);
  }
  const fs::path& path() const override { return path_; }
  const OptimizerState& meta() const override { return meta_; }

  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    OPTSTATE_ASSIGN_OR_RETURN(auto info, component_info(fqn, entry, c));
    const auto [count, elem, row] = info;
    const int64_t rows_per_piece = std::max<int64_t>(1, static_cast<int64_t>(kStreamPieceBytes) / (row * elem));
    std::vector<std::byte> piece;
    for (int64_t r = 0; r * row < count; r += rows_per_piece) {
      const int64_t b = r * row, e = std::min(count, (r + rows_per_piece) * row);
      piece.resize(static_cast<size_t>((e - b) * elem));
      OPTSTATE_RETURN_IF_ERROR(read_range(fqn, entry, c, b, e, piece));
      OPTSTATE_RETURN_IF_ERROR(sink(piece));
    }
    return Status::Ok();
  }

  // Reads the whole rows (dim 0) that hold [begin, end) through a hyperslab, then cuts the range.
  Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin, int64_t end,
                    std::span<std::byte> out) override {
    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    OPTSTATE_ASSIGN_OR_RETURN(auto info, component_info(fqn, entry, c));
    const auto [count, elem, row] = info;
    const std::string dpath = path_of(fqn, entry, c);
    if (begin < 0 || end < begin || end > count || static_cast<int64_t>(out.size()) != (end - begin) * elem)
      return invalid_argument(fmt::format("{}: range [{}, {}) of dataset '{}' is outside [0, {}) or does not fit",
                                          path_.string(), begin, end, dpath, count));
    if (begin == end) return Status::Ok();
    // Relative to the param's group, kept from the last read: `validate` and `convert` read a
    // param's entries one after another, and each lookup from the root searches a group of every
    // param (50,000 params: validate's best of six runs 6.42 -> 6.14 s; the rest is libhdf5's own
    // cost per dataset).
    if (!group_.ok() || group_fqn_ != fqn) {
      group_ = Id(H5Gopen2(file_.get(), fqn.c_str(), H5P_DEFAULT), H5Gclose);
      group_fqn_ = group_.ok() ? fqn : std::string();
    }
    const std::string rel = dpath.substr(fqn.size() + 2);  // "/<fqn>/" off
    Id ds(group_.ok() ? H5Dopen2(group_.get(), rel.c_str(), H5P_DEFAULT) : hid_t{-1}, H5Dclose);
    if (!ds.ok()) return corrupt(fmt::format("{}: cannot open dataset '{}'", path_.string(), dpath));
    Id fspace(H5Dget_space(ds.get()), H5Sclose);
    const int rank = H5Sget_simple_extent_ndims(fspace.get());
    std::vector<hsize_t> dims(static_cast<size_t>(std::max(rank, 0)));
    H5Sget_simple_extent_dims(fspace.get(), dims.data(), nullptr);
    const int64_t r0 = begin / row, r1 = (end + row - 1) / row;
    std::vector<std::byte> rows;
    std::span<std::byte> dst = out;
    const bool exact = r0 * row == begin && r1 * row == end;
    if (!exact) {
      rows.resize(static_cast<size_t>((r1 - r0) * row * elem));
      dst = rows;
    }
    Id mspace;
    if (rank > 0) {
      std::vector<hsize_t> start(dims.size(), 0), cnt = dims;
      start[0] = static_cast<hsize_t>(r0);
      cnt[0] = static_cast<hsize_t>(r1 - r0);
      if (H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start.data(), nullptr, cnt.data(), nullptr) < 0)
        return corrupt(fmt::format("{}: cannot select rows [{}, {}) of '{}'", path_.string(), r0, r1, dpath));
      mspace = Id(H5Screate_simple(rank, cnt.data(), nullptr), H5Sclose);
    } else {
      mspace = Id(H5Screate(H5S_SCALAR), H5Sclose);
    }
    if (auto f = chunked_.find(dpath); f != chunked_.end())
      OPTSTATE_RETURN_IF_ERROR(check_chunks(ds.get(), dims, f->second, r0, r1, dpath));
    const DType d = dtype_of_component(fqn, entry, c);
    if (H5Dread(ds.get(), native_type(d), mspace.get(), fspace.get(), H5P_DEFAULT, dst.data()) < 0)
      return corrupt(fmt::format("{}: cannot read dataset '{}' rows [{}, {}) (a chunk failed its fletcher32 "
                                 "checksum or the file is damaged)",
                                 path_.string(), dpath, r0, r1));
    if (!exact)
      std::memcpy(out.data(), rows.data() + (begin - r0 * row) * elem, out.size());
    return Status::Ok();
  }

  // Each chunk rows [r0, r1) lie in is looked up first (an error there is the chunk index's:
  // H5Dread meets it too and says so):
  // - libhdf5 1.10.8's fletcher32 filter takes its 4 bytes off a chunk's stored size without
  //   checking there are 4: a chunk stored in fewer (a damaged chunk index) made H5Dread read far
  //   past its buffer (SIGSEGV; fuzz_hdf5_file);
  // - its deflate filter inflates a chunk whatever size that comes to, doubling its buffer, and
  //   then uses the chunk's bytes of it: 1 MB of deflated zeros made validate hold 1 GiB and say
  //   "ok". A deflated chunk is inflated here first, counting (64 KiB at a time, once per chunk),
  //   and refused past its limit;
  // - its szip filter allocates and fills the size a chunk's first 4 bytes state (up to 4 GiB):
  //   that must be within the same limit.
  // A chunk is found by H5Dget_chunk_storage_size, a search of the chunk index by its key (an
  // error where the chunk is not allocated). libhdf5 1.10.8's H5Dget_chunk_info_by_coord, which
  // gives the filter mask too, walks the whole index for each chunk: reading a dataset was
  // quadratic in its chunks (three of 16.7 M floats in 65,536 chunks of 1 KiB each: 128 s). It is
  // asked only for a chunk stored in under 4 bytes; a chunk inflated here gives its mask as it
  // is read.
  Status check_chunks(hid_t ds, const std::vector<hsize_t>& dims, ChunkChecks& f, int64_t r0, int64_t r1,
                      const std::string& dpath) {
    if (dims.empty() || f.chunk.size() != dims.size()) return Status::Ok();
    std::vector<hsize_t> at(dims.size(), 0);
    at[0] = static_cast<hsize_t>(r0) / f.chunk[0] * f.chunk[0];
    while (true) {
      hsize_t stored = 0;
      if (H5Dget_chunk_storage_size(ds, at.data(), &stored) >= 0) {
        if (f.fletcher32 && stored < 4) {
          unsigned mask = 0;
          haddr_t address = HADDR_UNDEF;
          const bool skipped = H5Dget_chunk_info_by_coord(ds, at.data(), &mask, &address, &stored) >= 0 &&
                               ((mask >> *f.fletcher32) & 1) != 0;
          if (!skipped)
            return corrupt(fmt::format("{}: dataset '{}': the chunk at [{}] is stored in {} bytes, fewer than its "
                                       "fletcher32 checksum's 4",
                                       path_.string(), dpath, fmt::join(at, ", "), stored));
        }
        if (f.compressor) OPTSTATE_RETURN_IF_ERROR(check_inflated_size(ds, at, dims, f, stored, dpath));
      }
      size_t i = dims.size();  // the next chunk: the last dimension first; rows up to r1
      while (i-- > 0) {
        at[i] += f.chunk[i];
        if (at[i] < (i == 0 ? static_cast<hsize_t>(r1) : dims[i])) break;
        if (i == 0) return Status::Ok();
        at[i] = 0;
      }
    }
  }

  std::string locate(const std::string& fqn, const std::string& entry, Component c, int64_t index) const override {
    return fmt::format("{} dataset '{}'", path_.string(), path_of(fqn, entry, c));
  }

 private:
  static hid_t native_type(DType d) {
    switch (d) {
      case DType::kF32: return H5T_NATIVE_FLOAT;
      case DType::kF64: return H5T_NATIVE_DOUBLE;
      case DType::kBF16:
      case DType::kF16: return H5T_NATIVE_UINT16;
      case DType::kU8: return H5T_NATIVE_UINT8;
      case DType::kI8: return H5T_NATIVE_INT8;
      case DType::kI32: return H5T_NATIVE_INT32;
      case DType::kI64: return H5T_NATIVE_INT64;
      case DType::kI16: return H5T_NATIVE_INT16;
      case DType::kBool: return H5T_NATIVE_UINT8;
      default: break;  // complex, float8, uint16..64: no entry is (check_structure: entries are float)
    }
    return H5T_NATIVE_UINT8;
  }
  std::string path_of(const std::string& fqn, const std::string& entry, Component c) const {
    const Entry& e = meta_.params.at(fqn).entries.at(entry);
    return component_path(fqn, entry, e, c);
  }
  DType dtype_of_component(const std::string& fqn, const std::string& entry, Component c) const {
    return component_dtype(meta_.params.at(fqn).entries.at(entry), c);
  }
  // (element count, element size, elements per row of dim 0)
  Result<std::tuple<int64_t, int64_t, int64_t>> component_info(const std::string& fqn, const std::string& entry,
                                                                Component c) const {
    auto p = meta_.params.find(fqn);
    if (p == meta_.params.end()) return not_found(fmt::format("{}: no param '{}'", path_.string(), fqn));
    auto e = p->second.entries.find(entry);
    if (e == p->second.entries.end())
      return not_found(fmt::format("{}: no entry '{}'", path_.string(), entry_key(fqn, entry)));
    const auto dims = component_dims(p->second, e->second, c);
    int64_t count = 1, row = 1;
    for (size_t i = 0; i < dims.size(); ++i) {
      count *= static_cast<int64_t>(dims[i]);
      if (i > 0) row *= static_cast<int64_t>(dims[i]);
    }
    return std::tuple{count, int64_t{dtype_size(component_dtype(e->second, c))}, std::max<int64_t>(row, 1)};
  }

  Status check_inflated_size(hid_t ds, const std::vector<hsize_t>& at, const std::vector<hsize_t>& dims,
                             ChunkChecks& f, hsize_t stored, const std::string& dpath) {
    const auto chunk_at = [&] {
      return fmt::format("{}: dataset '{}': the chunk at [{}]", path_.string(), dpath, fmt::join(at, ", "));
    };
    const bool szip = f.compressor_id == H5Z_FILTER_SZIP;
    // Deflate inflates at most 1032-fold: a chunk that inflates to at most 64 MiB that way is left
    // to libhdf5 (most chunks of many small params; they cost nothing here).
    constexpr uint64_t kMaxInflateRatio = 1040, kUncheckedInflateBytes = uint64_t{64} << 20;
    if (!szip && stored <= kUncheckedInflateBytes / kMaxInflateRatio) return Status::Ok();
    uint64_t number = 0;  // the chunk's, row-major: each is checked once
    for (size_t i = 0; i < at.size(); ++i)
      number = number * ((dims[i] + f.chunk[i] - 1) / f.chunk[i]) + at[i] / f.chunk[i];
    if (!f.inflated.insert(number).second) return Status::Ok();
    // A compressor writes a chunk only where that makes it smaller (else the chunk is kept as it
    // is, its mask bit set): more than the limit stored is not its.
    if (stored > f.inflate_limit)
      return corrupt(fmt::format("{} is stored {} in {} bytes, more than its {} bytes decompressed can be",
                                 chunk_at(), szip ? "szip-compressed" : "deflated", stored, f.inflate_limit));
    std::vector<std::byte> raw(static_cast<size_t>(stored));
    uint32_t mask = 0;  // the filters skipped for this chunk
    if (H5Dread_chunk(ds, H5P_DEFAULT, at.data(), &mask, raw.data()) < 0) return Status::Ok();  // H5Dread fails too
    if ((mask >> *f.compressor) & 1) return Status::Ok();  // kept as it is, not compressed
    size_t n = raw.size();
    for (unsigned i : f.fletcher32_after)
      if (!((mask >> i) & 1)) n = n >= 4 ? n - 4 : 0;
    if (szip) {  // the decompressed size (u32, little-endian), then the szip stream
      if (n < 4) return Status::Ok();  // libhdf5 refuses it itself
      uint64_t declared = 0;
      for (int i = 3; i >= 0; --i) declared = (declared << 8) | std::to_integer<uint64_t>(raw[static_cast<size_t>(i)]);
      if (declared > f.inflate_limit)
        return corrupt(fmt::format("{} says it decompresses to {} bytes, more than the {} its chunks hold can be "
                                   "(libhdf5 would allocate and fill them)",
                                   chunk_at(), declared, f.inflate_limit));
      return Status::Ok();
    }
    if (n > std::numeric_limits<uInt>::max()) return Status::Ok();  // a chunk of 4 GiB stored: zlib's counts are 32-bit
    z_stream z{};
    if (inflateInit(&z) != Z_OK) return internal_error(fmt::format("{}: zlib's inflateInit failed", chunk_at()));
    z.next_in = reinterpret_cast<Bytef*>(raw.data());
    z.avail_in = static_cast<uInt>(n);
    std::array<Bytef, 64 << 10> scratch;
    int status = Z_OK;
    while (status == Z_OK && z.total_out <= f.inflate_limit) {
      z.next_out = scratch.data();
      z.avail_out = static_cast<uInt>(scratch.size());
      status = inflate(&z, Z_NO_FLUSH);
      if (status == Z_BUF_ERROR && z.avail_in == 0) break;  // cut short: libhdf5 says so itself
    }
    const uint64_t total = z.total_out;
    inflateEnd(&z);
    if (total > f.inflate_limit)
      return corrupt(fmt::format("{} inflates to more than {} bytes, its chunks hold {} (a deflate bomb: libhdf5 "
                                 "would hold it all before using its chunk's bytes)",
                                 chunk_at(), f.inflate_limit, (f.inflate_limit - 1024) / 2));
    return Status::Ok();
  }

  fs::path path_;
  Id file_;
  OptimizerState meta_;
  Unchecked unchecked_;
  ChunkedDatasets chunked_;
  std::string group_fqn_;  // the param whose group group_ is (read_range, under hdf5_mutex)
  Id group_;               // closed before file_
};

Status write_component(hid_t parent, const char* name, const ParamState& ps, const Entry& e, Component c,
                       int compression, const std::string& where) {
  const DType d = component_dtype(e, c);
  const auto dims = component_dims(ps, e, c);
  const int rank = static_cast<int>(dims.size());
  Id space(rank ? H5Screate_simple(rank, dims.data(), nullptr) : H5Screate(H5S_SCALAR), H5Sclose);
  Id dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_obj_track_times(dcpl.get(), false);  // no clock in the file: the same state, the same bytes
  bool empty = false;
  for (hsize_t x : dims) empty = empty || x == 0;
  if (rank > 0 && !empty) {
    // Chunks of whole rows near 1 MiB: fletcher32 checks each, gzip compresses each.
    std::vector<hsize_t> chunk = dims;
    uint64_t row_bytes = dtype_size(d);
    for (size_t i = 1; i < dims.size(); ++i) row_bytes *= dims[i];
    chunk[0] = std::clamp<hsize_t>(kChunkTargetBytes / std::max<uint64_t>(row_bytes, 1), 1, dims[0]);
    if (row_bytes * chunk[0] > (uint64_t{1} << 31))
      return invalid_argument(fmt::format("{}: rows of {} bytes are too large for HDF5 chunks", where, row_bytes));
    H5Pset_chunk(dcpl.get(), rank, chunk.data());
    if (compression > 0) {
      H5Pset_shuffle(dcpl.get());
      H5Pset_deflate(dcpl.get(), static_cast<unsigned>(compression));
    }
    H5Pset_fletcher32(dcpl.get());
  }
  Id ds(H5Dcreate2(parent, name, file_type(d), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT), H5Dclose);
  if (!ds.ok()) return hdf5_failure(where, "cannot create dataset");
  const Buffer& b = e.buffer(c);
  hid_t mem = d == DType::kF32   ? H5T_NATIVE_FLOAT
              : d == DType::kF64 ? H5T_NATIVE_DOUBLE
              : d == DType::kU8  ? H5T_NATIVE_UINT8
              : d == DType::kI8  ? H5T_NATIVE_INT8
              : d == DType::kI32 ? H5T_NATIVE_INT32
              : d == DType::kI64 ? H5T_NATIVE_INT64
                                 : H5T_NATIVE_UINT16;
  if (!empty && H5Dwrite(ds.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, b.data) < 0)
    return hdf5_failure(where, "cannot write dataset");
  OPTSTATE_RETURN_IF_ERROR(set_string_attr(ds.get(), "dtype", std::string(dtype_name(d))).with_context(where));
  return Status::Ok();
}

Status write_file(StateSource& source, const fs::path& file_path, int compression) {
  const OptimizerState& state = source.meta();
  const std::string meta_text = encode_state_meta(state);
  if (meta_text.size() > kMaxMetaBytes)  // what the reader takes: a file it refuses is no checkpoint
    return invalid_argument(fmt::format("the optstate metadata of {} params would be {} bytes, over the {} MiB the "
                                        "reader takes; write this state as dcp",
                                        state.params.size(), meta_text.size(), kMaxMetaBytes >> 20));
  Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  // The 1.10 file format (read by HDF5 1.10 and later: Debian 12's, every h5py wheel since 2.10):
  // a single-chunk dataset keeps its chunk's address in its header where the 1.8 format allocates
  // a whole v1 B-tree node (~2.5 KiB), which made a file of small params 4.5x its size.
  H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_LATEST);
  Id fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  H5Pset_obj_track_times(fcpl.get(), false);  // the root group's header
  Id file(H5Fcreate(file_path.c_str(), H5F_ACC_EXCL, fcpl.get(), fapl.get()), H5Fclose);
  if (!file.ok()) return hdf5_failure(file_path.string(), "cannot create HDF5 file");
  OPTSTATE_RETURN_IF_ERROR(set_string_attr(file.get(), "format", kFormatTag));
  OPTSTATE_RETURN_IF_ERROR(set_i64_attr(file.get(), "layout_version", kLayoutVersion));
  OPTSTATE_RETURN_IF_ERROR(set_string_attr(file.get(), "optimizer", state.kind));
  OPTSTATE_RETURN_IF_ERROR(set_string_attr(file.get(), "optstate", meta_text));
  Id gcpl(H5Pcreate(H5P_GROUP_CREATE), H5Pclose);
  H5Pset_obj_track_times(gcpl.get(), false);
  for (const auto& [fqn, ps] : state.params) {
    const std::string where = fmt::format("{}: param '{}'", file_path.string(), fqn);
    if (fqn.empty() || fqn.find('/') != std::string::npos || fqn == "." )
      return invalid_argument(fmt::format("{}: an HDF5 group name cannot be empty or hold '/'", where));
    Id g(H5Gcreate2(file.get(), fqn.c_str(), H5P_DEFAULT, gcpl.get(), H5P_DEFAULT), H5Gclose);
    if (!g.ok()) return hdf5_failure(where, "cannot create group");
    OPTSTATE_RETURN_IF_ERROR(set_shape_attr(g.get(), "shape", ps.shape));
    OPTSTATE_RETURN_IF_ERROR(set_string_attr(g.get(), "dtype", std::string(dtype_name(ps.param_dtype))));
    OPTSTATE_RETURN_IF_ERROR(set_i64_attr(g.get(), "step", ps.step));
    OPTSTATE_RETURN_IF_ERROR(set_i64_attr(g.get(), "param_group", ps.group));
    for (const auto& [name, me] : ps.entries) {
      const std::string ew = fmt::format("{}: entry '{}'", file_path.string(), entry_key(fqn, name));
      OPTSTATE_RETURN_IF_ERROR(check_interrupt(ew));  // libhdf5 writes on its own, not through OutputFile
      if (name.find('/') != std::string::npos) return invalid_argument(ew + ": name holds '/'");
      OPTSTATE_ASSIGN_OR_RETURN(const Entry e, source.load(fqn, name));
      if (e.encoding == Encoding::kDense) {
        OPTSTATE_RETURN_IF_ERROR(write_component(g.get(), name.c_str(), ps, e, Component::kValues, compression, ew));
        continue;
      }
      Id sub(H5Gcreate2(g.get(), name.c_str(), H5P_DEFAULT, gcpl.get(), H5P_DEFAULT), H5Gclose);
      if (!sub.ok()) return hdf5_failure(ew, "cannot create group");
      OPTSTATE_RETURN_IF_ERROR(set_string_attr(sub.get(), "encoding", "blockwise8"));
      OPTSTATE_RETURN_IF_ERROR(set_i64_attr(sub.get(), "block_size", e.block_size));
      OPTSTATE_RETURN_IF_ERROR(set_string_attr(sub.get(), "qmap", e.qmap));
      for (Component c : e.components())
        OPTSTATE_RETURN_IF_ERROR(write_component(sub.get(), std::string(component_name(c)).c_str(), ps, e, c,
                                                 compression, ew));
    }
  }
  if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) return hdf5_failure(file_path.string(), "flush failed");
  // Closing writes the file's last metadata: a failure here is a damaged file, not to be published.
  if (file.close() < 0) return hdf5_failure(file_path.string(), "close failed");
  return Status::Ok();
}

// Where the superblock starts (the base address libhdf5 takes): at 0 or after a user block of 512,
// 1024, 2048, ... bytes; nullopt without a signature.
std::optional<uint64_t> superblock_offset(const InputFile& f) {
  static constexpr unsigned char kSig[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  for (uint64_t at = 0; at + 8 <= f.size() && at <= (uint64_t{1} << 20); at = at ? at * 2 : 512) {
    std::byte head[8];
    if (!f.read_at(at, head).ok()) return std::nullopt;
    if (std::memcmp(head, kSig, 8) == 0) return at;
  }
  return std::nullopt;
}

bool has_signature(const fs::path& path) {
  auto f = InputFile::open(path);
  return f.ok() && superblock_offset(*f).has_value();
}

// The file's bytes as the checks below read them (hdf5_layout.h): the superblock, and reads at
// addresses relative to its base.
class RawFile {
 public:
  static Result<std::unique_ptr<RawFile>> open(const fs::path& path, const std::string& where) {
    OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(path));
    const auto base = superblock_offset(f);
    if (!base) return corrupt(fmt::format("{}: not an HDF5 file (no signature)", where));
    std::vector<std::byte> head(static_cast<size_t>(std::min<uint64_t>(256, f.size() - *base)));
    OPTSTATE_RETURN_IF_ERROR(f.read_at(*base, head));
    OPTSTATE_ASSIGN_OR_RETURN(Superblock sb, parse_superblock(head, where));
    auto raw = std::unique_ptr<RawFile>(new RawFile(std::move(f), *base, sb));
    OPTSTATE_RETURN_IF_ERROR(read_superblock_extension(raw->reader(), raw->sb_, where));
    OPTSTATE_RETURN_IF_ERROR(check_driver_info_block(raw->reader(), raw->sb_, where));
    return raw;
  }
  const Superblock& superblock() const { return sb_; }
  uint64_t size() const { return file_.size() - base_; }  // bytes from the base on
  Status read(uint64_t address, std::span<std::byte> out) const {
    if (address > size() || out.size() > size() - address)
      return corrupt(fmt::format("{} bytes at address {} lie past the file's end", out.size(), address));
    if (out.size() > kBlockBytes) return file_.read_at(base_ + address, out);
    // Most reads are an object header's few hundred bytes, near the last ones: served from blocks
    // (a read each was half the preads of validate at 50,000 params, 800,000 of them).
    size_t done = 0;
    while (done < out.size()) {
      const uint64_t at = address + done, block = at / kBlockBytes;
      Block& b = blocks_[block % blocks_.size()];
      if (b.index != block) {
        b.index = UINT64_MAX;
        b.bytes.resize(static_cast<size_t>(std::min<uint64_t>(kBlockBytes, size() - block * kBlockBytes)));
        OPTSTATE_RETURN_IF_ERROR(file_.read_at(base_ + block * kBlockBytes, b.bytes));
        b.index = block;
      }
      const size_t offset = static_cast<size_t>(at - block * kBlockBytes);
      const size_t take = std::min(out.size() - done, b.bytes.size() - offset);
      std::memcpy(out.data() + done, b.bytes.data() + offset, take);
      done += take;
    }
    return Status::Ok();
  }
  ReadAt reader() const {
    return [this](uint64_t address, std::span<std::byte> out) { return read(address, out); };
  }

 private:
  RawFile(InputFile f, uint64_t base, Superblock sb) : file_(std::move(f)), base_(base), sb_(sb) {}
  static constexpr uint64_t kBlockBytes = 16 << 10;
  struct Block {
    uint64_t index = UINT64_MAX;
    std::vector<std::byte> bytes;
  };
  InputFile file_;
  uint64_t base_;
  Superblock sb_;
  mutable std::array<Block, 64> blocks_;  // 1 MiB, by block index; used under the HDF5 lock (open)
};

// Before libhdf5 reads the root group's attributes: every attribute message in the root's object
// header lies inside itself (libhdf5 1.10 decodes them all on a lookup, trusting their sizes), and
// the global heap collection a variable-length `format` or `optstate` lies in walks as libhdf5's
// loader will walk it (it loops without end on a damaged one). hdf5_layout.h; attributes not held
// in the root's object header (dense storage, past 8 attributes) are not checked here (FORMAT.md).
Status check_root_attributes(const RawFile& raw, const std::string& where) {
  const Superblock& sb = raw.superblock();
  OPTSTATE_ASSIGN_OR_RETURN(const auto attributes,
                            find_vlen_string_attributes(raw.reader(), sb, sb.root_header, where));
  for (const auto& [name, ref] : attributes) {
    // The two libhdf5 reads; nothing stored: no collection read.
    if ((name != "format" && name != "optstate") || ref.collection == 0) continue;
    const std::string what = fmt::format("{}: attribute '{}'", where, name);
    const std::string at = fmt::format("{}: its global heap collection at {}", what, ref.collection);
    std::byte collection_head[16];
    OPTSTATE_RETURN_IF_ERROR(raw.read(ref.collection, collection_head).with_context(at));
    OPTSTATE_ASSIGN_OR_RETURN(const uint64_t size, parse_collection_size(collection_head, sb.length_size, at));
    if (size > raw.size() - ref.collection)  // read() found its first 16 bytes in the file
      return corrupt(fmt::format("{}: a collection of {} bytes runs past the file's end", at, size));
    std::vector<std::byte> collection(static_cast<size_t>(size));
    OPTSTATE_RETURN_IF_ERROR(raw.read(ref.collection, collection).with_context(at));
    OPTSTATE_RETURN_IF_ERROR(check_collection(collection, sb.length_size, ref, at));
  }
  return Status::Ok();
}

// Where the link `name` under `loc` leads, looked at before libhdf5 follows it (the link's own
// message, not its target's header): nullopt where there is no such link; the object header
// address of a hard link's target, or of a soft link's (a path inside the file, which libhdf5
// resolves: HADDR_UNDEF where it does not). A link to another file (external, or user-defined) is
// refused: a checkpoint reads only its own bytes. libhdf5 looks each name of a soft link's path up
// in the group before it, decoding that group's links: each group the path passes through is given
// to `check_group` first (the first one, the root or the link's own group, was checked already),
// and a path through another soft link is refused.
using GroupCheck = std::function<Status(haddr_t, const std::string& path)>;
Status check_soft_link_path(hid_t loc, const std::string& name, size_t value_size, const std::string& what,
                            const GroupCheck& check_group) {
  std::string value(value_size, '\0');
  if (H5Lget_val(loc, name.c_str(), value.data(), value.size(), H5P_DEFAULT) < 0) return Status::Ok();  // libhdf5 fails too
  value.resize(strnlen(value.c_str(), value.size()));
  // Paths as libhdf5 resolves them from `loc`: absolute from the root; relative from the group the
  // link is in (`name` may pass through groups). Empty and "." names are skipped, as libhdf5 does.
  std::string prefix = !value.empty() && value[0] == '/' ? "/"
                       : name.find('/') != std::string::npos ? name.substr(0, name.rfind('/') + 1)
                                                               : "";
  std::vector<std::string> names;
  for (size_t at = 0; at <= value.size();) {
    const size_t end = std::min(value.find('/', at), value.size());
    if (end > at && value.compare(at, end - at, ".") != 0) names.push_back(value.substr(at, end - at));
    at = end + 1;
  }
  for (size_t i = 0; i + 1 < names.size(); ++i) {
    prefix += names[i];
#if H5_VERSION_GE(1, 12, 0)
    H5L_info2_t info{};
    if (H5Lget_info2(loc, prefix.c_str(), &info, H5P_DEFAULT) < 0) return Status::Ok();  // libhdf5 fails too
    haddr_t address = HADDR_UNDEF;
    if (info.type == H5L_TYPE_HARD && H5VLnative_token_to_addr(loc, info.u.token, &address) < 0) return Status::Ok();
#else
    H5L_info_t info{};
    if (H5Lget_info(loc, prefix.c_str(), &info, H5P_DEFAULT) < 0) return Status::Ok();  // libhdf5 fails too
    const haddr_t address = info.type == H5L_TYPE_HARD ? info.u.address : HADDR_UNDEF;
#endif
    if (info.type != H5L_TYPE_HARD)
      return corrupt(fmt::format("{} is a soft link to '{}', a path through another link ('{}'): this reader follows "
                                 "soft links one at a time",
                                 what, value, names[i]));
    OPTSTATE_RETURN_IF_ERROR(check_group(address, prefix));
    prefix += "/";
  }
  return Status::Ok();
}

Result<std::optional<haddr_t>> link_target(hid_t loc, const std::string& name, const std::string& what,
                                           const GroupCheck& check_group) {
  haddr_t address = HADDR_UNDEF;
#if H5_VERSION_GE(1, 12, 0)
  H5L_info2_t info{};
  if (H5Lget_info2(loc, name.c_str(), &info, H5P_DEFAULT) < 0) return std::optional<haddr_t>();
  if (info.type == H5L_TYPE_HARD && H5VLnative_token_to_addr(loc, info.u.token, &address) < 0)
    return std::optional<haddr_t>();
#else
  H5L_info_t info{};
  if (H5Lget_info(loc, name.c_str(), &info, H5P_DEFAULT) < 0) return std::optional<haddr_t>();
  if (info.type == H5L_TYPE_HARD) address = info.u.address;
#endif
  if (info.type != H5L_TYPE_HARD && info.type != H5L_TYPE_SOFT)
    return corrupt(fmt::format("{} is {} link (to another file): this reader reads only what the file holds itself",
                               what, info.type == H5L_TYPE_EXTERNAL ? "an external" : "a user-defined"));
  if (info.type == H5L_TYPE_SOFT) {  // the target's header, which loading decodes nothing of
    OPTSTATE_RETURN_IF_ERROR(check_soft_link_path(loc, name, info.u.val_size, what, check_group));
#if H5_VERSION_GE(1, 12, 0)
    H5O_info2_t target{};
    if (H5Oget_info_by_name3(loc, name.c_str(), &target, H5O_INFO_BASIC, H5P_DEFAULT) < 0 ||
        H5VLnative_token_to_addr(loc, target.token, &address) < 0)
      address = HADDR_UNDEF;
#else
    H5O_info_t target{};
    address = H5Oget_info_by_name2(loc, name.c_str(), &target, H5O_INFO_BASIC, H5P_DEFAULT) < 0 ? HADDR_UNDEF
                                                                                                  : target.addr;
#endif
  }
  return std::optional<haddr_t>(address);
}

class Hdf5Driver final : public FormatDriver {
 public:
  std::string_view name() const override { return "hdf5"; }
  bool compresses() const override { return true; }

  bool sniff(const fs::path& path) const override {
    std::error_code ec;
    return fs::is_regular_file(path, ec) && has_signature(path);
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
    start_hdf5();
    const std::string where = path.string();
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) return not_found(fmt::format("{}: no such file", where));
    if (!has_signature(path)) return corrupt(fmt::format("{}: not an HDF5 file (no signature)", where));
    // What H5Fopen itself decodes past the superblock (the superblock extension, the driver
    // information block) is checked before it runs (hdf5_layout.h).
    OPTSTATE_ASSIGN_OR_RETURN(const auto raw, RawFile::open(path, where));
    // A metadata cache of 1 MiB at most (libhdf5's default grows to 32 MiB): a cached object
    // header holds its messages decoded, several KiB for a dataset, far more than the bytes the
    // cache counts, and each dataset is opened once at open and once when read. 30,000 params
    // (90,000 datasets): validate held 546 MB, now 90 MB, in the same time (the headers not
    // cached are read again, from the page cache). A larger one (64 MiB initial, 128 MiB most)
    // made validate of 50,000 params slower (9.3 -> 10 s) and 400 MB larger.
    Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    H5AC_cache_config_t cache{};
    cache.version = H5AC__CURR_CACHE_CONFIG_VERSION;
    if (!fapl.ok() || H5Pget_mdc_config(fapl.get(), &cache) < 0)
      return internal_error(fmt::format("{}: libhdf5 gave no file access properties", where));
    cache.set_initial_size = true;
    cache.initial_size = cache.max_size = kMetadataCacheBytes;
    cache.min_size = std::min<size_t>(cache.min_size, kMetadataCacheBytes);
    if (H5Pset_mdc_config(fapl.get(), &cache) < 0)
      return internal_error(fmt::format("{}: libhdf5 refused a metadata cache of {} bytes", where, kMetadataCacheBytes));
    Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
    if (!file.ok()) return corrupt(fmt::format("{}: HDF5 cannot open the file (damaged or truncated)", where));
    // What libhdf5 1.10.8 trusts and fails on in ways other than an error (hdf5_layout.h): the
    // root's attributes and links before it looks at them, each group's links before it looks a
    // name up there, each dataset's header before it opens it.
    OPTSTATE_RETURN_IF_ERROR(check_root_attributes(*raw, where));
    OPTSTATE_RETURN_IF_ERROR(
        check_group_header(raw->reader(), raw->superblock(), raw->superblock().root_header, where).status());
    OPTSTATE_ASSIGN_OR_RETURN(std::string tag, get_string_attr(file.get(), "format", where));
    if (tag != kFormatTag)
      return corrupt(fmt::format("{}: an HDF5 file, but not an optstate checkpoint (format '{}')", where, tag));
    OPTSTATE_ASSIGN_OR_RETURN(std::string text, get_string_attr(file.get(), "optstate", where));
    OPTSTATE_ASSIGN_OR_RETURN(OptimizerState meta, decode_state_meta(text, where));
    // Every component the metadata names is a dataset of the right type and shape.
    Hdf5Reader::Unchecked unchecked;
    Hdf5Reader::ChunkedDatasets chunked;
    for (const auto& [fqn, ps] : meta.params) {
      // The param's group is looked up once, its datasets by names relative to it: each lookup
      // from the root searches a group of every param (at 50,000 params, a third of validate).
      // Each group's header is checked before libhdf5 looks a name up in it (it decodes every
      // link message there), each dataset's before libhdf5 opens it (hdf5_layout.h); each link is
      // looked at before libhdf5 follows it.
      const auto check_group = [&](const std::optional<haddr_t>& at, const std::string& gpath) -> Status {
        if (!at || *at == HADDR_UNDEF) return Status::Ok();
        return check_group_header(raw->reader(), raw->superblock(), *at, fmt::format("{}: group '{}'", where, gpath))
            .status();
      };
      const GroupCheck soft_path_group = [&](haddr_t at, const std::string& path) -> Status {
        if (at == HADDR_UNDEF) return Status::Ok();
        return check_group_header(raw->reader(), raw->superblock(), at,
                                  fmt::format("{}: group '{}', on a soft link's path", where, path))
            .status();
      };
      Id group;
      if (fqn.find('/') == std::string::npos) {
        OPTSTATE_ASSIGN_OR_RETURN(const auto target,
                                  link_target(file.get(), fqn, fmt::format("{}: '/{}'", where, fqn), soft_path_group));
        OPTSTATE_RETURN_IF_ERROR(check_group(target, "/" + fqn));
        if (target) group = Id(H5Gopen2(file.get(), fqn.c_str(), H5P_DEFAULT), H5Gclose);
      }
      for (const auto& [name, e] : ps.entries) {
        bool looked_up = group.ok() && name.find('/') == std::string::npos;
        if (looked_up && e.encoding != Encoding::kDense) {  // the entry's group of components
          const std::string gpath = fmt::format("/{}/{}", fqn, name);
          OPTSTATE_ASSIGN_OR_RETURN(const auto target,
                                    link_target(group.get(), name, fmt::format("{}: '{}'", where, gpath), soft_path_group));
          OPTSTATE_RETURN_IF_ERROR(check_group(target, gpath));
          looked_up = target.has_value();  // else its first dataset is missing
        }
        for (Component c : e.components()) {
          const std::string dpath = component_path(fqn, name, e, c);
          const std::string rel =
              e.encoding == Encoding::kDense ? name : name + "/" + std::string(component_name(c));
          // The link gives the dataset's header, whose messages libhdf5 1.10.8 trusts as it opens
          // the dataset (a chunk dimension of 0: SIGFPE): checked first.
          std::optional<haddr_t> object;
          if (looked_up) {
            OPTSTATE_ASSIGN_OR_RETURN(
                object, link_target(group.get(), rel, fmt::format("{}: '{}'", where, dpath), soft_path_group));
          }
          if (!object) return corrupt(fmt::format("{}: dataset '{}' is missing", where, dpath));
          if (*object != HADDR_UNDEF)
            OPTSTATE_RETURN_IF_ERROR(check_dataset_header(raw->reader(), raw->superblock(), *object,
                                                          fmt::format("{}: dataset '{}'", where, dpath))
                                         .status());
          Id ds(H5Dopen2(group.get(), rel.c_str(), H5P_DEFAULT), H5Dclose);
          if (!ds.ok()) {
            // A dataset in a newer HDF5's file format is one too (h5py under HDF5 2.0 with
            // libver='latest' writes layout messages 1.10 does not know): say so.
            const std::string cause = hdf5_cause();
            unsigned major = 0, minor = 0, release = 0;
            H5get_libversion(&major, &minor, &release);
            return corrupt(fmt::format("{}: '{}' is not a dataset libhdf5 {}.{}.{} can open ({}){}", where, dpath, major,
                                       minor, release, cause,
                                       cause.find("version") != std::string::npos
                                           ? "; a newer HDF5's file format (as h5py under HDF5 2.0 writes with "
                                             "libver='latest') is read by that HDF5 only"
                                           : ""));
          }
          Id type(H5Dget_type(ds.get()), H5Tclose);
          Id space(H5Dget_space(ds.get()), H5Sclose);
          Id dcpl(H5Dget_create_plist(ds.get()), H5Pclose);
          // Where fletcher32 and a compressor (deflate or szip, at most one) are in the pipeline, if
          // they are; what comes after the compressor (its output is what the filters after it are
          // undone to) must be fletcher32.
          Hdf5Reader::ChunkChecks checks;
          const int filters = dcpl.ok() ? H5Pget_nfilters(dcpl.get()) : 0;
          for (int i = 0; i < filters; ++i) {
            unsigned flags = 0, filter_config = 0;
            size_t nvalues = 0;
            const H5Z_filter_t id = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &nvalues, nullptr, 0,
                                                   nullptr, &filter_config);
            if (id == H5Z_FILTER_FLETCHER32 && !checks.fletcher32) checks.fletcher32 = static_cast<unsigned>(i);
            if (id == H5Z_FILTER_FLETCHER32 && checks.compressor) checks.fletcher32_after.push_back(static_cast<unsigned>(i));
            if (id != H5Z_FILTER_FLETCHER32 && checks.compressor)
              return corrupt(fmt::format("{}: dataset '{}' applies filter {} after {}, which this reader does not read "
                                         "(h5py and optstate end a pipeline with its compressor or fletcher32)",
                                         where, dpath, id, checks.compressor_id == H5Z_FILTER_SZIP ? "szip" : "deflate"));
            if (id == H5Z_FILTER_DEFLATE || id == H5Z_FILTER_SZIP) {
              checks.compressor = static_cast<unsigned>(i);
              checks.compressor_id = id;
            }
          }
          ++unchecked.of;
          if (!checks.fletcher32 && unchecked.count++ == 0) unchecked.first = dpath;
          const DType d = component_dtype(e, c);
          const auto want = component_dims(ps, e, c);
          const int rank = H5Sget_simple_extent_ndims(space.get());
          std::vector<hsize_t> dims(static_cast<size_t>(std::max(rank, 0))), max_dims = dims;
          if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), max_dims.data());
          if (rank < 0 || dims != want || H5Tequal(type.get(), file_type(d)) <= 0)
            return corrupt(fmt::format("{}: dataset '{}' does not have the type {} and shape {} the metadata says",
                                       where, dpath, dtype_name(d), format_shape(ps.shape)));
          // libhdf5 1.10 checks a chunk's shape against the dataset's when it creates one, not when
          // it reads one: a chunk larger than a fixed dimension (a damaged layout message) made
          // its H5Dread read freed memory (fuzz_hdf5_file, under ASan).
          if (rank > 0 && dcpl.ok() && H5Pget_layout(dcpl.get()) == H5D_CHUNKED) {
            std::vector<hsize_t> chunk(dims.size(), 0);
            bool fits = H5Pget_chunk(dcpl.get(), rank, chunk.data()) == rank;
            for (int i = 0; i < rank && fits; ++i)
              fits = chunk[i] > 0 && (max_dims[i] == H5S_UNLIMITED || chunk[i] <= std::max<hsize_t>(max_dims[i], 1));
            if (!fits)
              return corrupt(fmt::format("{}: dataset '{}' of shape [{}] has chunks of [{}], larger than the dataset can "
                                         "be",
                                         where, dpath, fmt::join(dims, ", "), fmt::join(chunk, ", ")));
            if (checks.fletcher32 || checks.compressor) {
              // A chunk inflates to its elements' bytes (with a fletcher32 before deflate, 4 more):
              // twice that and 1 KiB bounds it with room to spare.
              uint64_t chunk_bytes = H5Tget_size(type.get());
              for (hsize_t n : chunk) chunk_bytes = n != 0 && chunk_bytes > (uint64_t{1} << 40) / n ? (uint64_t{1} << 40) : chunk_bytes * n;
              checks.inflate_limit = 2 * chunk_bytes + 1024;
              checks.chunk = std::move(chunk);
              chunked.emplace(dpath, std::move(checks));
            }
          }
          // A compact dataset's bytes (in its header) or a contiguous one's (allocated, or not yet:
          // fill values) are its elements' exactly: libhdf5 1.10.8 read 8 bytes of a compact
          // dataset stored in 0 from a null pointer (SIGSEGV; fuzz_hdf5_file).
          const H5D_layout_t layout = dcpl.ok() ? H5Pget_layout(dcpl.get()) : H5D_LAYOUT_ERROR;
          if (layout == H5D_COMPACT || layout == H5D_CONTIGUOUS) {
            uint64_t need = dtype_size(d);
            for (hsize_t x : dims) need *= x;  // the metadata's shape, checked: no overflow
            const hsize_t stored = H5Dget_storage_size(ds.get());
            if (stored != need && !(layout == H5D_CONTIGUOUS && stored == 0))
              return corrupt(fmt::format("{}: dataset '{}' of {} bytes is stored {} in {} bytes", where, dpath, need,
                                         layout == H5D_COMPACT ? "compact" : "contiguous", stored));
          }
        }
      }
    }
    return std::unique_ptr<CheckpointReader>(
        new Hdf5Reader(path, std::move(file), std::move(meta), std::move(unchecked), std::move(chunked)));
  }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    OPTSTATE_RETURN_IF_ERROR(check_structure(source.meta(), false));
    OPTSTATE_RETURN_IF_ERROR(check_json_numbers(source.meta()).with_context(path.string()));
    if (options.compression < 0 || options.compression > 9)
      return invalid_argument(fmt::format("gzip level {} out of range (0-9)", options.compression));
    OPTSTATE_RETURN_IF_ERROR(check_destination(path, options.overwrite));
    OPTSTATE_ASSIGN_OR_RETURN(Staging staging, Staging::file(path));
    Status st;
    {
      std::lock_guard<std::recursive_mutex> lock(hdf5_mutex());
      start_hdf5();
      st = write_file(source, staging.path(), options.compression);
    }
    return staging.commit(st, options.overwrite);
  }
};

}  // namespace

const FormatDriver& driver() {
  static const Hdf5Driver d;
  return d;
}

}  // namespace optstate::hdf5
