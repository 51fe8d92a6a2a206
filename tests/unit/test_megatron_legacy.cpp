// Megatron-LM's legacy checkpoints (formats/megatron/megatron_layout.cpp): the rank folders' and
// tracker's names, and where tensor parallelism puts each rank's shard of a param.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "megatron/megatron_layout.h"

namespace mg = optstate::megatron;

TEST_CASE("megatron legacy: rank folders, iteration folders and the tracker file") {
  CHECK(mg::parse_rank_dir("mp_rank_00") == mg::RankDir{0, {}});
  CHECK(mg::parse_rank_dir("mp_rank_03_001") == mg::RankDir{3, {1}});
  CHECK(mg::parse_rank_dir("mp_rank_01_002_003") == mg::RankDir{1, {2, 3}});
  CHECK(mg::parse_rank_dir("mp_rank_128") == mg::RankDir{128, {}});
  for (const char* bad : {"mp_rank_", "mp_rank_0", "mp_rank_00_01", "mp_rank_00_", "mp_rank_00_001_002_003",
                          "mp_rank_0a", "mp_rank_-1", "rank_00", "mp_rank_00_0x1", "mp_rank_ 00"})
    CHECK_MESSAGE(!mg::parse_rank_dir(bad), bad);
  CHECK(mg::is_iteration_dir("iter_0000003"));
  CHECK(mg::is_iteration_dir("iter_12345678"));
  CHECK(mg::is_iteration_dir("release"));
  CHECK(!mg::is_iteration_dir("iter_3"));
  CHECK(!mg::is_iteration_dir("iter_00000x3"));
  CHECK(mg::iteration_dir_of_tracker("3") == "iter_0000003");
  CHECK(mg::iteration_dir_of_tracker("1000\n") == "iter_0001000");
  CHECK(mg::iteration_dir_of_tracker("12345678") == "iter_12345678");
  CHECK(mg::iteration_dir_of_tracker("release") == "release");
  CHECK(!mg::iteration_dir_of_tracker(""));
  CHECK(!mg::iteration_dir_of_tracker("-1"));
  CHECK(!mg::iteration_dir_of_tracker("3 4"));
  CHECK(!mg::iteration_dir_of_tracker("../x"));
}

TEST_CASE("megatron legacy: the dim tensor parallelism splits, by Megatron's layer names") {
  // Megatron-Core's
  CHECK(mg::tensor_parallel_dim("decoder.layers.0.self_attention.linear_qkv.weight") == 0);
  CHECK(mg::tensor_parallel_dim("decoder.layers.0.self_attention.linear_qkv.bias") == 0);
  CHECK(mg::tensor_parallel_dim("decoder.layers.0.self_attention.linear_proj.weight") == 1);
  CHECK(!mg::tensor_parallel_dim("decoder.layers.0.self_attention.linear_proj.bias"));
  CHECK(!mg::tensor_parallel_dim("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"));
  CHECK(mg::tensor_parallel_dim("decoder.layers.1.mlp.linear_fc1.weight") == 0);
  CHECK(mg::tensor_parallel_dim("decoder.layers.1.mlp.linear_fc2.weight") == 1);
  CHECK(mg::tensor_parallel_dim("decoder.layers.1.mlp.experts.linear_fc1.weight3") == 0);
  CHECK(mg::tensor_parallel_dim("decoder.layers.1.mlp.experts.linear_fc2.weight12") == 1);
  CHECK(mg::tensor_parallel_dim("embedding.word_embeddings.weight") == 0);
  CHECK(!mg::tensor_parallel_dim("embedding.position_embeddings.weight"));
  CHECK(mg::tensor_parallel_dim("output_layer.weight") == 0);
  CHECK(!mg::tensor_parallel_dim("decoder.final_layernorm.weight"));
  CHECK(!mg::tensor_parallel_dim("decoder.layers.1.mlp.router.weight"));
  CHECK(!mg::tensor_parallel_dim("decoder.layers.1.mlp.linear_fc1.weightx"));
  // the legacy model's
  CHECK(mg::tensor_parallel_dim("language_model.encoder.layers.0.self_attention.query_key_value.weight") == 0);
  CHECK(mg::tensor_parallel_dim("language_model.encoder.layers.0.self_attention.dense.weight") == 1);
  CHECK(mg::tensor_parallel_dim("language_model.encoder.layers.0.mlp.dense_h_to_4h.bias") == 0);
  CHECK(mg::tensor_parallel_dim("language_model.encoder.layers.0.mlp.dense_4h_to_h.weight") == 1);
  CHECK(!mg::tensor_parallel_dim("weight"));

  CHECK(mg::second_projection_of("decoder.layers.1.mlp.linear_fc1.weight") == "decoder.layers.1.mlp.linear_fc2.weight");
  CHECK(mg::second_projection_of("decoder.layers.1.mlp.linear_fc1.bias") == "decoder.layers.1.mlp.linear_fc2.weight");
  CHECK(mg::second_projection_of("decoder.layers.1.mlp.experts.linear_fc1.weight7") ==
        "decoder.layers.1.mlp.experts.linear_fc2.weight7");
  CHECK(mg::second_projection_of("l.0.mlp.dense_h_to_4h.weight") == "l.0.mlp.dense_4h_to_h.weight");
  CHECK(!mg::second_projection_of("decoder.layers.1.mlp.linear_fc2.weight"));
  CHECK(!mg::second_projection_of("decoder.layers.1.self_attention.linear_qkv.weight"));
}

