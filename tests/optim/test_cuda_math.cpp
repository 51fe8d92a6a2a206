// The CUDA kernels' element math (optim/cuda/optim_cuda_math.h), compiled here for the host, gives
// the CPU kernels' bits: same inputs, same step scalars, every param, moment, code and absmax equal.
// This proves the operation order on any machine; the GPU check then only has to show the device
// computes what the host does (IEEE ops, no contraction: -fmad=false).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "adamw8bit_kernel.h"
#include "adamw_kernel.h"
#include "cuda/optim_cuda_math.h"
#include "optstate/dtype.h"
#include "optstate/quant8.h"
#include "test_random.h"

using namespace optstate;
using namespace optstate::optim;
namespace cm = optstate::optim::cuda::math;

namespace {

using test::randn;

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

}  // namespace

TEST_CASE("CUDA FusedAdamW math == CPU kernel, bit for bit (fp32/bf16, amsgrad, maximize, 3 steps)") {
  const int64_t n = 1037;
  for (int bf16 = 0; bf16 < 2; ++bf16)
    for (int ams = 0; ams < 2; ++ams)
      for (int maxi = 0; maxi < 2; ++maxi) {
        CAPTURE(bf16);
        CAPTURE(ams);
        CAPTURE(maxi);
        const AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, ams != 0, maxi != 0};
        const cuda::Hyper dh{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, ams, maxi};
        auto p32 = randn(n, 1.0f, 1), m = randn(n, 1e-2f, 2), v = randn(n, 1e-3f, 3);
        for (auto& x : v) x = x * x;
        std::vector<float> mx = v;
        auto pb = to_bf16(p32);
        auto p32b = p32;
        auto pbb = pb;
        auto mb = m, vb = v, mxb = mx;
        for (int step = 1; step <= 3; ++step) {
          auto g32 = randn(n, 0.1f, 10 + step);
          auto gb = to_bf16(g32);
          AdamWTensor t{};
          t.param = bf16 ? static_cast<void*>(pb.data()) : p32.data();
          t.grad = bf16 ? static_cast<const void*>(gb.data()) : g32.data();
          t.exp_avg = m.data();
          t.exp_avg_sq = v.data();
          t.max_exp_avg_sq = mx.data();
          t.numel = n;
          t.kind = bf16 ? ParamKind::kBF16 : ParamKind::kF32;
          t.s = adamw_step_scalars(h, step);
          adamw_cpu(std::span(&t, 1), CpuIsa::kGeneric);
          const cm::AdamWScalars s = cm::adamw_scalars(dh, static_cast<float>(step));
          const cuda::Param kind = bf16 ? cuda::Param::kBF16 : cuda::Param::kF32;
          void* pp = bf16 ? static_cast<void*>(pbb.data()) : p32b.data();
          for (int64_t i = 0; i < n; ++i) {
            float p = cm::load_value(pp, i, kind);
            const float g = cm::load_value(t.grad, i, kind);
            cm::adamw_element(s, p, g, mb[i], vb[i], &mxb[i]);
            cm::store_value(pp, i, p, kind);
          }
        }
        CHECK(std::memcmp(m.data(), mb.data(), n * 4) == 0);
        CHECK(std::memcmp(v.data(), vb.data(), n * 4) == 0);
        if (ams) CHECK(std::memcmp(mx.data(), mxb.data(), n * 4) == 0);
        if (bf16) CHECK(std::memcmp(pb.data(), pbb.data(), n * 2) == 0);
        else CHECK(std::memcmp(p32.data(), p32b.data(), n * 4) == 0);
      }
}

