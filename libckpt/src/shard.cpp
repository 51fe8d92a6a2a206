#include "optstate/shard.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "optstate/quant8.h"

namespace optstate {
namespace {

bool is_moment(const std::string& name) { return name == kExpAvg || name == kExpAvgSq || name == kMaxExpAvgSq; }

// The element range of an entry this rank holds (codes' range for blockwise8: whole blocks).
FlatRange element_range(const std::string& name, const Entry& e, const std::vector<int64_t>& shape, int64_t numel,
                        const ShardLoadOptions& o) {
  if (o.whole_params && name == kParam) return {0, numel};
  return shard_range(e, e.encoding == Encoding::kBlockwise8 ? Component::kCodes : Component::kValues, shape, o.world,
                     o.rank);
}

Result<Buffer> read_bytes(CheckpointReader& reader, const std::string& fqn, const std::string& name,
                          const Entry& stored, Component c, int64_t begin, int64_t end,
                          const DestinationFn* destination = nullptr) {
  const int64_t elem = component_elem_size(stored, c);
  const size_t bytes = static_cast<size_t>((end - begin) * elem);
  std::span<std::byte> out;
  if (destination && *destination) out = (*destination)(fqn, name, c, stored, bytes);
  if (out.size() == bytes && out.data()) {
    OPTSTATE_RETURN_IF_ERROR(reader.read_range(fqn, name, c, begin, end, out));
    Buffer placed;
    placed.data = out.data();
    placed.size = bytes;
    return placed;
  }
  Buffer b = Buffer::allocate(bytes, &out);
  OPTSTATE_RETURN_IF_ERROR(reader.read_range(fqn, name, c, begin, end, out));
  return b;
}

template <class T>
std::span<const T> as(const Buffer& v) {
  return {reinterpret_cast<const T*>(v.data), v.size / sizeof(T)};
}

// Range [r.begin, r.end) of a stored entry as fp32 values, into `out` (r.size() floats): written
// there directly (a whole entry's dequantized blocks, a dense entry widened), not through a copy.
Status read_f32_into(CheckpointReader& reader, const std::string& fqn, const std::string& name, const Entry& stored,
                     int64_t numel, FlatRange r, std::span<float> out) {
  const std::string key = entry_key(fqn, name);
  if (out.size() != static_cast<size_t>(r.size()))
    return internal_error(fmt::format("{}: {} floats for a range of {}", key, out.size(), r.size()));
  if (stored.encoding == Encoding::kDense) {
    OPTSTATE_ASSIGN_OR_RETURN(auto bytes, read_bytes(reader, fqn, name, stored, Component::kValues, r.begin, r.end));
    return dense_to_f32_into(bytes.span(), stored.dtype, out, key);
  }
  // The blocks covering the range, dequantized; where the range starts or ends inside a block,
  // through a buffer of those blocks, cut to it.
  const int64_t bs = stored.block_size;
  const int64_t b0 = r.begin / bs, b1 = (r.end + bs - 1) / bs;
  const int64_t e0 = b0 * bs, e1 = std::min(numel, b1 * bs);
  OPTSTATE_ASSIGN_OR_RETURN(QMap m, qmap_from_name(stored.qmap));
  OPTSTATE_ASSIGN_OR_RETURN(auto codes, read_bytes(reader, fqn, name, stored, Component::kCodes, e0, e1));
  OPTSTATE_ASSIGN_OR_RETURN(auto absmax, read_bytes(reader, fqn, name, stored, Component::kAbsmax, b0, b1));
  if (e0 == r.begin && e1 == r.end) {
    dequantize_blockwise(as<uint8_t>(codes), as<float>(absmax), bs, m, out);
    return Status::Ok();
  }
  std::vector<float> values(static_cast<size_t>(e1 - e0));
  dequantize_blockwise(as<uint8_t>(codes), as<float>(absmax), bs, m, values);
  std::copy(values.begin() + (r.begin - e0), values.begin() + (r.end - e0), out.begin());
  return Status::Ok();
}

// Fills the buffers of `target` with range r (elements) of the stored entry.
Status read_into(CheckpointReader& reader, const std::string& fqn, const std::string& name, const Entry& stored,
                 int64_t numel, FlatRange r, Entry& target, const DestinationFn* destination = nullptr) {
  const bool same = stored.encoding == target.encoding && stored.dtype == target.dtype &&
                    stored.block_size == target.block_size && stored.qmap == target.qmap;
  if (same && target.encoding == Encoding::kDense) {
    OPTSTATE_ASSIGN_OR_RETURN(auto v, read_bytes(reader, fqn, name, stored, Component::kValues, r.begin, r.end,
                                                 destination));
    target.values = std::move(v);
    return Status::Ok();
  }
  if (same) {  // blockwise8, block-aligned range: the stored codes and absmax as they are
    const int64_t bs = stored.block_size;
    OPTSTATE_ASSIGN_OR_RETURN(auto c, read_bytes(reader, fqn, name, stored, Component::kCodes, r.begin, r.end,
                                                 destination));
    OPTSTATE_ASSIGN_OR_RETURN(auto a, read_bytes(reader, fqn, name, stored, Component::kAbsmax, r.begin / bs,
                                                 (r.end + bs - 1) / bs, destination));
    target.codes = std::move(c);
    target.absmax = std::move(a);
    return Status::Ok();
  }
  if (target.encoding == Encoding::kDense) {
    if (target.dtype != DType::kF32)
      return invalid_argument(fmt::format("entry '{}': cannot convert {} to dense {}", entry_key(fqn, name),
                                          encoding_name(stored.encoding), dtype_name(target.dtype)));
    std::span<std::byte> out;
    Buffer values = Buffer::allocate(static_cast<size_t>(r.size()) * sizeof(float), &out);
    OPTSTATE_RETURN_IF_ERROR(read_f32_into(reader, fqn, name, stored, numel, r,
                                           {reinterpret_cast<float*>(out.data()), static_cast<size_t>(r.size())}));
    target.values = std::move(values);
    return Status::Ok();
  }
  std::vector<float> values(static_cast<size_t>(r.size()));
  OPTSTATE_RETURN_IF_ERROR(read_f32_into(reader, fqn, name, stored, numel, r, values));
  OPTSTATE_ASSIGN_OR_RETURN(QMap m, qmap_from_name(target.qmap));
  std::vector<uint8_t> codes(values.size());
  std::vector<float> absmax(static_cast<size_t>((r.size() + target.block_size - 1) / target.block_size));
  requantize_blockwise(values, target.block_size, m, codes, absmax);
  target.codes = Buffer::copy_of(std::as_bytes(std::span(codes)));
  target.absmax = Buffer::copy_of(std::as_bytes(std::span(absmax)));
  return Status::Ok();
}

// check_only's reading of one entry's range: the stored bytes of a range read as stored are
// streamed (a whole component: cache-sized pieces, each chunk's checksum verified, nothing kept) or
// read into `scratch` (a part of one); a range that needs converting is converted and dropped.
Status check_range(CheckpointReader& reader, const std::string& fqn, const std::string& name, const Entry& stored,
                   int64_t numel, FlatRange r, const Entry& target, const DestinationFn& scratch) {
  const bool same = stored.encoding == target.encoding && stored.dtype == target.dtype &&
                    stored.block_size == target.block_size && stored.qmap == target.qmap;
  if (!same) {
    Entry converted = target;
    return read_into(reader, fqn, name, stored, numel, r, converted);
  }
  for (Component c : stored.components()) {
    const bool absmax = c == Component::kAbsmax;
    const int64_t begin = absmax ? r.begin / stored.block_size : r.begin;
    const int64_t end = absmax ? (r.end + stored.block_size - 1) / stored.block_size : r.end;
    if (begin == 0 && end == component_count(stored, c, numel)) {
      OPTSTATE_RETURN_IF_ERROR(reader.stream(fqn, name, c, [](std::span<const std::byte>) { return Status::Ok(); }));
      continue;
    }
    OPTSTATE_RETURN_IF_ERROR(read_bytes(reader, fqn, name, stored, c, begin, end, &scratch).status());
  }
  return Status::Ok();
}

Status check_options(const ShardLoadOptions& o) {
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world)
    return invalid_argument(fmt::format("rank {} of world size {} is not a rank", o.rank, o.world));
  if (o.to == TargetEncoding::k8bit && (o.quant.block_size <= 0 || o.quant.block_size > (int64_t{1} << 20)))
    return invalid_argument(fmt::format("block size {} out of range", o.quant.block_size));
  return Status::Ok();
}

}  // namespace

