#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <doctest/doctest.h>
#include <torch/optim/schedulers/step_lr.h>

#include <cmath>
#include <random>

#include "adamw8bit.h"
#include "adamw8bit_kernel.h"
#include "adamw_kernel.h"
#include "device_steps.h"
#include "fused_adamw.h"
#include "optstate/hash.h"
#include "optstate/quant8.h"
#include "test_tensors.h"
#include "torch_bridge.h"

using namespace optstate;
using namespace optstate::optim;

namespace {

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) { return test::randn_tensor(std::move(shape), seed); }

struct Ref {  // torch.optim.AdamW's for-loop, restated with the same ATen ops
  at::Tensor p, m, v, vmax;
  int64_t step = 0;
  void update(const at::Tensor& grad, const AdamWHyper& h) {
    at::Tensor g = h.maximize ? -grad : grad;
    ++step;
    p.mul_(1 - h.lr * h.weight_decay);
    m.lerp_(g, 1 - h.beta1);
    v.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
    const double bc1 = 1 - std::pow(h.beta1, step), bc2 = 1 - std::pow(h.beta2, step);
    at::Tensor src = v;
    if (h.amsgrad) {
      at::maximum_out(vmax, vmax, v);
      src = vmax;
    }
    at::Tensor denom = (src.sqrt() / std::sqrt(bc2)).add_(h.eps);
    p.addcdiv_(m, denom, -(h.lr / bc1));
  }
};

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

}  // namespace

TEST_CASE("FusedAdamW follows torch's AdamW for-loop within 1e-6 for every flag combination") {
  at::NoGradGuard no_grad;
  for (bool amsgrad : {false, true})
    for (bool maximize : {false, true})
      for (double wd : {0.0, 0.1}) {
        CAPTURE(amsgrad);
        CAPTURE(maximize);
        CAPTURE(wd);
        const AdamWHyper h{3e-3, 0.9, 0.99, 1e-8, wd, amsgrad, maximize};
        at::Tensor init = randn({257, 31}, 1);
        at::Tensor p = init.clone();
        FusedAdamW opt({p}, FusedAdamWOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(wd)
                                .amsgrad(amsgrad).maximize(maximize));
        Ref ref{init.clone(), at::zeros_like(init), at::zeros_like(init), at::zeros_like(init)};
        for (int s = 0; s < 200; ++s) {
          at::Tensor g = randn({257, 31}, 100 + s);
          p.mutable_grad() = g.clone();
          opt.step();
          ref.update(g, h);
        }
        CHECK(rel_diff(p, ref.p) <= 1e-6);
        auto& st = static_cast<FusedAdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
        CHECK(st.step() == 200);
        CHECK(rel_diff(st.exp_avg(), ref.m) <= 1e-6);
        CHECK(rel_diff(st.exp_avg_sq(), ref.v) <= 1e-6);
      }
}

TEST_CASE("the multi-tensor launch equals per-tensor updates, and both ISAs give the same bits") {
  const std::vector<int64_t> sizes{0, 1, 7, 8, 16383, 16384, 16385, 40001};
  const AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, true, false};
  auto make = [&](std::vector<at::Tensor>& store) {
    std::vector<AdamWTensor> items;
    for (size_t i = 0; i < sizes.size(); ++i) {
      at::Tensor p = randn({sizes[i]}, i), g = randn({sizes[i]}, 50 + i);
      at::Tensor m = randn({sizes[i]}, 70 + i) * 0.1, v = randn({sizes[i]}, 90 + i).abs() * 0.01;
      at::Tensor mx = v.clone();
      store.insert(store.end(), {p, g, m, v, mx});
      items.push_back({p.data_ptr(), g.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(), mx.data_ptr<float>(),
                       sizes[i], ParamKind::kF32, adamw_step_scalars(h, 3)});
    }
    return items;
  };
  std::vector<at::Tensor> all, one, gen;
  auto items_all = make(all), items_one = make(one), items_gen = make(gen);
  adamw_cpu(items_all);
  for (const auto& it : items_one) adamw_cpu(std::span(&it, 1));
  adamw_cpu(items_gen, CpuIsa::kGeneric);
  for (size_t i = 0; i < all.size(); ++i) {
    CHECK(at::equal(all[i], one[i]));
    CHECK(at::equal(all[i], gen[i]));
  }
}

// The ISAs whose paths this CPU runs, generic first.
std::vector<CpuIsa> cpu_isas() {
  std::vector<CpuIsa> isas{CpuIsa::kGeneric};
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Gather})
    if (cpu_has(isa)) isas.push_back(isa);
  return isas;
}

