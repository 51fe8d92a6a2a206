// nanotron checkpoints (formats/nanotron/nanotron_layout.cpp): the optimizer files' names,
// optimizer_config.json and ZeRO-1's split of a param over data-parallel ranks.
#include <doctest/doctest.h>

#include <string>

#include "nanotron/nanotron_layout.h"

using namespace optstate;
namespace nt = optstate::nanotron;

TEST_CASE("nanotron: optimizer file names, with and without ZeRO's and expert parallelism's ranks") {
  const auto plain = nt::parse_file_name("optimizer_pp-1-of-2_tp-0-of-4_exp-0-of-1.pt");
  REQUIRE(plain);
  CHECK(plain->pp == 1);
  CHECK(plain->pp_size == 2);
  CHECK(!plain->dp);
  CHECK(plain->tp == 0);
  CHECK(plain->tp_size == 4);
  const auto zero = nt::parse_file_name("optimizer_pp-0-of-1_dp-3-of-8_tp-1-of-2_exp-0-of-1.pt");
  REQUIRE(zero);
  CHECK(*zero->dp == 3);
  CHECK(*zero->dp_size == 8);
  const auto old = nt::parse_file_name("optimizer_pp-0-of-1_tp-0-of-1.pt");  // before expert parallelism
  REQUIRE(old);
  CHECK(old->exp_size == 1);
  for (const char* bad : {"optimizer_config.json", "optimizer_pp-2-of-2_tp-0-of-1_exp-0-of-1.pt",
                          "optimizer_pp-0-of-0_tp-0-of-1.pt", "optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.pth",
                          "optimizer_pp--1-of-2_tp-0-of-1.pt", "optimizer_pp-0-of-1_tp-0-of-1_x.pt",
                          "optimizer_pp-0-of-1_dp-0-of-2.pt", "lr_scheduler_pp-0-of-1_tp-0-of-1.pt",
                          "optimizer_pp-0-of-1_tp-0-of-99999999999999999999.pt", "optimizer_pp-+0-of-1_tp-0-of-1.pt"})
    CHECK_MESSAGE(!nt::parse_file_name(bad), bad);
}

TEST_CASE("nanotron: optimizer_config.json of a plain and of a ZeRO-1 optimizer") {
  const auto plain = nt::parse_config(
      R"({"type": "OptimizerFromGradientAccumulator", "parallelism": {"tp_size": "1", "dp_size": "2",
          "pp_size": "2", "expert_parallel_size": "1"}, "configs": {}})", "c.json");
  REQUIRE(plain.ok());
  CHECK(!plain->is_zero());
  CHECK(plain->pp_size == 2);
  CHECK(plain->dp_size == 2);
  const auto zero = nt::parse_config(
      R"({"type": "ZeroDistributedOptimizer", "parallelism": {"tp_size": "1", "dp_size": "2", "pp_size": "1",
          "expert_parallel_size": "1"}, "configs": {"param_name_to_dp_rank_offsets": {"w": {"0": ["0", "3"],
          "1": ["3", "5"]}, "b": {"0": ["0", "1"]}}, "orig_param_shapes": {"w": ["5"], "b": ["1"]}}})", "c.json");
  REQUIRE(zero.ok());
  REQUIRE(zero->is_zero());
  CHECK(zero->zero.at("w").shape == std::vector<int64_t>{5});
  CHECK(zero->zero.at("w").runs.at(1) == std::pair<int64_t, int64_t>{3, 5});
  CHECK(zero->zero.at("b").runs.size() == 1);
}

