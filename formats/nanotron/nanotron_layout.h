// nanotron's checkpoints (huggingface/nanotron: `checkpoints/<step>/` with model/, optimizer/,
// lr_scheduler/, random/, checkpoint_metadata.json, config.yaml): what its optimizer folder's file
// names and optimizer_config.json say, parsed as pure functions. The torch.save driver's reader reads
// the files (torchsave/: open_rank_files). Layout: FORMAT.md.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "optstate/status.h"

namespace optstate::nanotron {

// optimizer_pp-<p>-of-<P>[_dp-<d>-of-<D>]_tp-<t>-of-<T>[_exp-<e>-of-<E>].pt: the ranks of the file's
// writer. The dp part is ZeroDistributedOptimizer's (each data-parallel rank saves its runs); the
// exp part is nanotron's since expert parallelism (older releases omit it: 0 of 1).
struct FileRanks {
  int64_t pp = 0, pp_size = 0;
  std::optional<int64_t> dp, dp_size;
  int64_t tp = 0, tp_size = 0;
  int64_t exp = 0, exp_size = 1;
  bool operator==(const FileRanks&) const = default;
};
std::optional<FileRanks> parse_file_name(std::string_view name);

// optimizer_config.json, as world rank 0 writes it: the optimizer's class, the parallel sizes
// (strings of digits, as nanotron writes them; numbers taken too) and, for ZeroDistributedOptimizer,
// where each param's flat runs lie per data-parallel rank and its shape before flattening (rank 0's
// pipeline stage's params only).
struct Config {
  std::string type;
  int64_t tp_size = 1, dp_size = 1, pp_size = 1, exp_size = 1;
  struct ZeroParam {
    std::map<int64_t, std::pair<int64_t, int64_t>> runs;  // dp rank -> [start, end)
    std::vector<int64_t> shape;
  };
  std::map<std::string, ZeroParam> zero;  // empty unless type is ZeroDistributedOptimizer
  bool is_zero() const { return type == "ZeroDistributedOptimizer"; }
};
// Every number checked (sizes in [1, 2^20], runs inside the shape's elements, ranks below dp_size);
// `where` names the file in errors.
Result<Config> parse_config(std::string_view json, const std::string& where);

// A file under the checkpoint's model/ (nanotron's get_path): <module path>/model_<tensor>.safetensors
// for a param no rank shards, or model_<tensor>_pp-rank-<p>-of-<P>_tp-rank-<t>-of-<T>[_exp-rank-<e>-
// of-<E>].safetensors for a NanotronParameter sharded over tensor-parallel ranks (every such param,
// tp_size 1 too). `components`: the path's parts below model/.
struct ModelFile {
  std::string name;  // the param's, as the optimizer's 'names' give it
  bool sharded = false;
  int64_t pp = 0, pp_size = 1, tp = 0, tp_size = 1;
};
std::optional<ModelFile> parse_model_path(const std::vector<std::string>& components);

// One slice of nanotron's SlicesPair ("start,stop,step", each "None" or an integer).
struct Slice {
  std::optional<int64_t> start, stop, step;
};
// A sharded param's TensorMetadata, from its safetensors __metadata__: its whole shape
// (unsharded_shape, "(64, 16)"; numpy's "np.int64(64)" taken for 64, as numpy 2 prints nanotron's
// sizes) and how the local tensor's boxes lie in it (local_global_slices_pairs:
// "<local dims>#<global dims>" pairs joined by ';', dims by '|'; fused q/k/v and gate/up give
// several pairs).
struct SlicePair {
  std::vector<Slice> local, global;
};
struct ShardMeta {
  std::vector<int64_t> unsharded;
  std::vector<SlicePair> pairs;
};
Result<ShardMeta> parse_shard_metadata(const std::map<std::string, std::string>& metadata, const std::string& where);

// Where a local tensor's elements lie in the whole tensor: runs of `count` consecutive elements
// from flat index `local` of the local tensor to flat index `global` of the whole one, in local
// order, merged where both continue. Each pair's boxes must lie inside their tensors (step 1,
// `None` the whole dim), be of one size, and the local boxes must cover the local tensor exactly
// once; at most `max_runs` runs.
struct Run {
  int64_t local = 0, global = 0, count = 0;
  bool operator==(const Run&) const = default;
};
Result<std::vector<Run>> shard_runs(const std::vector<int64_t>& local_shape, const ShardMeta& meta, size_t max_runs,
                                    const std::string& where);

// nanotron's ZeRO-1 split of a param of `numel` elements over `dp` ranks
// (ZeroDistributedOptimizer._partition_parameters): ceil(numel / dp) each, the last ranks one
// fewer until they add up; empty runs left out.
std::map<int64_t, std::pair<int64_t, int64_t>> zero_runs(int64_t numel, int64_t dp);

}  // namespace optstate::nanotron
