// The CUDA kernels' bodies: what one thread (FusedAdamW, dense 8-bit state) or one lane of a warp
// (blockwise 8-bit state) does with its share of a work item, and the host-side work list. Compiled
// for the device by optim_cuda.cu and for the host by tests/optim/test_cuda_emulated.cpp, which runs
// every thread and lane of every work item in turn (a warp's max reduction between the two lane
// phases) and checks the result against the CPU kernels bit for bit: indexing, vector paths, partial
// blocks and the quantizer are proven on any machine; the GPU adds only the launch and the shuffles.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "optim_cuda.h"
#include "optim_cuda_math.h"
#include "optstate/quant8_buckets.h"

#if defined(__CUDACC__)
#define OPTSTATE_UNROLL _Pragma("unroll")
#else
#define OPTSTATE_UNROLL
#endif

namespace optstate::optim::cuda::body {

using namespace math;

constexpr int kThreads = 256;              // threads per CUDA block
constexpr int kWarps = kThreads / 32;      // warps per CUDA block (8-bit: one quantization block each)
constexpr int kMaxFastBlock8 = 256;        // 8-bit register path: 2 groups of 4 elements per lane
constexpr int kGroups8 = kMaxFastBlock8 / 128;

struct Work {
  uint32_t tensor;
  int64_t begin, end;  // elements (FusedAdamW, dense 8-bit state) or quantization blocks (8-bit)
};

// ---- set_grads: where a descriptor keeps its gradient pointer ----

// The byte stride and the offset of the `grad` field in an array of descriptors.
struct GradField {
  size_t stride, offset;
};
inline GradField grad_field(bool eight) {
  return eight ? GradField{sizeof(AdamW8bitTensor), offsetof(AdamW8bitTensor, grad)}
               : GradField{sizeof(AdamWTensor), offsetof(AdamWTensor, grad)};
}

// Descriptor i's gradient pointer := grad (one thread of set_grads' launch per descriptor).
OPTSTATE_HD void put_grad(char* descriptors, GradField f, size_t i, const void* grad) {
  memcpy(descriptors + i * f.stride + f.offset, &grad, sizeof grad);
}

// ---- host: the work list and the per-tensor flags ----

inline bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

inline int64_t round_chunk(int64_t chunk) {
  chunk = (chunk + 1023) / 1024 * 1024;
  return chunk < 1024 ? 1024 : chunk;
}

// Items of at most `chunk` elements; sets each tensor's vector flag.
inline std::vector<Work> adamw_work(std::vector<AdamWTensor>& ts, int64_t chunk) {
  chunk = round_chunk(chunk);
  std::vector<Work> work;
  for (size_t k = 0; k < ts.size(); ++k) {
    AdamWTensor& t = ts[k];
    const uintptr_t pa = t.kind == Param::kF32 ? 16 : 8;
    t.vec = aligned(t.param, pa) && aligned(t.grad, pa) && aligned(t.exp_avg, 16) && aligned(t.exp_avg_sq, 16) &&
            (t.max_exp_avg_sq == nullptr || aligned(t.max_exp_avg_sq, 16));
    for (int64_t b = 0; b < t.numel; b += chunk)
      work.push_back({static_cast<uint32_t>(k), b, b + chunk < t.numel ? b + chunk : t.numel});
  }
  return work;
}

// Items of about `chunk` elements: whole quantization blocks (at least one), or element ranges for
// dense state. Sets each tensor's register-path flag.
inline std::vector<Work> adamw8bit_work(std::vector<AdamW8bitTensor>& ts, int64_t chunk) {
  chunk = round_chunk(chunk);
  std::vector<Work> work;
  for (size_t k = 0; k < ts.size(); ++k) {
    AdamW8bitTensor& t = ts[k];
    if (t.block == 0) {
      t.fast = 0;
      for (int64_t b = 0; b < t.numel; b += chunk)
        work.push_back({static_cast<uint32_t>(k), b, b + chunk < t.numel ? b + chunk : t.numel});
      continue;
    }
    const uintptr_t pa = t.kind == Param::kF32 ? 16 : 8;
    t.fast = t.block <= kMaxFastBlock8 && t.block % 4 == 0 && aligned(t.param, pa) && aligned(t.grad, pa) &&
             aligned(t.m_codes, 4) && aligned(t.v_codes, 4) && (t.vmax_codes == nullptr || aligned(t.vmax_codes, 4));
    const int64_t blocks = (t.numel + t.block - 1) / t.block;
    const int64_t per = chunk / t.block > 0 ? chunk / t.block : 1;
    for (int64_t b = 0; b < blocks; b += per)
      work.push_back({static_cast<uint32_t>(k), b, b + per < blocks ? b + per : blocks});
  }
  return work;
}

// ---- device and host: vector access ----

struct Four {
  float v[4];
};

OPTSTATE_HD Four load4(const void* base, int64_t i, Param k) {
  Four r;
#if defined(__CUDA_ARCH__)
  if (k == Param::kF32) {
    const float4 x = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    r.v[0] = x.x, r.v[1] = x.y, r.v[2] = x.z, r.v[3] = x.w;
  } else {
    const uint2 x = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
    r.v[0] = bits_float(x.x << 16), r.v[1] = bits_float(x.x & 0xffff0000u);
    r.v[2] = bits_float(x.y << 16), r.v[3] = bits_float(x.y & 0xffff0000u);
  }
#else
  for (int e = 0; e < 4; ++e) r.v[e] = load_value(base, i + e, k);
#endif
  return r;
}

OPTSTATE_HD void store4(void* base, int64_t i, const Four& r, Param k) {
#if defined(__CUDA_ARCH__)
  if (k == Param::kF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
  } else {
    uint16_t h[4];
    for (int e = 0; e < 4; ++e) store_value(h, e, r.v[e], Param::kBF16);
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i) =
        make_uint2(h[0] | (uint32_t{h[1]} << 16), h[2] | (uint32_t{h[3]} << 16));
  }
#else
  for (int e = 0; e < 4; ++e) store_value(base, i + e, r.v[e], k);
#endif
}