TEST_CASE("CUDA AdamW8bit math == CPU kernel, bit for bit (blocks of 64 and 256, partial last block, amsgrad)") {
  const int64_t n = 5000;
  const float* smap = qmap_table(QMap::kDynamicSigned).data();
  const float* umap = qmap_table(QMap::kDynamicUnsigned).data();
  for (int64_t block : {int64_t{64}, int64_t{256}})
    for (int ams = 0; ams < 2; ++ams) {
      CAPTURE(block);
      CAPTURE(ams);
      const int64_t nb = (n + block - 1) / block;
      const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, ams != 0, false};
      const cuda::Hyper dh{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, ams, 0};
      // State from quantizing real moments, as after a few steps.
      auto m0 = randn(n, 1e-2f, 4), v0 = randn(n, 1e-3f, 5);
      for (auto& x : v0) x = x * x;
      std::vector<uint8_t> mc(n), vc(n), xc(n);
      std::vector<float> ma(nb), va(nb), xa(nb);
      quantize_blockwise(m0, block, QMap::kDynamicSigned, mc, ma);
      quantize_blockwise(v0, block, QMap::kDynamicUnsigned, vc, va);
      quantize_blockwise(v0, block, QMap::kDynamicUnsigned, xc, xa);
      auto p = randn(n, 1.0f, 6);
      auto mc2 = mc, vc2 = vc, xc2 = xc;
      auto ma2 = ma, va2 = va, xa2 = xa;
      auto p2 = p;
      for (int step = 1; step <= 3; ++step) {
        auto g = randn(n, 0.1f, 20 + step);
        AdamW8bitTensor t{};
        t.param = p.data();
        t.grad = g.data();
        t.kind = ParamKind::kF32;
        t.numel = n;
        t.block = block;
        t.m_codes = mc.data();
        t.v_codes = vc.data();
        t.vmax_codes = xc.data();
        t.m_absmax = ma.data();
        t.v_absmax = va.data();
        t.vmax_absmax = xa.data();
        t.s = adamw8bit_step_scalars(h, static_cast<float>(step));
        adamw8bit_cpu(std::span(&t, 1), CpuIsa::kGeneric);
        // The kernel's per-block sequence, on the host.
        const cm::Scalars8 s = cm::scalars8(dh, static_cast<float>(step));
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t off = b * block, len = std::min(block, n - off);
          std::vector<float> M(len), V(len), X(len);
          uint32_t mm = 0, vm = 0, xm = 0;
          for (int64_t i = 0; i < len; ++i) {
            float mi = smap[mc2[off + i]] * ma2[b], vi = umap[vc2[off + i]] * va2[b];
            float xi = ams ? umap[xc2[off + i]] * xa2[b] : 0.0f;
            float pi = p2[off + i];
            cm::update8(s, pi, g[off + i], mi, vi, &xi);
            p2[off + i] = pi;
            M[i] = mi;
            V[i] = vi;
            X[i] = xi;
            mm = std::max(mm, cm::float_bits(mi) & 0x7fffffffu);
            vm = std::max(vm, cm::float_bits(vi) & 0x7fffffffu);
            xm = std::max(xm, cm::float_bits(xi) & 0x7fffffffu);
          }
          const float nm = cm::scale_from_bits(mm), nv = cm::scale_from_bits(vm), nx = cm::scale_from_bits(xm);
          for (int64_t i = 0; i < len; ++i) {
            mc2[off + i] = cm::quantize(M[i] / nm, smap);
            vc2[off + i] = cm::quantize(V[i] / nv, umap);
            if (ams) xc2[off + i] = cm::quantize(X[i] / nx, umap);
          }
          ma2[b] = nm;
          va2[b] = nv;
          if (ams) xa2[b] = nx;
        }
      }
      CHECK(mc == mc2);
      CHECK(vc == vc2);
      CHECK(std::memcmp(ma.data(), ma2.data(), nb * 4) == 0);
      CHECK(std::memcmp(va.data(), va2.data(), nb * 4) == 0);
      if (ams) {
        CHECK(xc == xc2);
        CHECK(std::memcmp(xa.data(), xa2.data(), nb * 4) == 0);
      }
      CHECK(std::memcmp(p.data(), p2.data(), n * 4) == 0);
    }
}

