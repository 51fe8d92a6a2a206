// The CUDA steps over tensor lists (cuda_step.h), on the kernels in cuda/optim_cuda.cu: used by the
// torch ops' CUDA implementations and by the LibTorch optimizers. Built only when LibTorch has CUDA
// (the GPU check script builds it against the lent machine's torch; the CPU wheel in CI has none:
// cuda_step_none.cpp stands in). The kernels' device tables (a Plan) are cached per list of
// tensors: an optimizer's tensors stay put between steps.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cuda/optim_cuda.h"
#include "cuda_step.h"
#include "op_checks.h"
#include "optstate/quant8.h"

namespace optstate::optim {
namespace {

struct Cached {
  std::unique_ptr<cuda::Plan> plan;
  at::Tensor hyper;  // device bytes of one cuda::Hyper
};

std::mutex g_mu;
std::map<std::vector<const void*>, Cached> g_plans;

// Plans are keyed by their tensors' addresses and sizes and the chunk; of the gradients only by
// their address modulo 16, as they are often reallocated between steps: set_grads re-points the
// plan at them. Plans are never evicted: a captured CUDA graph may still point at one (a plan is
// ~24 bytes per 64k elements, 0.5 MB for a 1.2B-parameter set).

// A gradient's place in a plan key: its alignment class (the plan's vector paths depend on it).
const void* grad_key(const void* grad) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(grad) & uintptr_t{15});
}


void check(int err, const char* what) {
  TORCH_CHECK(err == 0, "optstate ", what, ": CUDA error ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// Points the plan at this step's gradients: a launch every step, not only when they moved. A CUDA
// graph replay runs no host code, so the host cannot know which pointers a replay left in the
// descriptors; this way every step, eager or replayed, sets its own (a few microseconds).
void use_grads(Cached& c, const std::vector<const void*>& grads, cudaStream_t s) {
  check(cuda::set_grads(*c.plan, grads.data(), grads.size(), s), "gradient pointers");
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &status) != cudaSuccess) return false;
  return status != cudaStreamCaptureStatusNone;
}

// Set-up a step does once (device allocations and copies, a device-wide sync) cannot be recorded in
// a CUDA graph, and trying would invalidate the capture with a runtime error that names neither:
// refused before any CUDA call, saying what to do.
void refuse_setup_in_capture(cudaStream_t s, const char* op, const char* what) {
  TORCH_CHECK(!capturing(s), op, ": ", what,
              ", which a CUDA graph cannot record; run one step eagerly before capturing (a warm-up, as "
              "torch.cuda.graph asks) and capture the steps after it");
}

// Work done before the first step on each GPU, under its own lock. A failure (an exception) is not
// recorded: the next step tries again.
class OncePerDevice {
 public:
  template <class F>
  void run(c10::DeviceIndex device, F&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_.count(device)) return;
    fn();
    done_.insert(device);
  }

 private:
  std::mutex mu_;
  std::set<c10::DeviceIndex> done_;
};

// The first step on a GPU first asks the runtime for the kernels' image there, so a GPU the build
// has no code for gets told what to rebuild with rather than a launch's "no kernel image".
void ensure_image(c10::DeviceIndex device) {
  static OncePerDevice checked;
  checked.run(device, [&] { cuda_kernel_image(device); });
}

// A tensor lr's placement, checked. Params on the CPU come here only through a GPU tensor lr
// (the dispatcher picks CUDA for any CUDA argument).
void check_lr_cuda(const LrArg& lr, const at::Tensor& first_param, const char* op) {
  TORCH_CHECK(first_param.is_cuda(), op, ": params on ", first_param.device(), " with a tensor lr on ",
              lr.tensor.device(), "; CPU params need lr on the CPU");
  check_lr(OpBackend::kCuda, lr, first_param, op);
}

// The step's hyperparameters into the plan's device buffer, by a launch on the stream (no host sync).
// A tensor lr on the GPU is read by that launch, each time it runs (also as a CUDA graph replay).
void put_hyper(Cached& c, cuda::Hyper h, const LrArg& lr, cudaStream_t s) {
  cuda::LrSource source = cuda::LrSource::kValue;
  const void* device_lr = nullptr;
  if (lr.tensor.defined() && lr.tensor.is_cuda()) {
    source = lr.tensor.scalar_type() == at::kDouble ? cuda::LrSource::kF64 : cuda::LrSource::kF32;
    device_lr = lr.tensor.const_data_ptr();
  } else {
    h.lr = lr_value(lr);  // a number, or a CPU tensor (no device sync)
  }
  check(cuda::store_hyper(static_cast<cuda::Hyper*>(c.hyper.data_ptr()), h, s, source, device_lr),
        "hyperparameters");
}