TEST_CASE("megatron legacy: a tensor-parallel rank's shard placed in the whole param") {
  using Runs = std::vector<mg::Run>;
  // column-parallel [6, 4] of rank 1 of 2: rows 6..11 of [12, 4], one run
  auto s = mg::shard_runs({6, 4}, 0, false, 1, 2);
  REQUIRE(s);
  CHECK(s->whole == std::vector<int64_t>{12, 4});
  CHECK(s->runs == Runs{{0, 24, 24}});
  // row-parallel [3, 2] of rank 2 of 3: columns 4..5 of [3, 6], a run per row
  s = mg::shard_runs({3, 2}, 1, false, 2, 3);
  REQUIRE(s);
  CHECK(s->whole == std::vector<int64_t>{3, 6});
  CHECK(s->runs == Runs{{0, 4, 2}, {2, 10, 2}, {4, 16, 2}});
  // SwiGLU's fc1 [4, 3] of rank 1 of 2 (gate rows 0..1, up rows 2..3): whole [8, 3] is the gate's 4
  // rows above up's 4; the rank's gate rows are 2..3, its up rows 6..7
  s = mg::shard_runs({4, 3}, 0, true, 1, 2);
  REQUIRE(s);
  CHECK(s->whole == std::vector<int64_t>{8, 3});
  CHECK(s->runs == Runs{{0, 6, 6}, {6, 18, 6}});
  // ... and its bias [4]
  s = mg::shard_runs({4}, 0, true, 0, 2);
  REQUIRE(s);
  CHECK(s->runs == Runs{{0, 0, 2}, {2, 4, 2}});
  CHECK(!mg::shard_runs({4, 3}, 2, false, 0, 2));   // no such dim
  CHECK(!mg::shard_runs({3, 3}, 0, true, 0, 2));    // odd halves
  CHECK(!mg::shard_runs({4, 3}, 1, true, 0, 2));    // a gated shard splits rows
  CHECK(!mg::shard_runs({4, 3}, 0, false, 2, 2));   // no such rank
  CHECK(!mg::shard_runs({int64_t{1} << 40, 3}, 0, false, 0, 2));
}

namespace {

// A buffer laid out as Megatron lays one: `starts` per tensor (module order), each tensor's values
// distinct, the padding zeros; the main params are the weights widened exactly (bf16 patterns).
struct FakeBuffer {
  std::vector<std::vector<uint32_t>> weights;
  std::vector<uint32_t> buffer;
  mg::BufferValues values() const {
    mg::BufferValues v;
    v.buffer = [this](std::span<const int64_t> at) -> optstate::Result<std::vector<uint32_t>> {
      std::vector<uint32_t> out;
      for (int64_t i : at) out.push_back(buffer.at(static_cast<size_t>(i)));
      return out;
    };
    v.tensor = [this](size_t t, std::span<const int64_t> at) -> optstate::Result<std::vector<uint32_t>> {
      std::vector<uint32_t> out;
      for (int64_t i : at) out.push_back(weights.at(t).at(static_cast<size_t>(i)));
      return out;
    };
    return v;
  }
};

FakeBuffer fake(const std::vector<int64_t>& numels, const std::vector<int64_t>& starts, int64_t total) {
  FakeBuffer f;
  f.buffer.assign(static_cast<size_t>(total), 0);
  uint32_t next = 1;
  for (size_t t = 0; t < numels.size(); ++t) {
    auto& w = f.weights.emplace_back();
    for (int64_t i = 0; i < numels[t]; ++i) {
      w.push_back(next++);
      if (starts[t] >= 0) f.buffer.at(static_cast<size_t>(starts[t] + i)) = w.back();
    }
  }
  return f;
}

}  // namespace