// Appends each threshold of q times s and two neighbours on each side, both signs, and a float of
// every exponent and sign.
static void append_quantizer_probes(std::vector<float>& xs, const Quantizer& q, float s) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int c = 0; c < 255; ++c) {
    float up = q.thresholds()[c] * s, down = up;
    for (int k = 0; k < 3; ++k) {
      xs.insert(xs.end(), {up, down, -up, -down});
      up = std::nextafter(up, inf);
      down = std::nextafter(down, -inf);
    }
  }
  for (uint32_t bits = 0; bits < 0xffffffffu - 65537; bits += 65537) {
    float f;
    std::memcpy(&f, &bits, 4);
    xs.push_back(f);
  }
}

TEST_CASE("the step's requantization equals the reference quantizer on thresholds, bucket edges and every exponent") {
  const std::vector<CpuIsa> isas = cpu_isas();
  const float inf = std::numeric_limits<float>::infinity();
  for (QMap m : {QMap::kDynamicSigned, QMap::kDynamicUnsigned}) {
    const Quantizer& q = Quantizer::get(m);
    std::vector<float> xs{0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, inf, -inf, 1e-45f, -1e-45f, 1e-40f, -1e-40f,
                          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()};
    append_quantizer_probes(xs, q, 1.0f);
    // the edges of the AVX-512 quantizer's buckets (at most 2^8 per binade) and the floats below
    // them, both signs, 2^-27 to 4
    for (uint32_t e = 100; e <= 129; ++e) {
      for (uint32_t k = 0; k < 256; ++k) {
        const uint32_t bits = e << 23 | k << 15;
        for (uint32_t b : {bits, bits - 1, bits | 0x80000000u, (bits - 1) | 0x80000000u}) {
          float f;
          std::memcpy(&f, &b, 4);
          xs.push_back(f);
        }
      }
    }
    xs.push_back(0.5f);  // a length that leaves a scalar tail after the 8-wide loop
    for (CpuIsa isa : isas) {
      CAPTURE(static_cast<int>(isa));
      std::vector<uint8_t> codes(xs.size());
      quantize_scaled_cpu(xs, m, codes, isa);
      size_t wrong = 0;
      for (size_t i = 0; i < xs.size(); ++i) wrong += codes[i] != quantize_scaled_reference(xs[i], q.map());
      CHECK(wrong == 0);
    }
  }
}

// The step divides the moments by the bias corrections; the AVX-512 path does it without the
// divider where the result is the same (adamw8bit_kernel_impl.inc: div_by16). A sample of every
// float (and the edges of where the corrected quotient is used) against the divider, bit for bit;
// tests/optim/check_division_exhaustive.cpp runs every float.
TEST_CASE("the step's divisions by its bias corrections are torch's, bit for bit, for every kind of value") {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> a{0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 0x1p-100f, -0x1p-100f,
                       std::nextafter(0x1p-100f, 0.0f), 0x1p100f, std::nextafter(0x1p100f, inf), 0x1.8p-125f};
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {
    const uint32_t bits = static_cast<uint32_t>(u);
    float f;
    std::memcpy(&f, &bits, 4);
    a.push_back(f);
  }
  // 1 - 0.9^t and sqrt(1 - 0.999^t) for a few steps, divisors near powers of two, and ones whose
  // reciprocal is not normal (the divider then does all of it)
  std::vector<float> divisors{0x1.000002p0f, 0x1.fffffep-1f, 3.0f, 0x1p127f, 1e-39f, 0.0f, -0.5f};
  for (int t : {1, 2, 10, 1000}) {
    divisors.push_back(1.0f - static_cast<float>(std::pow(0.9, t)));
    divisors.push_back(std::sqrt(1.0f - static_cast<float>(std::pow(0.999, t))));
  }
  std::vector<float> ref(a.size()), got(a.size());
  for (float b : divisors) {
    CAPTURE(b);
    divide_by_scalar_cpu(a, b, ref, CpuIsa::kGeneric);
    size_t wrong = 0;  // the generic path is the divider itself
    for (size_t i = 0; i < a.size(); ++i) {
      const float want = a[i] / b;
      wrong += std::memcmp(&ref[i], &want, 4) != 0;
    }
    REQUIRE(wrong == 0);
    for (CpuIsa isa : cpu_isas()) {
      CAPTURE(static_cast<int>(isa));
      divide_by_scalar_cpu(a, b, got, isa);
      CHECK(std::memcmp(got.data(), ref.data(), 4 * a.size()) == 0);
    }
  }
}

