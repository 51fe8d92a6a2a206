#include "zarr.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <system_error>

#include "optstate/json_strict.h"
#include "optstate/io.h"
#include "optstate/state.h"

namespace optstate::dcp::zarr {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// numpy's dtype strings as zarr writes them (`<` little-endian, `|` for one byte), and "bfloat16",
// which Megatron-Core writes over zarr's "<V2" where tensorstore registers numpy's bfloat16.
struct ZarrDType {
  std::string_view name;
  DType dtype;
};
constexpr ZarrDType kZarrDTypes[] = {
    {"<f4", DType::kF32}, {"<f2", DType::kF16},  {"<f8", DType::kF64},  {"bfloat16", DType::kBF16},
    {"|u1", DType::kU8},  {"|i1", DType::kI8},   {"<i2", DType::kI16},  {"<i4", DType::kI32},
    {"<i8", DType::kI64}, {"|b1", DType::kBool}, {"<c8", DType::kC64}, {"<c16", DType::kC128},
    {"<u2", DType::kU16}, {"<u4", DType::kU32},  {"<u8", DType::kU64},
};

Result<std::vector<int64_t>> int_list(const json& doc, const char* key, const std::string& where) {
  const auto it = doc.find(key);
  if (it == doc.end() || !it->is_array()) return corrupt(fmt::format("{}: no '{}' list", where, key));
  if (it->size() > static_cast<size_t>(kMaxRank))
    return corrupt(fmt::format("{}: '{}' of {} axes; up to {} are read", where, key, it->size(), kMaxRank));
  std::vector<int64_t> out;
  for (const json& v : *it) {
    if (!v.is_number_integer()) return corrupt(fmt::format("{}: '{}' holds a non-integer", where, key));
    out.push_back(v.get<int64_t>());
  }
  return out;
}

bool is_null_or_empty(const json& doc, const char* key) {
  const auto it = doc.find(key);
  return it == doc.end() || it->is_null() || (it->is_array() && it->empty());
}

}  // namespace

Result<Array> parse_zarray(std::string_view text, const std::string& where) {
  if (text.size() > kMaxZarrayBytes) return corrupt(fmt::format("{}: {} bytes; up to {} are read", where, text.size(), kMaxZarrayBytes));
  std::optional<std::string> duplicate;
  std::string refused;
  const json doc = parse_json_strict(text.data(), text.data() + text.size(), duplicate, refused);
  if (!refused.empty()) return corrupt(fmt::format("{}: JSON {}", where, refused));
  if (doc.is_discarded() || !doc.is_object()) return corrupt(where + ": not a JSON object");
  if (duplicate) return corrupt(fmt::format("{}: key '{}' twice", where, *duplicate));
  const auto format = doc.find("zarr_format");
  if (format == doc.end() || !format->is_number_integer() || format->get<int64_t>() != 2)
    return unsupported(where + ": not zarr_format 2 (Megatron-Core's zarr backend writes zarr 2 arrays)");
  Array a;
  OPTSTATE_ASSIGN_OR_RETURN(a.shape, int_list(doc, "shape", where));
  OPTSTATE_ASSIGN_OR_RETURN(a.chunks, int_list(doc, "chunks", where));
  if (a.shape.size() != a.chunks.size())
    return corrupt(fmt::format("{}: shape {} and chunks {} have different axes", where, format_shape(a.shape),
                               format_shape(a.chunks)));
  const auto numel = checked_numel(a.shape);
  if (!numel.ok()) return corrupt(fmt::format("{}: shape {}: {}", where, format_shape(a.shape), numel.status().message()));
  for (const int64_t c : a.chunks)
    if (c < 1) return corrupt(fmt::format("{}: chunks {} holds an axis under 1", where, format_shape(a.chunks)));
  const auto dt = doc.find("dtype");
  if (dt == doc.end() || !dt->is_string())
    return unsupported(where + ": a dtype that is not one numpy type (a structured dtype)");
  const std::string dname = dt->get<std::string>();
  const auto known = std::find_if(std::begin(kZarrDTypes), std::end(kZarrDTypes),
                                  [&](const ZarrDType& z) { return z.name == dname; });
  if (known == std::end(kZarrDTypes))
    return unsupported(fmt::format("{}: dtype '{}' is not read (little-endian numbers and bfloat16 are)", where,
                                   printable(dname)));
  a.dtype = known->dtype;
  if (!is_null_or_empty(doc, "compressor"))
    return unsupported(fmt::format("{}: chunks compressed with {}; optstate reads uncompressed arrays, as "
                                   "Megatron-Core writes them (compressor null)",
                                   where, printable(doc["compressor"].dump())));
  if (!is_null_or_empty(doc, "filters"))
    return unsupported(where + ": chunks stored through filters; optstate reads unfiltered arrays (filters null)");
  const auto order = doc.find("order");
  if (order != doc.end() && !(order->is_string() && order->get<std::string>() == "C"))
    return unsupported(where + ": chunks in Fortran order; optstate reads C order (order \"C\")");
  if (const auto sep = doc.find("dimension_separator"); sep != doc.end() && !sep->is_null()) {
    if (!sep->is_string() || !(sep->get<std::string>() == "." || sep->get<std::string>() == "/"))
      return corrupt(where + ": dimension_separator neither \".\" nor \"/\"");
    a.separator = sep->get<std::string>()[0];
  }
  // the grid's size and a chunk's, checked before anything is sized by them
  int64_t count = 1;
  for (size_t i = 0; i < a.shape.size(); ++i) {
    const int64_t along = a.shape[i] == 0 ? 0 : (a.shape[i] - 1) / a.chunks[i] + 1;
    if (along != 0 && count > kMaxChunksPerArray / along)
      return corrupt(fmt::format("{}: shape {} in chunks {}: more than {} chunks", where, format_shape(a.shape),
                                 format_shape(a.chunks), kMaxChunksPerArray));
    count *= along;
  }
  uint64_t bytes = dtype_size(a.dtype);
  for (const int64_t c : a.chunks) {
    if (static_cast<uint64_t>(c) > kMaxChunkBytes / bytes)
      return corrupt(fmt::format("{}: chunks {}: a chunk over {} bytes", where, format_shape(a.chunks), kMaxChunkBytes));
    bytes *= static_cast<uint64_t>(c);
  }
  return a;
}

