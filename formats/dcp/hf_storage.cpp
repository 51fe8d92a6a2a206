#include "hf_storage.h"

#include <fmt/format.h>

#include <algorithm>
#include <system_error>
#include <vector>

#include "optstate/io.h"
#include "optstate/json_strict.h"
#include "optstate/state.h"

namespace optstate::dcp::hf_storage {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// saved_offsets of each tensor the sharding info places.
Result<std::map<std::string, std::vector<int64_t>>> parse_sharding_info(const std::string& text, const std::string& where) {
  if (text.size() > kMaxShardingInfoBytes)
    return corrupt(fmt::format("{}: {} of {} bytes; up to {} are read", where, kShardingInfoKey, text.size(),
                               kMaxShardingInfoBytes));
  std::optional<std::string> twice;
  std::string refused;
  const json doc = parse_json_strict(text.data(), text.data() + text.size(), twice, refused);
  if (!refused.empty()) return corrupt(fmt::format("{}: {}: JSON {}", where, kShardingInfoKey, refused));
  if (doc.is_discarded() || !doc.is_object())
    return corrupt(fmt::format("{}: {} is not a JSON object", where, kShardingInfoKey));
  if (twice) return corrupt(fmt::format("{}: {} names '{}' twice", where, kShardingInfoKey, *twice));
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& [name, v] : doc.items()) {
    const auto offsets = v.is_object() ? v.find("saved_offsets") : v.end();
    if (offsets == v.end() || !offsets->is_array())
      return corrupt(fmt::format("{}: {}: tensor '{}' has no saved_offsets list", where, kShardingInfoKey, name));
    std::vector<int64_t> o;
    for (const json& x : *offsets) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0)
        return corrupt(fmt::format("{}: {}: tensor '{}' has an offset that is not a whole number >= 0", where,
                                   kShardingInfoKey, name));
      o.push_back(x.get<int64_t>());
    }
    out.emplace(name, std::move(o));
  }
  return out;
}

// The header of the safetensors blob at `at` in `f`, which runs to the file's end.
Result<safetensors::Header> read_header(const InputFile& f, uint64_t at, const std::string& where) {
  if (f.size() < at || f.size() - at < 8) return corrupt(fmt::format("{}: too short for a safetensors file", where));
  std::byte head[8];
  OPTSTATE_RETURN_IF_ERROR(f.read_at(at, head));
  OPTSTATE_ASSIGN_OR_RETURN(const uint64_t n, safetensors::parse_header_length(head, f.size() - at, where));
  std::vector<std::byte> json_bytes(n);
  OPTSTATE_RETURN_IF_ERROR(f.read_at(at + 8, json_bytes));
  return safetensors::parse_header(json_bytes, f.size() - at - 8 - n, where);
}

Result<safetensors::Header> read_header(const fs::path& path) {
  OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(path));
  return read_header(f, 0, path.string());
}

// The folder's safetensors files, sorted by name.
Result<std::vector<std::string>> safetensors_files(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.' || it->path().extension() != ".safetensors" || !it->is_regular_file(ec)) continue;
    names.push_back(name);
    if (names.size() > kMaxFiles) return corrupt(fmt::format("{}: more than {} safetensors files", dir.string(), kMaxFiles));
  }
  if (ec) return io_error(fmt::format("{}: {}", dir.string(), ec.message()));
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

Status add_file(const safetensors::Header& h, const std::string& relative_path, Metadata& md, const std::string& where) {
  std::map<std::string, std::vector<int64_t>> placed;
  const auto info = h.metadata.find(kShardingInfoKey);
  if (info != h.metadata.end()) {
    OPTSTATE_ASSIGN_OR_RETURN(placed, parse_sharding_info(info->second, where));
  }
  for (const auto& [name, t] : h.tensors) {
    const std::string tw = fmt::format("{}: tensor '{}'", where, name);
    std::vector<int64_t> offsets(t.shape.size(), 0);
    if (info != h.metadata.end()) {
      const auto p = placed.find(name);
      if (p == placed.end()) return corrupt(fmt::format("{}: not placed by {}", tw, kShardingInfoKey));
      offsets = p->second;
    }
    if (offsets.size() != t.shape.size())
      return corrupt(fmt::format("{}: {} saved_offsets for a piece of {} axes", tw, offsets.size(), t.shape.size()));
    for (size_t d = 0; d < offsets.size(); ++d)
      if (offsets[d] > (int64_t{1} << 50) || t.shape[d] > (int64_t{1} << 50))
        return corrupt(fmt::format("{}: a piece {} at {} ends past 2^50 elements along an axis", tw, format_shape(t.shape),
                                   format_shape(offsets)));
    auto [it, fresh] = md.items.try_emplace(name);
    ItemMeta& im = it->second;
    if (fresh) {
      im.is_tensor = true;
      im.dtype = t.dtype;
      md.order.push_back(name);
    } else if (im.dtype != t.dtype || im.chunks.front().sizes.size() != t.shape.size()) {
      return corrupt(fmt::format("{}: a piece of {} {} where another file's is {} of {} axes", tw, dtype_name(t.dtype),
                                 format_shape(t.shape), dtype_name(im.dtype), im.chunks.front().sizes.size()));
    }
    StorageLoc loc;
    loc.relative_path = relative_path;
    loc.offset = h.data_start + t.begin;
    loc.length = t.end - t.begin;
    loc.raw_shape = t.shape;
    if (!md.storage.emplace(ChunkKey{name, offsets}, std::move(loc)).second)
      return corrupt(fmt::format("{}: a second piece at offsets {}", tw, format_shape(offsets)));
    im.chunks.push_back(ChunkMeta{std::move(offsets), t.shape});
  }
  return Status::Ok();
}