// The bias corrections are the only step-dependent inputs, and a one-ulp difference in one changes
// every element's update. Both kernels' scalars are compared over every step a run reaches early
// and a stride through long runs, at the betas people use; glibc's powf (what std::pow(float,
// float) calls) misrounds some of them (beta 0.9 first at step 685, 0.999 at 873), so its result is
// not a definition the device can reproduce.
TEST_CASE("Step scalars: the CPU kernels' == the CUDA kernels' (host compile), steps 1..100000 and a stride to 2^24; "
          "beta^t correctly rounded") {
  std::vector<int64_t> steps;
  for (int64_t t = 1; t <= 100000; ++t) steps.push_back(t);
  for (int64_t t = 100001; t <= (int64_t{1} << 24); t += 997) steps.push_back(t);
  int64_t checked = 0;
  for (const double b1 : {0.8, 0.9, 0.95})
    for (const double b2 : {0.95, 0.99, 0.999, 0.9999}) {
      CAPTURE(b1);
      CAPTURE(b2);
      const AdamWHyper h{3e-4, b1, b2, 1e-8, 0.1, false, false};
      const cuda::Hyper dh{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, 0, 0};
      int64_t bad8 = 0, bad32 = 0, bad_cr = 0, first8 = 0, first32 = 0, first_cr = 0;
      for (const int64_t t : steps) {
        const float step = static_cast<float>(t);
        const AdamW8bitScalars c = adamw8bit_step_scalars(h, step);
        const cm::Scalars8 d = cm::scalars8(dh, step);
        if (t <= 100000) {  // beta^t correctly rounded: against the 80-bit power rounded to fp32
          const auto cr = [&](double b) {
            const auto base = static_cast<long double>(static_cast<float>(b));
            return static_cast<float>(std::pow(base, static_cast<long double>(t)));
          };
          if (c.bc1 != 1.0f - cr(b1) || c.bc2_sqrt != std::sqrt(1.0f - cr(b2))) first_cr = bad_cr++ ? first_cr : t;
        }
        if (std::memcmp(&c.bc1, &d.bc1, 4) || std::memcmp(&c.bc2_sqrt, &d.bc2_sqrt, 4) || c.lr != d.lr ||
            c.lr_wd != d.lr_wd || c.w1 != d.w1 || c.w2 != d.w2 || c.eps != d.eps)
          first8 = bad8++ ? first8 : t;
        const AdamWStepScalars e = adamw_step_scalars(h, t);
        const cm::AdamWScalars f = cm::adamw_scalars(dh, step);
        if (std::memcmp(&e.neg_step_size, &f.neg_step_size, 4) || std::memcmp(&e.bc2_sqrt, &f.bc2_sqrt, 4) ||
            e.decay != f.decay || e.lerp_weight != f.lerp_weight || e.beta2 != f.beta2 ||
            e.one_minus_b2 != f.one_minus_b2 || e.eps != f.eps)
          first32 = bad32++ ? first32 : t;
        ++checked;
      }
      CHECK_MESSAGE(bad_cr == 0, "AdamW8bit: ", bad_cr, " steps not correctly rounded, the first ", first_cr);
      CHECK_MESSAGE(bad8 == 0, "AdamW8bit: ", bad8, " steps differ, the first ", first8);
      CHECK_MESSAGE(bad32 == 0, "FusedAdamW: ", bad32, " steps differ, the first ", first32);
    }
  MESSAGE(checked, " (betas, step) pairs compared");
}

TEST_CASE("Quantization's fast division: exact quotients where codes depend on them, the division's codes everywhere") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> mant(0, (1u << 23) - 1);
  std::vector<float> divisors{1.0f, std::nextafter(1.0f, 0.0f), std::nextafter(1.0f, 2.0f), 1.9999999f, 1.5f,
                              1e-12f, 3.0f, 0.1f, 0x1p45f};
  for (int i = 0; i < 4; ++i) divisors.push_back(cm::bits_float((static_cast<uint32_t>(88 + 20 * i) << 23) | mant(rng)));
  int64_t wrong = 0, checked = 0;
  for (float d : divisors) {  // every mantissa of x in [d/2, d) and [d/2^20, d/2^19): quotients' bits depend on mantissas
    const cm::Recip k = cm::recip(d);
    REQUIRE(k.ok);
    for (int shift : {1, 20})
      for (uint32_t m = 0; m < (1u << 23); ++m) {
        const float x = std::ldexp(cm::bits_float(0x3f800000u | m), std::ilogb(d) - shift);
        wrong += cm::float_bits(cm::div_fast(x, k)) != cm::float_bits(x / d);
        wrong += cm::float_bits(cm::div_fast(-x, k)) != cm::float_bits(-x / d);
        checked += 2;
      }
  }
  CHECK(wrong == 0);
  // Random blocks: d a scale in [1e-12, 2^45], |x| <= d with quotients down to denormals and zeros;
  // the codes through both maps equal the division's, and the quotient itself wherever |q| >= 2^-24.
  const Quantizer& qs = Quantizer::get(QMap::kDynamicSigned);
  const Quantizer& qu = Quantizer::get(QMap::kDynamicUnsigned);
  std::uniform_int_distribution<int> exd(-39, 44), exq(-152, -1);
  int64_t code_wrong = 0, value_wrong = 0;
  for (int i = 0; i < 4000000; ++i) {
    const float d = std::ldexp(1.0f + mant(rng) * 0x1p-23f, exd(rng));
    float x = std::ldexp(d * (1.0f + mant(rng) * 0x1p-23f) * 0.5f, exq(rng) + 1);
    if (i % 1000 == 0) x = 0.0f;
    if (i % 1000 == 1) x = d;
    if (i & 1) x = -x;
    const cm::Recip k = cm::recip(d);
    const float want = x / d, got = cm::div_fast(x, k);
    if (std::fabs(want) >= 0x1p-24f) value_wrong += cm::float_bits(got) != cm::float_bits(want);
    code_wrong += qs(got) != qs(want) || qu(got) != qu(want);
    ++checked;
  }
  CHECK(checked > 100000000);
  CHECK(value_wrong == 0);
  CHECK(code_wrong == 0);
  CHECK(!cm::recip(0x1p46f).ok);
  CHECK(!cm::recip(std::numeric_limits<float>::infinity()).ok);
  CHECK(!cm::recip(std::numeric_limits<float>::quiet_NaN()).ok);
}