OPTSTATE_HD uint32_t load_codes4(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t x;
  memcpy(&x, p, 4);
  return x;
#endif
}

OPTSTATE_HD void store_codes4(uint8_t* p, uint32_t x) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(p) = x;
#else
  memcpy(p, &x, 4);
#endif
}

// ---- FusedAdamW: one thread of a work item ----

// Groups of 4 elements a thread has in flight before it computes (the GPU check's
// OPTSTATE_CUDA_GROUPS sweep: 1 is 64 bytes of loads per thread, 2 is 128). The results do not
// depend on it: every element is updated alone, by the same operations.
constexpr int kMaxGroups = 2;

struct AdamWGroup {
  Four p, g, m, v, x;
};

OPTSTATE_HD void adamw_load(const AdamWScalars& sc, const AdamWTensor& t, int64_t j, AdamWGroup& a) {
  a.p = load4(t.param, j, t.kind);
  a.g = load4(t.grad, j, t.kind);
  a.m = load4(t.exp_avg + j, 0, Param::kF32);
  a.v = load4(t.exp_avg_sq + j, 0, Param::kF32);
  a.x = Four{};
  if (sc.amsgrad) a.x = load4(t.max_exp_avg_sq + j, 0, Param::kF32);
}

OPTSTATE_HD void adamw_update_store(const AdamWScalars& sc, const AdamWTensor& t, int64_t j, AdamWGroup& a) {
  for (int e = 0; e < 4; ++e) adamw_element(sc, a.p.v[e], a.g.v[e], a.m.v[e], a.v.v[e], &a.x.v[e]);
  store4(t.param, j, a.p, t.kind);
  store4(t.exp_avg + j, 0, a.m, Param::kF32);
  store4(t.exp_avg_sq + j, 0, a.v, Param::kF32);
  if (sc.amsgrad) store4(t.max_exp_avg_sq + j, 0, a.x, Param::kF32);
}

template <int kGroups = 1>
OPTSTATE_HD void adamw_thread(const AdamWScalars& sc, const AdamWTensor& t, int64_t begin, int64_t end, int thread,
                              int threads) {
  static_assert(kGroups >= 1 && kGroups <= kMaxGroups, "groups in flight");
  int64_t rest = begin;
  if (t.vec) {  // begin is a multiple of 4 (items are multiples of 1024 elements)
    const int64_t vend = begin + ((end - begin) & ~int64_t{3});
    const int64_t stride = 4 * int64_t{threads};
    int64_t j = begin + 4 * int64_t{thread};
    if constexpr (kGroups > 1) {
      // The loads of all groups before the first store: a store may alias a later group's data as
      // far as the compiler knows, so it would not move those loads up itself.
      for (; j + (kGroups - 1) * stride < vend; j += kGroups * stride) {
        AdamWGroup a[kGroups];
OPTSTATE_UNROLL
        for (int k = 0; k < kGroups; ++k) adamw_load(sc, t, j + k * stride, a[k]);
OPTSTATE_UNROLL
        for (int k = 0; k < kGroups; ++k) adamw_update_store(sc, t, j + k * stride, a[k]);
      }
    }
    for (; j < vend; j += stride) {
      AdamWGroup a;
      adamw_load(sc, t, j, a);
      adamw_update_store(sc, t, j, a);
    }
    rest = vend;
  }
  for (int64_t j = rest + thread; j < end; j += threads) {
    float p = load_value(t.param, j, t.kind);
    const float g = load_value(t.grad, j, t.kind);
    adamw_element(sc, p, g, t.exp_avg[j], t.exp_avg_sq[j], sc.amsgrad ? &t.max_exp_avg_sq[j] : nullptr);
    store_value(t.param, j, p, t.kind);
  }
}

