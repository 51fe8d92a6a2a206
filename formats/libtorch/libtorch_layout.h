// LibTorch's optimizer archive, what C++'s torch::save(optimizer, path) writes: encoded from the
// canonical state as pure functions (the driver, libtorch_format.cpp, writes the zip and the
// tensors' bytes). Layout: FORMAT.md. Reading is the torch.save driver's (torchsave/): the same
// zip, pickle interpreter and tensor rebuilds.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "optstate/state.h"

namespace optstate::libtorch {

// One storage record "<folder>/data/<index>": a component of an entry of the state, or (`bytes`
// set) a count LibTorch keeps as an int64 0-d tensor.
struct StorageSpec {
  std::string fqn, entry;
  Component component = Component::kValues;
  bool dequantize = false;  // a blockwise8 entry written as its fp32 values
  std::string bytes;        // inline data (the counts)
};

struct ArchivePlan {
  std::string data_pkl;                                     // the module tree, protocol 2
  std::vector<std::pair<std::string, std::string>> code;   // "code/__torch__/....py" -> class source
  std::vector<StorageSpec> storages;                        // data/0, data/1, ... in this order
};

// The archive of `state`, its params numbered in the groups' order (torch's numbering): the layout
// of torch::optim::AdamW's archive (which torch::optim::AdamW, optstate's FusedAdamW and AdamW8bit
// load), 8-bit moments as optstate's AdamW8bit writes them (codes, absmax, block_size) unless
// `dequantize`. Weights ("param" entries) are no part of an optimizer archive and are left out.
Result<ArchivePlan> plan_archive(const OptimizerState& state, bool dequantize);

}  // namespace optstate::libtorch
