#include "optstate/coordinator.h"

#include <fmt/format.h>

namespace optstate {

void InProcessStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
  }
  cv_.notify_all();
}

Result<std::string> InProcessStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return values_.count(key) != 0; }))
    return io_error(fmt::format("timed out after {} ms waiting for '{}'", timeout.count(), key));
  return values_.at(key);
}

}  // namespace optstate