// ---- AdamW8bit ----

// Dense fp32 state (tensors below the 8-bit size): one thread of an element range.
OPTSTATE_HD void dense8_thread(const Scalars8& sc, const AdamW8bitTensor& t, int64_t begin, int64_t end, int thread,
                               int threads) {
  for (int64_t j = begin + thread; j < end; j += threads) {
    float p = load_value(t.param, j, t.kind);
    const float g = load_value(t.grad, j, t.kind);
    update8(sc, p, g, t.m[j], t.v[j], sc.amsgrad ? &t.vmax[j] : nullptr);
    store_value(t.param, j, p, t.kind);
  }
}

// The tables a CUDA block keeps in shared memory (27 KB): maps (dequantize) and the quantizer's
// bucket entries of both maps (quantize). The quantizer is the CPU's one-threshold bucket table
// (Quantizer, quant8_buckets.h): the same entries read by the same bucket_code, here from shared
// memory, one 4-byte load and one comparison. (The layouts are constexpr calls, not variables:
// nvcc folds them, and device code cannot name host constexpr objects of class type.)
struct Tables8 {
  float smap[256], umap[256];
  uint32_t sq[bucket_entries(bucket_layout(true))], uq[bucket_entries(bucket_layout(false))];
};

OPTSTATE_HD uint8_t quantize_signed(float x, const Tables8& t) { return bucket_code(x, t.sq, bucket_layout(true)); }
OPTSTATE_HD uint8_t quantize_unsigned(float x, const Tables8& t) { return bucket_code(x, t.uq, bucket_layout(false)); }

// Host: the tables from the two maps and the Quantizers' bucket entries; false unless the entries
// have this layout.
inline bool build_tables8(const float* signed_map, const float* unsigned_map, const uint32_t* signed_entries,
                          size_t signed_count, const uint32_t* unsigned_entries, size_t unsigned_count, Tables8& t) {
  if (signed_count != bucket_entries(bucket_layout(true)) || unsigned_count != bucket_entries(bucket_layout(false)))
    return false;
  memcpy(t.smap, signed_map, sizeof t.smap);
  memcpy(t.umap, unsigned_map, sizeof t.umap);
  memcpy(t.sq, signed_entries, sizeof t.sq);
  memcpy(t.uq, unsigned_entries, sizeof t.uq);
  return true;
}

// The largest |x| bit patterns of a lane's elements (a warp reduces them to the block's new absmax).
struct Max8 {
  uint32_t m = 0, v = 0, x = 0;
};

OPTSTATE_HD void track(Max8& mx, float m, float v, float x) {
  const uint32_t a = float_bits(m) & 0x7fffffffu, b = float_bits(v) & 0x7fffffffu, c = float_bits(x) & 0x7fffffffu;
  mx.m = mx.m > a ? mx.m : a;
  mx.v = mx.v > b ? mx.v : b;
  mx.x = mx.x > c ? mx.x : c;
}

// Register path (t.fast): lane l owns elements [128k + 4l, 128k + 4l + 4) of its block, k < 2, read
// and written 4 at a time; the updated moments wait in registers for the block's new absmax.
struct Lane8 {
  float m[4 * kGroups8], v[4 * kGroups8], x[4 * kGroups8];
};

// One group of a lane's register-path elements as read: params, gradients, codes.
struct Lane8In {
  Four p, g;
  uint32_t mc, vc, xc;
};

