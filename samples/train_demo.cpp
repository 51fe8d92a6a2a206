// optstate-demo: trains a small MLP with FusedAdamW on generated data, checkpoints it in the native
// format, resumes from a checkpoint in a new process, and prints the state hash.
//
//   optstate-demo [--optimizer adamw|adamw8bit] ...
//   optstate-demo --steps 60 --final out/a                        # uninterrupted
//   optstate-demo --steps 30 --save out/ckpt-30                   # first half, then checkpoint
//   optstate-demo --steps 60 --resume out/ckpt-30 --final out/b   # second half in a new process
//   optstate-demo --steps 30 --torch-save out/t30                 # LibTorch's idiom instead:
//   optstate-demo --steps 60 --torch-resume out/t30 --final out/c  # torch::save / torch::load
//
// Batches are a pure function of (seed, step), so a resumed run sees the same data as an
// uninterrupted one and must end with the same hash, bit for bit.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/serialize.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "adamw8bit.h"
#include "fused_adamw.h"
#include "optstate/hash.h"
#include "registry.h"
#include "torch_bridge.h"

namespace {

using optstate::optim::AdamW8bit;
using optstate::optim::AdamW8bitOptions;
using optstate::optim::FusedAdamW;
using optstate::optim::FusedAdamWOptions;

struct Options {
  int64_t steps = 60, seed = 7;
  std::string save, resume, final_path, optimizer = "adamw";
  std::string torch_save, torch_resume;  // prefixes of <prefix>.model.pt and <prefix>.optimizer.pt
  bool bf16 = false;
};

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "optstate-demo: %s\n", msg.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die("option " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--steps") o.steps = std::stoll(next());
    else if (a == "--seed") o.seed = std::stoll(next());
    else if (a == "--save") o.save = next();
    else if (a == "--resume") o.resume = next();
    else if (a == "--final") o.final_path = next();
    else if (a == "--torch-save") o.torch_save = next();
    else if (a == "--torch-resume") o.torch_resume = next();
    else if (a == "--bf16") o.bf16 = true;
    else if (a == "--optimizer") o.optimizer = next();
    else if (a == "--help") {
      std::puts("usage: optstate-demo --steps N [--optimizer adamw|adamw8bit] [--seed S] [--resume CKPT] "
                "[--save CKPT] [--final CKPT] [--torch-save PREFIX] [--torch-resume PREFIX] [--bf16]");
      std::exit(0);
    } else die("unknown option " + a);
  }
  return o;
}

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed, double scale) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen) * scale;
}

struct Mlp {
  std::vector<std::string> names{"layers.0.weight", "layers.1.weight", "head.weight",
                                 "layers.0.bias",   "layers.1.bias",   "head.bias"};
  std::vector<at::Tensor> params;
  at::ScalarType dtype;

  Mlp(uint64_t seed, bool bf16) : dtype(bf16 ? at::kBFloat16 : at::kFloat) {
    const std::vector<std::vector<int64_t>> shapes{{128, 32}, {128, 128}, {8, 128}, {128}, {128}, {8}};
    for (size_t i = 0; i < shapes.size(); ++i) {
      const double fan_in = shapes[i].size() == 2 ? static_cast<double>(shapes[i][1]) : 1e4;
      params.push_back(randn(shapes[i], seed * 100 + i, 1.0 / std::sqrt(fan_in)).to(dtype).requires_grad_(true));
    }
  }
  at::Tensor forward(const at::Tensor& x) const {
    at::Tensor h = at::relu(at::linear(x, params[0], params[3]));
    h = at::relu(at::linear(h, params[1], params[4]));
    return at::linear(h, params[2], params[5]);
  }
};

// Batch `step` of a fixed regression task: y = tanh(x T).
std::pair<at::Tensor, at::Tensor> batch(uint64_t seed, int64_t step, at::ScalarType dtype) {
  static const at::Tensor teacher = randn({32, 8}, 12345, 0.5);
  at::Tensor x = randn({64, 32}, seed * 1000003 + static_cast<uint64_t>(step), 1.0);
  return {x.to(dtype), at::tanh(at::matmul(x, teacher)).to(dtype)};
}

template <typename Opt>
optstate::OptimizerState export_all(const Opt& opt, const Mlp& model) {
  auto st = optstate::optim::export_state(opt, model.names, /*include_params=*/true);
  if (!st.ok()) die(st.status().to_string());
  return std::move(st).value();
}

