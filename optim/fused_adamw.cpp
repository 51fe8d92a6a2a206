#include "fused_adamw.h"

#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "adamw_kernel.h"
#include "archive.h"
#include "cuda_step.h"
#include "device_steps.h"
#include "step_commit.h"
#include "torch_bridge.h"

namespace optstate::optim {

FusedAdamWOptions::FusedAdamWOptions(double lr) : lr_(lr) {}

namespace {
void check_options(const FusedAdamWOptions& o) {
  const auto [b1, b2] = o.betas();
  TORCH_CHECK(o.lr() >= 0, "FusedAdamW: invalid learning rate ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "FusedAdamW: invalid epsilon ", o.eps());
  TORCH_CHECK(b1 >= 0 && b1 < 1, "FusedAdamW: invalid beta1 ", b1);
  TORCH_CHECK(b2 >= 0 && b2 < 1, "FusedAdamW: invalid beta2 ", b2);
  TORCH_CHECK(o.weight_decay() >= 0, "FusedAdamW: invalid weight_decay ", o.weight_decay());
}
}  // namespace

FusedAdamW::FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedAdamWOptions defaults)
    : Optimizer(param_groups, std::make_unique<FusedAdamWOptions>(defaults)) {
  check_options(defaults);
  // LibTorch's add_param_group only merges group options for its own optimizer types and falls back
  // to the defaults for any other; a group given with its own FusedAdamWOptions keeps them as given.
  for (size_t i = 0; i < param_groups.size(); ++i)
    if (param_groups[i].has_options()) {
      auto* given = dynamic_cast<const FusedAdamWOptions*>(&param_groups[i].options());
      TORCH_CHECK(given, "FusedAdamW: param group ", i, " has options of another optimizer");
      check_options(*given);
      param_groups_[i].set_options(std::make_unique<FusedAdamWOptions>(*given));
    }
}

FusedAdamW::FusedAdamW(std::vector<at::Tensor> params, FusedAdamWOptions defaults)
    : FusedAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

at::Tensor FusedAdamW::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  // Every group and param is checked before anything changes, so a refused step leaves the state as
  // it was; then each param's step count advances with its update, so the two stay in agreement
  // even when a CUDA launch is refused part-way (step_commit.h).
  using Group = StepGroup<FusedAdamWOptions, FusedAdamWParamState>;
  NewStates fresh("FusedAdamW");
  std::vector<Group> groups;
  for (auto& group : param_groups()) {
    auto& o = static_cast<FusedAdamWOptions&>(group.options());
    check_options(o);
    Group& gr = groups.emplace_back(Group{&o, o.step_lr(o.lr(), "FusedAdamW"), {}, {}});
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& g = p.grad();
      TORCH_CHECK(!g.is_sparse(), "FusedAdamW does not support sparse gradients");
      TORCH_CHECK(p.device().is_cpu() || p.is_cuda(), "FusedAdamW: params must be on the CPU or a CUDA GPU, got ",
                  p.device());
      TORCH_CHECK(g.device() == p.device(), "FusedAdamW: grad on ", g.device(), ", param on ", p.device());
      TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16,
                  "FusedAdamW: params must be float32 or bfloat16, got ", p.scalar_type());
      TORCH_CHECK(g.scalar_type() == p.scalar_type(), "FusedAdamW: grad dtype ", g.scalar_type(),
                  " differs from param dtype ", p.scalar_type());
      TORCH_CHECK(g.sizes() == p.sizes(), "FusedAdamW: grad shape differs from param shape");
      auto* st = static_cast<FusedAdamWParamState*>(fresh.find(state_, p));
      if (!st) {
        fresh.before_new_tensors(p);
        auto made = std::make_unique<FusedAdamWParamState>();
        const auto f32 = p.options().dtype(at::kFloat);
        // In the param's layout, as torch's AdamW keeps them: a channels_last param then steps in
        // place over storage order (with_param_layout).
        made->exp_avg(at::zeros_like(p, f32, at::MemoryFormat::Preserve));
        made->exp_avg_sq(at::zeros_like(p, f32, at::MemoryFormat::Preserve));
        if (o.amsgrad()) made->max_exp_avg_sq(at::zeros_like(p, f32, at::MemoryFormat::Preserve));
        st = fresh.add(p, std::move(made));
      }
      const bool needs_max = o.amsgrad() && !st->max_exp_avg_sq().defined();  // amsgrad turned on since
      if (needs_max) fresh.before_new_tensors(p);
      // The kernels take raw pointers: state set by hand (or loaded elsewhere) must fit its param.
      // A param in a dense layout its moments share (channels_last, as made above) is stepped in
      // place over storage order; one whose moments are contiguous (loaded from a checkpoint)
      // through a contiguous working copy.
      bool with_param_layout = p.is_non_overlapping_and_dense();
      for (const at::Tensor* m : {&st->exp_avg(), &st->exp_avg_sq(), &st->max_exp_avg_sq()}) {
        TORCH_CHECK(!m->defined() || (m->device() == p.device() && m->scalar_type() == at::kFloat &&
                                      m->numel() == p.numel() &&
                                      (m->is_contiguous() || (m->sizes() == p.sizes() && m->strides() == p.strides()))),
                    "FusedAdamW: the state of a param of ", p.numel(), " elements on ", p.device(),
                    " must be float32 tensors of as many elements on the same device, contiguous or in the param's "
                    "layout");
        if (m->defined() && m->strides() != p.strides()) with_param_layout = false;
      }
      at::Tensor work = p, grad = g;
      if (with_param_layout) {
        if (g.strides() != p.strides()) grad = at::empty_like(p).copy_(g);
      } else {
        if (!working_copies_) working_copies_ = std::make_shared<WorkingCopies>();
        work = working_copies_->refreshed(p, fresh);
        grad = g.contiguous();
      }
      (p.is_cuda() ? gr.cuda[p.device().index()] : gr.cpu).push_back({p, st, needs_max, work, grad});
    }
  }
  fresh.commit(state_);
  std::vector<AdamWTensor> items;
  std::vector<const StepParam<FusedAdamWParamState>*> cpu_params;
  auto add_max = [](const StepParam<FusedAdamWParamState>& x) {
    if (x.needs_max) x.st->max_exp_avg_sq(at::zeros_like(x.st->exp_avg_sq()));
  };
  for (Group& gr : groups) {
    const FusedAdamWOptions& o = *gr.o;
    AdamWHyper hyper{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                     o.amsgrad(), o.maximize()};
    for (auto& [device, params] : gr.cuda) {
      if (!device_steps_) device_steps_ = std::make_shared<DeviceSteps>();
      std::vector<at::Tensor> p, g, m, v, mx, steps;
      for (auto& x : params) {
        add_max(x);
        p.push_back(x.work);
        g.push_back(x.grad);
        m.push_back(x.st->exp_avg());
        v.push_back(x.st->exp_avg_sq());
        if (o.amsgrad()) mx.push_back(x.st->max_exp_avg_sq());
        steps.push_back(device_steps_->before_step(x.p, x.st->step()));
      }
      launch_then_count(*device_steps_, params, [&] {
        fused_adamw_cuda(p, g, m, v, mx, steps, gr.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
                         hyper.amsgrad, hyper.maximize);
      });
    }
    if (!gr.cpu.empty()) hyper.lr = lr_value(gr.lr);  // a tensor lr's value, read once per group
    for (auto& x : gr.cpu) {
      add_max(x);
      FusedAdamWParamState& st = *x.st;
      AdamWTensor t{};
      t.param = x.work.data_ptr();
      t.grad = x.grad.const_data_ptr();
      t.exp_avg = st.exp_avg().data_ptr<float>();
      t.exp_avg_sq = st.exp_avg_sq().data_ptr<float>();
      t.max_exp_avg_sq = o.amsgrad() ? st.max_exp_avg_sq().data_ptr<float>() : nullptr;
      t.numel = x.p.numel();
      t.kind = x.p.scalar_type() == at::kFloat ? ParamKind::kF32 : ParamKind::kBF16;
      t.s = adamw_step_scalars(hyper, st.step() + 1);
      items.push_back(t);
      cpu_params.push_back(&x);
    }
  }
  adamw_cpu(items);
  for (const auto* x : cpu_params) {
    x->write_back();
    x->st->step(x->st->step() + 1);
  }
  return loss;
}

int64_t FusedAdamW::step_count(const at::Tensor& param) const {
  return DeviceSteps::step_count<FusedAdamWParamState>(*this, device_steps_.get(), param);
}

void FusedAdamW::sync_step_counts() { DeviceSteps::sync<FusedAdamWParamState>(*this, device_steps_.get()); }

void FusedAdamW::save(torch::serialize::OutputArchive& archive) const {
  const auto state = export_state(*this, numbered_names(*this), /*include_params=*/false);
  TORCH_CHECK(state.ok(), "FusedAdamW::save: ", state.status().message());
  write_archive(archive, *this, *state, {});
}

void FusedAdamW::load(torch::serialize::InputArchive& archive) {
  const auto state = read_archive(archive, *this);
  TORCH_CHECK(state.ok(), "FusedAdamW::load: ", state.status().message());
  const Status done = import_state(*this, numbered_names(*this), *state, /*load_params=*/false);
  TORCH_CHECK(done.ok(), "FusedAdamW::load: ", done.message());
}

}  // namespace optstate::optim