template <bool kAms>
OPTSTATE_HD void lane8_load(const AdamW8bitTensor& t, int64_t off, int n, int i0, Lane8In& in) {
  in.p = Four{}, in.g = Four{};
  in.mc = in.vc = in.xc = 0;
  if (i0 + 4 <= n) {
    in.p = load4(t.param, off + i0, t.kind);
    in.g = load4(t.grad, off + i0, t.kind);
    in.mc = load_codes4(t.m_codes + off + i0);
    in.vc = load_codes4(t.v_codes + off + i0);
    if (kAms) in.xc = load_codes4(t.vmax_codes + off + i0);
    return;
  }
  for (int e = 0; e < 4 && i0 + e < n; ++e) {
    in.p.v[e] = load_value(t.param, off + i0 + e, t.kind);
    in.g.v[e] = load_value(t.grad, off + i0 + e, t.kind);
    in.mc |= uint32_t{t.m_codes[off + i0 + e]} << (8 * e);
    in.vc |= uint32_t{t.v_codes[off + i0 + e]} << (8 * e);
    if (kAms) in.xc |= uint32_t{t.vmax_codes[off + i0 + e]} << (8 * e);
  }
}

// Dequantizes and updates group k (its first element i0 of the block), keeps the new moments in
// registers and their block max, and writes the params.
template <bool kAms>
OPTSTATE_HD void lane8_apply(const Scalars8& sc, const AdamW8bitTensor& t, int64_t off, int n, int k, int i0,
                             const Tables8& tab, float ms, float vs, float xs, Lane8In& in, Lane8& r, Max8& mx) {
  const bool full = i0 + 4 <= n;
OPTSTATE_UNROLL
  for (int e = 0; e < 4; ++e) {
    if (!full && i0 + e >= n) break;
    float m = tab.smap[(in.mc >> (8 * e)) & 0xffu] * ms;
    float v = tab.umap[(in.vc >> (8 * e)) & 0xffu] * vs;
    float x = kAms ? tab.umap[(in.xc >> (8 * e)) & 0xffu] * xs : 0.0f;
    update8(sc, in.p.v[e], in.g.v[e], m, v, &x);
    r.m[4 * k + e] = m;
    r.v[4 * k + e] = v;
    r.x[4 * k + e] = x;
    track(mx, m, v, x);
  }
  if (full) {
    store4(t.param, off + i0, in.p, t.kind);
  } else {
    for (int e = 0; e < 4 && i0 + e < n; ++e) store_value(t.param, off + i0 + e, in.p.v[e], t.kind);
  }
}

// kPreload: both groups' loads before either is computed (the GPU check's OPTSTATE_CUDA_GROUPS=2;
// twice the bytes in flight per lane, more registers). Same results either way.
template <bool kAms, bool kPreload = false>
OPTSTATE_HD void lane8_update(const Scalars8& sc, const AdamW8bitTensor& t, int64_t b, int lane, const Tables8& tab,
                              Lane8& r, Max8& mx) {
  const int64_t off = b * t.block;
  const int n = static_cast<int>(t.block < t.numel - off ? t.block : t.numel - off);
  const float ms = t.m_absmax[b], vs = t.v_absmax[b];
  const float xs = kAms ? t.vmax_absmax[b] : 0.0f;
  if constexpr (kPreload) {
    Lane8In in[kGroups8];
OPTSTATE_UNROLL
    for (int k = 0; k < kGroups8; ++k)
      if (128 * k + 4 * lane < n) lane8_load<kAms>(t, off, n, 128 * k + 4 * lane, in[k]);
OPTSTATE_UNROLL
    for (int k = 0; k < kGroups8; ++k) {
      for (int e = 0; e < 4; ++e) r.m[4 * k + e] = r.v[4 * k + e] = r.x[4 * k + e] = 0.0f;
      if (128 * k + 4 * lane < n) lane8_apply<kAms>(sc, t, off, n, k, 128 * k + 4 * lane, tab, ms, vs, xs, in[k], r, mx);
    }
  } else {
OPTSTATE_UNROLL
    for (int k = 0; k < kGroups8; ++k) {
      const int i0 = 128 * k + 4 * lane;
      for (int e = 0; e < 4; ++e) r.m[4 * k + e] = r.v[4 * k + e] = r.x[4 * k + e] = 0.0f;
      if (i0 >= n) continue;
      Lane8In in;
      lane8_load<kAms>(t, off, n, i0, in);
      lane8_apply<kAms>(sc, t, off, n, k, i0, tab, ms, vs, xs, in, r, mx);
    }
  }
}

