// CUDA kernels of FusedAdamW and AdamW8bit; see optim_cuda.h. Compiled with -fmad=false: every
// multiply and add rounds on its own as on the CPU path, and fmaf appears exactly where the CPU
// kernels call std::fma. sqrtf and '/' are IEEE (nvcc's -prec-sqrt/-prec-div defaults).
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "optim_cuda.h"
#include "optim_cuda_math.h"

namespace optstate::optim::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = int64_t{1} << 16;  // elements per work item (FusedAdamW)
constexpr int kMaxBlock8 = 256;               // largest quantization block the 8-bit kernel keeps in shared memory
constexpr int kWarps = kThreads / 32;

struct Work {
  uint32_t tensor;
  int64_t begin, end;  // elements (FusedAdamW) or quantization blocks (AdamW8bit)
};

__constant__ float c_maps[2][256];  // dynamic signed, dynamic unsigned

using namespace math;

__global__ void increment_steps_adamw(const AdamWTensor* ts, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) *ts[i].step += 1.0f;
}

__global__ void increment_steps_8bit(const AdamW8bitTensor* ts, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) *ts[i].step += 1.0f;
}

// One CUDA block per work item; 16-byte loads/stores for fp32 tensors whose pointers allow them.
__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWTensor* ts, const Work* work, const Hyper* hyper) {
  const Work w = work[blockIdx.x];
  const AdamWTensor t = ts[w.tensor];
  __shared__ AdamWScalars s;
  if (threadIdx.x == 0) s = adamw_scalars(*hyper, *t.step);
  __syncthreads();
  const AdamWScalars sc = s;
  int64_t i = w.begin;
  const bool vec = t.kind == Param::kF32 && !sc.amsgrad &&
                   ((reinterpret_cast<uintptr_t>(t.param) | reinterpret_cast<uintptr_t>(t.grad) |
                     reinterpret_cast<uintptr_t>(t.exp_avg) | reinterpret_cast<uintptr_t>(t.exp_avg_sq)) & 15) == 0;
  if (vec) {
    float4* p4 = reinterpret_cast<float4*>(t.param);
    const float4* g4 = reinterpret_cast<const float4*>(t.grad);
    float4* m4 = reinterpret_cast<float4*>(t.exp_avg);
    float4* v4 = reinterpret_cast<float4*>(t.exp_avg_sq);
    const int64_t vend = w.begin + ((w.end - w.begin) & ~int64_t{3});
    for (int64_t j = w.begin / 4 + threadIdx.x; j < vend / 4; j += kThreads) {
      float4 p = p4[j], m = m4[j], v = v4[j];
      const float4 g = g4[j];
      adamw_element(sc, p.x, g.x, m.x, v.x, nullptr);
      adamw_element(sc, p.y, g.y, m.y, v.y, nullptr);
      adamw_element(sc, p.z, g.z, m.z, v.z, nullptr);
      adamw_element(sc, p.w, g.w, m.w, v.w, nullptr);
      p4[j] = p;
      m4[j] = m;
      v4[j] = v;
    }
    i = vend;
  }
  for (int64_t j = i + threadIdx.x; j < w.end; j += kThreads) {
    float p = load_value(t.param, j, t.kind);
    const float g = load_value(t.grad, j, t.kind);
    adamw_element(sc, p, g, t.exp_avg[j], t.exp_avg_sq[j], sc.amsgrad ? &t.max_exp_avg_sq[j] : nullptr);
    store_value(t.param, j, p, t.kind);
  }
}

// ---- AdamW8bit ----

// max |x| as bit patterns over the warp (NaN above inf), clipped to 1e-12; NaN propagates.
__device__ __forceinline__ float warp_scale(uint32_t local_max) {
  for (int o = 16; o > 0; o /= 2) local_max = max(local_max, __shfl_xor_sync(0xffffffffu, local_max, o));
  return scale_from_bits(local_max);
}

// One warp per quantization block; the updated moments wait in shared memory for their new absmax.
__global__ void __launch_bounds__(kThreads) adamw8bit_kernel(const AdamW8bitTensor* ts, const Work* work,
                                                             const Hyper* hyper) {
  const Work w = work[blockIdx.x];
  const AdamW8bitTensor t = ts[w.tensor];
  __shared__ Scalars8 s;
  __shared__ float scratch[kWarps][3][kMaxBlock8];
  if (threadIdx.x == 0) s = scalars8(*hyper, *t.step);
  __syncthreads();
  const Scalars8 sc = s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t.block == 0) {  // dense fp32 state: w is a range of elements
    for (int64_t j = w.begin + threadIdx.x; j < w.end; j += kThreads) {
      float p = load_value(t.param, j, t.kind);
      const float g = load_value(t.grad, j, t.kind);
      update8(sc, p, g, t.m[j], t.v[j], sc.amsgrad ? &t.vmax[j] : nullptr);
      store_value(t.param, j, p, t.kind);
    }
    return;
  }
  const float* smap = c_maps[0];
  const float* umap = c_maps[1];
  for (int64_t b = w.begin + warp; b < w.end; b += kWarps) {
    const int64_t off = b * t.block;
    const int n = static_cast<int>(t.block < t.numel - off ? t.block : t.numel - off);
    const float ms = t.m_absmax[b], vs = t.v_absmax[b];
    const float xs = sc.amsgrad ? t.vmax_absmax[b] : 0.0f;
    uint32_t mmax = 0, vmaxb = 0, xmax = 0;
    for (int i = lane; i < n; i += 32) {
      float m = smap[t.m_codes[off + i]] * ms;
      float v = umap[t.v_codes[off + i]] * vs;
      float x = sc.amsgrad ? umap[t.vmax_codes[off + i]] * xs : 0.0f;
      float p = load_value(t.param, off + i, t.kind);
      const float g = load_value(t.grad, off + i, t.kind);
      update8(sc, p, g, m, v, &x);
      store_value(t.param, off + i, p, t.kind);
      scratch[warp][0][i] = m;
      scratch[warp][1][i] = v;
      scratch[warp][2][i] = x;
      mmax = max(mmax, __float_as_uint(m) & 0x7fffffffu);
      vmaxb = max(vmaxb, __float_as_uint(v) & 0x7fffffffu);
      xmax = max(xmax, __float_as_uint(x) & 0x7fffffffu);
    }
    const float nm = warp_scale(mmax), nv = warp_scale(vmaxb), nx = warp_scale(xmax);
    __syncwarp();
    for (int i = lane; i < n; i += 32) {
      t.m_codes[off + i] = quantize(scratch[warp][0][i] / nm, smap);
      t.v_codes[off + i] = quantize(scratch[warp][1][i] / nv, umap);
      if (sc.amsgrad) t.vmax_codes[off + i] = quantize(scratch[warp][2][i] / nx, umap);
    }
    if (lane == 0) {
      t.m_absmax[b] = nm;
      t.v_absmax[b] = nv;
      if (sc.amsgrad) t.vmax_absmax[b] = nx;
    }
    __syncwarp();
  }
}

