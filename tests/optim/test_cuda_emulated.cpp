// The CUDA kernels' bodies (optim/cuda/optim_cuda_body.h) run on the host: every thread of every
// work item, and for 8-bit state every lane of every warp with the warp's max reduction between the
// lanes' two phases, as the kernels in optim_cuda.cu call them. Results equal the CPU kernels bit for
// bit, so the work lists, the vector and scalar paths, partial blocks, the two-pass path for other
// block sizes, the step counters and the bucket quantizer are checked without a GPU. (Threads and
// lanes touch disjoint elements and read the old block scales before any lane writes new ones, so
// running them one after another gives what any GPU schedule gives.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "adamw8bit_kernel.h"
#include "adamw_kernel.h"
#include "cuda/optim_cuda_body.h"
#include "optstate/dtype.h"
#include "optstate/quant8.h"
#include "test_random.h"

using namespace optstate;
using namespace optstate::optim;
namespace cb = optstate::optim::cuda::body;
namespace cm = optstate::optim::cuda::math;

namespace {

using test::randn;

// A param (+ grad) buffer of either dtype, `shift` elements past a 64-byte boundary (shift 1: no
// vector access), holding `values`.
struct Buf {
  std::vector<unsigned char> bytes;
  void* ptr = nullptr;
  Buf(const std::vector<float>& values, bool bf16, int shift) {
    const size_t es = bf16 ? 2 : 4;
    bytes.resize(values.size() * es + 128);
    auto base = reinterpret_cast<uintptr_t>(bytes.data());
    ptr = reinterpret_cast<void*>(((base + 63) & ~uintptr_t{63}) + shift * es);
    for (size_t i = 0; i < values.size(); ++i) {
      if (bf16) {
        const uint16_t h = f32_to_bf16(values[i]);
        std::memcpy(static_cast<char*>(ptr) + 2 * i, &h, 2);
      } else {
        std::memcpy(static_cast<char*>(ptr) + 4 * i, &values[i], 4);
      }
    }
  }
  Buf(const Buf& o, size_t n, bool bf16, int shift) : Buf(std::vector<float>(n), bf16, shift) {
    std::memcpy(ptr, o.ptr, n * (bf16 ? 2 : 4));
  }
};

const cb::Tables8& tables8() {
  static const std::unique_ptr<cb::Tables8> t = [] {
    auto p = std::make_unique<cb::Tables8>();
    const Quantizer& s = Quantizer::get(QMap::kDynamicSigned);
    const Quantizer& u = Quantizer::get(QMap::kDynamicUnsigned);
    REQUIRE(cb::build_tables8(s.map(), u.map(), s.entries(), bucket_entries(s.layout()), u.entries(),
                              bucket_entries(u.layout()), *p));
    return p;
  }();
  return *t;
}

// What prepare_adamw + adamw_kernel (groups 1) or adamw_kernel_g2 (groups 2) do, one thread after another.
void emulate_adamw(std::vector<cuda::AdamWTensor> ts, const cuda::Hyper& h, int64_t chunk, int groups) {
  const std::vector<cb::Work> work = cb::adamw_work(ts, chunk);
  std::vector<cm::AdamWScalars> sc;
  for (auto& t : ts) {
    *t.step += 1.0f;
    sc.push_back(cm::adamw_scalars(h, *t.step));
  }
  for (const cb::Work& w : work)
    for (int th = 0; th < cb::kThreads; ++th) {
      if (groups == 2)
        cb::adamw_thread<2>(sc[w.tensor], ts[w.tensor], w.begin, w.end, th, cb::kThreads);
      else
        cb::adamw_thread<1>(sc[w.tensor], ts[w.tensor], w.begin, w.end, th, cb::kThreads);
    }
}

// What prepare_adamw8bit + adamw8bit_kernel<kAms> (or, kPreload, adamw8bit_kernel_p<kAms>) do: warps
// in turn, lanes in turn within a phase.
template <bool kAms, bool kPreload>
void emulate_8bit(std::vector<cuda::AdamW8bitTensor> ts, const cuda::Hyper& h, int64_t chunk) {
  const std::vector<cb::Work> work = cb::adamw8bit_work(ts, chunk);
  std::vector<cm::Scalars8> sc;
  for (auto& t : ts) {
    *t.step += 1.0f;
    sc.push_back(cm::scalars8(h, *t.step));
  }
  const cb::Tables8& tab = tables8();
  for (const cb::Work& w : work) {
    const cuda::AdamW8bitTensor& t = ts[w.tensor];
    if (t.block == 0) {
      for (int th = 0; th < cb::kThreads; ++th) cb::dense8_thread(sc[w.tensor], t, w.begin, w.end, th, cb::kThreads);
      continue;
    }
    for (int warp = 0; warp < cb::kWarps; ++warp)
      for (int64_t b = w.begin + warp; b < w.end; b += cb::kWarps) {
        cb::Max8 mx[32];
        cb::Lane8 r[32];
        for (int lane = 0; lane < 32; ++lane) {
          if (t.fast)
            cb::lane8_update<kAms, kPreload>(sc[w.tensor], t, b, lane, tab, r[lane], mx[lane]);
          else
            cb::lane8_pass<kAms, false>(sc[w.tensor], t, b, lane, tab, mx[lane], 0, 0, 0);
        }
        cb::Max8 all;
        for (const cb::Max8& m : mx) cb::track(all, cm::bits_float(m.m), cm::bits_float(m.v), cm::bits_float(m.x));
        const float nm = cm::scale_from_bits(all.m), nv = cm::scale_from_bits(all.v);
        const float nx = kAms ? cm::scale_from_bits(all.x) : 0.0f;
        for (int lane = 0; lane < 32; ++lane) {
          if (t.fast)
            cb::lane8_store<kAms>(t, b, lane, tab, r[lane], nm, nv, nx);
          else
            cb::lane8_pass<kAms, true>(sc[w.tensor], t, b, lane, tab, mx[lane], nm, nv, nx);
        }
        cb::store_absmax<kAms>(t, b, nm, nv, nx);
      }
  }
}

bool same_bytes(const void* a, const void* b, size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

}  // namespace

TEST_CASE("CUDA quantizer (shared-memory copy of the bucket tables) == reference at every threshold, bucket edge, stride") {
  const cb::Tables8& tab = tables8();
  for (QMap m : {QMap::kDynamicSigned, QMap::kDynamicUnsigned}) {
    CAPTURE(static_cast<int>(m));
    const Quantizer& q = Quantizer::get(m);
    const bool is_signed = m == QMap::kDynamicSigned;
    const BucketLayout layout = bucket_layout(is_signed);
    auto device_code = [&](float x) { return is_signed ? cb::quantize_signed(x, tab) : cb::quantize_unsigned(x, tab); };
    int64_t checked = 0, wrong = 0;
    auto check = [&](float x) {
      ++checked;
      const uint8_t want = quantize_scaled_reference(x, q.map());
      if (device_code(x) != want || q(x) != want) ++wrong;
    };
    for (int c = 0; c < 255; ++c) {  // both sides of every threshold
      float x = q.thresholds()[c];
      for (int k = 0; k < 4; ++k) x = std::nextafter(x, -2.0f);
      for (int k = 0; k < 9; ++k, x = std::nextafter(x, 2.0f)) check(x);
    }
    for (uint32_t sign : {0u, 0x80000000u})  // every bucket's first and last magnitude, up to 2
      for (uint32_t k = 0; k <= layout.first + layout.count; ++k) {
        const uint32_t first = k << layout.shift;
        check(cm::bits_float(sign | first));
        if (first) check(cm::bits_float(sign | (first - 1)));
      }
    for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 1e30f, -1e30f, std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(), 1e-12f, -1e-12f})
      check(x);
    for (uint32_t bits = 0; bits <= 0x3f800000u; bits += 9973) {  // every 9973rd magnitude, both signs
      check(cm::bits_float(bits));
      check(cm::bits_float(bits | 0x80000000u));
    }
    CHECK(device_code(std::numeric_limits<float>::quiet_NaN()) == 0);
    CHECK(device_code(-std::numeric_limits<float>::quiet_NaN()) == 0);
    CHECK(checked > 200000);
    CHECK(wrong == 0);
  }
  // entries of another layout (here: one short) are refused, not copied short
  const Quantizer& s = Quantizer::get(QMap::kDynamicSigned);
  const Quantizer& u = Quantizer::get(QMap::kDynamicUnsigned);
  auto scratch = std::make_unique<cb::Tables8>();
  CHECK_FALSE(cb::build_tables8(s.map(), u.map(), s.entries(), bucket_entries(s.layout()) - 1, u.entries(),
                                bucket_entries(u.layout()), *scratch));
  CHECK_FALSE(cb::build_tables8(s.map(), u.map(), s.entries(), bucket_entries(s.layout()), u.entries(),
                                bucket_entries(u.layout()) - 1, *scratch));
}

