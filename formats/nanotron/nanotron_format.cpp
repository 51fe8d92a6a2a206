// The nanotron driver: a nanotron checkpoint (huggingface/nanotron's `checkpoints/<step>/`, or its
// optimizer/ folder): each pipeline stage's (and, under ZeRO-1, each data-parallel rank's) torch.save
// of nanotron's NamedOptimizer state_dict, read through the torch.save driver's reader (torchsave/:
// open_rank_files), which puts ZeRO-1's flat runs together where optimizer_config.json places them.
// Read only: a nanotron checkpoint is converted into the other formats. Layout: FORMAT.md.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "nanotron_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "safetensors/safetensors_layout.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::nanotron {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMaxConfigBytes = uint64_t{256} << 20;  // a name and two runs per param and rank
constexpr size_t kMaxFiles = size_t{1} << 16;

// The optimizer folder of `path`: itself, or its optimizer/ (the checkpoint's root).
std::optional<fs::path> optimizer_dir(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::nullopt;
  if (fs::is_regular_file(path / "optimizer_config.json", ec)) return path;
  if (fs::is_regular_file(path / "optimizer" / "optimizer_config.json", ec)) return path / "optimizer";
  return std::nullopt;
}

Result<std::string> read_text(const fs::path& path) {
  OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(path));
  if (f.size() > kMaxConfigBytes)
    return corrupt(fmt::format("{}: {} bytes; optstate reads up to {}", path.string(), f.size(), kMaxConfigBytes));
  std::string text(static_cast<size_t>(f.size()), '\0');
  OPTSTATE_RETURN_IF_ERROR(f.read_at(0, std::as_writable_bytes(std::span(text.data(), text.size()))));
  return text;
}

constexpr size_t kMaxModelFiles = size_t{1} << 20;
constexpr size_t kMaxRuns = size_t{1} << 26;  // row runs between shards and whole params, all params

// The model folder's shard files (tensor parallelism: where each rank's shard of a param lies) and
// shapes (params of pipeline stages optimizer_config.json leaves out under ZeRO-1).
Status read_model_folder(const fs::path& model, int64_t tp_size, torchsave::RankFileSet& parts) {
  std::error_code ec;
  if (!fs::is_directory(model, ec))
    return corrupt(fmt::format("{}: missing; a nanotron checkpoint of tensor parallelism or of pipeline stages "
                               "under ZeRO-1 is read with its model folder (the params' shapes and shards)",
                               model.string()));
  size_t files = 0, runs = 0;
  for (fs::recursive_directory_iterator it(model, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    if (++files > kMaxModelFiles) return corrupt(fmt::format("{}: more than {} files", model.string(), kMaxModelFiles));
    std::vector<std::string> components;
    for (const auto& c : fs::relative(it->path(), model, ec)) components.push_back(c.string());
    const auto mf = parse_model_path(components);
    if (!mf) continue;  // not a param's file (nanotron writes none other there)
    const std::string where = it->path().string();
    OPTSTATE_ASSIGN_OR_RETURN(InputFile f, InputFile::open(it->path()));
    std::byte first8[8];
    if (f.size() < sizeof first8) return corrupt(where + ": shorter than a safetensors header");
    OPTSTATE_RETURN_IF_ERROR(f.read_at(0, first8));
    OPTSTATE_ASSIGN_OR_RETURN(const uint64_t n, safetensors::parse_header_length(first8, f.size(), where));
    std::vector<std::byte> json(static_cast<size_t>(n));
    OPTSTATE_RETURN_IF_ERROR(f.read_at(8, json));
    OPTSTATE_ASSIGN_OR_RETURN(const safetensors::Header h, safetensors::parse_header(json, f.size() - 8 - n, where));
    const auto data = h.tensors.find("data");
    if (data == h.tensors.end() || h.tensors.size() != 1)
      return corrupt(where + ": not nanotron's one tensor 'data'");
    const std::vector<int64_t>& shape = data->second.shape;
    if (!mf->sharded) parts.replicated.insert(mf->name);
    if (!mf->sharded || mf->tp == 0) {
      if (!parts.shapes.emplace(mf->name, shape).second && parts.shapes[mf->name] != shape)
        return corrupt(fmt::format("{}: '{}' of shape {}, another file of it {}", where, mf->name, format_shape(shape),
                                   format_shape(parts.shapes[mf->name])));
    }
    if (!mf->sharded || tp_size == 1) continue;
    if (mf->tp_size != tp_size)
      return corrupt(fmt::format("{}: a shard of tensor-parallel size {}; the optimizer's is {}", where, mf->tp_size, tp_size));
    OPTSTATE_ASSIGN_OR_RETURN(const ShardMeta meta, parse_shard_metadata(h.metadata, where));
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<Run> shard, shard_runs(shape, meta, kMaxRuns - runs, where));
    runs += shard.size();
    auto& sh = parts.sharded[mf->name];
    if (sh.shape.empty()) sh.shape = meta.unsharded;
    if (sh.shape != meta.unsharded)
      return corrupt(fmt::format("{}: unsharded_shape {}, another shard of '{}' says {}", where,
                                 format_shape(meta.unsharded), mf->name, format_shape(sh.shape)));
    std::vector<torchsave::RankFileSet::Run> placed;
    for (const Run& r : shard) placed.push_back({r.local, r.global, r.count});
    if (!sh.by_tp.emplace(mf->tp, std::pair{shape, std::move(placed)}).second)
      return corrupt(fmt::format("{}: a second shard of '{}' for tensor-parallel rank {}", where, mf->name, mf->tp));
  }
  if (ec) return io_error(fmt::format("{}: {}", model.string(), ec.message()));
  return Status::Ok();
}

