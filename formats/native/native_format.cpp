// The native optstate checkpoint: a directory with data files and a JSON manifest.
// Byte layout: formats/native/FORMAT.md.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sys/stat.h>
#include <xxhash.h>

#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "optstate/io.h"
#include "optstate/state_json.h"
#include "native_manifest.h"
#include "registry.h"

namespace optstate::native {
namespace {

constexpr uint64_t kAlign = 64;
// Chunks are capped so that a reader verifying a partial range never reads much beyond it.
constexpr uint64_t kMaxChunkBytes = uint64_t{16} << 20;

class NativeReader final : public CheckpointReader {
 public:
  NativeReader(fs::path dir, Manifest manifest) : dir_(std::move(dir)), m_(std::move(manifest)) {}
  std::string_view format() const override { return "native"; }
  bool checksummed() const override { return true; }
  const fs::path& path() const override { return dir_; }
  const OptimizerState& meta() const override { return m_.state; }
  std::optional<int64_t> ranks() const override { return static_cast<int64_t>(m_.files.size()); }

  std::string locate(const std::string& fqn, const std::string& entry, Component c, int64_t index) const override {
    auto it = m_.chunks.find(ChunkKey{fqn, entry, c});
    if (it != m_.chunks.end())
      for (const Chunk& ch : it->second)
        if (index >= ch.begin && index < ch.end) {
          const auto* e = &m_.state.params.at(fqn).entries.at(entry);
          return fmt::format("{} at byte {}", m_.files[ch.file].full_path.string(),
                             ch.offset + static_cast<uint64_t>(index - ch.begin) * component_elem_size(*e, c));
        }
    return dir_.string();
  }

  Status stream(const std::string& fqn, const std::string& entry, Component c, const ByteSink& sink) override {
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Chunk>* chunks, chunks_of(fqn, entry, c));
    for (const Chunk& ch : *chunks) OPTSTATE_RETURN_IF_ERROR(read_chunk(ch, fqn, entry, c, sink));
    return Status::Ok();
  }

  // Reads only the chunks that overlap [begin, end); each is verified whole (chunks are at most
  // kMaxChunkBytes, so a rank reads at most that much beyond its range at either end).
  Status read_range(const std::string& fqn, const std::string& entry, Component c, int64_t begin, int64_t end,
                    std::span<std::byte> out) override {
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Chunk>* chunks, chunks_of(fqn, entry, c));
    const Entry& e = m_.state.params.at(fqn).entries.at(entry);
    const int64_t elem = component_elem_size(e, c);
    const int64_t count = chunks->empty() ? 0 : chunks->back().end;
    if (begin < 0 || end < begin || end > count || static_cast<int64_t>(out.size()) != (end - begin) * elem)
      return invalid_argument(fmt::format("range [{}, {}) of entry '{}' {} is outside [0, {}) or does not fit",
                                          begin, end, entry_key(fqn, entry), component_name(c), count));
    for (const Chunk& ch : *chunks) {
      if (ch.end <= begin || ch.begin >= end) continue;
      if (ch.begin >= begin && ch.end <= end && ch.length == static_cast<uint64_t>((ch.end - ch.begin) * elem)) {
        // The whole chunk is wanted: read it straight into place and verify it there.
        const std::span<std::byte> dst = out.subspan(static_cast<size_t>((ch.begin - begin) * elem), ch.length);
        OPTSTATE_RETURN_IF_ERROR(read_chunk_into(ch, fqn, entry, c, dst));
        continue;
      }
      int64_t at = ch.begin;  // element index of the next byte the sink sees
      OPTSTATE_RETURN_IF_ERROR(read_chunk(ch, fqn, entry, c, [&](std::span<const std::byte> piece) {
        const int64_t n = static_cast<int64_t>(piece.size()) / elem;
        const int64_t a = std::max(at, begin), b = std::min(at + n, end);
        if (a < b)
          std::memcpy(out.data() + (a - begin) * elem, piece.data() + (a - at) * elem,
                      static_cast<size_t>((b - a) * elem));
        at += n;
        return Status::Ok();
      }));
    }
    return Status::Ok();
  }

