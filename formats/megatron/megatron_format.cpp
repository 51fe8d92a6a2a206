// The megatron driver: Megatron-LM's legacy checkpoint (`--ckpt-format torch`): iter_<N>/ with a
// folder per model-parallel rank, mp_rank_<tp>[_<pp>][_<ep>]/model_optim_rng.pt, each torch.save of
// the trainer's dict (the model's state_dict, or its virtual pipeline chunks'; the optimizer's, or
// its MoE chain's; the distributed optimizer's state in distrib_optim.pt beside). The files are read
// through the torch.save driver's set reader (torchsave/: open_rank_files, Megatron's kind):
// tensor-parallel shards put together where Megatron's layer names split them, each pipeline stage's
// (and model chunk's) layers numbered on, each expert rank's experts numbered on
// (megatron_layout.h). Read only; Megatron's torch_dist checkpoints are DCPs (formats/dcp/).
// Layout: FORMAT.md.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "megatron_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/io.h"
#include "torchsave/torchsave_reader.h"

namespace optstate::megatron {

namespace fs = std::filesystem;

namespace {

constexpr const char* kRankFile = "model_optim_rng.pt";
constexpr const char* kDistribFile = "distrib_optim.pt";
constexpr size_t kMaxRanks = 4096;

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}
bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

// The iteration folder's rank folders (those holding model_optim_rng.pt), by name.
std::map<std::string, RankDir> rank_dirs(const fs::path& iteration) {
  std::map<std::string, RankDir> out;
  std::error_code ec;
  size_t seen = 0;
  for (fs::directory_iterator it(iteration, ec), end; !ec && it != end && ++seen <= 4 * kMaxRanks; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (const auto r = parse_rank_dir(name); r && is_file(it->path() / kRankFile)) out.emplace(name, *r);
  }
  return out;
}

// What `path` is of a legacy checkpoint: its iteration folder, and the one rank's file or folder
// given, if that is what was given.
struct Located {
  fs::path iteration;
  std::optional<fs::path> one_rank;
  bool tracked = false;  // found through the save folder's tracker
};
std::optional<Located> locate(const fs::path& path) {
  if (is_file(path)) {
    const std::string name = path.filename().string();
    if ((name != kRankFile && name != kDistribFile) || !parse_rank_dir(path.parent_path().filename().string()))
      return std::nullopt;
    return Located{path.parent_path().parent_path(), path.parent_path()};
  }
  if (!is_dir(path)) return std::nullopt;
  if (parse_rank_dir(path.filename().string()) && is_file(path / kRankFile)) return Located{path.parent_path(), path};
  if (!rank_dirs(path).empty()) return Located{path, std::nullopt};
  if (const auto it = tracked_iteration(path); it && !rank_dirs(*it).empty()) return Located{*it, std::nullopt, true};
  return std::nullopt;
}

// Every model-parallel rank's file, by (pipeline stage, expert rank, tensor-parallel rank), checked:
// a full grid, stages 0..P-1 by expert ranks 0..E-1 by tensor-parallel ranks 0..T-1. A folder
// name's two numbers after the tensor-parallel rank are the pipeline stage and the expert rank;
// one is the pipeline stage, or the expert rank where the args say expert parallelism without
// pipeline parallelism (Megatron's get_checkpoint_name names only the parallelisms in use).
struct RankFile {
  int64_t pp = 0, ep = 0, tp = 0;
  fs::path path;
};
Result<std::vector<RankFile>> rank_files(const fs::path& iteration) {
  const auto dirs = rank_dirs(iteration);
  std::optional<size_t> parts;
  for (const auto& [name, r] : dirs) {
    if (parts && *parts != r.more.size())
      return corrupt(fmt::format("{}: rank folders named with {} and {} numbers after the tensor-parallel rank ({})",
                                 iteration.string(), *parts, r.more.size(), name));
    parts = r.more.size();
  }
  if (!parts) return corrupt(fmt::format("{}: no mp_rank_<tp>/{}", iteration.string(), kRankFile));
  if (dirs.size() > kMaxRanks) return corrupt(fmt::format("{}: more than {} ranks", iteration.string(), kMaxRanks));
  bool one_is_expert = false;
  if (*parts == 1) {
    const fs::path first = iteration / dirs.begin()->first / kRankFile;
    OPTSTATE_ASSIGN_OR_RETURN(const torchsave::MegatronSizes sizes, torchsave::read_megatron_sizes(first));
    one_is_expert = sizes.ep.value_or(1) > 1 && sizes.pp.value_or(1) == 1;
    if (sizes.ep.value_or(1) > 1 && sizes.pp.value_or(1) > 1)
      return corrupt(fmt::format("{}: its args say pipeline_model_parallel_size {} and expert_model_parallel_size {}, "
                                 "and its folder names one rank after the tensor-parallel rank, not both",
                                 first.string(), *sizes.pp, *sizes.ep));
  }
  const bool pp_named = *parts == 2 || (*parts == 1 && !one_is_expert);
  const bool ep_named = *parts == 2 || one_is_expert;
  std::map<std::tuple<int64_t, int64_t, int64_t>, fs::path> grid;  // (pp, ep, tp) -> file
  int64_t stages = 0, experts = 0, ranks = 0;
  for (const auto& [name, r] : dirs) {
    const int64_t pp = pp_named ? r.more[0] : 0;
    const int64_t ep = ep_named ? r.more.back() : 0;
    grid.emplace(std::tuple{pp, ep, r.tp}, iteration / name / kRankFile);
    stages = std::max(stages, pp + 1);
    experts = std::max(experts, ep + 1);
    ranks = std::max(ranks, r.tp + 1);
  }
  auto plural = [](int64_t n, const char* what) { return fmt::format("{} {}{}", n, what, n == 1 ? "" : "s"); };
  std::vector<RankFile> files;
  for (int64_t pp = 0; pp < stages; ++pp)
    for (int64_t ep = 0; ep < experts; ++ep)
      for (int64_t tp = 0; tp < ranks; ++tp) {
        const auto f = grid.find({pp, ep, tp});
        if (f == grid.end())
          return corrupt(fmt::format("{}: {} has no {} ({} of {}{} found)", iteration.string(),
                                     fmt::format("mp_rank_{:02d}{}{}", tp, pp_named ? fmt::format("_{:03d}", pp) : "",
                                                 ep_named ? fmt::format("_{:03d}", ep) : ""),
                                     kRankFile, plural(stages, "stage"), plural(ranks, "tensor-parallel rank"),
                                     ep_named ? " by " + plural(experts, "expert rank") : ""));
        files.push_back({pp, ep, tp, f->second});
      }
  return files;
}

Result<std::vector<std::byte>> values_of(CheckpointReader& r, const std::string& name, const std::string& entry) {
  std::vector<std::byte> out;
  OPTSTATE_RETURN_IF_ERROR(r.stream(name, entry, Component::kValues, [&](std::span<const std::byte> b) {
    out.insert(out.end(), b.begin(), b.end());
    return Status::Ok();
  }));
  return out;
}

// Each param's place over the model-parallel ranks, from their files: a pipeline stage's layers
// numbered on from the stages before it, an expert rank's experts from its first (its local experts
// times its rank); within a stage and expert rank, split along Megatron's dim for its name, or
// replicated (its weights then equal in every rank's file, checked: a param Megatron splits that its
// names do not say would differ); an expert rank's dense params are expert rank 0's (their shapes
// checked alike, and a 1-D param's weights: a folder of another iteration differs there); the last
// stage's output_layer.weight, where it is the first stage's embedding tied to it (equal weights and
// moments: Megatron sums their gradients), read once.
Result<torchsave::RankFileSet> find_parts(const fs::path& iteration, const std::vector<RankFile>& files) {
  torchsave::RankFileSet parts;
  parts.megatron = true;
  parts.path = iteration;
  parts.dir = iteration;
  parts.zero_rule = [](int64_t numel) { return std::map<int64_t, std::pair<int64_t, int64_t>>{{0, {0, numel}}}; };
  parts.megatron_ranks = files.back().tp + 1;
  parts.megatron_experts = files.back().ep + 1;
  parts.megatron_stages = files.back().pp + 1;
  parts.tp_size = parts.megatron_ranks;
  const size_t ranks = static_cast<size_t>(parts.megatron_ranks), experts = static_cast<size_t>(parts.megatron_experts);
  // Each rank's file read alone first: its params' local names and shapes, its weights.
  std::vector<std::unique_ptr<CheckpointReader>> readers;
  for (const RankFile& rf : files) {
    const fs::path distrib = rf.path.parent_path() / kDistribFile;
    torchsave::RankFileSet::File file{rf.path, rf.pp, 0, rf.tp, is_file(distrib) ? distrib : fs::path()};
    file.ep = rf.ep;
    parts.files.push_back(file);
    if (files.size() == 1) break;
    torchsave::RankFileSet one = parts;
    one.files = {file};
    one.files[0].tp = 0;
    one.files[0].pp = 0;
    one.tp_size = 1;
    OPTSTATE_ASSIGN_OR_RETURN(auto r, torchsave::open_rank_files(one));
    readers.push_back(std::move(r));
  }
  if (files.size() == 1) return parts;
  auto index_of = [&](int64_t pp, size_t ep, size_t tp) { return (static_cast<size_t>(pp) * experts + ep) * ranks + tp; };
  auto reader_of = [&](int64_t pp, size_t ep, size_t tp) -> CheckpointReader& { return *readers[index_of(pp, ep, tp)]; };
  auto file_of = [&](int64_t pp, size_t ep, size_t tp) { return files[index_of(pp, ep, tp)].path.string(); };
  // a virtual pipeline: each stage's file holds model chunks, named "model<c>." by the reader
  const auto& names0 = reader_of(0, 0, 0).meta().params;
  parts.megatron_chunked = !names0.empty() && chunk_of(names0.begin()->first).has_value();
  for (const auto& reader : readers)
    for (const auto& [name, ps] : reader->meta().params)
      if (chunk_of(name).has_value() != parts.megatron_chunked)
        return corrupt(fmt::format("{}: stages' files with model chunks (a virtual pipeline: model0, model1, ...) and "
                                   "without ('{}')", iteration.string(), name));
  // the stages' layer offsets, per stack of layers (expert rank 0 holds every layer's params): the
  // layers of stage 0, then of stage 1, ...; under a virtual pipeline chunk 0's of every stage, then
  // chunk 1's, ... (Megatron's interleaved layout), each stack with its chunk's prefix
  std::map<int64_t, std::map<int64_t, std::map<std::string, int64_t>>> count;  // chunk -> stage -> stack -> layers
  for (int64_t pp = 0; pp < parts.megatron_stages; ++pp)
    for (const auto& [name, ps] : reader_of(pp, 0, 0).meta().params)
      if (const auto l = layer_of(name)) {
        const auto c = parts.megatron_chunked ? chunk_of(name) : std::nullopt;
        int64_t& n = count[c ? c->chunk : 0][pp][l->stack];
        n = std::max(n, l->index + 1);
      }
  std::map<std::string, int64_t> next;  // per stack without its chunk's prefix
  for (const auto& [chunk, stages] : count)
    for (const auto& [pp, stacks] : stages)
      for (const auto& [stack, n] : stacks) {
        const auto c = parts.megatron_chunked ? chunk_of(stack) : std::nullopt;
        const std::string base(c ? c->rest : std::string_view(stack));
        parts.layer_offsets[pp][stack] = next[base];
        next[base] += n;
      }
  // each stage's local experts (a layer's experts over its expert ranks, numbered from 0 on each)
  std::map<int64_t, int64_t> local_experts;
  if (experts > 1)
    for (int64_t pp = 0; pp < parts.megatron_stages; ++pp)
      for (size_t ep = 0; ep < experts; ++ep) {
        int64_t n = 0;
        for (const auto& [name, ps] : reader_of(pp, ep, 0).meta().params) {
          if (!is_expert_param(name)) continue;
          const auto e = expert_of(name);
          if (!e)
            return unsupported(fmt::format("{} param '{}': an MoE experts' param of no one expert (the legacy "
                                           "GroupedMLP's weights hold every local expert), whose place among the "
                                           "expert ranks optstate does not know", file_of(pp, ep, 0), name));
          n = std::max(n, *e + 1);
        }
        if (ep == 0) local_experts[pp] = n;
        if (n > local_experts[pp])
          return corrupt(fmt::format("{}: experts numbered to {}; expert rank 0's file {} has {} a layer",
                                     file_of(pp, ep, 0), n - 1, file_of(pp, 0, 0), local_experts[pp]));
      }
  for (size_t i = 0; i < files.size(); ++i) {
    parts.files[i].expert_offset = files[i].ep * local_experts[files[i].pp];
    parts.files[i].dense_elsewhere = files[i].ep != 0;
  }
  auto global = [&](int64_t pp, size_t ep, const std::string& name) {
    const auto& offsets = parts.layer_offsets[pp];
    return global_name(name, &offsets, static_cast<int64_t>(ep) * local_experts[pp], parts.megatron_chunked);
  };
  // a tied embedding's copy on the last stage (under a virtual pipeline the first chunk's
  // embedding, the last chunk's output layer)
  const int64_t last = parts.megatron_stages - 1;
  if (last > 0) {
    const std::string global_out = "output_layer.weight";
    std::string out = global_out, emb = "embedding.word_embeddings.weight";
    if (parts.megatron_chunked) {
      int64_t chunks = 0;
      for (const auto& [name, ps] : reader_of(last, 0, 0).meta().params)
        if (const auto c = chunk_of(name)) chunks = std::max(chunks, c->chunk + 1);
      out = fmt::format("model{}.{}", chunks - 1, out);
      emb = "model0." + emb;
    }
    bool tied = true;
    for (size_t tp = 0; tp < ranks && tied; ++tp) {
      auto& a = reader_of(last, 0, tp);
      auto& b = reader_of(0, 0, tp);
      const auto pa = a.meta().params.find(out), pb = b.meta().params.find(emb);
      tied = pa != a.meta().params.end() && pb != b.meta().params.end() && pa->second.shape == pb->second.shape &&
             pa->second.entries.count(kParam) && pb->second.entries.count(kParam);
      for (const char* e : {kParam, kExpAvg, kExpAvgSq}) {
        if (!tied) break;
        OPTSTATE_ASSIGN_OR_RETURN(auto va, values_of(a, out, e));
        OPTSTATE_ASSIGN_OR_RETURN(auto vb, values_of(b, emb, e));
        tied = va == vb;
      }
    }
    if (tied) parts.tied_copies.insert({last, global_out});
  }
  for (int64_t pp = 0; pp < parts.megatron_stages; ++pp)
    for (size_t ep = 0; ep < experts; ++ep) {
      const OptimizerState& m0 = reader_of(pp, ep, 0).meta();
      const std::string f0 = file_of(pp, ep, 0);
      for (const auto& [name, ps0] : m0.params) {
        if (ep > 0 && !is_expert_param(name)) {
          // a dense param: expert rank 0's
          for (size_t tp = 0; tp < ranks; ++tp) {
            auto& r = reader_of(pp, ep, tp);
            auto& r0 = reader_of(pp, 0, tp);
            const std::string fw = fmt::format("{} param '{}'", file_of(pp, ep, tp), name);
            const auto it = r.meta().params.find(name), it0 = r0.meta().params.find(name);
            if (it == r.meta().params.end()) continue;
            if (it0 == r0.meta().params.end())
              return corrupt(fmt::format("{}: a dense param (not an expert's) that expert rank 0's {} lacks", fw,
                                         file_of(pp, 0, tp)));
            if (it->second.shape != it0->second.shape)
              return corrupt(fmt::format("{}: shape {}; expert rank 0's {} has {}", fw, format_shape(it->second.shape),
                                         file_of(pp, 0, tp), format_shape(it0->second.shape)));
            if (it->second.shape.size() != 1 || !it->second.entries.count(kParam) || !it0->second.entries.count(kParam))
              continue;
            OPTSTATE_ASSIGN_OR_RETURN(auto w, values_of(r, name, kParam));
            OPTSTATE_ASSIGN_OR_RETURN(auto w0, values_of(r0, name, kParam));
            if (w != w0)
              return corrupt(fmt::format("{}: a dense param whose weights differ from expert rank 0's ({}): the "
                                         "folders are not of one checkpoint", fw, file_of(pp, 0, tp)));
          }
          continue;
        }
        const std::string gname = global(pp, ep, name);
        const std::string pw = fmt::format("{} param '{}'", f0, name);
        const auto dim = tensor_parallel_dim(name);
        // SwiGLU's first projection: twice the rows of its layer's second projection's columns
        bool glu = false;
        if (const auto fc2 = second_projection_of(name); dim && fc2) {
          const auto f2 = m0.params.find(*fc2);
          if (f2 == m0.params.end() || f2->second.shape.size() != 2 || ps0.shape.empty())
            return unsupported(fmt::format("{}: whether it is a gated MLP's (SwiGLU: each rank's shard its part of "
                                           "the gate above its part of the up projection) is told by its layer's "
                                           "'{}', which the checkpoint does not hold as a matrix", pw, *fc2));
          glu = ps0.shape[0] == 2 * f2->second.shape[1];
          if (!glu && ps0.shape[0] != f2->second.shape[1])
            return corrupt(fmt::format("{}: {} rows, its layer's '{}' has {} columns (the MLP's width, or half a "
                                       "gated one's)", pw, ps0.shape[0], *fc2, f2->second.shape[1]));
        }
        std::optional<std::vector<std::byte>> w0;
        for (size_t tp = 0; tp < ranks; ++tp) {
          auto& r = reader_of(pp, ep, tp);
          const auto& mt = r.meta();
          const auto it = mt.params.find(name);
          const std::string fw = fmt::format("{} param '{}'", file_of(pp, ep, tp), name);
          if (it == mt.params.end()) return corrupt(fmt::format("{}: missing; {} has it", fw, f0));
          if (it->second.shape != ps0.shape)
            return corrupt(fmt::format("{}: shape {}; {} has {}", fw, format_shape(it->second.shape), f0,
                                       format_shape(ps0.shape)));
          if (ranks == 1) continue;
          if (dim) {
            const auto split = shard_runs(it->second.shape, *dim, glu, static_cast<int64_t>(tp), parts.tp_size);
            if (!split)
              return corrupt(fmt::format("{}: shape {} is no shard along dim {}", fw, format_shape(it->second.shape),
                                         *dim));
            auto& sh = parts.sharded[gname];
            sh.shape = split->whole;
            std::vector<torchsave::RankFileSet::Run> runs;
            for (const Run& rn : split->runs) runs.push_back({rn.local, rn.global, rn.count});
            sh.by_tp.emplace(static_cast<int64_t>(tp), std::pair{it->second.shape, std::move(runs)});
            continue;
          }
          if (!it->second.entries.count(kParam)) continue;
          OPTSTATE_ASSIGN_OR_RETURN(auto w, values_of(r, name, kParam));
          if (!w0) {
            w0 = std::move(w);
          } else if (w != *w0) {
            return unsupported(fmt::format("{}: its weights differ from tensor-parallel rank 0's, so tensor "
                                           "parallelism splits it, along a dim Megatron's layer names do not say", fw));
          }
        }
        if (!dim || ranks == 1) parts.replicated.insert(gname);
      }
      for (size_t tp = 1; tp < ranks; ++tp)
        for (const auto& [name, ps] : reader_of(pp, ep, tp).meta().params)
          if (!m0.params.count(name))
            return corrupt(fmt::format("{} param '{}': missing; {} has it", f0, name, file_of(pp, ep, tp)));
    }
  return parts;
}

class MegatronDriver final : public FormatDriver {
 public:
  std::string_view name() const override { return "megatron"; }