TEST_CASE("CUDA FusedAdamW kernel body, emulated thread by thread == CPU kernel bit for bit") {
  const std::vector<int64_t> sizes{1, 3, 1037, 4096, 70001, 5};
  for (int64_t chunk : {int64_t{1024}, cuda::kDefaultChunk})
    for (int bf16 = 0; bf16 < 2; ++bf16)
      for (int ams = 0; ams < 2; ++ams)
        for (int variant = 0; variant < 4; ++variant) {
          const int maxi = variant & 1, groups = 1 + (variant >> 1);  // groups: adamw_kernel or _g2
          CAPTURE(groups);
          CAPTURE(chunk);
          CAPTURE(bf16);
          CAPTURE(ams);
          CAPTURE(maxi);
          const AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, ams != 0, maxi != 0};
          const cuda::Hyper dh{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, ams, maxi};
          const cuda::Param kind = bf16 ? cuda::Param::kBF16 : cuda::Param::kF32;
          struct T {
            std::unique_ptr<Buf> p_cpu, p_gpu;
            std::vector<float> m, v, x, m2, v2, x2;
            float step = 0;
          };
          std::vector<T> ts(sizes.size());
          for (size_t k = 0; k < sizes.size(); ++k) {
            const auto n = static_cast<size_t>(sizes[k]);
            const int shift = k == 3 ? 1 : 0;  // one tensor that allows no vector access
            ts[k].p_cpu = std::make_unique<Buf>(randn(n, 1.0f, 1 + k), bf16 != 0, 0);
            ts[k].p_gpu = std::make_unique<Buf>(randn(n, 1.0f, 1 + k), bf16 != 0, shift);
            ts[k].m = randn(n, 1e-2f, 50 + k);
            ts[k].v = randn(n, 1e-3f, 60 + k);
            for (auto& y : ts[k].v) y *= y;
            ts[k].x = ts[k].v;
            ts[k].m2 = ts[k].m, ts[k].v2 = ts[k].v, ts[k].x2 = ts[k].x;
          }
          for (int step = 1; step <= 3; ++step) {
            std::vector<AdamWTensor> cpu;
            std::vector<cuda::AdamWTensor> gpu;
            std::vector<std::unique_ptr<Buf>> grads;
            for (size_t k = 0; k < sizes.size(); ++k) {
              T& t = ts[k];
              const int64_t n = sizes[k];
              grads.push_back(std::make_unique<Buf>(randn(n, 0.1f, 100 * step + k), bf16 != 0, 0));
              const Buf& g = *grads.back();
              grads.push_back(std::make_unique<Buf>(g, n, bf16 != 0, k == 3 ? 1 : 0));
              const Buf& g2 = *grads.back();
              AdamWTensor c{};
              c.param = t.p_cpu->ptr;
              c.grad = g.ptr;
              c.exp_avg = t.m.data();
              c.exp_avg_sq = t.v.data();
              c.max_exp_avg_sq = ams ? t.x.data() : nullptr;
              c.numel = n;
              c.kind = bf16 ? ParamKind::kBF16 : ParamKind::kF32;
              c.s = adamw_step_scalars(h, step);
              cpu.push_back(c);
              cuda::AdamWTensor d{};
              d.param = t.p_gpu->ptr;
              d.grad = g2.ptr;
              d.exp_avg = t.m2.data();
              d.exp_avg_sq = t.v2.data();
              d.max_exp_avg_sq = ams ? t.x2.data() : nullptr;
              d.step = &t.step;
              d.numel = n;
              d.kind = kind;
              gpu.push_back(d);
            }
            adamw_cpu(cpu, CpuIsa::kGeneric);
            emulate_adamw(gpu, dh, chunk, groups);
          }
          for (size_t k = 0; k < sizes.size(); ++k) {
            CAPTURE(k);
            const T& t = ts[k];
            const size_t n = static_cast<size_t>(sizes[k]);
            CHECK(t.step == 3.0f);
            // p_cpu and p_gpu started from the same values (same seed)
            CHECK(same_bytes(t.p_cpu->ptr, t.p_gpu->ptr, n * (bf16 ? 2 : 4)));
            CHECK(same_bytes(t.m.data(), t.m2.data(), n * 4));
            CHECK(same_bytes(t.v.data(), t.v2.data(), n * 4));
            if (ams) CHECK(same_bytes(t.x.data(), t.x2.data(), n * 4));
          }
        }
}