template <bool kAms, bool kFastDiv>
OPTSTATE_HD void lane8_store_codes(const AdamW8bitTensor& t, int64_t off, int n, int lane, const Tables8& tab,
                                   const Lane8& r, const Recip& dm, const Recip& dv, const Recip& dx) {
OPTSTATE_UNROLL
  for (int k = 0; k < kGroups8; ++k) {
    const int i0 = 128 * k + 4 * lane;
    if (i0 >= n) continue;
    uint32_t mc = 0, vc = 0, xc = 0;
OPTSTATE_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int j = 4 * k + e;
      const float qm = kFastDiv ? div_fast(r.m[j], dm) : r.m[j] / dm.d;
      const float qv = kFastDiv ? div_fast(r.v[j], dv) : r.v[j] / dv.d;
      mc |= uint32_t{quantize_signed(qm, tab)} << (8 * e);
      vc |= uint32_t{quantize_unsigned(qv, tab)} << (8 * e);
      if (kAms) {
        const float qx = kFastDiv ? div_fast(r.x[j], dx) : r.x[j] / dx.d;
        xc |= uint32_t{quantize_unsigned(qx, tab)} << (8 * e);
      }
    }
    if (i0 + 4 <= n) {
      store_codes4(t.m_codes + off + i0, mc);
      store_codes4(t.v_codes + off + i0, vc);
      if (kAms) store_codes4(t.vmax_codes + off + i0, xc);
    } else {
      for (int e = 0; e < 4 && i0 + e < n; ++e) {
        t.m_codes[off + i0 + e] = static_cast<uint8_t>(mc >> (8 * e));
        t.v_codes[off + i0 + e] = static_cast<uint8_t>(vc >> (8 * e));
        if (kAms) t.vmax_codes[off + i0 + e] = static_cast<uint8_t>(xc >> (8 * e));
      }
    }
  }
}

// The codes of a lane's moments given the block's new scales (a branch per block, uniform in the warp).
template <bool kAms>
OPTSTATE_HD void lane8_store(const AdamW8bitTensor& t, int64_t b, int lane, const Tables8& tab, const Lane8& r,
                             float nm, float nv, float nx) {
  const int64_t off = b * t.block;
  const int n = static_cast<int>(t.block < t.numel - off ? t.block : t.numel - off);
  const Recip dm = recip(nm), dv = recip(nv), dx = recip(kAms ? nx : 1.0f);
  if (dm.ok && dv.ok && dx.ok)
    lane8_store_codes<kAms, true>(t, off, n, lane, tab, r, dm, dv, dx);
  else
    lane8_store_codes<kAms, false>(t, off, n, lane, tab, r, dm, dv, dx);
}

// The block's new scales, by one lane once every lane has read the old ones (a __syncwarp before).
template <bool kAms>
OPTSTATE_HD void store_absmax(const AdamW8bitTensor& t, int64_t b, float nm, float nv, float nx) {
  t.m_absmax[b] = nm;
  t.v_absmax[b] = nv;
  if (kAms) t.vmax_absmax[b] = nx;
}

// Two-pass path (any block size or alignment): lane l owns elements l, l + 32, ...; the first pass
// only finds the new absmax, the second computes the same update again and writes everything. The
// update is deterministic and reads nothing the first pass wrote, so both passes agree bit for bit.
template <bool kAms, bool kWrite>
OPTSTATE_HD void lane8_pass(const Scalars8& sc, const AdamW8bitTensor& t, int64_t b, int lane, const Tables8& tab,
                            Max8& mx, float nm, float nv, float nx) {
  const int64_t off = b * t.block;
  const int64_t n = t.block < t.numel - off ? t.block : t.numel - off;
  const float ms = t.m_absmax[b], vs = t.v_absmax[b];
  const float xs = kAms ? t.vmax_absmax[b] : 0.0f;
  for (int64_t i = off + lane; i < off + n; i += 32) {
    float m = tab.smap[t.m_codes[i]] * ms;
    float v = tab.umap[t.v_codes[i]] * vs;
    float x = kAms ? tab.umap[t.vmax_codes[i]] * xs : 0.0f;
    float p = load_value(t.param, i, t.kind);
    update8(sc, p, load_value(t.grad, i, t.kind), m, v, &x);
    if (!kWrite) {
      track(mx, m, v, x);
      continue;
    }
    store_value(t.param, i, p, t.kind);
    t.m_codes[i] = quantize_signed(m / nm, tab);
    t.v_codes[i] = quantize_unsigned(v / nv, tab);
    if (kAms) t.vmax_codes[i] = quantize_unsigned(x / nx, tab);
  }
}

}  // namespace optstate::optim::cuda::body