int64_t chunk_count(const Array& a) {
  int64_t count = 1;
  for (size_t i = 0; i < a.shape.size(); ++i) count *= a.shape[i] == 0 ? 0 : (a.shape[i] - 1) / a.chunks[i] + 1;
  return count;
}

std::string chunk_file_name(std::span<const int64_t> index, char separator) {
  if (index.empty()) return "0";
  return fmt::format("{}", fmt::join(index, std::string_view(&separator, 1)));
}

uint64_t chunk_bytes(const Array& a) {
  uint64_t bytes = dtype_size(a.dtype);
  for (const int64_t c : a.chunks) bytes *= static_cast<uint64_t>(c);
  return bytes;
}

std::vector<GridChunk> chunk_grid(const Array& a) {
  std::vector<GridChunk> out;
  const int64_t count = chunk_count(a);
  if (count == 0) return out;
  out.reserve(static_cast<size_t>(count));
  const size_t n = a.shape.size();
  std::vector<int64_t> index(n, 0);
  for (int64_t k = 0; k < count; ++k) {
    GridChunk g;
    g.index = index;
    for (size_t i = 0; i < n; ++i) {
      g.box.offsets.push_back(index[i] * a.chunks[i]);
      g.box.sizes.push_back(std::min(a.chunks[i], a.shape[i] - index[i] * a.chunks[i]));
    }
    out.push_back(std::move(g));
    for (size_t i = n; i-- > 0;) {  // the next index, C order
      if ((index[i] + 1) * a.chunks[i] < a.shape[i]) {
        ++index[i];
        break;
      }
      index[i] = 0;
    }
  }
  return out;
}

bool box_is_prefix(const std::vector<int64_t>& sizes, const std::vector<int64_t>& chunks) {
  size_t axis = 0;  // the one axis that may be clipped: the first wider than one
  while (axis < sizes.size() && sizes[axis] == 1) ++axis;
  for (size_t i = axis + 1; i < sizes.size(); ++i)
    if (sizes[i] != chunks[i]) return false;
  return true;
}

bool is_lock_folder(const std::string& name, const std::vector<std::string>& sorted_names) {
  constexpr std::string_view kSync = ".sync";
  return name.size() > kSync.size() && name.ends_with(kSync) &&
         std::binary_search(sorted_names.begin(), sorted_names.end(), name.substr(0, name.size() - kSync.size()));
}

