// CUDA implementations of the optstate.fused_adamw_ and optstate.adamw8bit_ ops, over the kernels
// in cuda/optim_cuda.cu. Built only when LibTorch has CUDA (the GPU check script builds it against
// the lent machine's torch; the CPU wheel in CI has no CUDA). The kernels' device tables (a Plan)
// are cached per list of tensors: an optimizer's tensors stay put between steps.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <vector>

#include "cuda/optim_cuda.h"
#include "optstate/quant8.h"

namespace optstate::optim {
namespace {

struct Cached {
  std::unique_ptr<cuda::Plan> plan;
  at::Tensor hyper;  // device bytes of one cuda::Hyper
};

std::mutex g_mu;
std::map<std::vector<const void*>, Cached> g_plans;

void check(int err, const char* what) {
  TORCH_CHECK(err == 0, "optstate ", what, ": CUDA error ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The step's hyperparameters into the plan's device buffer, by a launch on the stream (no host sync).
void put_hyper(Cached& c, const cuda::Hyper& h, cudaStream_t s) {
  check(cuda::store_hyper(static_cast<cuda::Hyper*>(c.hyper.data_ptr()), h, s), "hyperparameters");
}

void ensure_maps() {
  static std::once_flag once;
  std::call_once(once, [] {
    const Quantizer& s = Quantizer::get(QMap::kDynamicSigned);
    const Quantizer& u = Quantizer::get(QMap::kDynamicUnsigned);
    check(cuda::set_qmaps(s.map(), u.map(), s.thresholds(), u.thresholds()), "quantization tables");
  });
}

void check_common(const at::Tensor& p, const at::Tensor& g, const at::Tensor& step, size_t i, const char* op) {
  TORCH_CHECK(p.is_cuda() && g.is_cuda() && g.device() == p.device(), op, ": tensor ", i, " and its grad must be on one GPU");
  TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16, op, ": params must be float32 or bfloat16");
  TORCH_CHECK(g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes() && p.is_contiguous() && g.is_contiguous(),
              op, ": grad ", i, " does not match its contiguous param");
  TORCH_CHECK(step.is_cuda() && step.device() == p.device() && step.numel() == 1 && step.scalar_type() == at::kFloat,
              op, ": step ", i, " must be a float32 scalar tensor on the param's GPU (no host sync per step)");
}

void fused_adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool amsgrad, bool maximize) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  (!amsgrad || max_exp_avg_sqs.size() == n),
              "optstate.fused_adamw_: tensor lists differ in length");
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<cuda::AdamWTensor> ts(n);
  std::vector<const void*> key;
  for (size_t i = 0; i < n; ++i) {
    check_common(params[i], grads[i], steps[i], i, "optstate.fused_adamw_");
    for (const at::Tensor* s : {&exp_avgs[i], &exp_avg_sqs[i]})
      TORCH_CHECK(s->is_cuda() && s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == params[i].numel(),
                  "optstate.fused_adamw_: state ", i, " must be contiguous float32 on the GPU");
    cuda::AdamWTensor& t = ts[i];
    t.param = params[i].data_ptr();
    t.grad = grads[i].const_data_ptr();
    t.exp_avg = exp_avgs[i].data_ptr<float>();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    t.max_exp_avg_sq = amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    t.step = steps[i].data_ptr<float>();
    t.numel = params[i].numel();
    t.kind = params[i].scalar_type() == at::kFloat ? cuda::Param::kF32 : cuda::Param::kBF16;
    key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(t.numel)));  // a freed and reused address
    for (const void* ptr : {static_cast<const void*>(t.param), t.grad, static_cast<const void*>(t.exp_avg), static_cast<const void*>(t.exp_avg_sq),
                            static_cast<const void*>(t.max_exp_avg_sq), static_cast<const void*>(t.step)})
      key.push_back(ptr);
  }
  key.push_back(reinterpret_cast<const void*>(uintptr_t{1}));  // plan kind
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::lock_guard<std::mutex> lock(g_mu);
  Cached& c = g_plans[key];
  if (!c.plan) {
    c.plan = cuda::make_adamw_plan(ts, stream);
    TORCH_CHECK(c.plan, "optstate.fused_adamw_: cannot build the CUDA work list");
    c.hyper = at::empty({static_cast<int64_t>(sizeof(cuda::Hyper))}, params[0].options().dtype(at::kByte));
  }
  put_hyper(c, {lr, beta1, beta2, eps, weight_decay, amsgrad, maximize}, stream);
  check(cuda::adamw_step(*c.plan, static_cast<const cuda::Hyper*>(c.hyper.data_ptr()), stream), "fused_adamw_");
}

