// DeepSpeed's FP16_Optimizer, its fused form (fp16 or bf16 without ZeRO, DeepSpeed's FusedAdam or
// apex's inside): each param group's params flattened into one fp32 master
// (['optimizer']['fp32_groups_flat'][g]: the group's params one after another in the group's order,
// no padding, as torch's _flatten_dense_tensors lays them out), the inner optimizer stepping that
// one flat param. Which params a group holds is not saved; it is found from the values: the
// module's fp16/bf16 weights beside it are the masters rounded (FP16_Optimizer copies them back
// after every step, and made the masters from them). Pure: values come through callbacks
// (FORMAT.md, "Without ZeRO (stage 0)").
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "optstate/status.h"

namespace optstate::deepspeed {

// Values as bit patterns (2 or 4 bytes, widened to uint32): group g's master at `begin + at[i]`
// rounded to tensor t's dtype (round to nearest even), tensor t's elements at C-order `at[i]`.
struct FlatValues {
  std::function<Result<std::vector<uint32_t>>(size_t group, int64_t begin, std::span<const int64_t> at, size_t tensor)>
      flat;
  std::function<Result<std::vector<uint32_t>>(size_t tensor, std::span<const int64_t> at)> tensor;
};

struct FlatPlace {
  size_t group = 0;
  int64_t begin = 0;  // the tensor's elements are the group's [begin, begin + numel)
};

// Where each of the model's tensors (module order, `numels`; `names` for errors) lies in the
// groups' flat masters (`group_numels`), or nullopt: no param of the optimizer (a frozen param).
// Each group's params are a subsequence of the tensors in module order (each group given a filter
// of model.parameters(), as for torch: names_from_model), packed from element 0 to its end, the
// groups disjoint; a tensor is placed where the master rounds to its weights (compared at
// dcp::megatron::sample_places). Exactly one such placement must fill every group; none, or two
// (equal weights that could change places: a check before any step), are refused naming the group
// and element, or the two tensors. Tensors of no elements are never placed. The search visits each
// (tensor, groups' fill) state once, and gives up after `max_visits` of them (fewer where the groups
// are so many that the states kept would hold over 2^26 fills); a state is given up
// at once where some group's next element is the first of no tensor left that fits there (found
// through the tensors' first elements, indexed once), so leaving out a tensor that fits ends its
// branch there, and the walk stays about as long as the model. `classes`: tensors of one class
// round alike (their dtype; empty: all one).
Result<std::vector<std::optional<FlatPlace>>> place_in_flat_groups(const std::vector<int64_t>& group_numels,
                                                                   const std::vector<int64_t>& numels,
                                                                   const std::vector<std::string>& names,
                                                                   const FlatValues& values, const std::string& where,
                                                                   const std::vector<int>& classes = {},
                                                                   int64_t max_visits = int64_t{1} << 20);

}  // namespace optstate::deepspeed
