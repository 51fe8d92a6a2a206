// Megatron-Core's distributed checkpoints (megatron.core.dist_checkpointing, Megatron-LM's default
// `--ckpt-format torch_dist`): a DCP whose optimizer items are `optimizer.state.<entry>.<key>`
// (key: the model's sharded key, transformer layers stacked along leading axes), beside
// `common.pt` (torch.save: the param groups without their members, the step) and `metadata.json`.
// Pure interpretation of those two files; the DCP reader reads the items (FORMAT.md, "Megatron").
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcp_layout.h"
#include "optstate/checkpoint.h"
#include "optstate/state.h"
#include "optstate/status.h"
#include "pickle.h"

namespace optstate::dcp::megatron {

// The sharded backend `metadata_json` (a folder's metadata.json) names: "torch_dist" (a DCP beside
// it), "zarr" (zarr.h), another; empty for a document that does not parse, names a key twice in one
// object or names no backend (the folder is then read as a plain DCP, or refused as one).
std::string sharded_backend(std::string_view metadata_json);

// Megatron-Core 0.19's integrity.json (save(..., verify_integrity=True), Megatron-LM's
// --verify-integrity): {"algorithm": "sha256", "files": {"<name>": "<64 hex digits>", ...}}, each
// file of the checkpoint folder (the manifest itself left out) with its SHA-256. Refused, naming
// why: not that object, another algorithm, a name that is not a plain file name of the folder (a
// path, "." or "..", the manifest's own), a digest that is not 64 lowercase hex digits, a name
// twice, more than kMaxIntegrityFiles files.
inline constexpr const char* kIntegrityManifest = "integrity.json";
inline constexpr size_t kMaxIntegrityFiles = 1'000'000;
struct FileDigest {
  std::string name, sha256;
};
Result<std::vector<FileDigest>> parse_integrity_manifest(std::string_view text, const std::string& where);

// A param group of Megatron's optimizer: AdamW's settings, torch.optim.AdamW's switches, the other
// plain keys (Megatron's wd_mult, lr_mult, max_lr, ...), and its wd_mult (1 where absent).
struct Group {
  Hyperparameters hyper;
  AdamWFlags flags;
  GroupExtras extras;
  double wd_mult = 1;
  bool expert_parallel = false;  // is_expert_parallel: MoE experts' params (an optimizer of their own)
};

// One optimizer of what common.pt holds.
struct Optimizer {
  // "" (Megatron's plain optimizer, or its mixed-precision one), or the distributed optimizer's
  // param_state_sharding_type ("fully_reshardable", "fully_sharded_model_space": per-param items;
  // "dp_reshardable": flat per-bucket buffers, megatron_buckets.h).
  std::string sharding;
  std::vector<Group> groups;
  // The step: the plain optimizer's state.common_step (a number or a one-element tensor, read by
  // the caller, which has its storages), or the distributed optimizer's groups' `step`.
  pickle::Ref step_ref = pickle::kNoRef;
  std::optional<double> group_step;
};

// What common.pt holds of the optimizer: one, or Megatron's chain of them (MoE under expert
// parallelism: the dense params' optimizer and the experts'), whose items are prefixed
// `chained_<i>.`.
struct Common {
  std::vector<Optimizer> optimizers;
  bool chained = false;
  // content_metadata's chained_optim_avoid_prefix (Megatron-LM's and verl's default since
  // Megatron-Core 0.14): a chain's items then carry no chained_<i>. prefix.
  bool avoid_prefix = false;
  std::vector<std::string> other_keys;  // common.pt's top-level keys but 'optimizer' (the trainer's)
  bool lightning = false;  // NeMo 1.x's Lightning checkpoint dict (the optimizer under 'optimizer_states')
};

// common.pt's pickle (its root dict). Refuses, naming why: no optimizer (saved without one), the
// distributed optimizer's dp_zero_gather_scatter (one gathered buffer per data-parallel group),
// param groups that are not AdamW's (another optimizer, Adam's L2 decay), groups that differ in
// their steps. A dp_reshardable optimizer comes without groups: they are in each data-parallel
// group's own item (interpret_group_optimizer).
// `root`: the dict's node (Megatron-Core 0.19's common_state item holds [dict]), the pickle's root
// where kNoRef; `file`: what errors call it.
Result<Common> interpret_common(const pickle::Pickle& p, const std::string& where, pickle::Ref root = pickle::kNoRef,
                                std::string_view file = "common.pt");

// The distributed optimizer's state dict that dp_reshardable saves per data-parallel group
// ("[chained_<i>.]optimizer.distributed.dp_group_idx_<G>.optimizer": its param groups, members
// left out, each with the step).
Result<Optimizer> interpret_group_optimizer(const pickle::Pickle& p, const std::string& where);

// dp_zero_gather_scatter's ShardedObject `optimizer.distributed.dp_group_idx_<G>.param_state`, and
// Megatron-LM's legacy distrib_optim.pt (formats/megatron/), which hold the same (get_parameter_state_dp_zero): {"buckets_coalesced":
// True, <gbuf>: {(param dtype, grad dtype): {"param", "exp_avg", "exp_avg_sq": flat float32 of
// "numel_unpadded" elements}}}. A buffer each, in gbuf order; refused, naming why: not coalesced,
// a buffer of several dtypes, params of another dtype than bf16/f16/f32, a tensor of another size.
struct FlatBuffer {
  int64_t gbuf = 0;
  DType param_dtype = DType::kF32;
  int64_t numel = 0;
  std::map<std::string, TensorRef> entries;  // param, exp_avg, exp_avg_sq
};
// `state`: the dict (Megatron-LM's distrib_optim.pt: the root, or an element of its chain's list), or
// the ShardedObject's one-element list around it.
Result<std::vector<FlatBuffer>> interpret_param_state(const pickle::Pickle& p, pickle::Ref state,
                                                      const std::string& where);

// The optimizer's dict of Megatron-LM's legacy checkpoint (model_optim_rng.pt's ['optimizer']):
// its param groups as interpret_common reads them, the distributed optimizer's without members,
// each with the step (formats/megatron/).
Result<Optimizer> interpret_legacy_optimizer(const pickle::Pickle& p, pickle::Ref opt, const std::string& where);

// An optimizer item's key: "[chained_<i>.]optimizer.state.<entry>.<key>" -> {i (-1 without the
// prefix), entry, key}, entry one of the names Megatron gives a param's state (no dots), key
// non-empty. nullopt for any other item key.
struct StateItem {
  int chain = -1;
  std::string entry, key;
};
std::optional<StateItem> state_item(std::string_view item_key);

// Which optimizer of an unprefixed chain (Common::avoid_prefix) holds sharded key `key`: the
// experts' (the one whose groups are is_expert_parallel) for a key under an MoE layer's experts
// (".experts."), the other for the rest. nullopt where the chain is not one dense optimizer and one
// of experts.
std::optional<size_t> unprefixed_chain(const Common& c, std::string_view key);

// How many leading axes of item `im` stack a key's params (Megatron's prepended axes: a layer's, an
// expert's): those where every chunk is one wide, the item wider than one there, or exactly one wide.
size_t stacked_axes(const ItemMeta& im);

// Megatron-Core's standard param groups (get_standard_config_overrides, no overrides given): no
// weight decay (wd_mult 0) for a param whose name ends in ".bias" or that is one-dimensional (its
// stacked axes left out); decay for the rest.
bool standard_no_decay(std::string_view key, const ItemMeta& im);

}  // namespace optstate::dcp::megatron