  // A rank's model_optim_rng.pt (or distrib_optim.pt) in its mp_rank_<tp> folder, that folder, an
  // iteration folder holding such folders, or the checkpoints folder whose tracker names one.
  bool sniff(const fs::path& path) const override { return locate(path).has_value(); }

  Result<std::unique_ptr<CheckpointReader>> open(const fs::path& path) const override {
    const auto at = locate(path);
    if (!at) return invalid_argument(path.string() + ": not a Megatron-LM legacy checkpoint (iter_<N>/mp_rank_<tp>/" +
                                     kRankFile + ")");
    OPTSTATE_ASSIGN_OR_RETURN(const std::vector<RankFile> files, rank_files(at->iteration));
    if (at->one_rank && files.size() > 1)
      return unsupported(fmt::format("{}: one model-parallel rank's part of a Megatron-LM checkpoint of {} ranks: its "
                                     "tensors are {}; read the iteration folder ({})", path.string(), files.size(),
                                     files.back().tp > 0   ? "shards of its params"
                                     : files.back().ep > 0 ? "one expert rank's experts (and the dense params)"
                                                           : "one pipeline stage's params",
                                     at->iteration.string()));
    OPTSTATE_ASSIGN_OR_RETURN(const torchsave::RankFileSet parts, find_parts(at->iteration, files));
    OPTSTATE_ASSIGN_OR_RETURN(auto reader, torchsave::open_rank_files(parts));
    if (at->tracked)
      reader->add_located_note(fmt::format("Megatron-LM's save folder: {} names {}/, the iteration read", kTrackerFile,
                                           at->iteration.filename().string()));
    return reader;
  }

  // A training run's folder: never replaced, never written.
  bool replaceable(const fs::path&) const override { return false; }
  bool writes() const override { return false; }
  Status write(StateSource&, const fs::path& path, const WriteOptions&) const override {
    return unsupported(fmt::format("{}: optstate reads Megatron-LM's legacy checkpoints and writes them as other "
                                   "formats (dcp, torchsave, safetensors, ...), not as Megatron's", path.string()));
  }
};

}  // namespace

std::optional<fs::path> tracked_iteration(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_regular_file(root / kTrackerFile, ec)) return std::nullopt;
  auto f = InputFile::open(root / kTrackerFile);
  if (!f.ok() || f->size() > 64) return std::nullopt;
  std::string text(static_cast<size_t>(f->size()), '\0');
  if (!f->read_at(0, std::as_writable_bytes(std::span(text.data(), text.size()))).ok()) return std::nullopt;
  const auto dir = iteration_dir_of_tracker(text);
  if (!dir || !fs::is_directory(root / *dir, ec)) return std::nullopt;
  return root / *dir;
}

const FormatDriver& driver() {
  static const MegatronDriver d;
  return d;
}

}  // namespace optstate::megatron
