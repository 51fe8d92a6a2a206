// One rank's part of a checkpoint (DESIGN §2): loading on M ranks whatever N wrote it, reading only
// the chunks a rank's ranges overlap, and checking a live shard against its checkpoint after a resume.
//
// A "local" state has the whole state's metadata (global shapes, steps, groups) while each buffer
// holds only this rank's range of its component: shard_range(entry, component, shape, world, rank).
// That is what native::save_sharded takes and what load_shard returns.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "optstate/checkpoint.h"
#include "optstate/transform.h"

namespace optstate {

// The encoding a live optimizer keeps, applied entry by entry as dequantize_state / quantize_state do.
enum class TargetEncoding { kAsStored, kFp32, k8bit };
Result<TargetEncoding> target_encoding_from_name(std::string_view name);  // "", "fp32", "8bit"

// The metadata an entry of `numel` elements gets under the target (buffers empty). Unlike
// quantize_state (convert keeps 8-bit entries as they are), k8bit also re-blocks 8-bit moments of
// another block size: a live optimizer has one.
Entry target_entry(const std::string& entry_name, const Entry& stored, int64_t numel, TargetEncoding to,
                   const QuantizeOptions& quant);

// Where a component's bytes should land: memory of exactly `bytes` bytes that the caller owns and
// keeps alive (the reader fills it in place, no copy; the returned state's Buffer then views it),
// or an empty span to let load_shard allocate. Asked only for components read as stored.
using DestinationFn = std::function<std::span<std::byte>(const std::string& fqn, const std::string& entry,
                                                         Component c, const Entry& target, size_t bytes)>;

struct ShardLoadOptions {
  int world = 1, rank = 0;
  TargetEncoding to = TargetEncoding::kAsStored;
  QuantizeOptions quant;
  // "param" entries (model weights) come back whole: with replicated weights (DDP, ZeRO-1) every rank
  // needs all of them.
  bool whole_params = false;
  DestinationFn destination;  // optional
  // Read, verify (checksums, sizes) and convert every range as a load would, keeping no bytes: the
  // result has the metadata and empty buffers, `destination` is not asked. A load into live tensors
  // runs this first, so a corrupt chunk fails it before any live byte changes.
  bool check_only = false;
};

// This rank's range of every entry, in the target encoding. A block-aligned 8-bit range reads the
// stored codes and absmax as they are (no requantization); an 8-bit source for a dense target reads
// the covering blocks and dequantizes; a dense source for an 8-bit target quantizes the range, which
// begins and ends on block boundaries, so it equals the whole-tensor result.
Result<OptimizerState> load_shard(CheckpointReader& reader, const ShardLoadOptions& options);

// Resume validation of one rank: every entry of the live shard (same conventions as load_shard, its
// encodings taken from `live`) is compared byte for byte with the checkpoint's bytes of that range,
// and the metadata (shapes, steps, groups, kind) with the checkpoint's. Each difference is named
// with its entry, rank and first differing element.
Result<std::vector<std::string>> verify_resume_shard(const OptimizerState& live, CheckpointReader& saved,
                                                     const ShardLoadOptions& options);

}  // namespace optstate
