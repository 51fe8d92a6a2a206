#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "optstate/hash.h"
#include "optstate/quant8.h"
#include "optstate/transform.h"
#include "test_helpers.h"

using namespace optstate;

TEST_CASE("dynamic maps have the documented landmarks and are strictly increasing") {
  const auto& s = qmap_table(QMap::kDynamicSigned);
  const auto& u = qmap_table(QMap::kDynamicUnsigned);
  CHECK(s[127] == 0.0f);
  CHECK(s[255] == 1.0f);
  CHECK(s[0] == doctest::Approx(-0.99297).epsilon(1e-5));
  CHECK(u[0] == 0.0f);
  CHECK(u[255] == 1.0f);
  for (int i = 1; i < 256; ++i) {
    CHECK(s[i - 1] < s[i]);
    CHECK(u[i - 1] < u[i]);
  }
  CHECK(qmap_from_name("dynamic-signed").ok());
  CHECK(!qmap_from_name("linear").ok());
}

TEST_CASE("the bucket quantizer equals the reference binary search on hard values") {
  for (QMap m : {QMap::kDynamicSigned, QMap::kDynamicUnsigned}) {
    const Quantizer& q = Quantizer::get(m);
    const float* map = q.map();
    std::vector<float> xs{0.0f, -0.0f, 1.0f, -1.0f, 1e-45f, -1e-45f, 1e-40f, std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
    for (int i = 0; i + 1 < 256; ++i) {
      const float mid = (map[i] + map[i + 1]) * 0.5f;
      for (float v : {map[i], mid, std::nextafter(mid, -2.0f), std::nextafter(mid, 2.0f)}) xs.push_back(v);
    }
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    for (int i = 0; i < 200000; ++i) xs.push_back(uni(rng) * std::ldexp(1.0f, -static_cast<int>(rng() % 40)));
    for (uint32_t bits = 0; bits < 0xffffffffu - 4099; bits += 4099) {  // a sweep over every exponent
      float f;
      std::memcpy(&f, &bits, 4);
      xs.push_back(f);
    }
    size_t mismatches = 0;
    for (float x : xs) mismatches += q(x) != quantize_scaled_reference(x, map);
    CHECK(mismatches == 0);
    CHECK(q(std::numeric_limits<float>::quiet_NaN()) == 0);
  }
  // Ties go up: the exact midpoint between two entries takes the upper code.
  const float* s = qmap_table(QMap::kDynamicSigned).data();
  CHECK(quantize_scaled_reference((s[200] + s[201]) * 0.5f, s) == 201);
}

TEST_CASE("blockwise quantization: scale, partial last block, round trip of dequantized blocks") {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(1000);  // 3 full blocks of 256 and a partial one of 232
  for (auto& v : x) v = nd(rng) * 1e-3f;
  x[10] = -0.5f;  // block 0's largest magnitude is negative: dequantizes to -0.99297 * absmax
  std::vector<uint8_t> codes(x.size());
  std::vector<float> absmax(4), back(x.size());
  quantize_blockwise(x, 256, QMap::kDynamicSigned, codes, absmax);
  CHECK(absmax[0] == 0.5f);
  CHECK(codes[10] == 0);
  dequantize_blockwise(codes, absmax, 256, QMap::kDynamicSigned, back);
  std::vector<uint8_t> codes2(x.size());
  std::vector<float> absmax2(4);
  // The plain rule would rescale block 0 (its max is now 0.99297 * 0.5); requantize recovers it.
  const int64_t recovered = requantize_blockwise(back, 256, QMap::kDynamicSigned, codes2, absmax2);
  CHECK(recovered >= 1);
  CHECK(codes2 == codes);
  CHECK(std::memcmp(absmax2.data(), absmax.data(), 16) == 0);
  // Zeros: absmax clamps to 1e-12 and every code is the map's zero.
  std::vector<float> zeros(256, 0.0f);
  std::vector<uint8_t> zc(256);
  std::vector<float> za(1);
  quantize_blockwise(zeros, 256, QMap::kDynamicSigned, zc, za);
  CHECK(za[0] == kMinAbsmax);
  CHECK(zc[0] == 127);
}

TEST_CASE("dequantize_state and quantize_state invert each other on 8-bit state") {
  OptimizerState s = testing::sample_state();
  // Make the weight's moments 8-bit (6 elements, block 4: a partial last block).
  auto q = quantize_state(s, {4, 1});
  REQUIRE(q.ok());
  const Entry& e = q->params.at("layers.0.weight").entries.at(kExpAvg);
  CHECK(e.encoding == Encoding::kBlockwise8);
  CHECK(e.qmap == "dynamic-signed");
  CHECK(e.absmax.size == 2 * 4);
  CHECK(q->params.at("layers.0.weight").entries.at(kParam).encoding == Encoding::kDense);  // weights stay
  auto d = dequantize_state(*q);
  REQUIRE(d.ok());
  auto q2 = quantize_state(*d, {4, 1});
  REQUIRE(q2.ok());
  auto h1 = hash_state(*q), h2 = hash_state(*q2), v1 = hash_state(*q, {.values = true}),
       v2 = hash_state(*d, {.values = true});
  REQUIRE(h1.ok());
  REQUIRE(h2.ok());
  CHECK(h1->root == h2->root);
  CHECK(v1->root == v2->root);
  CHECK(h1->root != hash_state(*d)->root);
  // Params below the threshold stay dense.
  auto big_threshold = quantize_state(s, {4, 1000});
  CHECK(big_threshold->params.at("layers.0.weight").entries.at(kExpAvg).encoding == Encoding::kDense);
}

TEST_CASE("quantize_state with reblock: 8-bit moments of other blocks requantized, as dequantizing first would") {
  const OptimizerState s = testing::sample_state();
  auto four = quantize_state(s, {4, 1});  // blocks of 4
  REQUIRE(four.ok());
  // Kept without reblock: an 8-bit entry stays as it is whatever block size is asked for.
  auto kept = quantize_state(*four, {2, 1});
  REQUIRE(kept.ok());
  CHECK(kept->params.at("layers.0.weight").entries.at(kExpAvg).block_size == 4);
  CHECK(hash_state(*kept)->root == hash_state(*four)->root);
  // With it: the codes and scales of dequantize-then-quantize, in one step.
  QuantizeOptions two{2, 1};
  two.reblock = true;
  auto one_step = quantize_state(*four, two);
  auto two_steps = quantize_state(*dequantize_state(*four), {2, 1});
  REQUIRE(one_step.ok());
  REQUIRE(two_steps.ok());
  CHECK(one_step->params.at("layers.0.weight").entries.at(kExpAvg).block_size == 2);
  CHECK(hash_state(*one_step)->root == hash_state(*two_steps)->root);
  // The same block size and maps: nothing to redo, the codes stay.
  QuantizeOptions same{4, 1};
  same.reblock = true;
  CHECK(hash_state(*quantize_state(*four, same))->root == hash_state(*four)->root);
  // Below the threshold an 8-bit entry is kept, not requantized.
  QuantizeOptions high{2, 1000};
  high.reblock = true;
  CHECK(quantize_state(*four, high)->params.at("layers.0.weight").entries.at(kExpAvg).block_size == 4);
}

TEST_CASE("entry_f32_span: fp32 values as they lie, others widened or dequantized into a reused scratch") {
  std::vector<float> scratch;
  // fp32: a view of the entry's own buffer, no copy, scratch untouched
  Entry f32;
  f32.values = testing::f32_buffer({1.5f, -2.0f, 3.25f});
  auto view = entry_f32_span(f32, 3, "p.exp_avg", scratch);
  REQUIRE(view.ok());
  CHECK(reinterpret_cast<const std::byte*>(view->data()) == f32.values.data);
  CHECK(scratch.empty());
  // bf16: widened into scratch, as entry_f32_values widens it
  Entry bf16;
  bf16.dtype = DType::kBF16;
  const std::vector<uint16_t> bits = {0x3f80, 0xc000, 0x4040, 0x0001};
  bf16.values = Buffer::copy_of(std::as_bytes(std::span(bits)));
  auto widened = entry_f32_span(bf16, 4, "p.param", scratch);
  REQUIRE(widened.ok());
  CHECK(widened->data() == scratch.data());
  const auto want = entry_f32_values(bf16, 4, "p.param");
  REQUIRE(want.ok());
  CHECK(std::equal(widened->begin(), widened->end(), want->begin(), want->end()));
  // blockwise8 of 600 elements (blocks of 256, a partial last one): the scratch grows and is reused
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> x(600);
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> codes(x.size());
  std::vector<float> absmax(3);
  quantize_blockwise(x, 256, QMap::kDynamicSigned, codes, absmax);
  Entry q;
  q.encoding = Encoding::kBlockwise8;
  q.dtype = DType::kU8;
  q.block_size = 256;
  q.qmap = qmap_name(QMap::kDynamicSigned);
  q.codes = Buffer::copy_of(std::as_bytes(std::span(codes)));
  q.absmax = testing::f32_buffer(absmax);
  auto dq = entry_f32_span(q, 600, "p.exp_avg", scratch);
  REQUIRE(dq.ok());
  CHECK(dq->size() == 600);
  CHECK(scratch.size() >= 600);
  const auto dq_want = entry_f32_values(q, 600, "p.exp_avg");
  REQUIRE(dq_want.ok());
  CHECK(std::memcmp(dq->data(), dq_want->data(), 600 * sizeof(float)) == 0);
  // a size that does not fit the entry is an error naming it, not a read past its buffer
  auto bad = entry_f32_span(f32, 4, "p.exp_avg", scratch);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("p.exp_avg") != std::string::npos);
  CHECK_FALSE(entry_f32_span(q, 601, "p.exp_avg", scratch).ok());
}