// The step divides each moment by its block's scale before the lookup; the AVX-512 path does it
// without the divider (Markstein's correction, adamw8bit_kernel_impl.inc), which must give the
// code of the correctly rounded quotient for every value: here x = t * s and its neighbours for each
// threshold t, values near the underflow of x and of x / s, and a sweep over every exponent.
TEST_CASE("the step's requantization divides by the block scale as torch does, for scales near every edge") {
  const std::vector<CpuIsa> isas = cpu_isas();
  const float inf = std::numeric_limits<float>::infinity();
  // the usual range of absmax, divisors whose reciprocal is inexact or has every bit set, the clip
  // (1e-12), and the edges of the corrected division's range ([2^-64, 2^126]) and just past them
  const std::vector<float> scales{0.1f, 3e-5f, 0x1.fffffep-1f, 0x1.000002p0f, 0x1.7ffffep-3f, 1e-12f, 7.0f,
                                  0x1p-64f, 0x1.fffffep-65f, 0x1p126f, 0x1.000002p126f, 3e38f, 1.0f / 3.0f};
  std::mt19937 rng(7);
  for (QMap m : {QMap::kDynamicSigned, QMap::kDynamicUnsigned}) {
    const Quantizer& q = Quantizer::get(m);
    for (float s : scales) {
      CAPTURE(s);
      std::vector<float> xs{0.0f, -0.0f, s, -s, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 1e-45f, -1e-45f};
      append_quantizer_probes(xs, q, s);
      for (int k = 0; k < 4096; ++k) {  // |x / s| near 2^-24 (the first bucket's edge) and 2^-100
        const int e = k % 2 ? -24 : -100;
        xs.push_back(std::ldexp(std::uniform_real_distribution<float>(0.5f, 2.0f)(rng), e) * s * (k % 4 < 2 ? 1 : -1));
      }
      for (CpuIsa isa : isas) {
        CAPTURE(static_cast<int>(isa));
        std::vector<uint8_t> codes(xs.size());
        quantize_scaled_cpu(xs, m, codes, isa, s);
        size_t wrong = 0;
        for (size_t i = 0; i < xs.size(); ++i) wrong += codes[i] != quantize_scaled_reference(xs[i] / s, q.map());
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("AdamW8bit: the AVX2 and AVX-512 kernels give the generic kernel's bits, hostile values included") {
  const std::vector<CpuIsa> isas = cpu_isas();
  if (isas.size() == 1) {
    WARN_MESSAGE(false, "no AVX2+FMA on this CPU: only the generic kernel exists here");
    return;
  }
  if (!cpu_has(CpuIsa::kAvx512)) WARN_MESSAGE(false, "no AVX-512 (F, BW, DQ, VL, VBMI) on this CPU: its path is not run");
  // Block sizes that are and are not multiples of the 8-, 16-, 32- and 64-wide loops; partial last blocks.
  const std::vector<std::pair<int64_t, int64_t>> shapes{{5000, 256}, {4099, 64}, {1003, 100}, {300, 7},
                                                        {4096, 256}, {2100, 2048}, {999, 128}};
  for (CpuIsa isa : isas)
  for (const auto& [n, block] : shapes)
    for (int kind = 0; kind < 2; ++kind)
      for (int ams = 0; ams < 2; ++ams) {
        if (isa == CpuIsa::kGeneric) continue;
        CAPTURE(static_cast<int>(isa));
        CAPTURE(n);
        CAPTURE(block);
        CAPTURE(kind);
        CAPTURE(ams);
        const int64_t nb = (n + block - 1) / block;
        const AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, ams != 0, false};
        at::Tensor m0 = randn({n}, 1) * 1e-2, v0 = (randn({n}, 2) * 1e-3).square();
        std::vector<float> m0v(m0.data_ptr<float>(), m0.data_ptr<float>() + n);
        std::vector<float> v0v(v0.data_ptr<float>(), v0.data_ptr<float>() + n);
        std::fill(m0v.begin(), m0v.begin() + std::min<int64_t>(n, block), 0.0f);  // an all-zero block
        // Elements whose param and moments start at 0 and whose gradient is tiny: the param then moves
        // by lr * (m / bc1) / eps, which shows any error in a quotient near underflow in its bits.
        std::vector<int64_t> tiny;
        for (int64_t k = 7; k < n && tiny.size() < 16; k += 13) tiny.push_back(k);
        for (int64_t k : tiny) m0v[k] = v0v[k] = 0.0f;
        struct State {
          at::Tensor p;
          std::vector<uint8_t> mc, vc, xc;
          std::vector<float> ma, va, xa;
        };
        auto make = [&] {
          State st{randn({n}, 3), std::vector<uint8_t>(n), std::vector<uint8_t>(n), std::vector<uint8_t>(n),
                   std::vector<float>(nb), std::vector<float>(nb), std::vector<float>(nb)};
          for (int64_t k : tiny) st.p.data_ptr<float>()[k] = 0.0f;
          if (kind == 1) st.p = st.p.to(at::kBFloat16);
          quantize_blockwise(m0v, block, QMap::kDynamicSigned, st.mc, st.ma);
          quantize_blockwise(v0v, block, QMap::kDynamicUnsigned, st.vc, st.va);
          quantize_blockwise(v0v, block, QMap::kDynamicUnsigned, st.xc, st.xa);
          return st;
        };
        State a = make(), b = make();
        for (int step = 1; step <= 4; ++step) {
          at::Tensor g = randn({n}, 10 + step) * 0.1;
          float* gp = g.data_ptr<float>();
          // Values that stress the quantizer, the scale and the divisions by the bias corrections:
          // huge, tiny (moments near 2^-100, where the AVX-512 path's corrected division hands over
          // to the divider), denormal, exact zero, NaN, infinite.
          gp[n - 1] = 1e30f;
          gp[n / 2] = 1e-40f;
          gp[n / 3] = -3e-20f;
          gp[n / 5] = 0x1p-97f;
          gp[n / 6] = -0x1p-99f;
          gp[n / 7] = 0x1p-120f;
          gp[1] = 0.0f;
          for (size_t j = 0; j < tiny.size(); ++j)
            gp[tiny[j]] = std::ldexp((j % 2 ? -1.0f : 1.0f) * (1.0f + static_cast<float>(j) / 16.0f), -104 - 2 * static_cast<int>(j));
          if (step == 3) gp[n / 4] = std::numeric_limits<float>::quiet_NaN();
          if (step == 4 && n > 900) gp[n - 900] = -std::numeric_limits<float>::infinity();
          if (kind == 1) g = g.to(at::kBFloat16);
          auto run = [&](State& st, CpuIsa isa) {
            AdamW8bitTensor t{};
            t.param = st.p.data_ptr();
            t.grad = g.data_ptr();
            t.kind = kind == 1 ? ParamKind::kBF16 : ParamKind::kF32;
            t.numel = n;
            t.block = block;
            t.m_codes = st.mc.data();
            t.v_codes = st.vc.data();
            t.vmax_codes = st.xc.data();
            t.m_absmax = st.ma.data();
            t.v_absmax = st.va.data();
            t.vmax_absmax = st.xa.data();
            t.s = adamw8bit_step_scalars(h, static_cast<float>(step));
            adamw8bit_cpu(std::span(&t, 1), isa);
          };
          run(a, isa);
          run(b, CpuIsa::kGeneric);
        }
        const auto bits = kind == 1 ? at::kShort : at::kInt;  // bit patterns: NaN compares unequal as floats
        CHECK(at::equal(a.p.view(bits), b.p.view(bits)));
        CHECK(a.mc == b.mc);
        CHECK(a.vc == b.vc);
        CHECK(a.xc == b.xc);
        CHECK(std::memcmp(a.ma.data(), b.ma.data(), 4 * nb) == 0);
        CHECK(std::memcmp(a.va.data(), b.va.data(), 4 * nb) == 0);
        CHECK(std::memcmp(a.xa.data(), b.xa.data(), 4 * nb) == 0);
      }
}

TEST_CASE("bf16 params are updated in one pass with fp32 state") {
  at::NoGradGuard no_grad;
  at::Tensor p32 = randn({1000}, 3);
  at::Tensor p = p32.to(at::kBFloat16);
  FusedAdamW opt({p}, FusedAdamWOptions(1e-2));
  p.mutable_grad() = randn({1000}, 4).to(at::kBFloat16);
  opt.step();
  auto& st = static_cast<FusedAdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
  CHECK((st.exp_avg().scalar_type() == at::kFloat));
  // Reference: the same step on the widened values, then one rounding.
  Ref ref{p32.to(at::kBFloat16).to(at::kFloat), at::zeros({1000}), at::zeros({1000}), at::zeros({1000})};
  ref.update(p.grad().to(at::kFloat), {1e-2, 0.9, 0.999, 1e-8, 1e-2, false, false});
  CHECK(at::equal(p, ref.p.to(at::kBFloat16)));
}

TEST_CASE("export and import restore the optimizer exactly; a bad import changes nothing") {
  at::NoGradGuard no_grad;
  auto build = [](std::vector<at::Tensor>& ps) {
    ps = {randn({16, 8}, 1), randn({8}, 2)};
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{ps[0]},
                        std::make_unique<FusedAdamWOptions>(FusedAdamWOptions(1e-2).weight_decay(0.5).amsgrad(true)));
    groups.emplace_back(std::vector<at::Tensor>{ps[1]}, std::make_unique<FusedAdamWOptions>(FusedAdamWOptions(2e-2)));
    return std::make_unique<FusedAdamW>(groups);
  };
  const std::vector<std::string> names{"w", "b"};
  std::vector<at::Tensor> a, b;
  auto oa = build(a);
  auto ob = build(b);
  CHECK(static_cast<FusedAdamWOptions&>(oa->param_groups()[0].options()).weight_decay() == 0.5);
  for (int s = 0; s < 5; ++s) {
    for (size_t i = 0; i < a.size(); ++i) a[i].mutable_grad() = randn(a[i].sizes().vec(), 10 * s + i);
    oa->step();
  }
  auto st = export_state(*oa, names, true);
  REQUIRE(st.ok());
  CHECK(st->params.at("w").entries.count(kMaxExpAvgSq) == 1);
  CHECK(st->groups[0].hyper.weight_decay == 0.5);

  OptimizerState wrong = *st;
  wrong.params.at("b").shape = {9};
  wrong.params.at("b").entries.clear();
  CHECK(!import_state(*ob, names, wrong, true).ok());
  CHECK(ob->state().empty());
  // A lying buffer in the last param (its shape right, its bytes short): refused, with the first
  // param's weights, every state and group 0's lr untouched (an import builds everything before it
  // applies anything).
  OptimizerState short_buffer = *st;
  short_buffer.groups[0].hyper.lr = 0.5;
  short_buffer.params.at("b").entries.at(kExpAvg).values.size -= 4;
  const at::Tensor w_before = b[0].clone();
  CHECK(!import_state(*ob, names, short_buffer, true).ok());
  CHECK(ob->state().empty());
  CHECK(at::equal(b[0], w_before));
  CHECK(!at::equal(b[0], a[0]));
  CHECK(static_cast<FusedAdamWOptions&>(ob->param_groups()[0].options()).lr() == 1e-2);

  REQUIRE(import_state(*ob, names, *st, true).ok());
  auto h1 = hash_state(*st);
  auto h2 = hash_state(*export_state(*ob, names, true));
  REQUIRE(h1.ok());
  REQUIRE(h2.ok());
  CHECK(h1->root == h2->root);
  // Groups are matched through their params, not by position (a flattened DCP records no group
  // order): the state with its groups listed the other way round imports the same.
  OptimizerState swapped = *st;
  std::swap(swapped.groups[0], swapped.groups[1]);
  swapped.params.at("w").group = 1;
  swapped.params.at("b").group = 0;
  std::vector<at::Tensor> c;
  auto oc = build(c);
  static_cast<FusedAdamWOptions&>(oc->param_groups()[0].options()).weight_decay(0.0);
  REQUIRE(import_state(*oc, names, swapped, true).ok());
  CHECK(static_cast<FusedAdamWOptions&>(oc->param_groups()[0].options()).weight_decay() == 0.5);
  CHECK(static_cast<FusedAdamWOptions&>(oc->param_groups()[1].options()).lr() == 2e-2);
  CHECK(hash_state(*export_state(*oc, names, true))->root == h1->root);
  // One live group holding params the checkpoint has with different hyperparameters: refused.
  std::vector<at::Tensor> d{randn({16, 8}, 1), randn({8}, 2)};
  FusedAdamW od(d, FusedAdamWOptions(1e-2));
  auto merged = import_state(od, names, *st, true);
  CHECK(!merged.ok());
  CHECK(merged.message().find("split the group") != std::string::npos);
  CHECK(od.state().empty());
  for (int s = 5; s < 10; ++s) {
    for (size_t i = 0; i < a.size(); ++i) {
      a[i].mutable_grad() = randn(a[i].sizes().vec(), 10 * s + i);
      b[i].mutable_grad() = a[i].grad().clone();
    }
    oa->step();
    ob->step();
  }
  for (size_t i = 0; i < a.size(); ++i) CHECK(at::equal(a[i], b[i]));
}

namespace {

template <class Opt>
std::vector<at::Tensor> lr_test_params(uint64_t seed) {
  std::vector<at::Tensor> ps{randn({300, 40}, seed), randn({5000}, seed + 1), randn({7}, seed + 2)};
  return ps;
}

void set_lr_test_grads(std::vector<at::Tensor>& a, std::vector<at::Tensor>& b, int step) {
  for (size_t i = 0; i < a.size(); ++i) {
    a[i].mutable_grad() = randn(a[i].sizes().vec(), 1000 + 10 * step + i) * 1e-2;
    b[i].mutable_grad() = a[i].grad().clone();
  }
}

bool same_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!at::equal(a[i].view(at::kInt), b[i].view(at::kInt))) return false;
  return true;
}

// A float32 lr tensor holds the fp32 value; the double-lr reference is given that same number.
double as_held(double lr, at::ScalarType dtype) { return dtype == at::kFloat ? static_cast<double>(static_cast<float>(lr)) : lr; }

template <class Opt, class Options>
void check_lr_tensor_follows_schedule() {
  at::NoGradGuard no_grad;
  for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    CAPTURE(dtype);
    auto pa = lr_test_params<Opt>(1), pb = lr_test_params<Opt>(1);
    const at::Tensor lr = at::full({}, 1e-2, at::TensorOptions().dtype(dtype));
    Opt a(pa, Options(as_held(1e-2, dtype)).weight_decay(0.1));
    Opt b(pb, Options(0.5).lr_tensor(lr).weight_decay(0.1));  // lr() becomes the tensor's value
    auto& ob = static_cast<Options&>(b.param_groups()[0].options());
    CHECK(ob.get_lr() == as_held(1e-2, dtype));
    torch::optim::StepLR sa(a, 2, 0.5), sb(b, 2, 0.5);
    for (int step = 0; step < 5; ++step) {
      set_lr_test_grads(pa, pb, step);
      a.step();
      b.step();
      sa.step();
      sb.step();
    }
    CHECK(same_bits(pa, pb));
    // The schedule wrote the same tensor in place: 1e-2 * 0.5^2 after 5 scheduler steps.
    CHECK(ob.lr_tensor().unsafeGetTensorImpl() == lr.unsafeGetTensorImpl());
    CHECK(lr.item<double>() == as_held(1e-2, dtype) * 0.25);

    // Writing the tensor itself, and setting options.lr() directly, are both followed.
    lr.fill_(3e-3);
    static_cast<Options&>(a.param_groups()[0].options()).set_lr(as_held(3e-3, dtype));
    set_lr_test_grads(pa, pb, 10);
    a.step();
    b.step();
    CHECK(same_bits(pa, pb));
    static_cast<Options&>(a.param_groups()[0].options()).lr(as_held(7e-3, dtype));
    ob.lr(as_held(7e-3, dtype));
    set_lr_test_grads(pa, pb, 11);
    a.step();
    b.step();
    CHECK(same_bits(pa, pb));
    CHECK(lr.item<double>() == as_held(7e-3, dtype));
  }
}

}  // namespace

