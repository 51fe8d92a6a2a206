// Megatron-Core's distributed optimizer saved dp_reshardable (formats/dcp/megatron_buckets.cpp):
// bucket item keys, and placing the model's weights on the buckets' flat main params by value.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dcp/megatron_buckets.h"
#include "optstate/dtype.h"

using namespace optstate;
namespace mg = optstate::dcp::megatron;

TEST_CASE("megatron buckets: item keys of dp_reshardable") {
  auto k = mg::bucket_key("optimizer.distributed.dp_group_idx_3.gbuf_idx_1.dtype_(torch.bfloat16, torch.float32)"
                          ".bucket_idx_12.exp_avg_sq");
  REQUIRE(k);
  CHECK(k->chain == -1);
  CHECK(k->group == 3);
  CHECK(k->gbuf == 1);
  CHECK(k->dtype == "(torch.bfloat16, torch.float32)");
  CHECK(k->bucket == 12);
  CHECK(k->entry == "exp_avg_sq");
  auto c = mg::bucket_key("chained_1.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_torch.float32.bucket_idx_0.param");
  REQUIRE(c);
  CHECK(c->chain == 1);
  CHECK(c->dtype == "torch.float32");
  CHECK(c->entry == "param");
  for (const char* bad : {"optimizer.distributed.dp_group_idx_0.optimizer",
                          "optimizer.distributed.dp_group_idx_x.gbuf_idx_0.dtype_f.bucket_idx_0.param",
                          "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_f.bucket_idx_0",
                          "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_f.bucket_idx_0.a.b",
                          "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.param",
                          "chained_x.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_f.bucket_idx_0.param",
                          "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"})
    CHECK_MESSAGE(!mg::bucket_key(bad), bad);
  auto g = mg::group_optimizer_key("chained_0.optimizer.distributed.dp_group_idx_5.optimizer");
  REQUIRE(g);
  CHECK(g->first == 0);
  CHECK(g->second == 5);
  CHECK_FALSE(mg::group_optimizer_key("optimizer.distributed.dp_group_idx_5.per_bucket_numel"));
}

TEST_CASE("megatron buckets: the sample compared first") {
  CHECK(mg::sample_places(3) == std::vector<int64_t>{0, 1, 2});
  const auto s = mg::sample_places(1000);
  CHECK(s.size() == 32);
  CHECK(std::is_sorted(s.begin(), s.end()));
  CHECK(s.front() == 0);
  CHECK(s.back() == 999);
  CHECK(s[8] > 7);
}

namespace {

// Buckets of fp32 main params and boxes of model weights, in memory.
struct Fixture {
  std::vector<std::vector<float>> main;  // per bucket
  std::vector<mg::Bucket> buckets;
  std::vector<mg::Box> boxes;
  std::vector<std::vector<float>> weights;  // per box, its values before rounding to its dtype
  std::vector<std::string> names;
  std::mt19937 rng{7};