TEST_CASE("megatron legacy: the distributed optimizer's params found in its coalesced buffer") {
  const std::vector<std::string> names{"a", "b", "c", "d"};
  // module order a, b, c, d; laid out d, c, b, a: d at 0 (5), c at 64 (aligned, 70 elements, the
  // bucket full), b at 134 (a new bucket: right where c ended), a at 198 (aligned from b's bucket's
  // start, 134 + 64)
  const std::vector<int64_t> numels{3, 10, 70, 5};
  FakeBuffer f = fake(numels, {198, 134, 64, 0}, 201);
  auto placed = mg::place_in_buffer(201, numels, names, f.values(), "buf");
  REQUIRE(placed.ok());
  CHECK(*placed == std::vector<std::optional<int64_t>>{198, 134, 64, 0});
  // a frozen param (in no buffer) between them: left out, the rest placed
  f = fake({3, 7, 10, 70, 5}, {198, -1, 134, 64, 0}, 201);
  placed = mg::place_in_buffer(201, {3, 7, 10, 70, 5}, {"a", "frozen", "b", "c", "d"}, f.values(), "buf");
  REQUIRE(placed.ok());
  CHECK(*placed == std::vector<std::optional<int64_t>>{198, std::nullopt, 134, 64, 0});
  // weights that do not match the main params where Megatron put them: refused, naming the param
  f = fake(numels, {198, 134, 64, 0}, 201);
  f.weights[2][0] ^= 1;  // c's (a sampled place: the first)
  placed = mg::place_in_buffer(201, numels, names, f.values(), "buf");
  REQUIRE(!placed.ok());
  CHECK(placed.status().message().find("fill 5 of the buffer's 201 elements") != std::string::npos);
  CHECK(placed.status().message().find("weights of 'c'") != std::string::npos);
  // a buffer longer than its params: refused
  f = fake(numels, {198, 134, 64, 0}, 206);
  CHECK(!mg::place_in_buffer(206, numels, names, f.values(), "buf").ok());
  // an all-zero param that fits both at its aligned start and where the last one ended: refused
  f = fake(numels, {198, 134, 64, 0}, 201);
  std::fill(f.weights[2].begin(), f.weights[2].end(), 0);
  for (int i = 64; i < 134; ++i) f.buffer[static_cast<size_t>(i)] = 0;
  placed = mg::place_in_buffer(201, numels, names, f.values(), "buf");
  REQUIRE(!placed.ok());
  CHECK(placed.status().message().find("'c' fits the buffer both at element 5 and at 64") != std::string::npos);
}