TEST_CASE("lr_tensor: LibTorch's StepLR writes it in place; steps equal the double-lr run, for both optimizers") {
  check_lr_tensor_follows_schedule<FusedAdamW, FusedAdamWOptions>();
  check_lr_tensor_follows_schedule<AdamW8bit, AdamW8bitOptions>();
}

TEST_CASE("lr_tensor: bad tensors are refused; export reads it and import writes it in place") {
  at::NoGradGuard no_grad;
  CHECK_THROWS_WITH(FusedAdamWOptions().lr_tensor(at::zeros({2})), doctest::Contains("one float32 or float64"));
  CHECK_THROWS_WITH(AdamW8bitOptions().lr_tensor(at::zeros({}, at::kInt)), doctest::Contains("one float32 or float64"));

  auto pa = lr_test_params<FusedAdamW>(5), pb = lr_test_params<FusedAdamW>(5);
  const at::Tensor lr_a = at::full({}, 2e-3, at::kDouble), lr_b = at::full({}, 9.0, at::kDouble);
  FusedAdamW a(pa, FusedAdamWOptions().lr_tensor(lr_a));
  FusedAdamW b(pb, FusedAdamWOptions().lr_tensor(lr_b));
  set_lr_test_grads(pa, pb, 0);
  a.step();
  lr_a.fill_(4e-3);  // written behind the options' back: export still reports the tensor's value
  const std::vector<std::string> names{"w", "v", "b"};
  auto st = export_state(a, names, true);
  REQUIRE(st.ok());
  CHECK(st->groups[0].hyper.lr == 4e-3);
  REQUIRE(import_state(b, names, *st, true).ok());
  auto& ob = static_cast<FusedAdamWOptions&>(b.param_groups()[0].options());
  CHECK(ob.lr_tensor().unsafeGetTensorImpl() == lr_b.unsafeGetTensorImpl());
  CHECK(lr_b.item<double>() == 4e-3);
  CHECK(ob.lr() == 4e-3);
}

