// One rank of a multi-process sharded save over c10d (torchrun-style environment), used by
// tests/dist/dist_cases.sh: every rank holds the same deterministic state, writes its shard, and
// rank 0 commits. OPTSTATE_KILL_RANK=r makes rank r SIGKILL itself at a random moment within
// OPTSTATE_KILL_MAX_US microseconds of entering the save (crash-safety trials).
#include <fmt/format.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "c10d_coordinator.h"
#include "native/native_sharded.h"
#include "optstate/transform.h"
#include "test_helpers.h"

using namespace optstate;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s dense|8bit CKPT\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const std::filesystem::path path = argv[2];
  const long timeout_ms = std::getenv("OPTSTATE_TIMEOUT_MS") ? std::atol(std::getenv("OPTSTATE_TIMEOUT_MS")) : 20000;
  auto coord = optim::C10dCoordinator::from_env(std::chrono::milliseconds(timeout_ms));
  if (!coord.ok()) {
    std::fprintf(stderr, "dist_check: %s\n", coord.status().message().c_str());
    return 2;
  }
  OptimizerState full = testing::sample_state();
  if (mode == "8bit") full = *quantize_state(full, {4, 1});
  const int rank = (*coord)->rank(), world = (*coord)->world_size();
  OptimizerState local = native::local_shard(full, world, rank);
  native::ShardedSaveOptions o;
  o.overwrite = true;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.save_id = fmt::format("{}#{}", path.string(), std::getenv("OPTSTATE_SAVE_ID") ? std::getenv("OPTSTATE_SAVE_ID") : "0");
  if (const char* victim = std::getenv("OPTSTATE_KILL_RANK")) {
    if (std::atoi(victim) == rank) {
      // Die at a random moment during the save: a watcher thread SIGKILLs the process after a
      // random delay of up to the given microseconds.
      const long max_us = std::getenv("OPTSTATE_KILL_MAX_US") ? std::atol(std::getenv("OPTSTATE_KILL_MAX_US")) : 2000;
      std::srand(static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
      const long delay = max_us > 0 ? std::rand() % max_us : 0;
      std::thread([delay] {
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
        ::raise(SIGKILL);
      }).detach();
    }
  }
  Status st = native::save_sharded(local, path, **coord, o);
  if (!st.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, st.message().c_str());
    return 1;
  }
  if (rank == 0) std::printf("rank 0 of %d: committed %s\n", world, path.c_str());
  return 0;
}