Result<Metadata> read_zarr_folder(const fs::path& dir) {
  const std::string where = dir.string();
  Metadata md;
  std::error_code ec;
  std::vector<std::string> names;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    if (it->is_directory(ec)) names.push_back(name);
    if (names.size() > static_cast<size_t>(kMaxChunksPerArray))
      return corrupt(fmt::format("{}: more than {} folders", where, kMaxChunksPerArray));
  }
  if (ec) return io_error(fmt::format("{}: {}", where, ec.message()));
  std::sort(names.begin(), names.end());
  int64_t chunks_total = 0;
  for (const std::string& key : names) {
    if (is_lock_folder(key, names)) continue;
    const fs::path folder = dir / key;
    const fs::path zarray = folder / ".zarray";
    if (fs::is_regular_file(zarray, ec)) {
      const std::string aw = fmt::format("{}/.zarray", folder.string());
      OPTSTATE_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, read_small_file(zarray, kMaxZarrayBytes));
      OPTSTATE_ASSIGN_OR_RETURN(const Array a,
                                parse_zarray(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), aw));
      chunks_total += chunk_count(a);
      if (chunks_total > kMaxChunksPerArray * 16)
        return corrupt(fmt::format("{}: more than {} chunks in all", where, kMaxChunksPerArray * 16));
      ItemMeta im;
      im.is_tensor = true;
      im.dtype = a.dtype;
      im.size = a.shape;
      const uint64_t stored = chunk_bytes(a);
      for (GridChunk& g : chunk_grid(a)) {
        const std::string rel = key + "/" + chunk_file_name(g.index, a.separator);
        const std::string cw = fmt::format("{}/{}: chunk {} of zarr array '{}'", where, rel, format_shape(g.index), key);
        if (!box_is_prefix(g.box.sizes, a.chunks))
          return unsupported(fmt::format("{}: an edge chunk clipped to {} of {} along an inner axis, which optstate "
                                         "does not read (Megatron-Core's chunks divide the shape)",
                                         cw, format_shape(g.box.sizes), format_shape(a.chunks)));
        OPTSTATE_ASSIGN_OR_RETURN(const fs::path file, contained_path(dir, rel));
        const uint64_t size = fs::file_size(file, ec);
        if (ec || !fs::is_regular_file(file, ec))
          return corrupt(fmt::format("{}: missing (zarr reads a missing chunk as fill_value, which Megatron leaves "
                                     "undefined: every chunk is written)",
                                     cw));
        if (size != stored)
          return corrupt(fmt::format("{}: holds {} bytes; an uncompressed chunk of {} {} is {}", cw, size,
                                     format_shape(a.chunks), dtype_name(a.dtype), stored));
        StorageLoc loc;
        loc.relative_path = rel;
        loc.length = size;
        loc.raw_shape = g.box.sizes;
        md.storage.emplace(ChunkKey{key, g.box.offsets}, std::move(loc));
        im.chunks.push_back(std::move(g.box));
      }
      md.items.emplace(key, std::move(im));
      md.order.push_back(key);
      continue;
    }
    // A ShardedObject: each rank's part torch.saved as shard_<offsets>_<shape>.pt
    std::vector<std::string> shards;
    for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.rfind("shard_", 0) == 0 && it->path().extension() == ".pt" && it->is_regular_file(ec))
        shards.push_back(name);
      if (shards.size() > static_cast<size_t>(kMaxChunksPerArray))
        return corrupt(fmt::format("{}: more than {} files", folder.string(), kMaxChunksPerArray));
    }
    if (ec) return io_error(fmt::format("{}: {}", folder.string(), ec.message()));
    std::sort(shards.begin(), shards.end());
    for (const std::string& shard : shards) {
      const std::string rel = key + "/" + shard;
      const std::string item = key + "/" + shard.substr(0, shard.size() - 3);
      const uint64_t size = fs::file_size(dir / rel, ec);
      if (ec) return io_error(fmt::format("{}/{}: {}", where, rel, ec.message()));
      ItemMeta im;
      md.items.emplace(item, im);
      md.order.push_back(item);
      md.storage.emplace(ChunkKey{item, {}}, StorageLoc{rel, 0, size, {}, std::nullopt});
    }
  }
  return md;
}

}  // namespace optstate::dcp::zarr
