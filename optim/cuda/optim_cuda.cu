// CUDA kernels of FusedAdamW and AdamW8bit; see optim_cuda.h. Compiled with -fmad=false: every
// multiply and add rounds on its own as on the CPU path, and fmaf appears exactly where the CPU
// kernels call std::fma. sqrtf and '/' are IEEE (nvcc's -prec-sqrt/-prec-div defaults).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "optim_cuda.h"
#include "optim_cuda_body.h"

namespace optstate::optim::cuda {
namespace {

using namespace body;

__device__ __align__(16) Tables8 g_tables;  // set by set_qmaps; each CUDA block copies it to shared memory

// Step counters += 1 and each tensor's step scalars, before the update launch reads them.
__global__ void prepare_adamw(const AdamWTensor* ts, size_t n, const Hyper* hyper, AdamWScalars* scalars) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float step = *ts[i].step + 1.0f;
  *ts[i].step = step;
  scalars[i] = adamw_scalars(*hyper, step);
}

__global__ void prepare_adamw8bit(const AdamW8bitTensor* ts, size_t n, const Hyper* hyper, Scalars8* scalars) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float step = *ts[i].step + 1.0f;
  *ts[i].step = step;
  scalars[i] = scalars8(*hyper, step);
}

// One CUDA block per work item.
template <int kGroups = 1>
__device__ __forceinline__ void adamw_item(const AdamWTensor* ts, const Work* work, const AdamWScalars* scalars) {
  const Work w = work[blockIdx.x];
  // Copies in registers: stores through the tensor pointers could alias the tables, and the loop
  // would reload every field after every store.
  const AdamWTensor t = ts[w.tensor];
  const AdamWScalars sc = scalars[w.tensor];
  adamw_thread<kGroups>(sc, t, w.begin, w.end, threadIdx.x, kThreads);
}

// Two register budgets (OPTSTATE_CUDA_MIN_BLOCKS): the compiler's choice (53 registers, 4 blocks per
// SM), and at most 48 registers for 5 blocks. (`__launch_bounds__(256, 1)` is not the former: it
// lets the compiler take 77.) Turing holds at most 1024 threads per SM, so 4 blocks there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
constexpr int kMinBlocks5 = 4;
#else
constexpr int kMinBlocks5 = 5;
#endif
__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWTensor* ts, const Work* work,
                                                         const AdamWScalars* scalars) {
  adamw_item(ts, work, scalars);
}
__global__ void __launch_bounds__(kThreads, kMinBlocks5) adamw_kernel_5(const AdamWTensor* ts, const Work* work,
                                                              const AdamWScalars* scalars) {
  adamw_item(ts, work, scalars);
}
// Two groups of 4 elements in flight per thread (OPTSTATE_CUDA_GROUPS=2).
__global__ void __launch_bounds__(kThreads) adamw_kernel_g2(const AdamWTensor* ts, const Work* work,
                                                            const AdamWScalars* scalars) {
  adamw_item<2>(ts, work, scalars);
}

