// CUDA twins of the CPU kernels (adamw_kernel.h, adamw8bit_kernel.h): the same element math in the
// same operation order (nvcc -fmad=false, IEEE sqrt and division, FMAs only where the CPU path has
// std::fma), so a step on the GPU gives the CPU path's bits. One multi-tensor launch: a device-side
// work list of (tensor, chunk) items built once per set of tensors (a Plan), no cap on tensors.
// Hyperparameters and step counters live in device memory, so a step needs no host sync and can
// be captured in a CUDA graph. Plain pointers: no LibTorch here (torch_ops_cuda.cpp dispatches).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace optstate::optim::cuda {

enum class Param : uint8_t { kF32, kBF16 };

// In device memory; the step counters are the optimizers' fp32 `step` tensors.
struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
  int32_t amsgrad, maximize;
};

struct AdamWTensor {
  void* param;
  const void* grad;
  float *exp_avg, *exp_avg_sq, *max_exp_avg_sq;
  float* step;  // device fp32 scalar, incremented by the step
  int64_t numel;
  Param kind;
};

struct AdamW8bitTensor {
  void* param;
  const void* grad;
  float* step;
  int64_t numel;
  int64_t block;  // 0: dense fp32 state
  uint8_t *m_codes, *v_codes, *vmax_codes;
  float *m_absmax, *v_absmax, *vmax_absmax;
  float *m, *v, *vmax;
  Param kind;
};

// The device-side tables of one set of tensors (uploaded once; reused while the tensors are).
class Plan {
 public:
  ~Plan();
  size_t tensors() const { return n_; }

 private:
  friend std::unique_ptr<Plan> make_adamw_plan(const std::vector<AdamWTensor>&, void*);
  friend std::unique_ptr<Plan> make_adamw8bit_plan(const std::vector<AdamW8bitTensor>&, void*);
  friend int adamw_step(const Plan&, const Hyper*, void*);
  friend int adamw8bit_step(const Plan&, const Hyper*, void*);
  void* tensors_ = nullptr;  // device array of AdamWTensor / AdamW8bitTensor
  void* work_ = nullptr;     // device array of work items
  size_t n_ = 0, work_items_ = 0;
  bool eight_ = false;
};

// Build the plan (cudaMalloc + copies on `stream`); nullptr on a CUDA error.
std::unique_ptr<Plan> make_adamw_plan(const std::vector<AdamWTensor>& tensors, void* stream);
std::unique_ptr<Plan> make_adamw8bit_plan(const std::vector<AdamW8bitTensor>& tensors, void* stream);

// One optimizer step: increments every step counter, then one launch updates every tensor.
// Returns a cudaError_t value (0: success). `hyper` is a device pointer.
int adamw_step(const Plan& plan, const Hyper* hyper, void* stream);
int adamw8bit_step(const Plan& plan, const Hyper* hyper, void* stream);

// Writes `h` into device memory with a one-thread launch on `stream`: no host sync (a pageable
// cudaMemcpyAsync would synchronize), and a CUDA graph can capture it.
int store_hyper(Hyper* device_hyper, const Hyper& h, void* stream);

// Sets the 256-entry maps the 8-bit kernel quantizes with (copied to constant memory once).
int set_qmaps(const float* signed_map, const float* unsigned_map);

}  // namespace optstate::optim::cuda