 private:
  Result<const std::vector<Chunk>*> chunks_of(const std::string& fqn, const std::string& entry, Component c) const {
    auto it = m_.chunks.find(ChunkKey{fqn, entry, c});
    if (it == m_.chunks.end())
      return not_found(fmt::format("{}: no {} of entry '{}'", dir_.string(), component_name(c), entry_key(fqn, entry)));
    return &it->second;
  }

  // Streams one chunk in pieces; the last piece is handed on only after the chunk's checksum matched.
  Status read_chunk(const Chunk& ch, const std::string& fqn, const std::string& entry, Component c,
                    const ByteSink& sink) {
    OPTSTATE_ASSIGN_OR_RETURN(const InputFile* file, open_file(ch.file));
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    Status status;
    for (uint64_t done = 0; done < ch.length && status.ok();) {
      const uint64_t n = std::min<uint64_t>(kStreamPieceBytes, ch.length - done);
      const std::span<std::byte> piece = piece_.for_read(ch.offset + done, n);
      status = file->read_at(ch.offset + done, piece);
      if (!status.ok()) break;
      XXH3_64bits_update(st, piece.data(), piece.size());
      done += n;
      if (done == ch.length && XXH3_64bits_digest(st) != ch.xxh3) break;
      status = sink(piece);
    }
    const uint64_t got = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    OPTSTATE_RETURN_IF_ERROR(status.with_context(fmt::format("entry '{}'", entry_key(fqn, entry))));
    return check_sum(*file, ch, fqn, entry, c, got);
  }

  static Status check_sum(const InputFile& file, const Chunk& ch, const std::string& fqn, const std::string& entry,
                          Component c, uint64_t got) {
    if (got == ch.xxh3) return Status::Ok();
    return corrupt(fmt::format("{}: checksum mismatch in bytes [{}, {}) holding entry '{}' {} [{}, {}): "
                               "manifest says {}, data gives {}",
                               file.path().string(), ch.offset, ch.offset + ch.length, entry_key(fqn, entry),
                               component_name(c), ch.begin, ch.end, u64_hex(ch.xxh3), u64_hex(got)));
  }

  Status read_chunk_into(const Chunk& ch, const std::string& fqn, const std::string& entry, Component c,
                         std::span<std::byte> dst) {
    OPTSTATE_ASSIGN_OR_RETURN(const InputFile* file, open_file(ch.file));
    OPTSTATE_RETURN_IF_ERROR(
        file->read_at(ch.offset, dst).with_context(fmt::format("entry '{}'", entry_key(fqn, entry))));
    return check_sum(*file, ch, fqn, entry, c, xxh3_64(dst));
  }

  Result<const InputFile*> open_file(size_t index) {
    auto it = open_.find(index);
    if (it != open_.end()) return &it->second;
    const DataFile& df = m_.files[index];
    OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(df.full_path));
    if (f.size() != df.size)
      return corrupt(fmt::format("{}: file has {} bytes, manifest says {} (truncated or replaced)",
                                 df.full_path.string(), f.size(), df.size));
    return &open_.emplace(index, std::move(f)).first->second;
  }

  fs::path dir_;
  Manifest m_;
  std::map<size_t, InputFile> open_;
  ReadBuffer piece_;  // reused between chunks
};

}  // namespace

std::string rank_file_name(int rank) { return fmt::format("data/rank-{:05d}.bin", rank); }