  size_t name(const std::string& n) {
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == n) return i;
    names.push_back(n);
    return names.size() - 1;
  }
  std::vector<float> random(int64_t n, float scale = 1) {
    std::normal_distribution<float> d(0, scale);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng);
    return v;
  }
  size_t box(const std::string& key, std::vector<int64_t> offsets, std::vector<float> values, DType d = DType::kBF16) {
    boxes.push_back(mg::Box{name(key), std::move(offsets), static_cast<int64_t>(values.size()), d});
    weights.push_back(std::move(values));
    return boxes.size() - 1;
  }
  // A bucket of domain `domain` holding boxes' values (main params: the weights slightly moved,
  // so that only rounding gives the weights back) at 64-aligned starts, each its own chunk, with
  // extra chunk bounds at `splits` (a param split between data-parallel ranks).
  size_t bucket(size_t domain, const std::vector<size_t>& ids, std::vector<int64_t> splits = {}, int64_t buffer = 0) {
    std::vector<float> m;
    std::vector<int64_t> starts;
    for (const size_t i : ids) {
      if (m.size() % 64) {
        starts.push_back(static_cast<int64_t>(m.size()));  // padding: a chunk of garbage
        while (m.size() % 64) m.push_back(12345.f);
      }
      starts.push_back(static_cast<int64_t>(m.size()));
      for (const float w : weights[i]) m.push_back(w);
    }
    for (int64_t s : splits) starts.push_back(s);
    std::sort(starts.begin(), starts.end());
    starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
    buckets.push_back(
        mg::Bucket{"bucket " + std::to_string(buckets.size()), domain, buffer, static_cast<int64_t>(m.size()), starts});
    main.push_back(std::move(m));
    return buckets.size() - 1;
  }
  static uint32_t narrow(float v, DType d) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    return d == DType::kBF16 ? f32_to_bf16(v) : d == DType::kF16 ? f32_to_f16(v) : bits;
  }
  mg::BucketValues values() {
    mg::BucketValues v;
    v.bucket = [this](size_t b, int64_t begin, std::span<const int64_t> at, DType d) -> Result<std::vector<uint32_t>> {
      std::vector<uint32_t> out;
      for (int64_t a : at) out.push_back(narrow(main.at(b).at(static_cast<size_t>(begin + a)), d));
      return out;
    };
    v.box = [this](size_t i, std::span<const int64_t> at) -> Result<std::vector<uint32_t>> {
      std::vector<uint32_t> out;
      for (int64_t a : at) out.push_back(narrow(weights.at(i).at(static_cast<size_t>(a)), boxes[i].dtype));
      return out;
    };
    return v;
  }
  // dp_zero_gather_scatter's flat buffer: each bucket's boxes at 64-aligned starts from the
  // bucket's (zeros between, as Megatron's gather leaves them), each bucket cut at its last param's
  // end, the buckets one after another; its chunk starts left to flat_buffer_bounds.
  size_t flat(size_t domain, const std::vector<std::vector<size_t>>& bucket_ids) {
    std::vector<float> m;
    for (const auto& ids : bucket_ids) {
      const size_t bucket_start = m.size();
      for (const size_t i : ids) {
        while ((m.size() - bucket_start) % 64) m.push_back(0.f);
        for (const float w : weights[i]) m.push_back(w);
      }
    }
    buckets.push_back(mg::Bucket{"flat " + std::to_string(buckets.size()), domain, 0, static_cast<int64_t>(m.size()), {}});
    main.push_back(std::move(m));
    return buckets.size() - 1;
  }
  Result<std::vector<int64_t>> bounds(size_t b, DType d = DType::kBF16) {
    const auto v = values();
    return mg::flat_buffer_bounds(b, buckets[b].numel, d, boxes, v, "flat");
  }
  Result<std::vector<std::optional<mg::Placement>>> place() {
    const auto v = values();
    return mg::place_boxes(buckets, boxes, names, v, "ckpt");
  }
};

}  // namespace

TEST_CASE("megatron buckets: params placed by value, across chunk splits, in bf16, f16 and f32") {
  Fixture f;
  const size_t out = f.box("output_layer.weight", {0, 0}, f.random(100), DType::kF32);
  const size_t l1 = f.box("decoder.layers.mlp.linear_fc1.weight", {1, 0, 0}, f.random(40));
  const size_t l0 = f.box("decoder.layers.mlp.linear_fc1.weight", {0, 0, 0}, f.random(40));
  const size_t half = f.box("decoder.final_layernorm.weight", {0}, f.random(24), DType::kF16);
  const size_t buffer_ = f.box("decoder.layers.self_attention.rotary.inv_freq", {0}, f.random(50));  // no param
  const size_t b0 = f.bucket(0, {out, l1}, {150});  // l1 split between two ranks at 150
  const size_t b1 = f.bucket(0, {l0, half});
  auto placed = f.place();
  REQUIRE_MESSAGE(placed.ok(), placed.status().message());
  REQUIRE(placed->size() == 5);
  REQUIRE((*placed)[out]);
  CHECK((*placed)[out]->bucket == b0);
  CHECK((*placed)[out]->begin == 0);
  CHECK((*placed)[l1]->bucket == b0);
  CHECK((*placed)[l1]->begin == 128);
  CHECK((*placed)[l0]->bucket == b1);
  CHECK((*placed)[l0]->begin == 0);
  CHECK((*placed)[half]->begin == 64);
  CHECK_FALSE((*placed)[buffer_]);
}

