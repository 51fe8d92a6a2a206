// load_shard / verify_resume_shard: every rank of every world size M gets exactly its range of a
// checkpoint written by N ranks, in the encoding it asks for, and the pieces add up to the whole.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "optstate/checkpoint.h"
#include "optstate/shard.h"
#include "optstate/transform.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;

namespace {

// w: 37x11 (8-bit eligible at min 100), b: 13 (stays dense), a bf16 "param" entry on w.
OptimizerState larger_state() {
  OptimizerState s;
  s.kind = "adamw";
  ParamGroup g;
  g.params = {"w", "b"};
  s.groups = {g};
  auto values = [](int64_t n, float scale, bool positive) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float x = std::sin(0.37f * static_cast<float>(i) + scale) * scale;
      v[static_cast<size_t>(i)] = positive ? x * x : x;
    }
    return testing::f32_buffer(v);
  };
  ParamState w;
  w.shape = {37, 11};
  w.step = 9;
  Entry m, v, p;
  m.values = values(407, 0.5f, false);
  v.values = values(407, 0.01f, true);
  p.dtype = DType::kBF16;
  std::vector<uint16_t> bf(407);
  for (size_t i = 0; i < bf.size(); ++i) bf[i] = static_cast<uint16_t>(0x3f00 + i);
  p.values = Buffer::copy_of(std::as_bytes(std::span(bf)));
  w.param_dtype = DType::kBF16;
  w.entries = {{kExpAvg, m}, {kExpAvgSq, v}, {kParam, p}};
  ParamState b;
  b.shape = {13};
  b.step = 9;
  Entry bm, bv;
  bm.values = values(13, 2.0f, false);
  bv.values = values(13, 3.0f, true);
  b.entries = {{kExpAvg, bm}, {kExpAvgSq, bv}};
  s.params = {{"w", w}, {"b", b}};
  return s;
}

// Concatenates the ranks' buffers of one component.
std::vector<std::byte> joined(const std::vector<OptimizerState>& shards, const std::string& fqn,
                              const std::string& entry, Component c) {
  std::vector<std::byte> out;
  for (const auto& s : shards) {
    const Buffer& b = s.params.at(fqn).entries.at(entry).buffer(c);
    out.insert(out.end(), b.data, b.data + b.size);
  }
  return out;
}

void check_equal_pieces(const std::vector<OptimizerState>& shards, const OptimizerState& whole) {
  for (const auto& [fqn, ps] : whole.params)
    for (const auto& [name, e] : ps.entries)
      for (Component c : e.components()) {
        const std::string key = entry_key(fqn, name);  // clang < 16 cannot capture a structured binding
        CAPTURE(key);
        CAPTURE(component_name(c));
        const Entry& got = shards[0].params.at(fqn).entries.at(name);
        CHECK(got.encoding == e.encoding);
        CHECK(got.block_size == e.block_size);
        const auto j = joined(shards, fqn, name, c);
        const Buffer& b = e.buffer(c);
        REQUIRE(j.size() == b.size);
        CHECK(std::memcmp(j.data(), b.data, b.size) == 0);
      }
}

}  // namespace

TEST_CASE("load_shard: M ranks of a checkpoint written by N ranks give back the whole state, in every encoding") {
  testing::TempDir dir;
  const OptimizerState dense = larger_state();
  const QuantizeOptions q{16, 100};
  const OptimizerState eight = *quantize_state(dense, q);
  const OptimizerState eight_as_fp32 = *dequantize_state(eight);
  const FormatDriver& native = *find_format("native");
  int n = 0;
  for (const OptimizerState* saved : {&dense, &eight})
    for (int N : {1, 3}) {
      const auto path = dir.path / fmt::format("ck{}", n++);
      WriteOptions wo;
      wo.world_size = N;
      REQUIRE(write_checkpoint(native, *saved, path, wo).ok());
      auto reader = native.open(path);
      REQUIRE(reader.ok());
      for (TargetEncoding to : {TargetEncoding::kAsStored, TargetEncoding::kFp32, TargetEncoding::k8bit})
        for (int M = 1; M <= 5; ++M) {
          CAPTURE(N);
          CAPTURE(M);
          CAPTURE(static_cast<int>(to));
          std::vector<OptimizerState> shards;
          for (int r = 0; r < M; ++r) {
            ShardLoadOptions o;
            o.world = M;
            o.rank = r;
            o.to = to;
            o.quant = q;
            auto s = load_shard(**reader, o);
            REQUIRE(s.ok());
            auto diffs = verify_resume_shard(*s, **reader, o);
            REQUIRE(diffs.ok());
            CHECK(diffs->empty());
            // Each buffer holds exactly shard_range of its component.
            for (const auto& [fqn, ps] : s->params)
              for (const auto& [name, e] : ps.entries)
                for (Component c : e.components())
                  CHECK(static_cast<int64_t>(e.buffer(c).size) ==
                        shard_range(e, c, ps.shape, M, r).size() * component_elem_size(e, c));
            shards.push_back(std::move(*s));
          }
          // Expected whole state: the stored one converted the way the target says.
          const OptimizerState& expect = to == TargetEncoding::kFp32  ? (saved == &dense ? dense : eight_as_fp32)
                                         : to == TargetEncoding::k8bit ? eight
                                                                       : *saved;
          check_equal_pieces(shards, expect);
        }
    }
}

