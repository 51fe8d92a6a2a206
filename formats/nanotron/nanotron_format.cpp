// The nanotron driver: a nanotron checkpoint (huggingface/nanotron's `checkpoints/<step>/`, or its
// optimizer/ folder): each pipeline stage's (and, under ZeRO-1, each data-parallel rank's) torch.save
// of nanotron's NamedOptimizer state_dict, read through the torch.save driver's reader (torchsave/:
// open_nanotron), which puts ZeRO-1's flat runs together where optimizer_config.json places them.
// Read only: a nanotron checkpoint is converted into the other formats. Layout: FORMAT.md.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "nanotron_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
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

Result<torchsave::NanotronParts> find_parts(const fs::path& root, const fs::path& dir) {
  const std::string where = (dir / "optimizer_config.json").string();
  OPTSTATE_ASSIGN_OR_RETURN(const std::string text, read_text(dir / "optimizer_config.json"));
  OPTSTATE_ASSIGN_OR_RETURN(const Config config, parse_config(text, where));
  if (config.tp_size > 1)
    return unsupported(fmt::format("{}: tensor parallel (tp_size {}): each rank's file holds its shards, placed as the "
                                   "model folder's safetensors metadata says; optstate reads nanotron checkpoints "
                                   "of tp_size 1", where, config.tp_size));
  if (config.exp_size > 1)
    return unsupported(fmt::format("{}: expert parallel (expert_parallel_size {}); optstate reads nanotron "
                                   "checkpoints of expert_parallel_size 1", where, config.exp_size));
  torchsave::NanotronParts parts;
  parts.path = root;
  parts.dir = dir;
  std::map<std::pair<int64_t, int64_t>, fs::path> by_rank;  // (pp, dp) -> file
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
    by_rank.emplace(std::pair{r->pp, r->dp.value_or(0)}, it->path());
  }
  if (ec) return io_error(fmt::format("{}: {}", dir.string(), ec.message()));
  const int64_t dps = config.is_zero() ? config.dp_size : 1;
  for (int64_t pp = 0; pp < config.pp_size; ++pp)
    for (int64_t dp = 0; dp < dps; ++dp) {
      const auto f = by_rank.find({pp, dp});
      if (f == by_rank.end())
        return corrupt(fmt::format("{}: pipeline stage {}{} has no optimizer file", dir.string(), pp,
                                   config.is_zero() ? fmt::format(", data-parallel rank {},", dp) : ""));
      parts.files.push_back({f->second, pp, dp});
    }
  if (config.is_zero()) {
    std::map<std::string, torchsave::NanotronParts::ZeroParam> zero;
    for (const auto& [name, zp] : config.zero) zero[name] = {zp.runs, zp.shape};
    parts.zero = std::move(zero);
  }
  // What the checkpoint's folder holds beside the optimizer's (read from its root).
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

class NanotronDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "nanotron"; }

  // A folder with optimizer_config.json (or optimizer/optimizer_config.json) beside a file named as
  // nanotron names its optimizer files.
  bool sniff(const fs::path& path) const override {
    const auto dir = optimizer_dir(path);
    if (!dir) return false;
    std::error_code ec;
    size_t seen = 0;
    for (fs::directory_iterator it(*dir, ec), end; !ec && it != end && ++seen <= 4096; it.increment(ec))
      if (parse_file_name(it->path().filename().string())) return true;
    return false;
  }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    const auto dir = optimizer_dir(path);
    if (!dir) return invalid_argument(path.string() + ": no optimizer_config.json (nor optimizer/optimizer_config.json)");
    OPTSTATE_ASSIGN_OR_RETURN(const torchsave::NanotronParts parts, find_parts(path, *dir));
    return torchsave::open_nanotron(parts);
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