TEST_CASE("megatron buckets: one key's equal layers by Megatron's reverse layout; other equal weights refused") {
  Fixture f;
  const size_t w = f.box("decoder.layers.mlp.linear_fc1.weight", {0, 0, 0}, f.random(64));
  const size_t ln1 = f.box("decoder.layers.input_layernorm.weight", {1, 0}, std::vector<float>(16, 1.f));
  const size_t ln0 = f.box("decoder.layers.input_layernorm.weight", {0, 0}, std::vector<float>(16, 1.f));
  f.bucket(0, {ln1, w, ln0});
  auto placed = f.place();
  REQUIRE_MESSAGE(placed.ok(), placed.status().message());
  CHECK((*placed)[ln1]->begin == 0);   // the later layer first
  CHECK((*placed)[ln0]->begin == 128);
  // one key's equal layers in two buffers (model chunks under virtual pipeline parallelism, whose
  // buffers Megatron orders first to last): not told apart
  Fixture v;
  const size_t v1 = v.box("decoder.layers.input_layernorm.weight", {1, 0}, std::vector<float>(16, 1.f));
  const size_t v0 = v.box("decoder.layers.input_layernorm.weight", {0, 0}, std::vector<float>(16, 1.f));
  v.bucket(0, {v0}, {}, 0);
  v.bucket(0, {v1}, {}, 1);
  auto chunks = v.place();
  REQUIRE_FALSE(chunks.ok());
  CHECK(chunks.status().message().find("one key's, in different buffers") != std::string::npos);
  // the same values under another key too: not told apart
  Fixture g;
  const size_t a = g.box("decoder.layers.input_layernorm.weight", {0, 0}, std::vector<float>(16, 1.f));
  const size_t b = g.box("decoder.layers.pre_mlp_layernorm.weight", {0, 0}, std::vector<float>(16, 1.f));
  g.bucket(0, {a, b});
  auto refused = g.place();
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("equal everywhere") != std::string::npos);
  CHECK(refused.status().message().find("pre_mlp_layernorm") != std::string::npos);
}

TEST_CASE("megatron buckets: a param replicated over tensor-parallel ranks is read from the first") {
  Fixture f;
  const size_t ln = f.box("decoder.final_layernorm.weight", {0}, f.random(8));
  const size_t c0 = f.box("decoder.layers.mlp.linear_fc1.weight", {0, 0, 0}, f.random(40));
  const size_t c1 = f.box("decoder.layers.mlp.linear_fc1.weight", {0, 20, 0}, f.random(40));
  f.bucket(1, {ln, c1});  // domain 1 first in the list
  const size_t first = f.bucket(0, {ln, c0});
  auto placed = f.place();
  REQUIRE_MESSAGE(placed.ok(), placed.status().message());
  CHECK((*placed)[ln]->bucket == first);
  CHECK((*placed)[c1]->bucket == 0);
  CHECK((*placed)[c0]->bucket == first);
}

TEST_CASE("megatron buckets: weights alike at every sampled place are told apart at every element") {
  Fixture f;
  auto v = f.random(1000);
  auto u = v;
  u[501] += 1;  // not among the 32 sampled places
  const auto sampled = mg::sample_places(1000);
  REQUIRE(std::find(sampled.begin(), sampled.end(), 501) == sampled.end());
  const size_t a = f.box("a.weight", {0, 0}, v, DType::kF32);
  const size_t b = f.box("b.weight", {0, 0}, u, DType::kF32);
  f.bucket(0, {b, a});
  auto placed = f.place();
  REQUIRE_MESSAGE(placed.ok(), placed.status().message());
  CHECK((*placed)[b]->begin == 0);
  CHECK((*placed)[a]->begin == 1024);
}

TEST_CASE("megatron buckets: state no weight matches, or a weight placed in part, is refused by name") {
  Fixture f;
  const size_t a = f.box("a.weight", {0, 0}, f.random(100));
  const size_t b = f.box("b.weight", {0, 0}, f.random(100));
  f.bucket(0, {a, b});
  f.weights[b] = f.random(100);  // stale weights
  auto stale = f.place();
  REQUIRE_FALSE(stale.ok());
  CHECK(stale.status().message().find("elements [100, 228) of bucket 0") != std::string::npos);
  Fixture g;
  const size_t p0 = g.box("c.weight", {0, 0}, g.random(30));
  g.box("c.weight", {30, 0}, g.random(30));  // its other part in no bucket
  g.bucket(0, {p0});
  auto part = g.place();
  REQUIRE_FALSE(part.ok());
  CHECK(part.status().message().find("1 of the 2 parts of 'c.weight'") != std::string::npos);
  CHECK(part.status().message().find("'c.weight' at (30, 0)") != std::string::npos);
  // chunk starts that do not tile the bucket
  Fixture h;
  h.bucket(0, {h.box("d.weight", {0}, h.random(10))});
  h.buckets[0].starts = {1};
  CHECK_FALSE(h.place().ok());
}