TEST_CASE("nanotron: optimizer_config.json that lies is refused, naming the file and what is wrong") {
  const std::string head = R"({"type": "ZeroDistributedOptimizer", "parallelism": {"tp_size": "1", "dp_size": "2",
      "pp_size": "1"}, "configs": {)";
  auto error_of = [](const std::string& json) {
    const auto c = nt::parse_config(json, "c.json");
    REQUIRE(!c.ok());
    CHECK(c.status().message().find("c.json") != std::string::npos);
    return c.status().message();
  };
  CHECK(error_of("[1]").find("not a JSON object") != std::string::npos);
  CHECK(error_of(R"({"type": "X", "type": "Y", "parallelism": {}})").find("'type' twice") != std::string::npos);
  CHECK(error_of(R"({"type": "X", "parallelism": {"tp_size": "0", "dp_size": "1", "pp_size": "1"}})")
            .find("'tp_size' is not a size") != std::string::npos);
  CHECK(error_of(R"({"type": "X", "parallelism": {"tp_size": "-1", "dp_size": "1", "pp_size": "1"}})")
            .find("'tp_size'") != std::string::npos);
  CHECK(error_of(R"({"type": "X", "parallelism": {"dp_size": "1", "pp_size": "1"}})").find("no 'tp_size'") !=
        std::string::npos);
  CHECK(error_of(head + "}}").find("without 'param_name_to_dp_rank_offsets'") != std::string::npos);
  // a run past the param's elements, a rank at or past dp_size, an empty or reversed run
  CHECK(error_of(head + R"("param_name_to_dp_rank_offsets": {"w": {"0": ["0", "6"]}}, "orig_param_shapes": {"w": ["5"]}}})")
            .find("inside its 5 elements") != std::string::npos);
  CHECK(error_of(head + R"("param_name_to_dp_rank_offsets": {"w": {"2": ["0", "5"]}}, "orig_param_shapes": {"w": ["5"]}}})")
            .find("not a rank below dp_size 2") != std::string::npos);
  CHECK(error_of(head + R"("param_name_to_dp_rank_offsets": {"w": {"0": ["3", "3"]}}, "orig_param_shapes": {"w": ["5"]}}})")
            .find("not [start, end)") != std::string::npos);
  CHECK(error_of(head + R"("param_name_to_dp_rank_offsets": {"w": {"0": ["0", "5"]}}, "orig_param_shapes": {}}})")
            .find("no orig_param_shapes") != std::string::npos);
  CHECK(error_of(head + R"("param_name_to_dp_rank_offsets": {}, "orig_param_shapes": {"w": ["5"]}}})")
            .find("no param_name_to_dp_rank_offsets") != std::string::npos);
  CHECK(error_of(head + R"("param_name_to_dp_rank_offsets": {}, "orig_param_shapes": {"w": ["1000000000000", "100000000000"]}}})")
            .find("overflow") != std::string::npos);
}

TEST_CASE("nanotron: ZeRO-1 splits a param in runs of ceil(numel / dp), the last ranks one fewer") {
  // ZeroDistributedOptimizer._partition_parameters: 10 over 4 -> 3, 3, 2, 2; 1 over 2 -> rank 0 only
  const auto ten = nt::zero_runs(10, 4);
  REQUIRE(ten.size() == 4);
  CHECK(ten.at(0) == std::pair<int64_t, int64_t>{0, 3});
  CHECK(ten.at(1) == std::pair<int64_t, int64_t>{3, 6});
  CHECK(ten.at(2) == std::pair<int64_t, int64_t>{6, 8});
  CHECK(ten.at(3) == std::pair<int64_t, int64_t>{8, 10});
  const auto one = nt::zero_runs(1, 2);
  REQUIRE(one.size() == 1);
  CHECK(one.at(0) == std::pair<int64_t, int64_t>{0, 1});
  CHECK(nt::zero_runs(1024, 2).at(1) == std::pair<int64_t, int64_t>{512, 1024});
  CHECK(nt::zero_runs(0, 2).empty());
}

TEST_CASE("nanotron: the model folder's file names give the param's name and its shard's ranks") {
  const auto plain = nt::parse_model_path({"model", "decoder", "0", "pp_block", "input_layernorm", "model_weight.safetensors"});
  REQUIRE(plain);
  CHECK(plain->name == "model.decoder.0.pp_block.input_layernorm.weight");
  CHECK(!plain->sharded);
  const auto shard = nt::parse_model_path({"model", "lm_head", "pp_block", "model_weight_pp-rank-1-of-2_tp-rank-3-of-4.safetensors"});
  REQUIRE(shard);
  CHECK(shard->name == "model.lm_head.pp_block.weight");
  CHECK(shard->sharded);
  CHECK(shard->pp == 1);
  CHECK(shard->tp == 3);
  CHECK(shard->tp_size == 4);
  CHECK(nt::parse_model_path({"model", "x", "model_bias_pp-rank-0-of-1_tp-rank-0-of-1_exp-rank-1-of-2.safetensors"}));
  for (const auto& bad : std::vector<std::vector<std::string>>{
           {"model_weight.safetensors"}, {"model", "weight.safetensors"}, {"model", "model_.safetensors"},
           {"model", "model_weight_pp-rank-0-of-1.safetensors"}, {"a.b", "model_weight.safetensors"},
           {"model", "model_weight_pp-rank-0-of-1_tp-rank-2-of-2.safetensors"}})
    CHECK(!nt::parse_model_path(bad));
}

