// Megatron-Core's distributed optimizer saved `dp_reshardable` (its default since Megatron-Core
// 0.14): per model-parallel rank (a data-parallel group, `dp_group_idx_<G>`) and DDP bucket, one
// flat item per state entry (`param`: the fp32 main params, `exp_avg`, `exp_avg_sq`) holding the
// bucket's params one after another, each in its own DCP chunk (a param split between two
// data-parallel ranks in two), with padding between them. Which param lies where is Megatron's DDP
// layout, computed from the live model and not saved; it is found here from the values: the fp32
// main param of a param, rounded to the model's dtype, is the model weight the checkpoint holds
// beside it. Pure: values come through callbacks (FORMAT.md, "Megatron", dp_reshardable).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "optstate/dtype.h"
#include "optstate/status.h"

namespace optstate::dcp::megatron {

// A bucket item's key:
// "[chained_<i>.]optimizer.distributed.dp_group_idx_<G>.gbuf_idx_<B>.dtype_<D>.bucket_idx_<K>.<entry>"
// (D: Megatron's buffer dtype key, e.g. "(torch.bfloat16, torch.float32)"; entry without dots).
struct BucketKey {
  int chain = -1;
  int64_t group = 0, gbuf = 0, bucket = 0;
  std::string dtype, entry;
};
std::optional<BucketKey> bucket_key(std::string_view item_key);

// The bytes item of a data-parallel group's optimizer state dict (its param groups):
// "[chained_<i>.]optimizer.distributed.dp_group_idx_<G>.optimizer" -> {chain, G}.
std::optional<std::pair<int, int64_t>> group_optimizer_key(std::string_view item_key);

// The ShardedObject item of a data-parallel group's state gathered flat (dp_zero_gather_scatter):
// "[chained_<i>.]optimizer.distributed.dp_group_idx_<G>.param_state/shard_<...>" -> {chain, G}.
std::optional<std::pair<int, int64_t>> param_state_key(std::string_view item_key);

// Params a chunk box of one model weight (one rank's part of it): a candidate for a run of a
// bucket. `offsets` order a stacked key's boxes (layers, experts).
struct Box {
  size_t key = 0;  // index into the caller's weights
  std::vector<int64_t> offsets;
  int64_t numel = 0;
  DType dtype = DType::kF32;  // the weight's: bf16, f16 or f32
};

// One bucket: its chunk starts (sorted, the first 0) over [0, numel), in domain `domain` (a
// (chain, data-parallel group): one model-parallel rank's buffers, in Megatron's order: by gbuf,
// then bucket).
struct Bucket {
  std::string name;  // for errors: its items' key without the entry
  size_t domain = 0;
  // Megatron's buffer (gbuf_idx: one per model chunk under virtual pipeline parallelism, and
  // dtype): the reverse layout orders a key's layers only within one.
  int64_t buffer = 0;
  int64_t numel = 0;
  std::vector<int64_t> starts;
};

// Values as bit patterns of `dtype` (2 or 4 bytes, widened to uint32): a bucket's main params at
// `begin + at[i]` rounded to `dtype` (round to nearest even), a box's weights at its C-order
// elements `at[i]`.
struct BucketValues {
  std::function<Result<std::vector<uint32_t>>(size_t bucket, int64_t begin, std::span<const int64_t> at, DType dtype)>
      bucket;
  std::function<Result<std::vector<uint32_t>>(size_t box, std::span<const int64_t> at)> box;
};

struct Placement {
  size_t bucket = 0;
  int64_t begin = 0;  // the box's elements are the bucket's [begin, begin + numel)
};

// Where each box's state lies (nullopt: none, a weight that is no param of these buckets: a
// buffer, a frozen param). A run of a bucket is a box's where it starts and ends at chunk bounds
// and its main params round to the box's weights (compared at up to 32 places, all of them where
// two boxes compete). Every box of a weight is placed or none; a bucket's elements no box takes
// are padding (runs shorter than Megatron's 64-element param alignment); boxes of equal values are
// told apart by Megatron's layout (a stacked key's later layers first in a buffer: it lays params
// out in reverse order) where they are one key's and their runs lie in one buffer, and refused
// otherwise; a box found in several
// domains (a param replicated over tensor-parallel ranks) is read from the first. `names`: the
// weights' keys, for errors.
Result<std::vector<std::optional<Placement>>> place_boxes(const std::vector<Bucket>& buckets,
                                                          const std::vector<Box>& boxes,
                                                          const std::vector<std::string>& names,
                                                          const BucketValues& values, const std::string& where);

// Megatron's distributed optimizer saved dp_zero_gather_scatter (Megatron-LM's without
// --ckpt-fully-parallel-save up to 0.13, NeMo 1.x's without dist_ckpt_parallel_save): each DDP
// buffer of a data-parallel group gathered into flat tensors (`param`, `exp_avg`, `exp_avg_sq`), its
// buckets one after another, each cut at its last param's end; within a bucket the params lie in
// reverse module order, each starting at a multiple of 64 elements from the bucket's start. The
// module order is not in a distributed checkpoint, so the params' bounds are walked from the
// values: from the buffer's start, each next param starts where the last ended (a new bucket) or
// at its 64-aligned start, and is a box (of the buffer's `dtype`) whose weights the main params
// there round to (its first elements looked up, then sample_places). Returns the bounds found (each
// param's start and end, sorted, 0 first, `numel` left out): the chunk starts place_boxes then
// places the boxes by. Refused, naming the element: no box fits at either start, boxes fit at both,
// or boxes of different sizes fit at one (equal weights of different lengths).
Result<std::vector<int64_t>> flat_buffer_bounds(size_t bucket, int64_t numel, DType dtype,
                                               const std::vector<Box>& boxes, const BucketValues& values,
                                               const std::string& where);

// The sample of a run of `numel` elements compared first: all of it up to 32, else its first 8,
// its last 8 and 16 spread between.
std::vector<int64_t> sample_places(int64_t numel);

}  // namespace optstate::dcp::megatron
