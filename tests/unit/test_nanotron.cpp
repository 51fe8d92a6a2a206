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
