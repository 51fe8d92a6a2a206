// The Coordinator of a sharded save over torch.distributed's c10d TCPStore, from the torchrun-style
// environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 hosts the store.
#pragma once

#include <memory>
#include <string>

#include "optstate/coordinator.h"

namespace c10d {
class Store;
}

namespace optstate::optim {

class C10dCoordinator final : public Coordinator {
 public:
  // Connects to the store on host:port, waiting up to timeout. With `serve`, this rank (0) hosts it
  // (the launcher case); without, every rank is a client of a store someone else serves, such as
  // the one torch.distributed's process group already runs.
  static Result<std::unique_ptr<C10dCoordinator>> connect(const std::string& host, int port, int rank, int world,
                                                          std::chrono::milliseconds timeout, bool serve);
  // From RANK, WORLD_SIZE, MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500).
  static Result<std::unique_ptr<C10dCoordinator>> from_env(std::chrono::milliseconds timeout);
  ~C10dCoordinator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Status set(const std::string& key, const std::string& value) override;
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  C10dCoordinator() = default;
  std::shared_ptr<c10d::Store> store_;
  int rank_ = 0, world_ = 1;
};

}  // namespace optstate::optim
