// Random inputs shared by the optim tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace optstate::test {

// n normal values of standard deviation `scale`, the same for the same seed.
inline std::vector<float> randn(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace optstate::test