namespace {

// One rank's data file while it is written: components' ranges appended in chunks of at most
// kMaxChunkBytes, each 64-byte aligned and hashed.
class RankFileWriter {
 public:
  static Result<RankFileWriter> create(const fs::path& staging, int rank) {
    OPTSTATE_ASSIGN_OR_RETURN(OutputFile out, OutputFile::create(staging / rank_file_name(rank)));
    return RankFileWriter(std::move(out), rank);
  }
  // Elements [r.begin, r.end) of a component; `bytes` holds exactly them.
  Status append(const std::string& fqn, const std::string& entry, Component c, FlatRange r, int64_t elem,
                std::span<const std::byte> bytes) {
    const int64_t per_chunk = std::max<int64_t>(1, static_cast<int64_t>(kMaxChunkBytes) / elem);
    for (int64_t b = r.begin; b < r.end; b += per_chunk) {
      const int64_t end = std::min(r.end, b + per_chunk);
      const auto piece = bytes.subspan(static_cast<size_t>((b - r.begin) * elem), static_cast<size_t>((end - b) * elem));
      OPTSTATE_RETURN_IF_ERROR(out_.write_zeros((kAlign - out_.offset() % kAlign) % kAlign));
      Chunk ch;
      ch.file = static_cast<size_t>(rank_);
      ch.offset = out_.offset();
      ch.length = piece.size();
      ch.begin = b;
      ch.end = end;
      ch.xxh3 = xxh3_64(piece);
      OPTSTATE_RETURN_IF_ERROR(out_.write(piece));
      rf_.chunks.emplace_back(ChunkKey{fqn, entry, c}, ch);
    }
    return Status::Ok();
  }
  Result<RankFile> finish() {
    rf_.size = out_.offset();
    OPTSTATE_RETURN_IF_ERROR(out_.sync_and_close());
    return std::move(rf_);
  }

 private:
  RankFileWriter(OutputFile out, int rank) : out_(std::move(out)), rank_(rank) {}
  OutputFile out_;
  int rank_;
  RankFile rf_;
};

// A write to more ranks than this reads its source once per this many ranks: each pass keeps one
// file per rank open and loads each entry once. Open files are limited: a pass takes at most a
// quarter of the soft limit (inputs may hold half).
int ranks_per_pass() { return static_cast<int>(std::clamp<size_t>(max_open_inputs() / 2, 4, 256)); }

}  // namespace

// Writes one rank's data file: its shard of every component (DESIGN §2). Each buffer of `local`
// holds exactly that shard.
Result<RankFile> write_rank_file(const OptimizerState& local, const fs::path& staging, int world, int rank) {
  OPTSTATE_ASSIGN_OR_RETURN(RankFileWriter out, RankFileWriter::create(staging, rank));
  for (const auto& [fqn, ps] : local.params)
    for (const auto& [name, e] : ps.entries)
      for (Component c : e.components()) {
        const FlatRange r = shard_range(e, c, ps.shape, world, rank);
        const int64_t elem = component_elem_size(e, c);
        if (static_cast<int64_t>(e.buffer(c).size) != r.size() * elem)
          return invalid_argument(fmt::format("entry '{}' {} holds {} bytes, rank {} of {} needs elements [{}, {})",
                                              entry_key(fqn, name), component_name(c), e.buffer(c).size, rank, world,
                                              r.begin, r.end));
        OPTSTATE_RETURN_IF_ERROR(out.append(fqn, name, c, r, elem, e.buffer(c).span()));
      }
  return out.finish();
}

void add_rank_file(Manifest& m, const fs::path& staging, int rank, const RankFile& rf) {
  const std::string rel = rank_file_name(rank);
  if (m.files.size() <= static_cast<size_t>(rank)) m.files.resize(static_cast<size_t>(rank) + 1);
  m.files[static_cast<size_t>(rank)] = DataFile{rel, rf.size, staging / rel};
  for (const auto& [key, ch] : rf.chunks) {
    Chunk c = ch;
    c.file = static_cast<size_t>(rank);
    m.chunks[key].push_back(c);
  }
}