TEST_CASE("device step counters: steps the host did not run (graph replays) are read back; a load still wins") {
  // DeviceSteps keeps a float32 counter per param on the param's device; the kernels add one per
  // step. Here the counter is a CPU tensor and the kernel's += 1 is done by hand.
  const at::Tensor p = at::zeros({4});
  DeviceSteps ds;
  at::Tensor c = ds.before_step(p, 0);
  CHECK(c.item<float>() == 0.0f);
  c.add_(1);  // step 1 runs
  CHECK(ds.before_step(p, 1).unsafeGetTensorImpl() == c.unsafeGetTensorImpl());
  c.add_(1);  // step 2 runs
  ds.before_step(p, 2);  // step 3 is captured in a graph: host code runs, the kernel does not
  c.add_(3);  // three replays
  CHECK(c.item<float>() == 5.0f);
  CHECK(ds.current(p, 3) == 5);  // the host counted 3
  ds.caught_up(p, 5);
  ds.before_step(p, 5);
  CHECK(c.item<float>() == 5.0f);  // no refill: the host agrees with the device
  c.add_(1);
  // A load sets the host count to 7: the host wins, and the next step refills the device.
  CHECK(ds.current(p, 7) == 7);
  ds.before_step(p, 7);
  CHECK(c.item<float>() == 7.0f);
  // A step whose launch was refused: forgotten, so the next step refills from the host's count (7)
  // although the host's count is the one that step was given.
  c.fill_(99.0);
  ds.forget(p);
  ds.before_step(p, 7);
  CHECK(c.item<float>() == 7.0f);

  // The optimizers' step_count is param_state.step() for CPU params.
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> ps{randn({10}, 1)};
  FusedAdamW opt(ps, FusedAdamWOptions(1e-2));
  CHECK(opt.step_count(ps[0]) == 0);
  ps[0].mutable_grad() = randn({10}, 2);
  opt.step();
  opt.step();
  opt.sync_step_counts();
  CHECK(opt.step_count(ps[0]) == 2);
}

