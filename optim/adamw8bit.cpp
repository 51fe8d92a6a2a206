#include "adamw8bit.h"

#include "archive.h"
#include "torch_bridge.h"

#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "adamw8bit_kernel.h"
#include "cuda_step.h"
#include "device_steps.h"
#include "step_commit.h"

namespace optstate::optim {

AdamW8bitOptions::AdamW8bitOptions(double lr) : lr_(lr) {}

namespace {
void check_options(const AdamW8bitOptions& o) {
  const auto [b1, b2] = o.betas();
  TORCH_CHECK(o.lr() >= 0, "AdamW8bit: invalid learning rate ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "AdamW8bit: invalid epsilon ", o.eps());
  TORCH_CHECK(b1 >= 0 && b1 < 1, "AdamW8bit: invalid beta1 ", b1);
  TORCH_CHECK(b2 >= 0 && b2 < 1, "AdamW8bit: invalid beta2 ", b2);
  TORCH_CHECK(o.weight_decay() >= 0, "AdamW8bit: invalid weight_decay ", o.weight_decay());
  TORCH_CHECK(o.block_size() > 0 && o.block_size() <= (1 << 20), "AdamW8bit: invalid block_size ", o.block_size());
  TORCH_CHECK(o.min_8bit_size() >= 0, "AdamW8bit: invalid min_8bit_size ", o.min_8bit_size());
}

Moment8bit zero_moment(const at::Tensor& p, int64_t block) {
  Moment8bit m;
  if (block > 0) {
    // As torchao's OptimState8bit.zeros: codes 0 and absmax 0 (dequantizes to zero); the first step
    // writes a real absmax (>= 1e-12).
    m.codes = at::zeros(p.sizes(), p.options().dtype(at::kByte));
    m.absmax = at::zeros({(p.numel() + block - 1) / block}, p.options().dtype(at::kFloat));
  } else {
    m.values = at::zeros(p.sizes(), p.options().dtype(at::kFloat));
  }
  return m;
}

// The kernels take raw pointers: state set by hand (or loaded elsewhere) must fit its param.
void check_state_fits(const AdamW8bitParamState& st, const at::Tensor& p) {
  const int64_t block = st.block_size();
  TORCH_CHECK(block >= 0 && block <= (1 << 20), "AdamW8bit: invalid state block_size ", block);
  const int64_t blocks = block > 0 ? (p.numel() + block - 1) / block : 0;
  auto fits = [&](const at::Tensor& t, at::ScalarType dtype, int64_t numel) {
    return t.defined() && t.device() == p.device() && t.scalar_type() == dtype && t.numel() == numel &&
           t.is_contiguous();
  };
  for (const Moment8bit* m : {&st.exp_avg(), &st.exp_avg_sq(), &st.max_exp_avg_sq()}) {
    if (!m->defined()) continue;
    const bool ok = block > 0 ? fits(m->codes, at::kByte, p.numel()) && fits(m->absmax, at::kFloat, blocks)
                              : fits(m->values, at::kFloat, p.numel());
    TORCH_CHECK(ok, "AdamW8bit: the state of a param of ", p.numel(), " elements on ", p.device(),
                " does not fit it (block_size ", block, ": uint8 codes of as many elements and one float32 absmax",
                " per block, or float32 values when 0, contiguous, on the param's device)");
  }
}
}  // namespace

AdamW8bitParamState AdamW8bit::zero_state(const at::Tensor& p, const AdamW8bitOptions& o) {
  AdamW8bitParamState st;
  st.block_size(p.numel() >= o.min_8bit_size() ? o.block_size() : 0);
  st.exp_avg(zero_moment(p, st.block_size()));
  st.exp_avg_sq(zero_moment(p, st.block_size()));
  if (o.amsgrad()) st.max_exp_avg_sq(zero_moment(p, st.block_size()));
  return st;
}

AdamW8bit::AdamW8bit(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, AdamW8bitOptions defaults)
    : Optimizer(param_groups, std::make_unique<AdamW8bitOptions>(defaults)) {
  check_options(defaults);
  // As in FusedAdamW: LibTorch only merges group options of its own optimizer types.
  for (size_t i = 0; i < param_groups.size(); ++i)
    if (param_groups[i].has_options()) {
      auto* given = dynamic_cast<const AdamW8bitOptions*>(&param_groups[i].options());
      TORCH_CHECK(given, "AdamW8bit: param group ", i, " has options of another optimizer");
      check_options(*given);
      param_groups_[i].set_options(std::make_unique<AdamW8bitOptions>(*given));
    }
}

AdamW8bit::AdamW8bit(std::vector<at::Tensor> params, AdamW8bitOptions defaults)
    : AdamW8bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

at::Tensor AdamW8bit::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  // Checked first, changed after, each param's step counted with its update (as FusedAdamW::step).
  using Group = StepGroup<AdamW8bitOptions, AdamW8bitParamState>;
  NewStates fresh("AdamW8bit");
  std::vector<Group> groups;
  for (auto& group : param_groups()) {
    auto& o = static_cast<AdamW8bitOptions&>(group.options());
    check_options(o);
    Group& gr = groups.emplace_back(Group{&o, o.step_lr(o.lr(), "AdamW8bit"), {}, {}});
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& g = p.grad();
      TORCH_CHECK(!g.is_sparse(), "AdamW8bit does not support sparse gradients");
      TORCH_CHECK(p.device().is_cpu() || p.is_cuda(), "AdamW8bit: params must be on the CPU or a CUDA GPU, got ",
                  p.device());
      TORCH_CHECK(g.device() == p.device(), "AdamW8bit: grad on ", g.device(), ", param on ", p.device());
      TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16,
                  "AdamW8bit: params must be float32 or bfloat16, got ", p.scalar_type());
      TORCH_CHECK(g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes(), "AdamW8bit: grad does not match param");
      auto* st = static_cast<AdamW8bitParamState*>(fresh.find(state_, p));
      if (!st) {
        fresh.before_new_tensors(p);
        st = fresh.add(p, std::make_unique<AdamW8bitParamState>(zero_state(p, o)));
      }
      const bool needs_max = o.amsgrad() && !st->max_exp_avg_sq().defined();  // amsgrad turned on since
      if (needs_max) fresh.before_new_tensors(p);
      check_state_fits(*st, p);
      if (!working_copies_) working_copies_ = std::make_shared<WorkingCopies>();
      (p.is_cuda() ? gr.cuda[p.device().index()] : gr.cpu)
          .push_back({p, st, needs_max, working_copies_->refreshed(p, fresh), g.contiguous()});
    }
  }
  fresh.commit(state_);
  std::vector<AdamW8bitTensor> items;
  std::vector<const StepParam<AdamW8bitParamState>*> cpu_params;
  auto add_max = [](const StepParam<AdamW8bitParamState>& x) {
    if (x.needs_max) x.st->max_exp_avg_sq(zero_moment(x.p, x.st->block_size()));
  };
  for (Group& gr : groups) {
    const AdamW8bitOptions& o = *gr.o;
    AdamWHyper hyper{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                     o.amsgrad(), false};
    for (auto& [device, params] : gr.cuda) {
      if (!device_steps_) device_steps_ = std::make_shared<DeviceSteps>();
      std::vector<at::Tensor> p, g, m, v, mx, m_absmax, v_absmax, mx_absmax, steps;
      std::vector<int64_t> blocks;
      for (auto& x : params) {
        add_max(x);
        const AdamW8bitParamState& st = *x.st;
        const bool q = st.block_size() > 0;
        auto data = [q](const Moment8bit& mo) { return q ? mo.codes : mo.values; };
        auto scale = [q](const Moment8bit& mo) { return q ? mo.absmax : at::Tensor(); };
        p.push_back(x.work);
        g.push_back(x.grad);
        m.push_back(data(st.exp_avg()));
        v.push_back(data(st.exp_avg_sq()));
        m_absmax.push_back(scale(st.exp_avg()));
        v_absmax.push_back(scale(st.exp_avg_sq()));
        if (o.amsgrad()) {
          mx.push_back(data(st.max_exp_avg_sq()));
          mx_absmax.push_back(scale(st.max_exp_avg_sq()));
        }
        blocks.push_back(st.block_size());
        steps.push_back(device_steps_->before_step(x.p, st.step()));
      }
      launch_then_count(*device_steps_, params, [&] {
        adamw8bit_cuda(p, g, m, v, mx, m_absmax, v_absmax, mx_absmax, steps, blocks, gr.lr, hyper.beta1, hyper.beta2,
                       hyper.eps, hyper.weight_decay, hyper.amsgrad);
      });
    }
    if (!gr.cpu.empty()) hyper.lr = lr_value(gr.lr);  // a tensor lr's value, read once per group
    for (auto& x : gr.cpu) {
      add_max(x);
      AdamW8bitParamState& st = *x.st;
      AdamW8bitTensor t{};
      t.param = x.work.data_ptr();
      t.grad = x.grad.const_data_ptr();
      t.kind = x.p.scalar_type() == at::kFloat ? ParamKind::kF32 : ParamKind::kBF16;
      t.numel = x.p.numel();
      t.block = st.block_size();
      if (t.block > 0) {
        t.m_codes = st.exp_avg().codes.data_ptr<uint8_t>();
        t.m_absmax = st.exp_avg().absmax.data_ptr<float>();
        t.v_codes = st.exp_avg_sq().codes.data_ptr<uint8_t>();
        t.v_absmax = st.exp_avg_sq().absmax.data_ptr<float>();
        if (o.amsgrad()) {
          t.vmax_codes = st.max_exp_avg_sq().codes.data_ptr<uint8_t>();
          t.vmax_absmax = st.max_exp_avg_sq().absmax.data_ptr<float>();
        }
      } else {
        t.m = st.exp_avg().values.data_ptr<float>();
        t.v = st.exp_avg_sq().values.data_ptr<float>();
        if (o.amsgrad()) t.vmax = st.max_exp_avg_sq().values.data_ptr<float>();
      }
      t.s = adamw8bit_step_scalars(hyper, static_cast<float>(st.step() + 1));
      items.push_back(t);
      cpu_params.push_back(&x);
    }
  }
  adamw8bit_cpu(items);
  for (const auto* x : cpu_params) {
    x->write_back();
    x->st->step(x->st->step() + 1);
  }
  return loss;
}

int64_t AdamW8bit::step_count(const at::Tensor& param) const {
  return DeviceSteps::step_count<AdamW8bitParamState>(*this, device_steps_.get(), param);
}

void AdamW8bit::sync_step_counts() { DeviceSteps::sync<AdamW8bitParamState>(*this, device_steps_.get()); }

void AdamW8bit::save(torch::serialize::OutputArchive& archive) const {
  const auto state = export_state(*this, numbered_names(*this), /*include_params=*/false);
  TORCH_CHECK(state.ok(), "AdamW8bit::save: ", state.status().message());
  const auto& o = static_cast<const AdamW8bitOptions&>(param_groups().at(0).options());
  write_archive(archive, *this, *state, {{"block_size", o.block_size()}, {"min_8bit_size", o.min_8bit_size()}});
}

void AdamW8bit::load(torch::serialize::InputArchive& archive) {
  const auto state = read_archive(archive, *this);
  TORCH_CHECK(state.ok(), "AdamW8bit::load: ", state.status().message());
  const Status done = import_state(*this, numbered_names(*this), *state, /*load_params=*/false);
  TORCH_CHECK(done.ok(), "AdamW8bit::load: ", done.message());
}

}  // namespace optstate::optim