TEST_CASE("megatron legacy: a pipeline stage's layers numbered again from its offset") {
  const auto l = mg::layer_of("decoder.layers.3.mlp.linear_fc1.weight");
  REQUIRE(l);
  CHECK(l->stack == "decoder.layers.");
  CHECK(l->index == 3);
  CHECK(mg::layer_of("language_model.encoder.layers.12.self_attention.dense.weight")->stack ==
        "language_model.encoder.layers.");
  CHECK(!mg::layer_of("embedding.word_embeddings.weight"));
  CHECK(!mg::layer_of("decoder.final_layernorm.weight"));
  CHECK(!mg::layer_of("decoder.mylayers.3.w"));
  CHECK(!mg::layer_of("decoder.layers.x.w"));
  CHECK(mg::renumber_layer("decoder.layers.3.mlp.linear_fc1.weight", 4) == "decoder.layers.7.mlp.linear_fc1.weight");
  CHECK(mg::renumber_layer("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 2) ==
        "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight");
  CHECK(mg::renumber_layer("output_layer.weight", 4) == "output_layer.weight");
}

TEST_CASE("megatron legacy: an expert rank's experts numbered on from its first") {
  CHECK(mg::is_expert_param("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"));
  CHECK(mg::is_expert_param("decoder.layers.0.mlp.experts.linear_fc2.weight3"));
  CHECK(!mg::is_expert_param("decoder.layers.0.mlp.shared_experts.linear_fc1.weight"));
  CHECK(!mg::is_expert_param("decoder.layers.0.mlp.router.weight"));
  CHECK(!mg::is_expert_param("decoder.layers.0.mlp.linear_fc1.weight"));

  CHECK(mg::expert_of("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight") == 1);
  CHECK(mg::expert_of("decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.bias") == 12);
  CHECK(mg::expert_of("decoder.layers.0.mlp.experts.linear_fc1.weight3") == 3);
  CHECK(mg::expert_of("decoder.layers.0.mlp.experts.linear_fc2.bias10") == 10);
  // the legacy GroupedMLP's weight1 holds every local expert: no one expert's
  CHECK(!mg::expert_of("decoder.layers.0.mlp.experts.weight1"));
  CHECK(!mg::expert_of("decoder.layers.0.mlp.experts.linear_fc1.weight"));
  CHECK(!mg::expert_of("decoder.layers.0.mlp.experts.local_experts.x.linear_fc1.weight"));
  CHECK(!mg::expert_of("decoder.layers.0.mlp.experts.local_experts.1"));
  CHECK(!mg::expert_of("decoder.layers.0.mlp.linear_fc1.weight"));

  CHECK(mg::renumber_expert("decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight", 4) ==
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight");
  CHECK(mg::renumber_expert("decoder.layers.3.mlp.experts.linear_fc2.weight1", 8) ==
        "decoder.layers.3.mlp.experts.linear_fc2.weight9");
  CHECK(mg::renumber_expert("decoder.layers.3.mlp.router.weight", 8) == "decoder.layers.3.mlp.router.weight");

  // a stage's layer and an expert rank's experts at once
  const std::map<std::string, int64_t> offsets{{"decoder.layers.", 2}};
  CHECK(mg::global_name("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", &offsets, 2) ==
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight");
  CHECK(mg::global_name("decoder.layers.1.mlp.router.weight", &offsets, 2) == "decoder.layers.3.mlp.router.weight");
  CHECK(mg::global_name("embedding.word_embeddings.weight", nullptr, 0) == "embedding.word_embeddings.weight");
}

TEST_CASE("megatron legacy: a virtual pipeline's model chunks named apart, then numbered over the model") {
  const auto c = mg::chunk_of("model1.decoder.layers.0.mlp.linear_fc1.weight");
  REQUIRE(c);
  CHECK(c->chunk == 1);
  CHECK(c->rest == "decoder.layers.0.mlp.linear_fc1.weight");
  CHECK(mg::chunk_of("model12.output_layer.weight")->chunk == 12);
  CHECK(!mg::chunk_of("model.decoder.layers.0.w"));
  CHECK(!mg::chunk_of("modelx.w"));
  CHECK(!mg::chunk_of("decoder.layers.0.w"));
  CHECK(!mg::chunk_of("model1"));
  // a chunk's stack of layers carries its prefix: chunk 1 of stage 0 after chunk 0 of both stages
  const auto l = mg::layer_of("model1.decoder.layers.0.mlp.linear_fc1.weight");
  REQUIRE(l);
  CHECK(l->stack == "model1.decoder.layers.");
  const std::map<std::string, int64_t> offsets{{"model0.decoder.layers.", 0}, {"model1.decoder.layers.", 2}};
  CHECK(mg::global_name("model1.decoder.layers.0.mlp.linear_fc1.weight", &offsets, 0, true) ==
        "decoder.layers.2.mlp.linear_fc1.weight");
  CHECK(mg::global_name("model0.embedding.word_embeddings.weight", &offsets, 0, true) ==
        "embedding.word_embeddings.weight");
  CHECK(mg::global_name("model1.decoder.layers.0.mlp.linear_fc1.weight", &offsets, 0, false) ==
        "model1.decoder.layers.2.mlp.linear_fc1.weight");
}