__device__ __forceinline__ uint32_t warp_max(uint32_t x) {
  for (int o = 16; o > 0; o /= 2) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// One warp per quantization block (several per CUDA block); maps and bucket tables in shared memory.
template <bool kAms, bool kPreload = false>
__device__ __forceinline__ void adamw8bit_item(const AdamW8bitTensor* ts, const Work* work, const Scalars8* scalars) {
  __shared__ __align__(16) Tables8 tab;
  {
    static_assert(sizeof(Tables8) % 16 == 0, "copied in 16-byte words");
    const auto* src = reinterpret_cast<const uint4*>(&g_tables);
    auto* dst = reinterpret_cast<uint4*>(&tab);
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(Tables8) / 16); i += kThreads) dst[i] = src[i];
  }
  __syncthreads();
  const Work w = work[blockIdx.x];
  const AdamW8bitTensor t = ts[w.tensor];
  const Scalars8 sc = scalars[w.tensor];
  if (t.block == 0) {
    dense8_thread(sc, t, w.begin, w.end, threadIdx.x, kThreads);
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t b = w.begin + warp; b < w.end; b += kWarps) {
    Max8 mx;
    Lane8 r;
    if (t.fast) {
      lane8_update<kAms, kPreload>(sc, t, b, lane, tab, r, mx);
    } else {
      lane8_pass<kAms, false>(sc, t, b, lane, tab, mx, 0.0f, 0.0f, 0.0f);
    }
    const float nm = scale_from_bits(warp_max(mx.m)), nv = scale_from_bits(warp_max(mx.v));
    const float nx = kAms ? scale_from_bits(warp_max(mx.x)) : 0.0f;
    if (t.fast) {
      lane8_store<kAms>(t, b, lane, tab, r, nm, nv, nx);
    } else {
      lane8_pass<kAms, true>(sc, t, b, lane, tab, mx, nm, nv, nx);
    }
    __syncwarp();  // every lane has read the old scales
    if (lane == 0) store_absmax<kAms>(t, b, nm, nv, nx);
  }
}

// Register budgets as for FusedAdamW: the compiler's choice (~80 registers, 3 blocks per SM) and at
// most 64 (4 blocks).
template <bool kAms>
__global__ void __launch_bounds__(kThreads) adamw8bit_kernel(const AdamW8bitTensor* ts, const Work* work,
                                                             const Scalars8* scalars) {
  adamw8bit_item<kAms>(ts, work, scalars);
}
template <bool kAms>
__global__ void __launch_bounds__(kThreads, 4) adamw8bit_kernel_4(const AdamW8bitTensor* ts, const Work* work,
                                                                  const Scalars8* scalars) {
  adamw8bit_item<kAms>(ts, work, scalars);
}
// Both groups of a lane's elements loaded before either is computed (OPTSTATE_CUDA_GROUPS=2).
template <bool kAms>
__global__ void __launch_bounds__(kThreads) adamw8bit_kernel_p(const AdamW8bitTensor* ts, const Work* work,
                                                               const Scalars8* scalars) {
  adamw8bit_item<kAms, true>(ts, work, scalars);
}

__global__ void step_scalars_kernel(Hyper h, const float* steps, int64_t n, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const AdamWScalars a = adamw_scalars(h, steps[i]);
  const Scalars8 b = scalars8(h, steps[i]);
  out[4 * i] = a.neg_step_size;
  out[4 * i + 1] = a.bc2_sqrt;
  out[4 * i + 2] = b.bc1;
  out[4 * i + 3] = b.bc2_sqrt;
}

__global__ void store_hyper_kernel(Hyper* dst, Hyper h, LrSource lr_source, const void* lr) {
  if (lr_source == LrSource::kF32) h.lr = *static_cast<const float*>(lr);
  if (lr_source == LrSource::kF64) h.lr = *static_cast<const double*>(lr);
  *dst = h;
}

// set_grads' launches: up to kGradBatch pointers as kernel arguments (2 KB, inside the 4 KB limit),
// each written into the `grad` field of one device-side tensor descriptor.
constexpr int kGradBatch = 256;
struct GradBatch {
  const void* grad[kGradBatch];
};

__global__ void set_grads_kernel(char* descriptors, GradField field, GradBatch batch, int count) {
  const int i = threadIdx.x;
  if (i < count) put_grad(descriptors, field, i, batch.grad[i]);
}