TEST_CASE("nanotron: a shard's TensorMetadata places its boxes in the whole tensor, row runs merged") {
  // a column shard of [64, 16]: rows 32..64, whole rows: one run
  auto meta = nt::parse_shard_metadata({{"version", "1.5"}, {"unsharded_shape", "(64, 16)"},
                                        {"local_global_slices_pairs", "None,None,None|None,None,None#32,64,None|None,None,None"}},
                                       "f");
  REQUIRE(meta.ok());
  auto runs = nt::shard_runs({32, 16}, *meta, 1000, "f");
  REQUIRE(runs.ok());
  CHECK(*runs == std::vector<nt::Run>{{0, 512, 512}});
  // a row shard of [16, 16] (columns 8..16): a run per row
  meta = nt::parse_shard_metadata({{"unsharded_shape", "(16, 16)"},
                                   {"local_global_slices_pairs", "None,None,None|None,None,None#None,None,None|8,16,None"}},
                                  "f");
  REQUIRE(meta.ok());
  runs = nt::shard_runs({16, 8}, *meta, 1000, "f");
  REQUIRE(runs.ok());
  REQUIRE(runs->size() == 16);
  CHECK((*runs)[1] == nt::Run{8, 24, 8});
  // fused q/k/v of GQA, tensor-parallel rank 1 of 2, as numpy 2 prints nanotron's sizes: q rows 8..16,
  // k rows 20..24, v rows 28..32 of [32, 16]
  meta = nt::parse_shard_metadata(
      {{"unsharded_shape", "(np.int64(32), 16)"},
       {"local_global_slices_pairs", "0,8,None|None,None,None#8,16,None|None,None,None;8,12,None|None,None,None#20,24,None|"
                                     "None,None,None;12,16,None|None,None,None#28,32,None|None,None,None"}},
      "f");
  REQUIRE(meta.ok());
  CHECK(meta->unsharded == std::vector<int64_t>{32, 16});
  runs = nt::shard_runs({16, 16}, *meta, 1000, "f");
  REQUIRE(runs.ok());
  CHECK(*runs == std::vector<nt::Run>{{0, 128, 128}, {128, 320, 64}, {192, 448, 64}});
  CHECK(!nt::shard_runs({16, 16}, *meta, 2, "f").ok());  // more runs than allowed
  // lies: a box past the tensor, boxes of two sizes, a step, the local tensor placed twice or in part
  auto error_of = [](const std::string& pairs, const std::vector<int64_t>& local) {
    auto m = nt::parse_shard_metadata({{"unsharded_shape", "(8, 4)"}, {"local_global_slices_pairs", pairs}}, "f");
    if (!m.ok()) return m.status().message();
    auto r = nt::shard_runs(local, *m, 1000, "f");
    REQUIRE(!r.ok());
    return r.status().message();
  };
  CHECK(error_of("0,4,None|None,None,None#6,10,None|None,None,None", {4, 4}).find("not one box") != std::string::npos);
  CHECK(error_of("0,4,None|None,None,None#0,3,None|None,None,None", {4, 4}).find("not one box") != std::string::npos);
  CHECK(error_of("0,4,2|None,None,None#0,4,2|None,None,None", {4, 4}).find("not one box") != std::string::npos);
  CHECK(error_of("0,4,None|None,None,None#0,4,None|None,None,None;0,4,None|None,None,None#4,8,None|None,None,None",
                 {4, 4}).find("twice") != std::string::npos);
  CHECK(error_of("0,2,None|None,None,None#0,2,None|None,None,None", {4, 4}).find("8 of the local tensor's 16") !=
        std::string::npos);
  CHECK(error_of("-1,4,None|None,None,None#0,5,None|None,None,None", {4, 4}).find("not one box") != std::string::npos);
  CHECK(error_of("0,4|None,None,None#0,4,None|None,None,None", {4, 4}).find("not pairs") != std::string::npos);
  CHECK(error_of("0,4,None#0,4,None", {4, 4}).find("a slice pair of 1 and 1 dims") != std::string::npos);
  CHECK(error_of("0,4,None|None,None,None#0,4,None|None,None,None", {4}).find("1 dims, unsharded_shape of 2") !=
        std::string::npos);
  CHECK(!nt::parse_shard_metadata({{"unsharded_shape", "(8, 4)"}}, "f").ok());
  CHECK(!nt::parse_shard_metadata({{"unsharded_shape", "8, 4"}, {"local_global_slices_pairs", "x"}}, "f").ok());
}