TEST_CASE("a step refused part-way changes nothing: no state made, no step counted, no param moved") {
  // Group 0 is fine; group 1's second param has a grad of the wrong shape. The refused step must not
  // leave group 0's params counted (or updated) by a step that did not happen: the next good step
  // equals the first step of an optimizer that never saw the refused one.
  at::NoGradGuard no_grad;
  auto run = [](auto make_opt, auto turn_on_amsgrad, auto has_max, const char* name) {
    CAPTURE(name);
    std::vector<at::Tensor> a{randn({64, 80}, 1), randn({80}, 2), randn({5000}, 3)};
    std::vector<at::Tensor> b;
    for (const auto& t : a) b.push_back(t.clone());
    auto oa = make_opt(a);
    auto ob = make_opt(b);
    for (size_t i = 0; i < a.size(); ++i) {
      a[i].mutable_grad() = randn(a[i].sizes().vec(), 10 + i);
      b[i].mutable_grad() = a[i].grad().clone();
    }
    // One good step first, so existing state is covered too; then amsgrad turned on in group 0: the
    // refused step must not add its moment either.
    oa->step();
    ob->step();
    turn_on_amsgrad(*oa);
    turn_on_amsgrad(*ob);
    const at::Tensor good = a[2].grad();
    a[2].mutable_grad() = randn({4999}, 7);
    const auto before = a[0].clone();
    CHECK_THROWS_WITH_AS(oa->step(), doctest::Contains("grad"), c10::Error);
    CHECK(at::equal(a[0], before));
    CHECK(oa->step_count(a[0]) == 1);
    CHECK(oa->step_count(a[2]) == 1);
    CHECK(!has_max(*oa, a[0]));
    a[2].mutable_grad() = good;
    oa->step();
    ob->step();
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(oa->step_count(a[i]) == 2);
      CHECK(at::equal(a[i], b[i]));
    }
    CHECK(has_max(*oa, a[0]));
    // A fresh optimizer refused at its first step makes no state.
    auto oc = make_opt(b);
    b[2].mutable_grad() = randn({4999}, 8);
    CHECK_THROWS_AS(oc->step(), c10::Error);
    CHECK(oc->state().empty());
  };
  run(
      [](std::vector<at::Tensor>& ps) {
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(std::vector<at::Tensor>{ps[0], ps[1]},
                            std::make_unique<FusedAdamWOptions>(FusedAdamWOptions(1e-2)));
        groups.emplace_back(std::vector<at::Tensor>{ps[2]}, std::make_unique<FusedAdamWOptions>(2e-2));
        return std::make_unique<FusedAdamW>(groups);
      },
      [](FusedAdamW& o) { static_cast<FusedAdamWOptions&>(o.param_groups()[0].options()).amsgrad(true); },
      [](FusedAdamW& o, const at::Tensor& p) {
        return static_cast<FusedAdamWParamState&>(*o.state().at(p.unsafeGetTensorImpl())).max_exp_avg_sq().defined();
      },
      "FusedAdamW");
  run(
      [](std::vector<at::Tensor>& ps) {
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(std::vector<at::Tensor>{ps[0], ps[1]},
                            std::make_unique<AdamW8bitOptions>(AdamW8bitOptions(1e-2)));
        groups.emplace_back(std::vector<at::Tensor>{ps[2]}, std::make_unique<AdamW8bitOptions>(2e-2));
        return std::make_unique<AdamW8bit>(groups);
      },
      [](AdamW8bit& o) { static_cast<AdamW8bitOptions&>(o.param_groups()[0].options()).amsgrad(true); },
      [](AdamW8bit& o, const at::Tensor& p) {
        return static_cast<AdamW8bitParamState&>(*o.state().at(p.unsafeGetTensorImpl())).max_exp_avg_sq().defined();
      },
      "AdamW8bit");
}