TEST_CASE("dtype: f32 to f16 rounds to nearest even, as torch's Half") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(f32_to_f16(f) == h);
  }
  CHECK(f32_to_f16(1.f + 0x1p-11f) == 0x3c00);                // halfway: to even (down)
  CHECK(f32_to_f16(1.f + 3 * 0x1p-11f) == 0x3c02);            // halfway: to even (up)
  CHECK(f32_to_f16(65519.f) == 0x7bff);
  CHECK(f32_to_f16(65520.f) == 0x7c00);
  CHECK(f32_to_f16(0x1p-25f) == 0);                            // halfway to the least subnormal: to even
  CHECK(f32_to_f16(0x1.8p-25f) == 1);
  CHECK(f32_to_f16(-0x1p-14f) == 0x8400);
  CHECK(f32_to_f16(std::nanf("")) == 0x7e00);
}

TEST_CASE("megatron buckets: dp_zero_gather_scatter's flat buffer walked by value, then placed") {
  CHECK(mg::param_state_key("optimizer.distributed.dp_group_idx_3.param_state/shard_0_1") == std::pair{-1, int64_t{3}});
  CHECK(mg::param_state_key("chained_1.optimizer.distributed.dp_group_idx_0.param_state/shard_0_1") ==
        std::pair{1, int64_t{0}});
  CHECK_FALSE(mg::param_state_key("optimizer.distributed.dp_group_idx_3.param_state"));
  CHECK_FALSE(mg::param_state_key("optimizer.distributed.dp_group_idx_3.optimizer/shard_0_1"));
  Fixture f;
  const size_t out = f.box("output_layer.weight", {0, 0}, f.random(100));
  const size_t l1 = f.box("decoder.layers.mlp.linear_fc1.weight", {1, 0, 0}, f.random(40));
  const size_t ln1 = f.box("decoder.layers.input_layernorm.weight", {1, 0}, std::vector<float>(16, 1.f));
  const size_t ln0 = f.box("decoder.layers.input_layernorm.weight", {0, 0}, std::vector<float>(16, 1.f));
  const size_t l0 = f.box("decoder.layers.mlp.linear_fc1.weight", {0, 0, 0}, f.random(40));
  const size_t other = f.box("decoder.layers.mlp.linear_fc2.weight", {0, 0, 0}, f.random(40), DType::kF32);  // not bf16
  const size_t b = f.flat(0, {{out, l1, ln1}, {ln0, l0}});
  // bucket 0: out [0, 100), l1 [128, 168), ln1 [192, 208); bucket 1 from 208: ln0 [208, 224), l0 [272, 312)
  REQUIRE(f.buckets[b].numel == 312);
  auto bounds = f.bounds(b);
  REQUIRE_MESSAGE(bounds.ok(), bounds.status().message());
  CHECK(*bounds == std::vector<int64_t>{0, 100, 128, 168, 192, 208, 224, 272});
  f.buckets[b].starts = *bounds;
  auto placed = f.place();
  REQUIRE_MESSAGE(placed.ok(), placed.status().message());
  CHECK((*placed)[out]->begin == 0);
  CHECK((*placed)[l1]->begin == 128);
  CHECK((*placed)[ln1]->begin == 192);  // equal layer norms: the later layer first
  CHECK((*placed)[ln0]->begin == 208);
  CHECK((*placed)[l0]->begin == 272);
  CHECK_FALSE((*placed)[other]);
}

TEST_CASE("megatron buckets: a flat buffer whose params no weight matches, or that fit two ways, is refused") {
  Fixture f;
  const size_t a = f.box("a.weight", {0, 0}, f.random(10));
  const size_t gone = f.box("b.weight", {0, 0}, f.random(30));
  const size_t b = f.flat(0, {{a, gone}});
  f.weights[gone] = f.random(30);  // stale weights beside the optimizer's state
  auto stale = f.bounds(b);
  REQUIRE_FALSE(stale.ok());
  CHECK(stale.status().message().find("no model weight's values lie at element 10 (nor at its 64-aligned start 64)") !=
        std::string::npos);
  Fixture z;
  const size_t x = z.box("x.weight", {0, 0}, z.random(10));
  const size_t zero = z.box("zero.bias", {0}, std::vector<float>(16, 0.f));  // as the padding before it
  const size_t zb = z.flat(0, {{x, zero}});
  auto both = z.bounds(zb);
  REQUIRE_FALSE(both.ok());
  CHECK(both.status().message().find("both where the last param ended (element 10) and at its 64-aligned start 64") !=
        std::string::npos);
}
