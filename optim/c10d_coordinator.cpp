#include "c10d_coordinator.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>

namespace optstate::optim {

Result<std::unique_ptr<C10dCoordinator>> C10dCoordinator::connect(const std::string& host, int port, int rank,
                                                                  int world, std::chrono::milliseconds timeout,
                                                                  bool serve) {
  if (world < 1 || rank < 0 || rank >= world)
    return invalid_argument(fmt::format("rank {} of world size {} is not a rank", rank, world));
  if (port <= 0 || port > 65535) return invalid_argument(fmt::format("port {} out of range", port));
  std::unique_ptr<C10dCoordinator> c(new C10dCoordinator());
  c->rank_ = rank;
  c->world_ = world;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = serve && rank == 0;
    if (serve) o.numWorkers = static_cast<size_t>(world);
    o.waitWorkers = serve;
    o.timeout = timeout;
    c->store_ = std::make_shared<c10d::TCPStore>(host, o);
  } catch (const std::exception& e) {
    return io_error(fmt::format("cannot reach the c10d store at {}:{}: {}", host, port, e.what()));
  }
  return c;
}

Result<std::unique_ptr<C10dCoordinator>> C10dCoordinator::from_env(std::chrono::milliseconds timeout) {
  auto env = [](const char* name, const char* fallback) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : (fallback ? fallback : "");
  };
  const std::string rank = env("RANK", nullptr), world = env("WORLD_SIZE", nullptr);
  if (rank.empty() || world.empty()) return invalid_argument("RANK and WORLD_SIZE must be set (torchrun-style)");
  try {
    return connect(env("MASTER_ADDR", "127.0.0.1"), std::stoi(env("MASTER_PORT", "29500")), std::stoi(rank),
                   std::stoi(world), timeout, /*serve=*/true);
  } catch (const std::exception&) {
    return invalid_argument("RANK, WORLD_SIZE and MASTER_PORT must be integers");
  }
}

C10dCoordinator::~C10dCoordinator() = default;

Status C10dCoordinator::set(const std::string& key, const std::string& value) {
  try {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    return io_error(fmt::format("c10d store: cannot set '{}': {}", key, e.what()));
  }
  return Status::Ok();
}

Result<std::string> C10dCoordinator::get(const std::string& key, std::chrono::milliseconds timeout) {
  try {
    store_->wait({key}, timeout);
    const std::vector<uint8_t> v = store_->get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception& e) {
    return io_error(fmt::format("c10d store: no '{}' within {} ms: {}", key, timeout.count(), e.what()));
  }
}

}  // namespace optstate::optim