TEST_CASE("CUDA AdamW8bit kernel body, emulated lane by lane == CPU kernel bit for bit") {
  // (numel, block): register path (64, 256, partial last blocks and groups), two-pass path (102:
  // not a multiple of 4; 512: above 256; a misaligned param), dense state (block 0).
  struct Shape {
    int64_t numel, block;
    int shift;
  };
  const std::vector<Shape> shapes{{5000, 256, 0}, {1030, 64, 0}, {130, 256, 0}, {3, 256, 0},   {777, 102, 0},
                                  {3000, 512, 0}, {600, 256, 1}, {4095, 0, 0},  {70000, 256, 0}};
  for (int64_t chunk : {int64_t{1024}, cuda::kDefaultChunk})
    for (int bf16 = 0; bf16 < 2; ++bf16)
      for (int variant = 0; variant < 4; ++variant) {
        const int ams = variant & 1;
        const bool preload = variant >> 1;  // adamw8bit_kernel or adamw8bit_kernel_p
        CAPTURE(chunk);
        CAPTURE(bf16);
        CAPTURE(ams);
        CAPTURE(preload);
        const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, ams != 0, false};
        const cuda::Hyper dh{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, ams, 0};
        const cuda::Param kind = bf16 ? cuda::Param::kBF16 : cuda::Param::kF32;
        struct T {
          std::unique_ptr<Buf> p_cpu, p_gpu;
          std::vector<uint8_t> mc, vc, xc, mc2, vc2, xc2;
          std::vector<float> ma, va, xa, ma2, va2, xa2, m, v, x, m2, v2, x2;
          float step = 0;
        };
        std::vector<T> ts(shapes.size());
        for (size_t k = 0; k < shapes.size(); ++k) {
          T& t = ts[k];
          const auto n = static_cast<size_t>(shapes[k].numel);
          const int64_t block = shapes[k].block;
          t.p_cpu = std::make_unique<Buf>(randn(n, 1.0f, 7 + k), bf16 != 0, 0);
          t.p_gpu = std::make_unique<Buf>(randn(n, 1.0f, 7 + k), bf16 != 0, shapes[k].shift);
          auto m0 = randn(n, 1e-2f, 30 + k), v0 = randn(n, 1e-3f, 40 + k);
          for (auto& y : v0) y *= y;
          if (block == 0) {
            t.m = m0, t.v = v0, t.x = v0;
          } else {
            const size_t nb = (n + block - 1) / block;
            t.mc.resize(n), t.vc.resize(n), t.xc.resize(n), t.ma.resize(nb), t.va.resize(nb), t.xa.resize(nb);
            quantize_blockwise(m0, block, QMap::kDynamicSigned, t.mc, t.ma);
            quantize_blockwise(v0, block, QMap::kDynamicUnsigned, t.vc, t.va);
            quantize_blockwise(v0, block, QMap::kDynamicUnsigned, t.xc, t.xa);
          }
          t.mc2 = t.mc, t.vc2 = t.vc, t.xc2 = t.xc, t.ma2 = t.ma, t.va2 = t.va, t.xa2 = t.xa;
          t.m2 = t.m, t.v2 = t.v, t.x2 = t.x;
        }
        for (int step = 1; step <= 3; ++step) {
          std::vector<AdamW8bitTensor> cpu;
          std::vector<cuda::AdamW8bitTensor> gpu;
          std::vector<std::unique_ptr<Buf>> grads;
          for (size_t k = 0; k < shapes.size(); ++k) {
            T& t = ts[k];
            const int64_t n = shapes[k].numel, block = shapes[k].block;
            std::vector<float> g = randn(static_cast<size_t>(n), 0.1f, 1000 * step + k);
            if (step == 2 && k == 0) g[5] = std::numeric_limits<float>::quiet_NaN();  // a NaN block: codes 0
            grads.push_back(std::make_unique<Buf>(g, bf16 != 0, 0));
            const void* gp = grads.back()->ptr;
            grads.push_back(std::make_unique<Buf>(g, bf16 != 0, shapes[k].shift));
            const void* gp2 = grads.back()->ptr;
            AdamW8bitTensor c{};
            c.param = t.p_cpu->ptr;
            c.grad = gp;
            c.kind = bf16 ? ParamKind::kBF16 : ParamKind::kF32;
            c.numel = n;
            c.block = block;
            c.s = adamw8bit_step_scalars(h, static_cast<float>(step));
            cuda::AdamW8bitTensor d{};
            d.param = t.p_gpu->ptr;
            d.grad = gp2;
            d.kind = kind;
            d.numel = n;
            d.block = block;
            d.step = &t.step;
            if (block > 0) {
              c.m_codes = t.mc.data(), c.v_codes = t.vc.data(), c.vmax_codes = ams ? t.xc.data() : nullptr;
              c.m_absmax = t.ma.data(), c.v_absmax = t.va.data(), c.vmax_absmax = ams ? t.xa.data() : nullptr;
              d.m_codes = t.mc2.data(), d.v_codes = t.vc2.data(), d.vmax_codes = ams ? t.xc2.data() : nullptr;
              d.m_absmax = t.ma2.data(), d.v_absmax = t.va2.data(), d.vmax_absmax = ams ? t.xa2.data() : nullptr;
            } else {
              c.m = t.m.data(), c.v = t.v.data(), c.vmax = ams ? t.x.data() : nullptr;
              d.m = t.m2.data(), d.v = t.v2.data(), d.vmax = ams ? t.x2.data() : nullptr;
            }
            cpu.push_back(c);
            gpu.push_back(d);
          }
          adamw8bit_cpu(cpu, CpuIsa::kGeneric);
          if (ams)
            preload ? emulate_8bit<true, true>(gpu, dh, chunk) : emulate_8bit<true, false>(gpu, dh, chunk);
          else
            preload ? emulate_8bit<false, true>(gpu, dh, chunk) : emulate_8bit<false, false>(gpu, dh, chunk);
        }
        // The flags the work list set: the register path where the shape and alignment allow it.
        std::vector<cuda::AdamW8bitTensor> probe(shapes.size());
        for (size_t k = 0; k < shapes.size(); ++k) {
          probe[k] = {};
          probe[k].param = ts[k].p_gpu->ptr;
          probe[k].grad = ts[k].p_gpu->ptr;
          probe[k].m_codes = probe[k].v_codes = ts[k].mc2.data();
          probe[k].kind = kind;
          probe[k].numel = shapes[k].numel;
          probe[k].block = shapes[k].block;
        }
        cb::adamw8bit_work(probe, chunk);
        const std::vector<int> fast{1, 1, 1, 1, 0, 0, 0, 0, 1};
        for (size_t k = 0; k < shapes.size(); ++k) CHECK(int{probe[k].fast} == fast[k]);
        for (size_t k = 0; k < shapes.size(); ++k) {
          CAPTURE(k);
          const T& t = ts[k];
          const auto n = static_cast<size_t>(shapes[k].numel);
          CHECK(t.step == 3.0f);
          CHECK(same_bytes(t.p_cpu->ptr, t.p_gpu->ptr, n * (bf16 ? 2 : 4)));
          CHECK(t.mc == t.mc2);
          CHECK(t.vc == t.vc2);
          CHECK(same_bytes(t.ma.data(), t.ma2.data(), t.ma.size() * 4));
          CHECK(same_bytes(t.va.data(), t.va2.data(), t.va.size() * 4));
          CHECK(same_bytes(t.m.data(), t.m2.data(), t.m.size() * 4));
          CHECK(same_bytes(t.v.data(), t.v2.data(), t.v.size() * 4));
          if (ams) {
            CHECK(t.xc == t.xc2);
            CHECK(same_bytes(t.xa.data(), t.xa2.data(), t.xa.size() * 4));
            CHECK(same_bytes(t.x.data(), t.x2.data(), t.x.size() * 4));
          }
        }
        // The NaN gradient of step 2 made block 0 of tensor 0 a NaN block (scale NaN, codes 0), on both sides.
        CHECK(std::isnan(ts[0].ma[0]));
        CHECK(std::all_of(ts[0].mc.begin(), ts[0].mc.begin() + 256, [](uint8_t c) { return c == 0; }));
        CHECK(!std::isnan(ts[0].ma[1]));
      }
}

