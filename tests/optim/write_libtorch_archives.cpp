// Writes the LibTorch optimizer archives the torchsave driver's tests and fuzz target use as seeds
// (formats/libtorch/testdata/, checked in), each with what it must read as, written by optstate's
// safetensors driver from the live optimizer (not through the archive):
//   libtorch_adamw.pt        torch::save of torch::optim::AdamW: two groups (amsgrad in the first),
//                            and a param that never had a gradient (no state);
//   libtorch_adamw8bit.pt    torch::save of optstate's AdamW8bit: a 64x80 weight in 8 bits, a bias dense;
//   <name>.expected.safetensors   the same state (torch's AdamW through FusedAdamW::load, which reads
//                            the archive with LibTorch's own InputArchive; AdamW8bit exported).
//
//   build/tests/optstate_write_libtorch_archives formats/libtorch/testdata
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <cstdio>
#include <filesystem>

#include "adamw8bit.h"
#include "archive.h"
#include "fused_adamw.h"
#include "registry.h"
#include "test_tensors.h"
#include "torch_bridge.h"

using namespace optstate;
using namespace optstate::optim;

namespace {

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) { return test::randn_tensor(std::move(shape), seed); }

template <class Options>
std::vector<torch::optim::OptimizerParamGroup> groups_of(std::vector<at::Tensor>& ps) {
  ps = {randn({64, 80}, 1), randn({80}, 2), randn({5}, 3)};
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{ps[0]}, std::make_unique<Options>(Options(1e-2).weight_decay(0.1).amsgrad(true)));
  groups.emplace_back(std::vector<at::Tensor>{ps[1], ps[2]}, std::make_unique<Options>(Options(3e-2).weight_decay(0)));
  return groups;
}

void train(torch::optim::Optimizer& opt, std::vector<at::Tensor>& ps) {
  for (int s = 0; s < 3; ++s) {
    for (size_t i = 0; i + 1 < ps.size(); ++i) ps[i].mutable_grad() = randn(ps[i].sizes().vec(), 100 * s + i);
    opt.step();
  }
}

int write_expected(const OptimizerState& state, const std::filesystem::path& path) {
  std::filesystem::remove(path);
  auto st = find_format("safetensors")->write(state, path, {});
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", path.c_str(), st.message().c_str());
    return 1;
  }
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path out = argv[1];
  std::filesystem::create_directories(out);
  at::NoGradGuard no_grad;
  int rc = 0;
  {
    std::vector<at::Tensor> ps;
    torch::optim::AdamW opt(groups_of<torch::optim::AdamWOptions>(ps));
    train(opt, ps);
    torch::save(opt, (out / "libtorch_adamw.pt").string());
    std::vector<at::Tensor> fs;
    FusedAdamW loaded(groups_of<FusedAdamWOptions>(fs));
    torch::load(loaded, (out / "libtorch_adamw.pt").string());
    auto state = export_state(loaded, numbered_names(loaded), false);
    if (!state.ok()) return 1;
    state->params.erase("2");  // never stepped: the archive gives it no shape, so it is not read
    for (auto& g : state->groups) std::erase(g.params, "2");
    rc |= write_expected(*state, out / "libtorch_adamw.expected.safetensors");
  }
  {
    std::vector<at::Tensor> ps;
    AdamW8bit opt(groups_of<AdamW8bitOptions>(ps));
    train(opt, ps);
    torch::save(opt, (out / "libtorch_adamw8bit.pt").string());
    auto state = export_state(opt, numbered_names(opt), false);
    if (!state.ok()) return 1;
    state->params.erase("2");
    for (auto& g : state->groups) std::erase(g.params, "2");
    rc |= write_expected(*state, out / "libtorch_adamw8bit.expected.safetensors");
  }
  return rc;
}