Result<TargetEncoding> target_encoding_from_name(std::string_view name) {
  if (name.empty()) return TargetEncoding::kAsStored;
  if (name == "fp32") return TargetEncoding::kFp32;
  if (name == "8bit") return TargetEncoding::k8bit;
  return invalid_argument(fmt::format("target encoding '{}' is not one of '', 'fp32', '8bit'", name));
}

Entry target_entry(const std::string& entry_name, const Entry& stored, int64_t numel, TargetEncoding to,
                   const QuantizeOptions& quant) {
  const Recode how = to == TargetEncoding::kFp32 ? Recode::kDequantize
                     : to == TargetEncoding::k8bit ? Recode::kQuantize
                                                   : Recode::kKeep;
  // An 8-bit optimizer keeps its own block size: 8-bit moments of another block size are re-blocked
  // through their values (same block size: taken as stored).
  if (to == TargetEncoding::k8bit && stored.encoding == Encoding::kBlockwise8 && stored.block_size != quant.block_size &&
      is_moment(entry_name) && numel >= quant.min_8bit_size)
    return recode_meta(entry_name, recode_meta(entry_name, stored, numel, Recode::kDequantize, quant), numel, how, quant);
  return recode_meta(entry_name, stored, numel, how, quant);
}

Result<OptimizerState> load_shard(CheckpointReader& reader, const ShardLoadOptions& options) {
  OPTSTATE_RETURN_IF_ERROR(check_options(options));
  // check_only: parts of components read as stored land in one reused scratch buffer.
  std::unique_ptr<std::byte[]> scratch;
  size_t scratch_size = 0;
  const DestinationFn to_scratch = [&](const std::string&, const std::string&, Component, const Entry&,
                                       size_t bytes) -> std::span<std::byte> {
    if (bytes > scratch_size) {
      scratch.reset();  // the old one goes first: peak memory is one range
      scratch.reset(new std::byte[bytes]);
      scratch_size = bytes;
    }
    return {scratch.get(), bytes};
  };
  OptimizerState out = reader.meta();
  for (auto& [fqn, ps] : out.params) {
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
    const ParamState& stored_ps = reader.meta().params.at(fqn);
    for (auto& [name, e] : ps.entries) {
      const Entry& stored = stored_ps.entries.at(name);
      e = target_entry(name, stored, numel, options.to, options.quant);
      const FlatRange r = element_range(name, e, ps.shape, numel, options);
      if (options.check_only)
        OPTSTATE_RETURN_IF_ERROR(check_range(reader, fqn, name, stored, numel, r, e, to_scratch));
      else
        OPTSTATE_RETURN_IF_ERROR(read_into(reader, fqn, name, stored, numel, r, e, &options.destination));
    }
  }
  return out;
}