Result<torchsave::RankFileSet> find_parts(const fs::path& root, const fs::path& dir) {
  const std::string where = (dir / "optimizer_config.json").string();
  OPTSTATE_ASSIGN_OR_RETURN(const std::string text, read_text(dir / "optimizer_config.json"));
  OPTSTATE_ASSIGN_OR_RETURN(const Config config, parse_config(text, where));
  if (config.exp_size > 1)
    return unsupported(fmt::format("{}: expert parallel (expert_parallel_size {}); optstate reads nanotron "
                                   "checkpoints of expert_parallel_size 1", where, config.exp_size));
  torchsave::RankFileSet parts;
  parts.path = root;
  parts.dir = dir;
  parts.dp_size = config.dp_size;
  parts.tp_size = config.tp_size;
  parts.zero_rule = [dp = config.dp_size](int64_t numel) { return zero_runs(numel, dp); };
  std::map<std::tuple<int64_t, int64_t, int64_t>, fs::path> by_rank;  // (pp, tp, dp) -> file
  std::error_code ec;
  size_t seen = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with("optimizer_") || name == "optimizer_config.json") continue;
    if (++seen > kMaxFiles) return corrupt(fmt::format("{}: more than {} optimizer files", dir.string(), kMaxFiles));
    const auto r = parse_file_name(name);
    if (!r) return corrupt(fmt::format("{}: not a nanotron optimizer file name (optimizer_pp-<p>-of-<P>[_dp-<d>-of-<D>]"
                                       "_tp-<t>-of-<T>[_exp-<e>-of-<E>].pt)", it->path().string()));
    if (r->pp_size != config.pp_size || r->tp_size != config.tp_size || r->exp_size != config.exp_size ||
        r->dp.has_value() != config.is_zero() || (r->dp_size && *r->dp_size != config.dp_size))
      return corrupt(fmt::format("{}: its ranks' sizes are not those of {} (pp_size {}, tp_size {}, dp_size {}, {})",
                                 it->path().string(), where, config.pp_size, config.tp_size, config.dp_size,
                                 config.is_zero() ? "ZeRO-1: a file per data-parallel rank" : "no ZeRO: data-parallel rank 0's file"));
    by_rank.emplace(std::tuple{r->pp, r->tp, r->dp.value_or(0)}, it->path());
  }
  if (ec) return io_error(fmt::format("{}: {}", dir.string(), ec.message()));
  const int64_t dps = config.is_zero() ? config.dp_size : 1;
  for (int64_t pp = 0; pp < config.pp_size; ++pp)
    for (int64_t tp = 0; tp < config.tp_size; ++tp)
      for (int64_t dp = 0; dp < dps; ++dp) {
        const auto f = by_rank.find({pp, tp, dp});
        if (f == by_rank.end())
          return corrupt(fmt::format("{}: pipeline stage {}{}{} has no optimizer file", dir.string(), pp,
                                     config.tp_size > 1 ? fmt::format(", tensor-parallel rank {},", tp) : "",
                                     config.is_zero() ? fmt::format(", data-parallel rank {},", dp) : ""));
        parts.files.push_back({f->second, pp, dp, tp, {}});
      }
  if (config.is_zero()) {
    std::map<std::string, torchsave::RankFileSet::ZeroParam> zero;
    for (const auto& [name, zp] : config.zero) zero[name] = {zp.runs, zp.shape};
    parts.zero = std::move(zero);
  }
  // The checkpoint's folder: the model's shards and shapes, where the optimizer's files need them;
  // what it holds beside the optimizer's.
  const fs::path top = root == dir ? dir.parent_path() : root;
  if (config.tp_size > 1 || (config.is_zero() && config.pp_size > 1))
    OPTSTATE_RETURN_IF_ERROR(read_model_folder(top / "model", config.tp_size, parts));
  if (root != dir) {
    std::vector<std::string> others;
    for (fs::directory_iterator it(root, ec), end; !ec && it != end && others.size() < 64; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name != "optimizer") others.push_back(name + (it->is_directory(ec) ? "/" : ""));
    }
    std::sort(others.begin(), others.end());
    for (const std::string& o : others)
      parts.not_read.push_back(o == "model/" ? "model/ (the model's weights, a safetensors file per param)" : o);
  }
  return parts;
}

