// Megatron-LM's legacy checkpoints (`--ckpt-format torch`): iter_<N>/mp_rank_<tp>[_<pp>][_<ep>]/
// model_optim_rng.pt per model-parallel rank, the distributed optimizer's distrib_optim.pt beside it.
// What their names say and how tensor parallelism splits a param, as pure functions; the torch.save
// driver's reader reads the files (torchsave/: open_rank_files). Layout: FORMAT.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "optstate/status.h"

namespace optstate::megatron {

// A model-parallel rank's folder, mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>] (get_checkpoint_name: the
// pipeline rank where pipeline parallelism is on, the expert rank where expert parallelism is).
struct RankDir {
  int64_t tp = 0;
  std::vector<int64_t> more;  // the pipeline and/or expert ranks, as the name gives them
  bool operator==(const RankDir&) const = default;
};
std::optional<RankDir> parse_rank_dir(std::string_view name);

// An iteration's folder name: iter_<N:07d> or release.
bool is_iteration_dir(std::string_view name);

// The tracker Megatron-LM's save writes beside the iteration folders (world rank 0, once every rank's
// files are saved), whatever the --ckpt-format.
inline constexpr const char* kTrackerFile = "latest_checkpointed_iteration.txt";

// latest_checkpointed_iteration.txt: an iteration number, or "release" -> the folder's name
// (iter_0000100, release); nullopt for anything else.
std::optional<std::string> iteration_dir_of_tracker(std::string_view text);
// A save folder's iteration folder that its tracker names, where the folder is there (reads the
// tracker, 64 bytes at most; megatron_format.cpp): the legacy driver's and the DCP driver's.
std::optional<std::filesystem::path> tracked_iteration(const std::filesystem::path& save_folder);

// How tensor parallelism splits a param of Megatron's layers, from its name: the dim its ranks'
// shards are concatenated along (column-parallel and vocab-parallel weights and their biases: 0;
// row-parallel weights: 1), or nullopt (replicated: layer norms, row-parallel biases, position
// embeddings, routers). Megatron-Core's names (linear_qkv, linear_proj, linear_fc1, linear_fc2,
// word_embeddings, output_layer; TEGroupedMLP's weight<k>) and the legacy model's (query_key_value,
// dense, dense_h_to_4h, dense_4h_to_h).
std::optional<int> tensor_parallel_dim(std::string_view name);

// For an MLP's first projection (linear_fc1, dense_h_to_4h; weight or bias, TEGroupedMLP's <k>-th),
// the name of its layer's second projection's weight (linear_fc2, dense_4h_to_h): a gated MLP's
// (SwiGLU's) first has twice the rows of the second's columns, and each tensor-parallel rank's
// shard of it is its part of the gate above its part of the up projection. nullopt for any other.
std::optional<std::string> second_projection_of(std::string_view name);

// Where a tensor-parallel rank's shard lies in the whole param: runs of `count` consecutive
// elements from flat index `local` of the shard to `global` of the whole, in local order. `dim`:
// the split dim; `glu`: the shard is two halves along dim 0 (gate, up), each the rank's part of
// the whole's half. Shapes checked (dim in range, halves even).
struct Run {
  int64_t local = 0, global = 0, count = 0;
  bool operator==(const Run&) const = default;
};
struct Split {
  std::vector<int64_t> whole;
  std::vector<Run> runs;
};
std::optional<Split> shard_runs(const std::vector<int64_t>& local_shape, int dim, bool glu, int64_t tp, int64_t tp_size);

// Under pipeline parallelism each stage's model numbers its transformer layers from 0: a name's
// layer, "<stack>layers.<i>.<rest>" (the first such segment: decoder.layers.3.mlp...,
// language_model.encoder.layers.3...), as {stack through "layers.", i}; nullopt for a name of no
// layer. renumber_layer gives the name with the layer's index moved by `offset`.
struct LayerOf {
  std::string stack;
  int64_t index = 0;
};
std::optional<LayerOf> layer_of(std::string_view name);
std::string renumber_layer(std::string_view name, int64_t offset);

// A mixture of experts (Megatron-Core's MoE layer, `.mlp.experts.`; its shared experts are dense):
// the experts' params are stepped by an optimizer of their own (Megatron's chain), and under
// expert parallelism each expert rank holds its local experts, numbered from 0: SequentialMLP's
// "...mlp.experts.local_experts.<i>.linear_fc1.weight", TEGroupedMLP's
// "...mlp.experts.linear_fc1.weight<i>". expert_of: a name's local expert index (nullopt for a name
// of no single expert, such as the legacy GroupedMLP's weight1 holding every local expert);
// renumber_expert: the name with it moved by `offset` (the rank's first expert).
bool is_expert_param(std::string_view name);
std::optional<int64_t> expert_of(std::string_view name);
std::string renumber_expert(std::string_view name, int64_t offset);

// Under a virtual pipeline a stage's file holds each model chunk's state_dict (['model0'],
// ['model1'], ...), each numbering its layers from 0; the torch.save reader names a chunk's tensors
// "model<c>.<name>" (torchsave::ModelSource). chunk_of: {c, name} of such a name.
struct ChunkOf {
  int64_t chunk = 0;
  std::string_view rest;
};
std::optional<ChunkOf> chunk_of(std::string_view name);

// A rank's param name in the whole model: its layer numbered on by its pipeline stage's (and model
// chunk's) offset for its stack of layers (`layer_offsets`: stack -> offset, the stack with its
// chunk's prefix; none for a stage's own numbering), then its expert by its expert rank's first
// expert; `chunked`: the name's chunk prefix then left out.
std::string global_name(std::string_view local, const std::map<std::string, int64_t>* layer_offsets,
                        int64_t expert_offset, bool chunked = false);

// The distributed optimizer's distrib_optim.pt (save_parameter_state, `buckets_coalesced`): per
// DDP buffer, flat fp32 tensors of its params' main params and moments, each bucket's
// [0, numel_unpadded) one after another (the padding after each bucket's last param left out).
// Megatron lays a buffer's params out in reverse module order, each starting at a multiple of 64
// elements from its bucket's start; a bucket ends after the param that fills it to the bucket
// size (not saved), so the next param starts where that one ended. Each tensor of the model's
// (module order, `numels`) is placed here from the values: at its aligned start, or where the last
// one ended (a new bucket), where the buffer's main params round to its weights (sample_places, more
// where both fit); a tensor that fits at neither is no param of the buffer (a frozen one). The
// placed params must fill the buffer to `numel_unpadded` exactly; values come through callbacks
// as bit patterns of the weights' dtype (the main params rounded to it).
struct BufferValues {
  std::function<Result<std::vector<uint32_t>>(std::span<const int64_t> at)> buffer;
  std::function<Result<std::vector<uint32_t>>(size_t tensor, std::span<const int64_t> at)> tensor;
};
Result<std::vector<std::optional<int64_t>>> place_in_buffer(int64_t numel_unpadded, const std::vector<int64_t>& numels,
                                                            const std::vector<std::string>& names,
                                                            const BufferValues& values, const std::string& where);

}  // namespace optstate::megatron
