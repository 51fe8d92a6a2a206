// A torch.save'd optimizer state_dict (`torch.save(optimizer.state_dict(), "optimizer.pt")`, as
// Hugging Face's Trainer and plain PyTorch loops keep it), interpreted from its data.pkl without
// running it, and encoded for the writer. Pure functions over the pickle; the driver
// (torchsave_format.cpp) reads the archive and the tensors' bytes. Layout and mapping: FORMAT.md.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/state.h"

namespace optstate::torchsave {

// A number the file holds either as a Python number or as a one-element tensor (torch keeps `step`
// as a float32 tensor; torchao keeps `lr` as one), which the driver reads.
struct Scalar {
  std::optional<double> number;
  std::optional<dcp::TensorRef> tensor;
};

struct EntrySpec {
  Encoding encoding = Encoding::kDense;
  dcp::TensorRef values;                // dense
  dcp::TensorRef codes, absmax;         // blockwise8
  int64_t block_size = 0;               // blockwise8
  std::optional<dcp::TensorRef> qmap;   // torchao's OptimState8bit: its map, checked by the driver
  std::string qmap_name;                // optstate's plain 8-bit tensors: the map the group names
};

struct ParamSpec {
  std::string fqn;
  int64_t id = 0;  // its index in the state_dict (torch numbers params 0.. across the groups)
  int group = 0;
  std::vector<int64_t> shape;
  Scalar step;
  std::map<std::string, EntrySpec> entries;
  std::optional<dcp::TensorRef> weight;  // from a "model" dict beside the optimizer's
};

struct GroupSpec {
  Hyperparameters hyper;
  Scalar lr;
  std::vector<std::string> params;  // fqns, in the group's order (params without state left out)
};

struct StateDict {
  std::vector<GroupSpec> groups;
  std::vector<ParamSpec> params;     // in id order
  bool eight = false;                // any 8-bit entry, or a group with optstate's block_size
  std::string optimizer_path;        // where the optimizer's dict is: "" (the file is one) or "['optimizer']"
  std::vector<std::string> not_read; // what the file holds that the canonical state does not
};

// The optimizer state_dict at the pickle's root, or the one dict beside others in a dict at the
// root ({"model": ..., "optimizer": ...}), or the one element of a list there (Lightning's
// "optimizer_states"). `where` names the file in errors.
Result<StateDict> interpret_state_dict(const pickle::Pickle& p, const std::string& where);

// Where the writer puts each tensor: the storage key of param `id`'s `entry` ("step", "exp_avg",
// ..., "param" for its weights in the "model" dict).
struct StorageKeys {
  std::map<std::pair<int64_t, std::string>, std::string> key;
};

// data.pkl for `state` (dense entries only: the writer dequantizes), params numbered in the
// groups' order. With weights, the file is {"model": {fqn: weight}, "optimizer": state_dict}.
// `param_names` are written unless every name is its own number (what this reader gives files
// without them), so a file read without names writes back as it was.
std::string encode_state_dict(const OptimizerState& state, const StorageKeys& keys);

// The params in the order torch numbers them (the groups' order): what encode_state_dict's ids mean.
std::vector<std::string> param_order(const OptimizerState& state);

}  // namespace optstate::torchsave