// One ZeRO-1 rank's or tensor-parallel rank's optimizer file (`_dp-` in its name, or `_tp-<t>-of-<T>`
// with T > 1): its tensors are flat runs or shards of its params, so alone it is no param's state.
// Claimed here so that it is refused rather than read by the torch.save driver as whole params.
std::optional<FileRanks> rank_part(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  const auto r = parse_file_name(path.filename().string());
  if (!r || (!r->dp && r->tp_size == 1)) return std::nullopt;
  return r;
}

class NanotronDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "nanotron"; }

  // A folder with optimizer_config.json (or optimizer/optimizer_config.json) beside a file named as
  // nanotron names its optimizer files; or one rank's part alone (rank_part), to refuse it.
  bool sniff(const fs::path& path) const override {
    if (rank_part(path)) return true;
    const auto dir = optimizer_dir(path);
    if (!dir) return false;
    std::error_code ec;
    size_t seen = 0;
    for (fs::directory_iterator it(*dir, ec), end; !ec && it != end && ++seen <= 4096; it.increment(ec))
      if (parse_file_name(it->path().filename().string())) return true;
    return false;
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    if (const auto r = rank_part(path))
      return unsupported(fmt::format("{}: one rank's file of a nanotron checkpoint {}: its tensors are {} of its "
                                     "params; read the checkpoint's folder ({})", path.string(),
                                     r->dp ? "under ZeRO-1" : "under tensor parallelism",
                                     r->dp ? "flat runs" : "shards", path.parent_path().parent_path().string()));
    const auto dir = optimizer_dir(path);
    if (!dir) return invalid_argument(path.string() + ": no optimizer_config.json (nor optimizer/optimizer_config.json)");
    OPTSTATE_ASSIGN_OR_RETURN(const torchsave::RankFileSet parts, find_parts(path, *dir));
    return torchsave::open_rank_files(parts);
  }

  // A training run's folder: never replaced, never written.
  bool replaceable(const fs::path&) const override { return false; }
  bool writes() const override { return false; }
  Status write(StateSource&, const fs::path& path, const WriteOptions&) const override {
    return unsupported(fmt::format("{}: optstate reads nanotron checkpoints and writes them as other formats "
                                   "(dcp, torchsave, safetensors, ...), not as nanotron's", path.string()));
  }
};

}  // namespace

const FormatDriver& driver() {
  static const NanotronDriver d;
  return d;
}

}  // namespace optstate::nanotron