void finish(Metadata& md) {
  for (auto& [name, im] : md.items) {
    im.size.assign(im.chunks.front().sizes.size(), 0);
    for (const ChunkMeta& c : im.chunks)
      for (size_t d = 0; d < c.sizes.size(); ++d) im.size[d] = std::max(im.size[d], c.offsets[d] + c.sizes[d]);
  }
}

bool is_hf_storage_folder(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec) || fs::exists(dir / ".metadata", ec)) return false;
  const auto names = safetensors_files(dir);
  return names.ok() && !names->empty();
}

Result<Metadata> read_hf_storage_folder(const fs::path& dir) {
  OPTSTATE_ASSIGN_OR_RETURN(const std::vector<std::string> names, safetensors_files(dir));
  if (names.empty()) return not_found(fmt::format("{}: no safetensors files", dir.string()));
  Metadata md;
  for (const std::string& name : names) {
    OPTSTATE_ASSIGN_OR_RETURN(const safetensors::Header h, read_header(dir / name));
    OPTSTATE_RETURN_IF_ERROR(add_file(h, name, md, (dir / name).string()));
  }
  finish(md);
  return md;
}

Result<bool> resolve_safetensors_blobs(const fs::path& dir, Metadata& md) {
  // The tensor chunks by file. A blob's chunks all have its start as their offset: only a file whose
  // tensor chunks share one offset is looked at (one read of 9 bytes), not DCP's usual files.
  std::map<std::string, std::vector<std::pair<const ChunkKey*, StorageLoc*>>> files;
  for (auto& [key, loc] : md.storage) {
    const auto im = md.items.find(key.first);
    if (im == md.items.end() || !im->second.is_tensor || !loc.transforms.empty() || loc.raw_shape) continue;
    files[loc.relative_path].emplace_back(&key, &loc);
  }
  bool any = false;
  for (const auto& [relative, chunks] : files) {
    const uint64_t offset = chunks.front().second->offset;
    if (std::any_of(chunks.begin(), chunks.end(), [&](const auto& c) { return c.second->offset != offset; }))
      continue;
    // A path out of the folder, a missing or short file: the reader's checks name the item.
    const auto contained = contained_path(dir, relative);
    if (!contained.ok()) continue;
    const fs::path& path = *contained;
    auto f = InputFile::open(path);
    std::byte head[9];
    if (!f.ok() || f->size() < offset || f->size() - offset < 9 || !f->read_at(offset, head).ok() ||
        head[8] != std::byte{'{'})
      continue;  // a torch.save archive (a zip's local header), or nothing: the reader says which
    const std::string where = fmt::format("{} (the safetensors blob at byte {})", path.string(), offset);
    OPTSTATE_ASSIGN_OR_RETURN(const safetensors::Header h, read_header(*f, offset, where));
    if (!h.metadata.count(kShardingInfoKey)) continue;  // not DCP's: the reader says what it found
    Metadata pieces;
    OPTSTATE_RETURN_IF_ERROR(add_file(h, relative, pieces, where));
    for (const auto& chunk_loc : chunks) {
      const ChunkKey* key = chunk_loc.first;  // not a structured binding: the lambda below captures it
      const StorageLoc* loc = chunk_loc.second;
      const ItemMeta& im = md.items.at(key->first);
      const std::string iw = fmt::format("{}: item '{}' chunk at {}", where, key->first, format_shape(key->second));
      const auto piece = pieces.storage.find(*key);
      if (piece == pieces.storage.end()) return corrupt(iw + ": not in the blob at these offsets");
      const auto chunk = std::find_if(im.chunks.begin(), im.chunks.end(),
                                      [&](const ChunkMeta& c) { return c.offsets == key->second; });
      const ItemMeta& stored = pieces.items.at(key->first);
      if (chunk == im.chunks.end() || *piece->second.raw_shape != chunk->sizes || stored.dtype != im.dtype ||
          piece->second.length != loc->length)
        return corrupt(fmt::format("{}: the blob holds {} {} ({} bytes), the metadata says {} {} ({} bytes)", iw,
                                   dtype_name(stored.dtype), format_shape(*piece->second.raw_shape),
                                   piece->second.length, dtype_name(im.dtype),
                                   chunk == im.chunks.end() ? "(no such chunk)" : format_shape(chunk->sizes),
                                   loc->length));
    }
    for (const auto& [key, loc] : chunks) {
      *loc = pieces.storage.at(*key);
      loc->offset += offset;
    }
    any = true;
  }
  return any;
}

}  // namespace optstate::dcp::hf_storage
