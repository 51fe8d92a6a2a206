// CUDA twins of the CPU kernels (adamw_kernel.h, adamw8bit_kernel.h): the same element math in the
// same operation order (nvcc -fmad=false, IEEE sqrt and division, FMAs only where the CPU path has
// std::fma), so a step on the GPU gives the CPU path's bits. One multi-tensor launch: a device-side
// work list of (tensor, chunk) items built once per set of tensors (a Plan), no cap on tensors.
// Hyperparameters and step counters live in device memory, so a step needs no host sync and can
// be captured in a CUDA graph. Plain pointers: no LibTorch here (torch_ops_cuda.cpp dispatches).
#pragma once

#include <cstddef>
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
  uint8_t vec;  // set by the plan: every pointer allows 4-element vector loads/stores
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
  uint8_t fast;  // set by the plan: block <= 256, a multiple of 4, pointers aligned for vector access
};

// The device-side tables of one set of tensors (uploaded once; reused while the tensors are).
class Plan {
 public:
  ~Plan();
  size_t tensors() const { return n_; }

 private:
  friend std::unique_ptr<Plan> make_adamw_plan(const std::vector<AdamWTensor>&, void*, int64_t);
  friend std::unique_ptr<Plan> make_adamw8bit_plan(const std::vector<AdamW8bitTensor>&, void*, int64_t);
  friend int adamw_step(const Plan&, const Hyper*, void*, int, int);
  friend int adamw8bit_step(const Plan&, const Hyper*, void*, int, int);
  friend int set_grads(Plan&, const void* const*, size_t, void*);
  // Device copies of the tensor and work tables, room for the per-tensor scalars.
  int allocate(const void* tensors, size_t tensor_bytes, const void* work, size_t work_bytes, size_t scalar_bytes,
               void* stream);
  void* tensors_ = nullptr;  // device array of AdamWTensor / AdamW8bitTensor
  void* work_ = nullptr;     // device array of work items
  void* scalars_ = nullptr;  // device array: each tensor's step scalars, computed at the step's start
  size_t n_ = 0, work_items_ = 0;
  bool eight_ = false, amsgrad_ = false;
};

// Elements per work item (one CUDA block's share): a tuning knob for the GPU check; rounded to a
// multiple of 1024. The default suits an H200 (~19k items for a 1.2B-parameter set).
inline constexpr int64_t kDefaultChunk = int64_t{1} << 16;

// Build the plan (cudaMalloc + copies on `stream`); nullptr on a CUDA error. 8-bit blocks of any
// size: up to 256 (a multiple of 4, aligned) take the register path, others a two-pass path.
std::unique_ptr<Plan> make_adamw_plan(const std::vector<AdamWTensor>& tensors, void* stream,
                                      int64_t chunk = kDefaultChunk);
std::unique_ptr<Plan> make_adamw8bit_plan(const std::vector<AdamW8bitTensor>& tensors, void* stream,
                                          int64_t chunk = kDefaultChunk);

// Points the plan's tensor descriptors at new gradient buffers, grads[i] for tensor i (same sizes
// and dtypes, and the same address modulo 16 as the plan was built with: its vector paths depend on
// that). Gradients are often reallocated every step (zero_grad(set_to_none=True), FSDP2's
// reduce-scatter outputs); this keeps one plan for them. Launches on `stream` with the pointers
// as arguments: no host sync, capturable (a captured step then sets its own gradients on replay).
int set_grads(Plan& plan, const void* const* grads, size_t n, void* stream);

// One optimizer step: a small launch increments every step counter and computes each tensor's step
// scalars (bias corrections) into the plan; then one launch updates every tensor.
// Returns a cudaError_t value (0: success). `hyper` is a device pointer.
// `min_blocks` picks a compiled register budget (resident CUDA blocks per SM): 0 the compiler's
// choice (FusedAdamW 53 registers = 4 blocks, AdamW8bit ~80 = 3 blocks), or 5 for FusedAdamW and 4
// for AdamW8bit (fewer registers, a few bytes spilled): a tuning knob for the GPU check.
// `groups` 2 (with min_blocks 0): kernels that have two groups of 4 elements' loads in flight per
// thread (FusedAdamW) or per lane (AdamW8bit's register path) before computing, where 1 has one;
// another tuning knob for the GPU check, same results.
int adamw_step(const Plan& plan, const Hyper* hyper, void* stream, int min_blocks = 0, int groups = 1);
int adamw8bit_step(const Plan& plan, const Hyper* hyper, void* stream, int min_blocks = 0, int groups = 1);

// Where the step's learning rate comes from: `Hyper::lr`, or a device scalar read when the step
// runs (torch's tensor `lr`: an LR schedule's in-place update reaches CUDA graph replays).
enum class LrSource : uint8_t { kValue, kF32, kF64 };

// Writes `h` into device memory with a one-thread launch on `stream`: no host sync (a pageable
// cudaMemcpyAsync would synchronize), and a CUDA graph can capture it. With `lr_source` kF32/kF64,
// the launch takes lr from the device scalar `device_lr` instead, so a replay reads its value then.
int store_hyper(Hyper* device_hyper, const Hyper& h, void* stream, LrSource lr_source = LrSource::kValue,
                const void* device_lr = nullptr);

// The step-dependent scalars the update launches use, for n step values: out[4i..4i+3] = FusedAdamW's
// -lr / bc1 and sqrt(bc2), AdamW8bit's bc1 and sqrt(bc2), as the kernels compute them from `h` and
// steps[i] (device arrays). For the GPU check, which holds them against the CPU kernels' scalars over
// long runs' worth of steps: device pow against the host's.
int step_scalars(const Hyper& h, const float* steps, int64_t n, float* out, void* stream);
// Which of the kernels' images the runtime takes for the current device: *binary_version is the
// machine code's architecture (major * 10 + minor; that of PTX JIT-compiled for the device where
// it came from PTX), *ptx_version the PTX's. cudaErrorNoKernelImageForDevice (or another error)
// where the build holds nothing this device runs. compiled_architectures(): the build's
// CMAKE_CUDA_ARCHITECTURES, space-separated ("75-real 80-real ... 120-virtual").
int kernel_image(int* binary_version, int* ptx_version);
const char* compiled_architectures();

// Sets the 8-bit kernel's tables on the current device, once per device before its first 8-bit
// step (it synchronizes the device: not while capturing a graph). Device memory, copied to each
// CUDA block's shared memory: the two 256-entry maps (dequantize) and the two Quantizers' bucket
// entries (quantize; Quantizer::entries(), quant8_buckets.h). Refused unless the entry counts are
// those of bucket_layout(true) and bucket_layout(false).
int set_qmaps(const float* signed_map, const float* unsigned_map, const uint32_t* signed_entries, size_t signed_count,
              const uint32_t* unsigned_entries, size_t unsigned_count);

}  // namespace optstate::optim::cuda
