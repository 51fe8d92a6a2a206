// How the ranks of a sharded save agree (DESIGN §2): a key-value store every rank reaches. Backed by
// torch.distributed's c10d TCPStore in optim/c10d_coordinator.h; an in-process implementation serves
// the unit tests. LibTorch-free.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "optstate/status.h"

namespace optstate {

class Coordinator {
 public:
  virtual ~Coordinator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Status set(const std::string& key, const std::string& value) = 0;
  // The value of `key` once some rank has set it; an error after `timeout`.
  virtual Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

// Ranks as threads of one process sharing one map (tests, single-process simulations).
class InProcessStore {
 public:
  void set(const std::string& key, const std::string& value);
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

class InProcessCoordinator final : public Coordinator {
 public:
  InProcessCoordinator(std::shared_ptr<InProcessStore> store, int rank, int world)
      : store_(std::move(store)), rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Status set(const std::string& key, const std::string& value) override {
    store_->set(key, value);
    return Status::Ok();
  }
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return store_->get(key, timeout);
  }

 private:
  std::shared_ptr<InProcessStore> store_;
  int rank_, world_;
};

}  // namespace optstate
