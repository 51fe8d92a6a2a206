// Sharded save of the native checkpoint by many ranks (DESIGN §2, §4): every rank writes its own
// data file in parallel into one staging directory; rank 0 commits the manifest only after every
// rank has reported its file and chunk checksums; a rank that fails or never reports means no
// commit, and the destination keeps whatever complete checkpoint it held before.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>

#include "optstate/coordinator.h"
#include "optstate/state.h"

namespace optstate::native {

struct ShardedSaveOptions {
  bool overwrite = false;
  // How long rank 0 waits for the other ranks' reports, and they for its commit.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // Distinguishes successive saves in one store; every rank must pass the same id. Empty: the
  // destination path and a per-process count of saves to it.
  std::string save_id;
};

// `local` has the whole state's metadata; each of its buffers holds exactly this rank's shard of
// that component (shard_range(entry, component, shape, world, rank)).
Status save_sharded(const OptimizerState& local, const std::filesystem::path& path, Coordinator& coord,
                    const ShardedSaveOptions& options = {});

// This rank's shard of a whole in-memory state (buffers sliced, no copy).
OptimizerState local_shard(const OptimizerState& full, int world, int rank);

}  // namespace optstate::native