int upload(const void* host, size_t bytes, void** dev, cudaStream_t stream) {
  if (bytes == 0) return 0;
  cudaError_t e = cudaMalloc(dev, bytes);
  if (e != cudaSuccess) return e;
  e = cudaMemcpyAsync(*dev, host, bytes, cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(stream);
}

unsigned grid(size_t n, unsigned threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace

int Plan::allocate(const void* tensors, size_t tensor_bytes, const void* work, size_t work_bytes, size_t scalar_bytes,
                   void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  int e = upload(tensors, tensor_bytes, &tensors_, s);
  if (e == 0) e = upload(work, work_bytes, &work_, s);
  if (e == 0 && scalar_bytes) e = cudaMalloc(&scalars_, scalar_bytes);
  return e;
}

Plan::~Plan() {
  if (tensors_) cudaFree(tensors_);
  if (work_) cudaFree(work_);
  if (scalars_) cudaFree(scalars_);
}

std::unique_ptr<Plan> make_adamw_plan(const std::vector<AdamWTensor>& tensors, void* stream, int64_t chunk) {
  std::vector<AdamWTensor> ts = tensors;
  const std::vector<Work> work = adamw_work(ts, chunk);
  std::unique_ptr<Plan> p(new Plan());
  p->n_ = ts.size();
  p->work_items_ = work.size();
  for (const AdamWTensor& t : ts) p->amsgrad_ |= t.max_exp_avg_sq != nullptr;
  if (p->allocate(ts.data(), ts.size() * sizeof(AdamWTensor), work.data(), work.size() * sizeof(Work),
                  ts.size() * sizeof(AdamWScalars), stream) != 0)
    return nullptr;
  return p;
}

std::unique_ptr<Plan> make_adamw8bit_plan(const std::vector<AdamW8bitTensor>& tensors, void* stream, int64_t chunk) {
  std::vector<AdamW8bitTensor> ts = tensors;
  const std::vector<Work> work = adamw8bit_work(ts, chunk);
  std::unique_ptr<Plan> p(new Plan());
  p->n_ = ts.size();
  p->work_items_ = work.size();
  p->eight_ = true;
  for (const AdamW8bitTensor& t : ts) p->amsgrad_ |= t.vmax_codes != nullptr || t.vmax != nullptr;
  if (p->allocate(ts.data(), ts.size() * sizeof(AdamW8bitTensor), work.data(), work.size() * sizeof(Work),
                  ts.size() * sizeof(Scalars8), stream) != 0)
    return nullptr;
  return p;
}

// The knobs name a compiled kernel: checked before anything is launched (a refused step must not
// have advanced the step counters).
static bool knobs_ok(int min_blocks, int groups, int other_min_blocks) {
  return groups == 1 ? min_blocks == 0 || min_blocks == other_min_blocks : groups == 2 && min_blocks == 0;
}

int adamw_step(const Plan& plan, const Hyper* hyper, void* stream, int min_blocks, int groups) {
  if (plan.eight_ || !knobs_ok(min_blocks, groups, 5)) return cudaErrorInvalidValue;
  if (plan.n_ == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  const auto* ts = static_cast<const AdamWTensor*>(plan.tensors_);
  auto* scalars = static_cast<AdamWScalars*>(plan.scalars_);
  prepare_adamw<<<grid(plan.n_, 128), 128, 0, s>>>(ts, plan.n_, hyper, scalars);
  if (plan.work_items_) {
    const auto* work = static_cast<const Work*>(plan.work_);
    const auto items = static_cast<unsigned>(plan.work_items_);
    switch (groups == 2 ? -1 : min_blocks) {
      case -1: adamw_kernel_g2<<<items, kThreads, 0, s>>>(ts, work, scalars); break;
      case 0: adamw_kernel<<<items, kThreads, 0, s>>>(ts, work, scalars); break;
      case 5: adamw_kernel_5<<<items, kThreads, 0, s>>>(ts, work, scalars); break;
      default: return cudaErrorInvalidValue;
    }
  }
  return cudaGetLastError();
}

namespace {
template <bool kAms>
int launch8(unsigned items, cudaStream_t s, const AdamW8bitTensor* ts, const Work* work, const Scalars8* scalars,
            int min_blocks, int groups) {
  switch (groups == 2 ? -1 : min_blocks) {
    case -1: adamw8bit_kernel_p<kAms><<<items, kThreads, 0, s>>>(ts, work, scalars); break;
    case 0: adamw8bit_kernel<kAms><<<items, kThreads, 0, s>>>(ts, work, scalars); break;
    case 4: adamw8bit_kernel_4<kAms><<<items, kThreads, 0, s>>>(ts, work, scalars); break;
    default: return cudaErrorInvalidValue;
  }
  return 0;
}
}  // namespace

int adamw8bit_step(const Plan& plan, const Hyper* hyper, void* stream, int min_blocks, int groups) {
  if (!plan.eight_ || !knobs_ok(min_blocks, groups, 4)) return cudaErrorInvalidValue;
  if (plan.n_ == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  const auto* ts = static_cast<const AdamW8bitTensor*>(plan.tensors_);
  auto* scalars = static_cast<Scalars8*>(plan.scalars_);
  prepare_adamw8bit<<<grid(plan.n_, 128), 128, 0, s>>>(ts, plan.n_, hyper, scalars);
  if (plan.work_items_) {
    const auto* work = static_cast<const Work*>(plan.work_);
    const auto items = static_cast<unsigned>(plan.work_items_);
    const int e = plan.amsgrad_ ? launch8<true>(items, s, ts, work, scalars, min_blocks, groups)
                                : launch8<false>(items, s, ts, work, scalars, min_blocks, groups);
    if (e != 0) return e;
  }
  return cudaGetLastError();
}

int set_grads(Plan& plan, const void* const* grads, size_t n, void* stream) {
  if (n != plan.n_) return cudaErrorInvalidValue;
  const GradField field = grad_field(plan.eight_);
  auto* base = static_cast<char*>(plan.tensors_);
  for (size_t first = 0; first < n; first += kGradBatch) {
    const int count = static_cast<int>(n - first < kGradBatch ? n - first : kGradBatch);
    GradBatch batch{};
    for (int i = 0; i < count; ++i) batch.grad[i] = grads[first + i];
    set_grads_kernel<<<1, kGradBatch, 0, static_cast<cudaStream_t>(stream)>>>(base + first * field.stride, field,
                                                                               batch, count);
  }
  return cudaGetLastError();
}

int store_hyper(Hyper* device_hyper, const Hyper& h, void* stream, LrSource lr_source, const void* device_lr) {
  if (lr_source != LrSource::kValue && device_lr == nullptr) return cudaErrorInvalidValue;
  store_hyper_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(device_hyper, h, lr_source, device_lr);
  return cudaGetLastError();
}

int step_scalars(const Hyper& h, const float* steps, int64_t n, float* out, void* stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return 0;
  step_scalars_kernel<<<grid(static_cast<size_t>(n), 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(h, steps, n,
                                                                                                        out);
  return cudaGetLastError();
}

int kernel_image(int* binary_version, int* ptx_version) {
  cudaFuncAttributes a{};
  const cudaError_t e = cudaFuncGetAttributes(&a, adamw_kernel);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky, but torch's next launch check would report it
    return e;
  }
  *binary_version = a.binaryVersion;
  *ptx_version = a.ptxVersion;
  return 0;
}

const char* compiled_architectures() { return OPTSTATE_CUDA_ARCHS; }

int set_qmaps(const float* signed_map, const float* unsigned_map, const uint32_t* signed_entries, size_t signed_count,
              const uint32_t* unsigned_entries, size_t unsigned_count) {
  static Tables8 t;  // 27 KB: not on the stack
  if (!build_tables8(signed_map, unsigned_map, signed_entries, signed_count, unsigned_entries, unsigned_count, t))
    return cudaErrorInvalidValue;
  const cudaError_t e = cudaMemcpyToSymbol(g_tables, &t, sizeof t);
  // Done before any stream (torch's may be non-blocking ones) launches a kernel that reads them.
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

}  // namespace optstate::optim::cuda