TEST_CASE("load_shard: 8-bit state is re-blocked only when the target block size differs") {
  testing::TempDir dir;
  const OptimizerState eight = *quantize_state(larger_state(), {16, 100});
  REQUIRE(write_checkpoint(*find_format("native"), eight, dir.path / "c", {}).ok());
  auto reader = find_format("native")->open(dir.path / "c");
  REQUIRE(reader.ok());
  ShardLoadOptions o;
  o.world = 2;
  o.to = TargetEncoding::k8bit;
  o.quant = {32, 100};
  auto s = load_shard(**reader, o);
  REQUIRE(s.ok());
  const Entry& m = s->params.at("w").entries.at(kExpAvg);
  CHECK(m.block_size == 32);
  CHECK(m.absmax.size == 7 * 4);  // rank 0 of 2 over 13 blocks of 32: 7 blocks
  // Its values are those of the 16-block state requantized in blocks of 32.
  const OptimizerState expect = *quantize_state(*dequantize_state(eight), {32, 100});
  const Entry& em = expect.params.at("w").entries.at(kExpAvg);
  CHECK(std::memcmp(m.codes.data, em.codes.data, m.codes.size) == 0);
}

TEST_CASE("load_shard: whole_params gives every rank the whole weights; verify names a wrong byte") {
  testing::TempDir dir;
  const OptimizerState dense = larger_state();
  REQUIRE(write_checkpoint(*find_format("native"), dense, dir.path / "c", {}).ok());
  auto reader = find_format("native")->open(dir.path / "c");
  REQUIRE(reader.ok());
  ShardLoadOptions o;
  o.world = 3;
  o.rank = 2;
  o.whole_params = true;
  auto s = load_shard(**reader, o);
  REQUIRE(s.ok());
  CHECK(s->params.at("w").entries.at(kParam).values.size == 407 * 2);
  CHECK(s->params.at("w").entries.at(kExpAvg).values.size == 11 * 11 * 4);  // rows 26..36 of 37 (chunks of 13)
  // Spoil one element of the live shard and one step: both named.
  std::vector<std::byte> bytes(s->params.at("w").entries.at(kExpAvg).values.span().begin(),
                               s->params.at("w").entries.at(kExpAvg).values.span().end());
  bytes[4 * 5] ^= std::byte{1};
  s->params.at("w").entries.at(kExpAvg).values = Buffer::take(std::move(bytes));
  s->params.at("b").step = 10;
  auto diffs = verify_resume_shard(*s, **reader, o);
  REQUIRE(diffs.ok());
  REQUIRE(diffs->size() == 2);
  CHECK((*diffs)[0].find("step live 10") != std::string::npos);
  CHECK((*diffs)[1].find("'w.exp_avg' values (rank 2 of 3)") != std::string::npos);
  CHECK((*diffs)[1].find("first at element 291") != std::string::npos);  // 26*11 + 5
  ShardLoadOptions bad = o;
  bad.rank = 3;
  CHECK(!load_shard(**reader, bad).ok());
}

TEST_CASE("load_shard check_only: reads and verifies every range, keeps no byte, never asks the destination") {
  testing::TempDir dir;
  const OptimizerState eight = *quantize_state(larger_state(), {16, 100});
  REQUIRE(write_checkpoint(*find_format("native"), eight, dir.path / "c", {}).ok());
  ShardLoadOptions o;
  o.to = TargetEncoding::kFp32;  // a conversion (8-bit to fp32) and ranges read as stored (param, b)
  o.check_only = true;
  int asked = 0;
  o.destination = [&](const std::string&, const std::string&, Component, const Entry&, size_t) {
    ++asked;
    return std::span<std::byte>();
  };
  for (int world : {1, 2}) {  // whole components (streamed), and rank 1's parts of them (scratch)
    CAPTURE(world);
    o.world = world;
    o.rank = world - 1;
    auto reader = find_format("native")->open(dir.path / "c");
    REQUIRE(reader.ok());
    auto s = load_shard(**reader, o);
    REQUIRE(s.ok());
    CHECK(asked == 0);
    CHECK(s->params.at("w").shape == std::vector<int64_t>{37, 11});
    CHECK(s->params.at("w").entries.at(kExpAvg).encoding == Encoding::kDense);  // the target's metadata
    for (const auto& [fqn, ps] : s->params)
      for (const auto& [name, e] : ps.entries)
        for (Component c : e.components()) CHECK(e.buffer(c).empty());
  }
  // One flipped byte in the first chunk (offset 0) of the data file: check_only fails as a load would.
  o.world = 1;
  o.rank = 0;
  {
    std::fstream f(dir.path / "c" / "data" / "rank-00000.bin", std::ios::binary | std::ios::in | std::ios::out);
    char byte = 0;
    REQUIRE(f.read(&byte, 1));
    byte ^= 0x10;
    f.seekp(0);
    REQUIRE(f.write(&byte, 1));
  }
  auto reader = find_format("native")->open(dir.path / "c");
  REQUIRE(reader.ok());
  auto s = load_shard(**reader, o);
  REQUIRE(!s.ok());
  CHECK(s.status().message().find("checksum mismatch") != std::string::npos);
  CHECK(s.status().message().find("rank-00000.bin") != std::string::npos);
}
