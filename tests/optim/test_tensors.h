// Random tensors shared by the LibTorch optim tests and the archive seed writer.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <vector>

namespace optstate::test {

// A standard normal CPU tensor of `shape`, the same for the same seed.
inline at::Tensor randn_tensor(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

}  // namespace optstate::test