void adamw8bit_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax, at::TensorList exp_avg_sq_absmax,
                    at::TensorList max_exp_avg_sq_absmax, at::TensorList steps, at::IntArrayRef block_sizes, double lr,
                    double beta1, double beta2, double eps, double weight_decay, bool amsgrad) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  block_sizes.size() == n && exp_avg_absmax.size() == n && exp_avg_sq_absmax.size() == n &&
                  (!amsgrad || (max_exp_avg_sqs.size() == n && max_exp_avg_sq_absmax.size() == n)),
              "optstate.adamw8bit_: lists differ in length");
  if (n == 0) return;
  ensure_maps();
  c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<cuda::AdamW8bitTensor> ts(n);
  std::vector<const void*> key;
  for (size_t i = 0; i < n; ++i) {
    check_common(params[i], grads[i], steps[i], i, "optstate.adamw8bit_");
    const int64_t block = block_sizes[i], numel = params[i].numel();
    TORCH_CHECK(block >= 0 && block <= 256, "optstate.adamw8bit_: block size ", block,
                " (the CUDA kernel keeps blocks of up to 256 in shared memory)");
    const int64_t nblocks = block > 0 ? (numel + block - 1) / block : 0;
    auto state = [&](const at::Tensor& t, bool codes, int64_t count) {
      TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.numel() == count && t.scalar_type() == (codes ? at::kByte : at::kFloat),
                  "optstate.adamw8bit_: state of param ", i, " has the wrong dtype, size or device");
      return t.data_ptr();
    };
    cuda::AdamW8bitTensor& t = ts[i];
    t = {};
    t.param = params[i].data_ptr();
    t.grad = grads[i].const_data_ptr();
    t.step = steps[i].data_ptr<float>();
    t.numel = numel;
    t.block = block;
    t.kind = params[i].scalar_type() == at::kFloat ? cuda::Param::kF32 : cuda::Param::kBF16;
    if (block > 0) {
      t.m_codes = static_cast<uint8_t*>(state(exp_avgs[i], true, numel));
      t.v_codes = static_cast<uint8_t*>(state(exp_avg_sqs[i], true, numel));
      t.m_absmax = static_cast<float*>(state(exp_avg_absmax[i], false, nblocks));
      t.v_absmax = static_cast<float*>(state(exp_avg_sq_absmax[i], false, nblocks));
      if (amsgrad) {
        t.vmax_codes = static_cast<uint8_t*>(state(max_exp_avg_sqs[i], true, numel));
        t.vmax_absmax = static_cast<float*>(state(max_exp_avg_sq_absmax[i], false, nblocks));
      }
    } else {
      t.m = static_cast<float*>(state(exp_avgs[i], false, numel));
      t.v = static_cast<float*>(state(exp_avg_sqs[i], false, numel));
      if (amsgrad) t.vmax = static_cast<float*>(state(max_exp_avg_sqs[i], false, numel));
    }
    key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(t.numel)));
    for (const void* ptr : {static_cast<const void*>(t.param), t.grad, static_cast<const void*>(t.step), static_cast<const void*>(t.m_codes),
                            static_cast<const void*>(t.m), static_cast<const void*>(t.vmax_codes),
                            static_cast<const void*>(t.vmax), reinterpret_cast<const void*>(block)})
      key.push_back(ptr);
  }
  key.push_back(reinterpret_cast<const void*>(uintptr_t{2}));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::lock_guard<std::mutex> lock(g_mu);
  Cached& c = g_plans[key];
  if (!c.plan) {
    c.plan = cuda::make_adamw8bit_plan(ts, stream);
    TORCH_CHECK(c.plan, "optstate.adamw8bit_: cannot build the CUDA work list");
    c.hyper = at::empty({static_cast<int64_t>(sizeof(cuda::Hyper))}, params[0].options().dtype(at::kByte));
  }
  put_hyper(c, {lr, beta1, beta2, eps, weight_decay, amsgrad, 0}, stream);
  check(cuda::adamw8bit_step(*c.plan, static_cast<const cuda::Hyper*>(c.hyper.data_ptr()), stream), "adamw8bit_");
}

}  // namespace

TORCH_LIBRARY_IMPL(optstate, CUDA, m) {
  m.impl("fused_adamw_", fused_adamw_cuda);
  m.impl("adamw8bit_", adamw8bit_cuda);
}

}  // namespace optstate::optim