__global__ void store_hyper_kernel(Hyper* dst, Hyper h) { *dst = h; }

template <class T>
int upload(const std::vector<T>& host, void** dev, cudaStream_t stream) {
  if (host.empty()) return 0;
  cudaError_t e = cudaMalloc(dev, host.size() * sizeof(T));
  if (e != cudaSuccess) return e;
  e = cudaMemcpyAsync(*dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(stream);
}

}  // namespace

Plan::~Plan() {
  if (tensors_) cudaFree(tensors_);
  if (work_) cudaFree(work_);
}

std::unique_ptr<Plan> make_adamw_plan(const std::vector<AdamWTensor>& tensors, void* stream) {
  std::vector<Work> work;
  for (size_t k = 0; k < tensors.size(); ++k)
    for (int64_t b = 0; b < tensors[k].numel; b += kChunk)
      work.push_back({static_cast<uint32_t>(k), b, b + kChunk < tensors[k].numel ? b + kChunk : tensors[k].numel});
  std::unique_ptr<Plan> p(new Plan());
  p->n_ = tensors.size();
  p->work_items_ = work.size();
  auto s = static_cast<cudaStream_t>(stream);
  if (upload(tensors, &p->tensors_, s) != 0 || upload(work, &p->work_, s) != 0) return nullptr;
  return p;
}

std::unique_ptr<Plan> make_adamw8bit_plan(const std::vector<AdamW8bitTensor>& tensors, void* stream) {
  std::vector<Work> work;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const AdamW8bitTensor& t = tensors[k];
    if (t.block > kMaxBlock8) return nullptr;
    if (t.block == 0) {
      for (int64_t b = 0; b < t.numel; b += kChunk)
        work.push_back({static_cast<uint32_t>(k), b, b + kChunk < t.numel ? b + kChunk : t.numel});
      continue;
    }
    const int64_t blocks = (t.numel + t.block - 1) / t.block;
    const int64_t per = kChunk / t.block > 0 ? kChunk / t.block : 1;  // quantization blocks per work item
    for (int64_t b = 0; b < blocks; b += per)
      work.push_back({static_cast<uint32_t>(k), b, b + per < blocks ? b + per : blocks});
  }
  std::unique_ptr<Plan> p(new Plan());
  p->n_ = tensors.size();
  p->work_items_ = work.size();
  p->eight_ = true;
  auto s = static_cast<cudaStream_t>(stream);
  if (upload(tensors, &p->tensors_, s) != 0 || upload(work, &p->work_, s) != 0) return nullptr;
  return p;
}

int adamw_step(const Plan& plan, const Hyper* hyper, void* stream) {
  if (plan.eight_) return cudaErrorInvalidValue;
  if (plan.n_ == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  const auto* ts = static_cast<const AdamWTensor*>(plan.tensors_);
  increment_steps_adamw<<<static_cast<unsigned>((plan.n_ + 255) / 256), 256, 0, s>>>(ts, plan.n_);
  if (plan.work_items_)
    adamw_kernel<<<static_cast<unsigned>(plan.work_items_), kThreads, 0, s>>>(ts, static_cast<const Work*>(plan.work_),
                                                                             hyper);
  return cudaGetLastError();
}

int adamw8bit_step(const Plan& plan, const Hyper* hyper, void* stream) {
  if (!plan.eight_) return cudaErrorInvalidValue;
  if (plan.n_ == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  const auto* ts = static_cast<const AdamW8bitTensor*>(plan.tensors_);
  increment_steps_8bit<<<static_cast<unsigned>((plan.n_ + 255) / 256), 256, 0, s>>>(ts, plan.n_);
  if (plan.work_items_)
    adamw8bit_kernel<<<static_cast<unsigned>(plan.work_items_), kThreads, 0, s>>>(
        ts, static_cast<const Work*>(plan.work_), hyper);
  return cudaGetLastError();
}

int store_hyper(Hyper* device_hyper, const Hyper& h, void* stream) {
  store_hyper_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(device_hyper, h);
  return cudaGetLastError();
}

int set_qmaps(const float* signed_map, const float* unsigned_map) {
  cudaError_t e = cudaMemcpyToSymbol(c_maps, signed_map, 256 * sizeof(float), 0);
  if (e != cudaSuccess) return e;
  return cudaMemcpyToSymbol(c_maps, unsigned_map, 256 * sizeof(float), 256 * sizeof(float));
}

}  // namespace optstate::optim::cuda