// The cached plan of `key` (built by `make_plan` the first time), pointed at this step's gradients
// and hyperparameters. The caller holds g_mu until its step is launched.
template <class MakePlan>
Cached& ready_plan(const std::vector<const void*>& key, MakePlan make_plan, const char* op, const at::Tensor& first,
                   const std::vector<const void*>& grads, const cuda::Hyper& hyper, const LrArg& lr, cudaStream_t s) {
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    refuse_setup_in_capture(s, op, "the first step over these tensors builds their device work list");
    ensure_image(first.device().index());
    Cached made;
    made.plan = make_plan();
    TORCH_CHECK(made.plan, op, ": cannot build the CUDA work list (", cudaGetErrorString(cudaGetLastError()), ")");
    made.hyper = at::empty({static_cast<int64_t>(sizeof(cuda::Hyper))}, first.options().dtype(at::kByte));
    it = g_plans.emplace(key, std::move(made)).first;
  }
  Cached& c = it->second;
  use_grads(c, grads, s);
  put_hyper(c, hyper, lr, s);
  return c;
}

// The 8-bit kernel's tables, once per GPU (a __device__ symbol lives in each device's context).
void ensure_maps(c10::DeviceIndex device, cudaStream_t stream, const char* op) {
  static OncePerDevice tables;
  tables.run(device, [&] {
    refuse_setup_in_capture(stream, op, "the first 8-bit step on a GPU copies the quantization tables to it");
    ensure_image(device);
    const Quantizer& s = Quantizer::get(QMap::kDynamicSigned);
    const Quantizer& u = Quantizer::get(QMap::kDynamicUnsigned);
    check(cuda::set_qmaps(s.map(), u.map(), s.entries(), bucket_entries(s.layout()), u.entries(),
                          bucket_entries(u.layout())),
          "quantization tables");
  });
}

// A tuning knob of the GPU check's sweep from the environment, `fallback` when unset.
int64_t env_knob(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == 0) return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  TORCH_CHECK(end && *end == 0 && v >= lo && v <= hi, name, "=", env, ": expected a number in [", lo, ", ", hi, "]");
  return v;
}

// The kernels' register budget: OPTSTATE_CUDA_MIN_BLOCKS (cuda::adamw_step says which values
// exist), else the compiler's choice (0).
int min_blocks() { return static_cast<int>(env_knob("OPTSTATE_CUDA_MIN_BLOCKS", 0, 0, 32)); }

// Groups of 4 elements in flight per thread or lane: OPTSTATE_CUDA_GROUPS (1 or 2), else 1.
int groups() { return static_cast<int>(env_knob("OPTSTATE_CUDA_GROUPS", 1, 1, 2)); }

// Elements per work item: OPTSTATE_CUDA_CHUNK, else the default.
int64_t chunk_elems() { return env_knob("OPTSTATE_CUDA_CHUNK", cuda::kDefaultChunk, 1024, int64_t{1} << 30); }

}  // namespace

bool cuda_kernels_built() { return true; }

std::string cuda_kernel_image(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  int major = 0, minor = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "device attributes");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "device attributes");
  int binary = 0, ptx = 0;
  const int err = cuda::kernel_image(&binary, &ptx);
  const std::string built = cuda::compiled_architectures();
  TORCH_CHECK(err == 0, "optstate: no CUDA kernels for GPU ", device, " (compute capability ", major, ".", minor,
              "): this build of optstate has code for CMAKE_CUDA_ARCHITECTURES=\"", built,
              "\" only; configure it with -DCMAKE_CUDA_ARCHITECTURES=", major * 10 + minor,
              " (or a list holding it) and rebuild (", cudaGetErrorString(static_cast<cudaError_t>(err)), ")");
  return "sm_" + std::to_string(binary) + " code (PTX version " + std::to_string(ptx) + ") on a compute capability " +
         std::to_string(major) + "." + std::to_string(minor) + " GPU; built for " + built;
}

bool cuda_stream_capturing(int device) {
  if (!at::hasCUDA()) return false;
  return capturing(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
}

size_t cuda_plan_count() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_plans.size();
}

at::Tensor cuda_step_scalars(const at::Tensor& steps, double lr, double beta1, double beta2, double eps,
                             double weight_decay) {
  TORCH_CHECK(steps.is_cuda() && steps.scalar_type() == at::kFloat && steps.dim() == 1,
              "optstate cuda_step_scalars: steps must be a 1-d float32 CUDA tensor");
  const c10::cuda::CUDAGuard guard(steps.device());
  const at::Tensor st = steps.contiguous();
  at::Tensor out = at::empty({st.numel(), 4}, st.options());
  const cuda::Hyper h{lr, beta1, beta2, eps, weight_decay, 0, 0};
  check(cuda::step_scalars(h, st.const_data_ptr<float>(), st.numel(), out.data_ptr<float>(),
                           c10::cuda::getCurrentCUDAStream().stream()),
        "step scalars");
  return out;
}