TEST_CASE("params not stored contiguously (channels_last, transposed) step as their contiguous twins") {
  // torch's AdamW steps any layout. FusedAdamW keeps its moments in the param's layout and steps over
  // storage order; with contiguous moments (as loaded) it goes through a working copy, as AdamW8bit
  // always does (its 8-bit blocks follow logical order). Either way the param keeps its layout.
  at::NoGradGuard no_grad;
  auto run = [](auto make_opt, const char* name, auto after_first_step, auto after_import) {
    CAPTURE(name);
    std::vector<at::Tensor> b{randn({8, 160, 3, 3}, 1), randn({80, 64}, 2), randn({300}, 3)};
    std::vector<at::Tensor> a{b[0].contiguous(at::MemoryFormat::ChannelsLast), b[1].t().contiguous().t(),
                              b[2].clone()};
    REQUIRE(!a[0].is_contiguous());
    REQUIRE(!a[1].is_contiguous());
    const std::vector<std::vector<int64_t>> strides{a[0].strides().vec(), a[1].strides().vec()};
    auto oa = make_opt(a);
    auto ob = make_opt(b);
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < a.size(); ++i) {
        b[i].mutable_grad() = randn(b[i].sizes().vec(), 100 * step + i);
        a[i].mutable_grad() = at::empty_like(a[i]).copy_(b[i].grad());  // the param's layout, as autograd's
      }
      if (step == 2) a[2].mutable_grad() = a[2].grad().expand({2, 300})[1];  // a strided view: any grad
      oa->step();
      ob->step();
      for (size_t i = 0; i < a.size(); ++i) CHECK(at::equal(a[i], b[i]));
      if (step == 0) after_first_step(*oa, a);
    }
    CHECK(a[0].strides().vec() == strides[0]);
    CHECK(a[1].strides().vec() == strides[1]);
    for (size_t i = 0; i < a.size(); ++i) CHECK(oa->step_count(a[i]) == 3);
    const std::vector<std::string> names{"conv", "t", "b"};
    const auto sa = export_state(*oa, names, false), sb = export_state(*ob, names, false);
    REQUIRE(sa.ok());
    REQUIRE(sb.ok());
    CHECK(hash_state(*sa)->root == hash_state(*sb)->root);
    // imported again (as torch::load does): the same state, FusedAdamW's moments in the param's layout
    auto oc = make_opt(a);
    REQUIRE(import_state(*oc, names, *sa, false).ok());
    const auto sc = export_state(*oc, names, false);
    REQUIRE(sc.ok());
    CHECK(hash_state(*sc)->root == hash_state(*sa)->root);
    after_import(*oc, a);
  };
  auto fused = [](std::vector<at::Tensor>& ps) { return std::make_unique<FusedAdamW>(ps, FusedAdamWOptions(1e-2)); };
  auto moments = [](FusedAdamW& o, const at::Tensor& p) -> FusedAdamWParamState& {
    return static_cast<FusedAdamWParamState&>(*o.state().at(p.unsafeGetTensorImpl()));
  };
  auto in_param_layout = [&](FusedAdamW& o, std::vector<at::Tensor>& ps) {
    CHECK(moments(o, ps[0]).exp_avg().strides() == ps[0].strides());
    CHECK(moments(o, ps[1]).exp_avg_sq().strides() == ps[1].strides());
  };
  run(fused, "FusedAdamW, moments in the param's layout", in_param_layout, in_param_layout);
  run(
      fused, "FusedAdamW, contiguous moments",
      [&](FusedAdamW& o, std::vector<at::Tensor>& ps) {
        for (const at::Tensor& p : ps) {
          FusedAdamWParamState& st = moments(o, p);
          st.exp_avg(st.exp_avg().contiguous());
          st.exp_avg_sq(st.exp_avg_sq().contiguous());
        }
      },
      in_param_layout);
  auto nothing = [](AdamW8bit&, std::vector<at::Tensor>&) {};
  run([](std::vector<at::Tensor>& ps) {
        return std::make_unique<AdamW8bit>(ps, AdamW8bitOptions(1e-2).min_8bit_size(4096));
      },
      "AdamW8bit", nothing, nothing);
}
