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

Result<safetensors::Header> read_header(const fs::path& path) {
  const std::string where = path.string();
  OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(path));
  if (f.size() < 8) return corrupt(fmt::format("{}: too short for a safetensors file", where));
  std::byte head[8];
  OPTSTATE_RETURN_IF_ERROR(f.read_at(0, head));
  OPTSTATE_ASSIGN_OR_RETURN(const uint64_t n, safetensors::parse_header_length(head, f.size(), where));
  std::vector<std::byte> json_bytes(n);
  OPTSTATE_RETURN_IF_ERROR(f.read_at(8, json_bytes));
  return safetensors::parse_header(json_bytes, f.size() - 8 - n, where);
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

}  // namespace optstate::dcp::hf_storage