void fused_adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList max_exp_avg_sqs, at::TensorList steps, const LrArg& lr, double beta1,
                      double beta2, double eps, double weight_decay, bool amsgrad, bool maximize) {
  const char* op = "optstate.fused_adamw_";
  if (!params.empty() && lr.tensor.defined()) check_lr_cuda(lr, params[0], op);
  check_fused_adamw_args(OpBackend::kCuda, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad);
  const size_t n = params.size();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<cuda::AdamWTensor> ts(n);
  std::vector<const void*> key, grad_ptrs(n);
  for (size_t i = 0; i < n; ++i) {
    cuda::AdamWTensor& t = ts[i];
    t.param = params[i].data_ptr();
    t.grad = grads[i].const_data_ptr();
    t.exp_avg = exp_avgs[i].data_ptr<float>();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    t.max_exp_avg_sq = amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    t.step = steps[i].data_ptr<float>();
    t.numel = params[i].numel();
    t.kind = params[i].scalar_type() == at::kFloat ? cuda::Param::kF32 : cuda::Param::kBF16;
    // Sizes and dtypes too: a freed address may come back holding another tensor.
    key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(t.numel)));
    key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(t.kind)));
    for (const void* ptr : {static_cast<const void*>(t.param), grad_key(t.grad), static_cast<const void*>(t.exp_avg),
                            static_cast<const void*>(t.exp_avg_sq), static_cast<const void*>(t.max_exp_avg_sq),
                            static_cast<const void*>(t.step)})
      key.push_back(ptr);
    grad_ptrs[i] = t.grad;
  }
  const int64_t chunk = chunk_elems();
  key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(chunk)));
  key.push_back(reinterpret_cast<const void*>(uintptr_t{1}));  // plan kind
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::lock_guard<std::mutex> lock(g_mu);
  Cached& c = ready_plan(
      key, [&] { return cuda::make_adamw_plan(ts, stream, chunk); }, op, params[0], grad_ptrs,
      {0.0, beta1, beta2, eps, weight_decay, amsgrad, maximize}, lr, stream);
  check(cuda::adamw_step(*c.plan, static_cast<const cuda::Hyper*>(c.hyper.data_ptr()), stream, min_blocks(),
                         groups()),
        "fused_adamw_ (OPTSTATE_CUDA_MIN_BLOCKS: 0 or 5; OPTSTATE_CUDA_GROUPS 2 only with 0)");
}

void adamw8bit_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_absmax, at::TensorList exp_avg_sq_absmax,
                    at::TensorList max_exp_avg_sq_absmax, at::TensorList steps, at::IntArrayRef block_sizes,
                    const LrArg& lr, double beta1, double beta2, double eps, double weight_decay, bool amsgrad) {
  const char* op = "optstate.adamw8bit_";
  if (!params.empty() && lr.tensor.defined()) check_lr_cuda(lr, params[0], op);
  check_adamw8bit_args(OpBackend::kCuda, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, exp_avg_absmax,
                       exp_avg_sq_absmax, max_exp_avg_sq_absmax, steps, block_sizes, amsgrad);
  const size_t n = params.size();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(params[0].device());
  ensure_maps(params[0].device().index(), c10::cuda::getCurrentCUDAStream().stream(), op);
  std::vector<cuda::AdamW8bitTensor> ts(n);
  std::vector<const void*> key, grad_ptrs(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t block = block_sizes[i], numel = params[i].numel();
    cuda::AdamW8bitTensor& t = ts[i];
    t = {};
    t.param = params[i].data_ptr();
    t.grad = grads[i].const_data_ptr();
    t.step = steps[i].data_ptr<float>();
    t.numel = numel;
    t.block = block;
    t.kind = params[i].scalar_type() == at::kFloat ? cuda::Param::kF32 : cuda::Param::kBF16;
    set_adamw8bit_state(t, i, block, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax,
                        max_exp_avg_sq_absmax, amsgrad);
    key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(t.numel)));
    key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(t.kind)));
    // Every pointer: after a state reload the caching allocator may hand some addresses out again.
    grad_ptrs[i] = t.grad;
    for (const void* ptr : {static_cast<const void*>(t.param), grad_key(t.grad), static_cast<const void*>(t.step),
                            static_cast<const void*>(t.m_codes), static_cast<const void*>(t.v_codes),
                            static_cast<const void*>(t.vmax_codes), static_cast<const void*>(t.m_absmax),
                            static_cast<const void*>(t.v_absmax), static_cast<const void*>(t.vmax_absmax),
                            static_cast<const void*>(t.m), static_cast<const void*>(t.v),
                            static_cast<const void*>(t.vmax), reinterpret_cast<const void*>(block)})
      key.push_back(ptr);
  }
  const int64_t chunk = chunk_elems();
  key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(chunk)));
  key.push_back(reinterpret_cast<const void*>(uintptr_t{2}));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::lock_guard<std::mutex> lock(g_mu);
  Cached& c = ready_plan(
      key, [&] { return cuda::make_adamw8bit_plan(ts, stream, chunk); }, op, params[0], grad_ptrs,
      {0.0, beta1, beta2, eps, weight_decay, amsgrad, 0}, lr, stream);
  check(cuda::adamw8bit_step(*c.plan, static_cast<const cuda::Hyper*>(c.hyper.data_ptr()), stream, min_blocks(),
                             groups()),
        "adamw8bit_ (OPTSTATE_CUDA_MIN_BLOCKS: 0 or 4; OPTSTATE_CUDA_GROUPS 2 only with 0)");
}

}  // namespace optstate::optim