namespace {

class NativeDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "native"; }
  bool shards() const override { return true; }

  bool sniff(const fs::path& path) const override {
    std::error_code ec;
    return fs::is_directory(path, ec) && fs::is_regular_file(path / kManifestName, ec);
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::exists(path, ec)) return not_found(fmt::format("{}: no such file or directory", path.string()));
    if (!fs::is_directory(path, ec)) return invalid_argument(fmt::format("{}: not a directory", path.string()));
    const fs::path manifest_path = path / kManifestName;
    if (!fs::exists(manifest_path, ec))
      return not_found(fmt::format("{}: not an optstate checkpoint (no {})", path.string(), kManifestName));
    OPTSTATE_ASSIGN_OR_RETURN(auto bytes, read_small_file(manifest_path, kMaxManifestBytes));
    OPTSTATE_ASSIGN_OR_RETURN(Manifest m, parse_manifest(bytes, path));
    // Declared sizes are checked against the files before anything is read or allocated.
    for (const DataFile& df : m.files) {
      const fs::file_status st = fs::status(df.full_path, ec);
      if (fs::exists(st) && !fs::is_regular_file(st))  // a FIFO or device there is not read (or waited on)
        return corrupt(fmt::format("{}: data file is not a regular file", df.full_path.string()));
      auto size = fs::file_size(df.full_path, ec);
      if (ec) return not_found(fmt::format("{}: data file missing ({})", df.full_path.string(), ec.message()));
      if (size != df.size)
        return corrupt(fmt::format("{}: file has {} bytes, manifest says {} (truncated or replaced)",
                                   df.full_path.string(), size, df.size));
    }
    return std::unique_ptr<CheckpointReader>(new NativeReader(path, std::move(m)));
  }

  Status write(StateSource& source, const fs::path& path, const WriteOptions& options) const override {
    OPTSTATE_RETURN_IF_ERROR(check_structure(source.meta(), false));
    OPTSTATE_RETURN_IF_ERROR(check_json_numbers(source.meta()).with_context(path.string()));
    OPTSTATE_RETURN_IF_ERROR(check_destination(path, options.overwrite));
    if (options.world_size < 1 || options.world_size > 65536)
      return invalid_argument(fmt::format("world size {} out of range", options.world_size));
    OPTSTATE_ASSIGN_OR_RETURN(Staging staging, Staging::directory(path));
    return staging.commit(write_into(source, staging.path(), options.world_size), options.overwrite);
  }

 private:
  // Entries outer, ranks inner: each entry is loaded once per pass and each rank's range of it
  // appended to that rank's file, so the files come out as write_rank_file writes them.
  static Status write_into(StateSource& source, const fs::path& staging, int world) {
    if (::mkdir((staging / "data").c_str(), 0755) != 0)
      return io_error(fmt::format("{}: cannot create data directory", staging.string()));
    const OptimizerState& meta = source.meta();
    Manifest m;
    m.state = meta;
    const int per_pass = ranks_per_pass();
    for (int first = 0; first < world; first += per_pass) {
      const int last = std::min(world, first + per_pass);
      std::vector<RankFileWriter> outs;
      for (int rank = first; rank < last; ++rank) {
        OPTSTATE_ASSIGN_OR_RETURN(RankFileWriter w, RankFileWriter::create(staging, rank));
        outs.push_back(std::move(w));
      }
      for (const auto& [fqn, ps] : meta.params)
        for (const auto& [name, me] : ps.entries) {
          OPTSTATE_ASSIGN_OR_RETURN(const Entry e, source.load(fqn, name));
          for (Component c : me.components()) {
            const int64_t elem = component_elem_size(me, c);
            for (int rank = first; rank < last; ++rank) {
              const FlatRange r = shard_range(me, c, ps.shape, world, rank);
              const auto bytes = e.buffer(c).span().subspan(static_cast<size_t>(r.begin * elem),
                                                            static_cast<size_t>(r.size() * elem));
              OPTSTATE_RETURN_IF_ERROR(outs[static_cast<size_t>(rank - first)].append(fqn, name, c, r, elem, bytes));
            }
          }
        }
      for (int rank = first; rank < last; ++rank) {
        OPTSTATE_ASSIGN_OR_RETURN(RankFile rf, outs[static_cast<size_t>(rank - first)].finish());
        add_rank_file(m, staging, rank, rf);
      }
    }
    OPTSTATE_RETURN_IF_ERROR(fsync_directory(staging / "data"));
    const std::string text = serialize_manifest(m);
    OPTSTATE_RETURN_IF_ERROR(check_manifest_size(text.size(), m.state.params.size(), kManifestName));
    return write_small_file(staging / kManifestName, std::as_bytes(std::span(text)));
  }
};

}  // namespace

const FormatDriver& driver() {
  static const NativeDriver d;
  return d;
}

}  // namespace optstate::native