TEST_CASE("set_grads' descriptor write changes each descriptor's grad pointer and nothing else") {
  auto check = [](auto& descriptors, bool eight) {
    using D = typename std::remove_reference_t<decltype(descriptors)>::value_type;
    const size_t bytes = descriptors.size() * sizeof(D);
    std::vector<char> expect(bytes);
    std::memcpy(expect.data(), descriptors.data(), bytes);
    std::vector<int> grads(descriptors.size());
    for (size_t i = 0; i < descriptors.size(); ++i) {
      cb::put_grad(reinterpret_cast<char*>(descriptors.data()), cb::grad_field(eight), i, &grads[i]);
      const void* g = &grads[i];
      std::memcpy(expect.data() + i * sizeof(D) + offsetof(D, grad), &g, sizeof g);
    }
    for (size_t i = 0; i < descriptors.size(); ++i) CHECK(descriptors[i].grad == &grads[i]);
    CHECK(std::memcmp(expect.data(), descriptors.data(), bytes) == 0);
  };
  std::vector<cuda::AdamWTensor> dense(3);
  std::vector<cuda::AdamW8bitTensor> eight(3);
  // Every byte set (so a write to the wrong field shows), the grad pointers distinct from the new ones.
  std::memset(dense.data(), 0x5a, dense.size() * sizeof dense[0]);
  std::memset(eight.data(), 0xa5, eight.size() * sizeof eight[0]);
  check(dense, false);
  check(eight, true);
}