Result<std::vector<std::string>> verify_resume_shard(const OptimizerState& live, CheckpointReader& saved,
                                                     const ShardLoadOptions& options) {
  OPTSTATE_RETURN_IF_ERROR(check_options(options));
  std::vector<std::string> diffs;
  const std::string where = fmt::format("rank {} of {}", options.rank, options.world);
  const OptimizerState& meta = saved.meta();
  const std::string path = saved.path().string();
  if (live.kind != meta.kind) diffs.push_back(fmt::format("kind: live '{}', {} '{}'", live.kind, path, meta.kind));
  // Hyperparameters param by param (as the hash sees them): how params are grouped is not part of
  // the state (a flattened DCP does not record it), what each is trained with is. One line per
  // live group that differs.
  for (size_t g = 0; g < live.groups.size(); ++g) {
    std::vector<std::string> differ;
    for (const std::string& fqn : live.groups[g].params) {
      auto it = meta.params.find(fqn);
      if (it == meta.params.end() || it->second.group < 0 || static_cast<size_t>(it->second.group) >= meta.groups.size())
        continue;  // reported below
      if (!(live.groups[g].hyper == meta.groups[static_cast<size_t>(it->second.group)].hyper)) differ.push_back(fqn);
    }
    if (!differ.empty())
      diffs.push_back(fmt::format("param group {}: hyperparameters of {} param(s) (first '{}') differ from {}", g,
                                  differ.size(), differ.front(), path));
  }
  for (const auto& [fqn, sps] : meta.params)
    if (!live.params.count(fqn)) diffs.push_back(fmt::format("param '{}' is in {} but not live", fqn, path));
  // A checkpoint of optimizer state alone (torch.save's optimizer.pt): a load leaves the weights
  // as they are, and so does the comparison.
  bool saved_weights = false;
  for (const auto& [fqn, sps] : meta.params) saved_weights = saved_weights || sps.entries.count(kParam);
  for (const auto& [fqn, ps] : live.params) {
    auto it = meta.params.find(fqn);
    if (it == meta.params.end()) {
      diffs.push_back(fmt::format("param '{}' is live but not in {}", fqn, path));
      continue;
    }
    const ParamState& sps = it->second;
    if (ps.shape != sps.shape) {
      diffs.push_back(fmt::format("param '{}': shape live {}, {} {}", fqn, format_shape(ps.shape), path,
                                  format_shape(sps.shape)));
      continue;
    }
    if (ps.step != sps.step)
      diffs.push_back(fmt::format("param '{}': step live {}, {} {}", fqn, ps.step, path, sps.step));
    OPTSTATE_ASSIGN_OR_RETURN(const int64_t numel, checked_numel(ps.shape));
    for (const auto& [name, stored] : sps.entries)
      if (!ps.entries.count(name))
        diffs.push_back(fmt::format("entry '{}' is in {} but not live", entry_key(fqn, name), path));
    for (const auto& [name, e] : ps.entries) {
      const std::string key = entry_key(fqn, name);
      auto se = sps.entries.find(name);
      if (se == sps.entries.end() && name == kParam && !saved_weights) continue;
      if (se == sps.entries.end()) {
        diffs.push_back(fmt::format("entry '{}' is live but not in {}", key, path));
        continue;
      }
      Entry expect = e;
      expect.values = expect.codes = expect.absmax = Buffer{};
      const FlatRange r = element_range(name, e, ps.shape, numel, options);
      Status st = read_into(saved, fqn, name, se->second, numel, r, expect);
      if (!st.ok()) {
        diffs.push_back(fmt::format("entry '{}' ({}): {}", key, where, st.message()));
        continue;
      }
      for (Component c : e.components()) {
        const Buffer &a = e.buffer(c), &b = expect.buffer(c);
        if (a.size != b.size) {
          diffs.push_back(fmt::format("entry '{}' {} ({}): live holds {} bytes, the checkpoint's range {} bytes", key,
                                      component_name(c), where, a.size, b.size));
          continue;
        }
        const auto mismatch = std::mismatch(a.data, a.data + a.size, b.data);
        if (mismatch.first != a.data + a.size) {
          const int64_t elem = component_elem_size(e, c);
          const int64_t local = (mismatch.first - a.data) / elem;
          const int64_t first = c == Component::kAbsmax ? r.begin / e.block_size : r.begin;
          diffs.push_back(fmt::format("entry '{}' {} ({}): differs from {} first at element {}", key,
                                      component_name(c), where, path, first + local));
        }
      }
    }
  }
  return diffs;
}

}  // namespace optstate
