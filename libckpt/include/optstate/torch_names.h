// How torch names and numbers an optimizer's params, shared by the drivers that read a model's
// state_dict beside a numbered optimizer state (torch.save's {"model", "optimizer"}, a DCP of
// {"model": model.state_dict(), "optimizer": optimizer.state_dict()}). Pure functions of names and
// shapes: no format here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace optstate {

// The name torch's distributed state dicts (get_state_dict, and so DCP) give a param that
// named_parameters() or a model's state_dict names `name`: the segments wrappers insert dropped
// (torch.compile's `_orig_mod`, activation checkpointing's `_checkpoint_wrapped_module`, FSDP1's
// `_fsdp_wrapped_module`), as python/optstate/names.py drops them. nanoGPT saves its compiled
// model's state_dict ('_orig_mod.transformer.wte.weight'); its state is 'transformer.wte.weight's.
// DDP's leading `module.` is dropped only where `ddp_prefix` says the whole state dict is under it
// (is_ddp_state_dict): one name does not tell it from a submodule named `module`.
std::string torch_param_fqn(std::string_view name, bool ddp_prefix = false);

// Whether a model's state_dict keys (`names`) are a DistributedDataParallel's (or DataParallel's):
// every one under `module.`, as torch's consume_prefix_in_state_dict_if_present takes it off and
// get_state_dict drops it. A model's own submodule named `module` holding everything is told apart
// by nothing; a state dict with any key outside it is not DDP's.
template <class Names>
bool is_ddp_state_dict(const Names& names) {
  bool any = false;
  for (const auto& name : names) {
    if (std::string_view(name).substr(0, 7) != "module.") return false;
    any = true;
  }
  return any;
}

// torch.nn's BatchNorm / InstanceNorm buffers (running_mean, running_var, num_batches_tracked),
// which sit between params of the same shape in a model's state_dict and are never an optimizer's
// params.
bool is_norm_buffer(std::string_view name);

// An optimizer's state_dict numbers its params as torch does (group by group, each group's in the
// order it was given) and names none; the model's state_dict beside it names its tensors in module
// order, params and buffers alike. Each group given a filter of `named_parameters()` (one group of
// `model.parameters()`; nanoGPT's and Hugging Face's decay / no-decay groups; only a LoRA's
// adapters), each group's params are a subsequence of the model's tensors in order, the groups
// disjoint. `groups`: per group, its params' shapes in order (none: a param without state, whose
// shape the file does not hold); `tensors`: the model's candidate tensors' shapes in order.
// Exactly one such placement must fit (shapes equal, every param placed): then `tensor_of[g][i]` is
// group g's i-th param's tensor; else `why` says what did not fit, and the params keep their numbers.
struct ModelPlacement {
  std::vector<std::vector<size_t>> tensor_of;
  std::string why;  // empty when placed
};
ModelPlacement place_params_in_model(const std::vector<std::vector<std::optional<std::vector<int64_t>>>>& groups,
                                     const std::vector<std::vector<int64_t>>& tensors);

}  // namespace optstate