template <typename Opt, typename OptOptions>
int run(const Options& o) {
  Mlp model(static_cast<uint64_t>(o.seed), o.bf16);
  // Two groups, as real training loops have: decay on matrices, none on biases.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>(model.params.begin(), model.params.begin() + 3),
                      std::make_unique<OptOptions>(OptOptions(3e-3).weight_decay(0.1)));
  groups.emplace_back(std::vector<at::Tensor>(model.params.begin() + 3, model.params.end()),
                      std::make_unique<OptOptions>(OptOptions(3e-3).weight_decay(0.0)));
  Opt opt(groups, OptOptions(3e-3));

  int64_t start = 0;
  if (!o.resume.empty()) {
    auto reader = optstate::open_checkpoint(o.resume);
    if (!reader.ok()) die(reader.status().message());
    auto state = optstate::load_all(**reader);
    if (!state.ok()) die(state.status().message());
    optstate::Status st = optstate::optim::import_state(opt, model.names, *state, /*load_params=*/true);
    if (!st.ok()) die(o.resume + ": " + st.message());
    start = state->params.at(model.names[0]).step;
    // Resume validation: the live optimizer must hash exactly like the checkpoint it came from.
    auto check = optstate::verify_resume(export_all(opt, model), **reader);
    if (!check.ok()) die(check.status().message());
    if (!check->ok()) die("resumed state differs from " + o.resume + ": " + check->differences.front());
    std::printf("resumed from %s at step %lld (every entry's hash verified)\n", o.resume.c_str(),
                static_cast<long long>(start));
  }
  if (!o.torch_resume.empty()) {
    // A C++ loop's own checkpoint: the weights and the optimizer through LibTorch's archives.
    std::vector<at::Tensor> weights;
    try {
      torch::load(weights, o.torch_resume + ".model.pt");
      torch::load(opt, o.torch_resume + ".optimizer.pt");  // checks the whole archive first
    } catch (const c10::Error& e) {
      die(o.torch_resume + ": " + e.what_without_backtrace());
    }
    if (weights.size() != model.params.size()) die(o.torch_resume + ".model.pt: not this model's weights");
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < weights.size(); ++i) model.params[i].copy_(weights[i]);
    start = opt.step_count(model.params[0]);
    std::printf("resumed from %s.optimizer.pt (torch::load) at step %lld\n", o.torch_resume.c_str(),
                static_cast<long long>(start));
  }

  for (int64_t step = start; step < o.steps; ++step) {
    auto [x, y] = batch(static_cast<uint64_t>(o.seed), step, model.dtype);
    opt.zero_grad();
    at::Tensor loss = at::mse_loss(model.forward(x).to(at::kFloat), y.to(at::kFloat));
    loss.backward();
    opt.step();
    if ((step + 1) % 10 == 0 || step + 1 == o.steps)
      std::printf("step %4lld  loss %.6f\n", static_cast<long long>(step + 1), loss.item<double>());
  }

  const optstate::OptimizerState state = export_all(opt, model);
  auto h = optstate::hash_state(state);
  if (!h.ok()) die(h.status().to_string());
  std::printf("state hash after step %lld: %s\n", static_cast<long long>(o.steps), h->root.c_str());
  if (!o.torch_save.empty()) {
    std::vector<at::Tensor> weights;
    for (const at::Tensor& p : model.params) weights.push_back(p.detach());
    torch::save(weights, o.torch_save + ".model.pt");
    torch::save(opt, o.torch_save + ".optimizer.pt");
    std::printf("saved %s.model.pt and %s.optimizer.pt (torch::save)\n", o.torch_save.c_str(), o.torch_save.c_str());
  }
  for (const std::string* path : {&o.save, &o.final_path}) {
    if (path->empty()) continue;
    optstate::WriteOptions wo;
    wo.overwrite = true;
    optstate::Status st = optstate::find_format("native")->write(state, *path, wo);
    if (!st.ok()) die(st.message());
    std::printf("saved %s\n", path->c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.optimizer == "adamw") return run<FusedAdamW, FusedAdamWOptions>(o);
  if (o.optimizer == "adamw8bit") return run<AdamW8bit, AdamW8bitOptions>(o);
  die("unknown optimizer '" + o.optimizer + "' (adamw or adamw8bit)");
}
