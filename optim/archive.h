// LibTorch's optimizer archive: what `torch::save(optimizer, "optimizer.pt")` writes and
// `torch::load(optimizer, ...)` reads, for FusedAdamW and AdamW8bit in the layout of
// torch::optim::AdamW's (formats/libtorch/FORMAT.md), so a C++ training loop keeps its checkpoint
// code when it switches optimizer, and an archive of one loads into the other.
//
// Both directions go through the canonical state (torch_bridge.h): the params are numbered in
// group order, as the archive lists them; loading checks everything before anything changes.
#pragma once

#include <string>
#include <vector>

#include "optstate/state.h"

namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace optstate::optim {

// "0", "1", ...: one name per param of `opt`, in group order.
std::vector<std::string> numbered_names(const torch::optim::Optimizer& opt);

// Writes `state` (exported from `opt` under numbered_names) into `archive`: "pytorch_version"
// "1.5.0"; "state/<key>" per param with state: "step" (int), each moment as a dense tensor under
// its name ("exp_avg", ...) or, 8-bit, as "<moment>_codes" (uint8, the param's shape) +
// "<moment>_absmax" (fp32, one per block) with the param's "block_size"; "param_groups": torch's
// group lists of keys, each group's "options" (lr, betas, eps, weight_decay, amsgrad, maximize,
// and `extra_options` such as AdamW8bit's block_size). A key is the param's TensorImpl address,
// as LibTorch writes it (only its position in the group lists matters when loading).
void write_archive(torch::serialize::OutputArchive& archive, const torch::optim::Optimizer& opt,
                   const OptimizerState& state, const std::vector<std::pair<std::string, int64_t>>& extra_options);

// Reads an archive written by write_archive or by torch::optim::AdamW::save into a canonical
// state whose params are numbered_names(opt): the archive's groups must match opt's in number and
// sizes (param i of the archive is opt's param i, as torch::optim loads it). Moments of another
// floating dtype (torch::optim::AdamW keeps a bf16 param's state in bf16) become fp32 exactly.
// Errors name the group, param and entry.
Result<OptimizerState> read_archive(torch::serialize::InputArchive& archive, const torch::optim::Optimizer& opt);

}  // namespace optstate::optim
