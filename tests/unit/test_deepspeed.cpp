// deepspeed driver: real DeepSpeed ZeRO checkpoints (formats/deepspeed/testdata/make_seeds.py:
// ZeRO-2 and ZeRO-3 of one run (ZeRO-3 with and without sub-groups), ZeRO-1 under bf16 with and
// without frozen params, Adam in L2 mode, ZeRO-3 under fp16 with skipped steps; 2 ranks each; a
// pipeline of 2 stages on 4 ranks; DeepSpeed MoE and AutoEP on 4 ranks) read as their canonical state;
// damaged and unsupported variants are refused with the file named.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <functional>

#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "optstate/io.h"
#include "optstate/validate.h"
#include "registry.h"
#include "test_helpers.h"
#include "torchsave/torchsave_layout.h"
#include "torchsave/torchsave_reader.h"

using namespace optstate;
namespace fs = std::filesystem;

namespace {

const fs::path kSeeds = fs::path(OPTSTATE_SOURCE_DIR) / "formats/deepspeed/testdata";

std::unique_ptr<CheckpointReader> open_seed(const fs::path& path) {
  auto r = open_checkpoint(path);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r.value()->format() == "deepspeed");
  return std::move(r.value());
}

// A seed's tag folder copied into `dir`, for damaging.
fs::path copy_tag(const char* seed, const testing::TempDir& dir) {
  const fs::path out = dir.path / "global_step3";
  fs::copy(kSeeds / seed / "global_step3", out, fs::copy_options::recursive);
  return out;
}

std::string error_of(const fs::path& path) {
  auto r = open_checkpoint(path);
  REQUIRE_FALSE(r.ok());
  return r.status().message();
}

// Where the data of zip record `record` (its full name) begins in archive `bytes`: past the local
// header that names it.
size_t record_data(const std::string& bytes, const std::string& record) {
  const size_t name = bytes.find(record);  // the first local header naming it
  REQUIRE(name != std::string::npos);
  const size_t header = name - 30;
  REQUIRE(bytes.compare(header, 4, "PK\x03\x04") == 0);
  auto u16 = [&](size_t at) { return static_cast<size_t>(static_cast<uint8_t>(bytes[at])) |
                                     static_cast<size_t>(static_cast<uint8_t>(bytes[at + 1])) << 8; };
  return header + 30 + u16(header + 26) + u16(header + 28);
}

// A fp16 seed (2 groups, 4 params) read: every param at `step` with `entries` entries (one of them
// the fp32 weights), and valid.
std::unique_ptr<CheckpointReader> check_fp16_seed(const fs::path& seed, int64_t step, size_t entries) {
  auto r = open_seed(seed);
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.params.size() == 4);
  for (const auto& kv : m.params) {  // not a structured binding: clang 14 cannot capture one
    const std::string& fqn = kv.first;
    const ParamState& ps = kv.second;
    CAPTURE(fqn);
    CHECK(ps.step == step);
    CHECK(ps.entries.size() == entries);
    CHECK(ps.entries.count(kParam) == 1);
  }
  CHECK(validate_checkpoint(seed, [](const fs::path& p) { return open_checkpoint(p); })->findings.empty());
  return r;
}

}  // namespace

TEST_CASE("deepspeed: ZeRO-1, -2 and -3 checkpoints read as AdamW state, each param put together from both ranks") {
  for (const char* seed : {"zero2_world2", "zero3_world2", "bf16_zero1_world2"}) {
    CAPTURE(seed);
    auto r = open_seed(kSeeds / seed);  // the folder whose `latest` names global_step3/
    const OptimizerState& m = r->meta();
    CHECK(m.kind == "adamw");
    REQUIRE(m.groups.size() == 2);  // Hugging Face's two: weights decayed, biases not
    CHECK(m.groups[0].hyper.weight_decay == 0.05);
    CHECK(m.groups[1].hyper.weight_decay == 0.0);
    CHECK(m.groups[0].params == std::vector<std::string>{"0.weight", "2.weight"});
    CHECK(m.groups[1].params == std::vector<std::string>{"0.bias", "2.bias"});
    CHECK(m.params.at("0.weight").shape == std::vector<int64_t>{24, 16});
    CHECK(m.params.at("2.bias").shape == std::vector<int64_t>{3});
    for (const auto& [fqn, ps] : m.params) {
      CHECK(ps.step == 3);
      CHECK(ps.entries.size() == 3);  // exp_avg, exp_avg_sq and the fp32 master weights
      for (const auto& [name, e] : ps.entries) CHECK(e.dtype == DType::kF32);
    }
    // the model's own weights (bf16 under bf16) are named, not read: the fp32 copies are the weights
    const auto nr = r->not_read();
    CHECK(std::any_of(nr.begin(), nr.end(), [](const std::string& s) { return s.starts_with("['module']"); }));
    auto v = validate_checkpoint(kSeeds / seed, [](const fs::path& p) { return open_checkpoint(p); });
    REQUIRE(v.ok());
    CHECK(v->findings.empty());
    // the tag folder itself opens as the same state
    auto tag = open_seed(kSeeds / seed / "global_step3");
    CHECK(hash_checkpoint(*tag)->root == hash_checkpoint(*r)->root);
  }
  // One run saved under ZeRO-2 and under ZeRO-3 (other partitions, other files): the same state.
  auto z2 = open_seed(kSeeds / "zero2_world2"), z3 = open_seed(kSeeds / "zero3_world2");
  CHECK(hash_checkpoint(*z2)->root == hash_checkpoint(*z3)->root);
  // ZeRO-3 splits a param group into flat params of at most sub_group_size elements (1e9 by
  // default: every model past 1B params); the seed's 100 gives group 0 two, group 1 one. It reads as
  // the same two groups, and so does DeepSpeed's universal checkpoint of it.
  for (const char* seed : {"zero3_subgroups_world2", "zero3_subgroups_world2_universal"}) {
    CAPTURE(seed);
    auto sub = open_seed(kSeeds / seed);
    REQUIRE(sub->meta().groups.size() == 2);
    CHECK(sub->meta().groups[0].params == std::vector<std::string>{"0.weight", "2.weight"});
    CHECK(sub->meta().groups[0].hyper.weight_decay == 0.05);
    CHECK(hash_checkpoint(*sub)->root == hash_checkpoint(*z2)->root);
  }
  // and it converts: any writable format takes it
  testing::TempDir dir;
  REQUIRE(write_checkpoint(*find_format("native"), *load_all(*z2), dir.path / "native", {}).ok());
  CHECK(hash_checkpoint(*open_checkpoint(dir.path / "native").value())->root == hash_checkpoint(*z2)->root);
  // DeepSpeed's own format is written only as a universal checkpoint of a DeepSpeed checkpoint
  const FormatDriver* ds = find_format("deepspeed");
  REQUIRE(ds);
  CHECK(!ds->writes());
  auto refused = ds->write(*load_all(*z2), dir.path / "ds", {});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.message().find("written from a DeepSpeed ZeRO checkpoint") != std::string::npos);
  CHECK(!fs::exists(dir.path / "ds"));
}

TEST_CASE("deepspeed: under fp16, steps the loss scaler skipped are not the optimizer's steps") {
  // 3 steps, the first 2 overflowed at loss scales 2^16 and 2^15 and were skipped: DeepSpeed counts 3
  // (global_steps, in the model states), torch's AdamW inside it stepped once, and that is the step.
  check_fp16_seed(kSeeds / "fp16_zero3_world2", 1, 3);  // moments and weights
}

TEST_CASE("deepspeed: a checkpoint whose optimizer never stepped reads as its fp32 weights at step 0") {
  // fp16 from a loss scale of 2^40: all 3 steps overflowed, the wrapped optimizer holds no state.
  auto r = check_fp16_seed(kSeeds / "fp16_unstepped_zero2_world2", 0, 1);  // the weights alone
  const OptimizerState& m = r->meta();
  // its universal checkpoint: fp32.pt alone per param, read back as the same state
  testing::TempDir dir;
  const FormatDriver* ds = find_format("deepspeed");
  REQUIRE(write_checkpoint(*ds, *load_all(*r), dir.path / "u", {.source = r.get()}).ok());
  for (const auto& [fqn, ps] : m.params) {
    size_t files = 0;
    for (const auto& e : fs::directory_iterator(dir.path / "u" / "zero" / fqn)) files += e.is_regular_file();
    CHECK(files == 1);
    CHECK(fs::is_regular_file(dir.path / "u" / "zero" / fqn / "fp32.pt"));
  }
  CHECK(hash_checkpoint(*open_seed(dir.path / "u"))->root == hash_checkpoint(*r)->root);
}

TEST_CASE("deepspeed: bitsandbytes' AdamW8bit wrapped by ZeRO reads as fp32 moments; DeepSpeed layouts of it are refused") {
  // Its 8-bit codes are blocks of each rank's partition (tests/python/test_deepspeed.py compares the
  // values with bitsandbytes' own dequantize_blockwise); the biases' partitions keep 32-bit state.
  const fs::path seed = kSeeds / "bnb_zero2_world2";
  auto r = open_seed(seed);
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"0.weight", "2.weight"});
  for (const auto& kv : m.params) {  // not a structured binding: clang 14 cannot capture one
    CAPTURE(kv.first);
    CHECK(kv.second.step == 3);
    CHECK(kv.second.entries.size() == 3);
    for (const auto& e : kv.second.entries) CHECK(e.second.encoding == Encoding::kDense);
  }
  const auto nr = r->not_read();
  CHECK(std::any_of(nr.begin(), nr.end(), [](const std::string& s) { return s.starts_with("bitsandbytes' 8-bit"); }));
  CHECK(validate_checkpoint(seed, [](const fs::path& p) { return open_checkpoint(p); })->findings.empty());
  // moments of a plausible size: an 8-bit run dequantized with the wrong block or map would not be
  auto all = load_all(*r);
  REQUIRE(all.ok());
  const Entry& v = all->params.at("0.weight").entries.at(kExpAvgSq);
  const std::span<const float> sq(reinterpret_cast<const float*>(v.values.data), v.values.size / 4);
  CHECK(std::all_of(sq.begin(), sq.end(), [](float x) { return x >= 0 && x < 1; }));
  // written again natively, the same state
  testing::TempDir dir;
  REQUIRE(write_checkpoint(*find_format("native"), *all, dir.path / "native", {}).ok());
  CHECK(hash_checkpoint(*open_checkpoint(dir.path / "native").value())->root == hash_checkpoint(*r)->root);
  const FormatDriver* ds = find_format("deepspeed");
  const auto universal = write_checkpoint(*ds, *all, dir.path / "u", {.source = r.get()});
  REQUIRE_FALSE(universal.ok());
  CHECK(universal.message().find("the optimizer DeepSpeed wraps is bitsandbytes'") != std::string::npos);
  CHECK_FALSE(fs::exists(dir.path / "u"));
}

TEST_CASE("deepspeed: a universal checkpoint of ZeRO-1/2 (zero/<param>/*.pt, optimizer_state.pt, the model states)") {
  for (const char* seed : {"zero2_world2", "bf16_zero1_world2"}) {
    CAPTURE(seed);
    auto r = open_seed(kSeeds / seed);
    const FormatDriver* ds = find_format("deepspeed");
    testing::TempDir dir;
    const fs::path out = dir.path / "universal";
    const auto st = write_checkpoint(*ds, *load_all(*r), out, {.source = r.get()});
    REQUIRE_MESSAGE(st.ok(), st.message());
    CHECK(fs::is_regular_file(out / "mp_rank_00_model_states.pt"));
    // the carried settings: rank 0's optimizer_state_dict without its partitions, plus param_groups
    const auto pkl = torchsave::first_zip_record(out / "zero" / "optimizer_state.pt");
    CHECK((pkl && pkl->ends_with("/data.pkl")));
    for (const auto& [fqn, ps] : r->meta().params) {
      const std::string& param = fqn;  // a structured binding: clang 14 cannot capture it
      CAPTURE(param);
      for (const char* f : {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"})
        CHECK(fs::is_regular_file(out / "zero" / fqn / f));
    }
    // read back (optstate reads universal checkpoints too): the same state
    auto back = open_checkpoint(out);
    REQUIRE_MESSAGE(back.ok(), back.status().message());
    CHECK((*back)->format() == "deepspeed");
    CHECK(hash_checkpoint(**back)->root == hash_checkpoint(*r)->root);
    CHECK(validate_checkpoint(out, [](const fs::path& p) { return open_checkpoint(p); })->findings.empty());
    // not written again from itself: it is universal already
    CHECK(write_checkpoint(*ds, *load_all(**back), dir.path / "again", {.source = back->get()})
              .message()
              .find("already a universal checkpoint") != std::string::npos);
    // a missing per-param file is named
    fs::remove(out / "zero" / r->meta().groups[0].params[0] / "exp_avg_sq.pt");
    auto broken = open_checkpoint(out);
    REQUIRE_FALSE(broken.ok());
    CHECK(broken.status().message().find("no exp_avg_sq.pt") != std::string::npos);
    // written once: DST is not replaced without --overwrite, and never a DeepSpeed folder
    CHECK_FALSE(write_checkpoint(*ds, *load_all(*r), out, {.source = r.get()}).ok());
  }
  {
    // Frozen params and buffers (no param group holds them): zero/<name>/fp32.pt of the module's
    // values as float32, as ds_to_universal writes them (tests/python/test_deepspeed.py compares the
    // files); the optimizer's params as before.
    auto r = open_seed(kSeeds / "frozen_bf16_zero1_world2");
    CHECK(r->meta().params.size() == 4);  // 1.weight, 1.bias, 3.weight, 3.bias
    const FormatDriver* ds = find_format("deepspeed");
    CHECK(ds->carries(*r, "universal"));  // the model states file goes through whole
    testing::TempDir dir;
    const fs::path out = dir.path / "universal";
    const auto st = write_checkpoint(*ds, *load_all(*r), out, {.source = r.get()});
    REQUIRE_MESSAGE(st.ok(), st.message());
    for (const char* name : {"0.weight", "0.bias", "scale", "seen"}) {
      CAPTURE(name);
      CHECK(fs::is_regular_file(out / "zero" / name / "fp32.pt"));
      CHECK(!fs::exists(out / "zero" / name / "exp_avg.pt"));
    }
    CHECK(fs::is_regular_file(out / "zero" / "3.weight" / "exp_avg.pt"));
    CHECK(hash_checkpoint(*open_seed(out))->root == hash_checkpoint(*r)->root);
    // a damaged frozen weight in the model states file: named, and nothing written
    const fs::path tag = copy_tag("frozen_bf16_zero1_world2", dir);
    const fs::path model = tag / "mp_rank_00_model_states.pt";
    std::string bytes = testing::read_file(model);
    const size_t data = record_data(bytes, "mp_rank_00_model_states/data/2");  // 0.weight, bf16
    bytes[data + 100] = static_cast<char>(bytes[data + 100] ^ 1);
    testing::write_file(model, bytes);
    auto damaged = open_seed(tag);  // the optimizer's state reads: the module is not part of it
    const auto refused = write_checkpoint(*ds, *load_all(*damaged), dir.path / "u2", {.source = damaged.get()});
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.message().find(model.string() + " ['module']['0.weight']") != std::string::npos);
    CHECK(refused.message().find("CRC-32") != std::string::npos);
    CHECK_FALSE(fs::exists(dir.path / "u2"));
  }
  // DeepSpeed's own conversion of the ZeRO-3 seed (no step.pt: each group's step from
  // optimizer_state.pt) reads as that checkpoint's state
  auto theirs = open_seed(kSeeds / "zero3_world2_universal");
  CHECK(hash_checkpoint(*theirs)->root == hash_checkpoint(*open_seed(kSeeds / "zero3_world2"))->root);
}

TEST_CASE("deepspeed: a ZeRO-3 checkpoint written again for another world size, sub-groups laid out anew") {
  // tests/python/test_deepspeed.py resumes DeepSpeed from such files; here: the files and the state.
  for (const char* seed : {"zero3_world2", "zero3_subgroups_world2", "fp16_zero3_world2"}) {
    CAPTURE(seed);
    auto z3 = open_seed(kSeeds / seed);
    const FormatDriver* ds = find_format("deepspeed");
    CHECK(ds->shards());
    for (int world : {1, 3, 4}) {
      CAPTURE(world);
      testing::TempDir dir;
      const fs::path out = dir.path / "global_step3";
      const auto st = write_checkpoint(*ds, *load_all(*z3), out, {.world_size = world, .source = z3.get()});
      REQUIRE_MESSAGE(st.ok(), st.message());
      size_t files = 0;
      for (const auto& e : fs::directory_iterator(out)) files += e.is_regular_file();
      CHECK(files == 2 * static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        CHECK(fs::is_regular_file(out / fmt::format("zero_pp_rank_{}_mp_rank_00_optim_states.pt", r)));
        CHECK(fs::is_regular_file(out / fmt::format("zero_pp_rank_{}_mp_rank_00_model_states.pt", r)));
      }
      // read back: every rank's partitions put together give the same state
      auto back = open_seed(out);
      CHECK(hash_checkpoint(*back)->root == hash_checkpoint(*z3)->root);
      CHECK(back->meta().groups.size() == 2);
      CHECK(validate_checkpoint(out, [](const fs::path& p) { return open_checkpoint(p); })->findings.empty());
    }
  }
  // An exception through the write (a bug, std::bad_alloc) leaves no staging folder behind.
  {
    auto z3 = open_seed(kSeeds / "zero3_world2");
    const OptimizerState state = *load_all(*z3);
    testing::TempDir dir;
    testing::ThrowingSource throwing(state, 1);
    CHECK_THROWS_AS((void)write_checkpoint(*find_format("deepspeed"), throwing, dir.path / "out",
                                           {.world_size = 3, .source = z3.get()}),
                    std::runtime_error);
    CHECK(fs::is_empty(dir.path));
  }
  // The state must be the source's (its params are laid out by the source's files): another is refused.
  auto z3 = open_seed(kSeeds / "zero3_world2");
  auto other = open_seed(kSeeds / "frozen_bf16_zero1_world2");
  testing::TempDir dir;
  const auto st = write_checkpoint(*find_format("deepspeed"), *load_all(*other), dir.path / "out",
                                   {.world_size = 3, .source = z3.get()});
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("is not in the state") != std::string::npos);
  CHECK_FALSE(fs::exists(dir.path / "out"));
}

TEST_CASE("deepspeed: a missing rank, model-parallel files, no model states or a damaged file are refused by name") {
  {
    testing::TempDir dir;
    const fs::path tag = copy_tag("zero2_world2", dir);
    fs::remove(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt");
    CHECK(error_of(tag).find("no optimizer file of rank 0") != std::string::npos);
  }
  {
    testing::TempDir dir;
    const fs::path tag = copy_tag("zero2_world2", dir);
    fs::remove(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt");  // rank 0 alone: partition_count says 2
    CHECK(error_of(tag).find("partition_count 2, but") != std::string::npos);
  }
  {
    testing::TempDir dir;
    const fs::path tag = copy_tag("zero2_world2", dir);
    // a second model-parallel rank (a tensor-parallel one: no pipeline layer files) must have every
    // rank's files, and its grid must be the one the model states record
    fs::copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt");
    CHECK(error_of(tag).find("no optimizer file of rank 1 (zero_pp_rank_1_mp_rank_01_optim_states.pt)") !=
          std::string::npos);
    fs::copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt");
    fs::copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt");
    CHECK(error_of(tag).find("mp_rank_00_model_states.pt: tp_degree 1, but") != std::string::npos);
  }
  {
    testing::TempDir dir;
    const fs::path tag = copy_tag("zero2_world2", dir);
    fs::remove(tag / "mp_rank_00_model_states.pt");
    CHECK(error_of(tag).find("no model states file") != std::string::npos);
  }
  {
    testing::TempDir dir;
    const fs::path tag = copy_tag("zero3_world2", dir);
    const fs::path f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt";
    const std::string bytes = testing::read_file(f);
    testing::write_file(f, bytes.substr(0, bytes.size() / 2));
    CHECK(error_of(tag).find(f.string()) != std::string::npos);
  }
  {
    // The other run's rank 1 beside this one's rank 0 (ZeRO-1 bf16 and ZeRO-2 files): refused.
    testing::TempDir dir;
    const fs::path tag = copy_tag("zero2_world2", dir);
    fs::copy(kSeeds / "zero3_world2/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
             tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", fs::copy_options::overwrite_existing);
    CHECK(error_of(tag).find("ZeRO stage 3 with 2 param groups (2 flat params), rank 0's file stage 2") != std::string::npos);
  }
  {
    // A bit flipped in a flat partition that several params share: reading param by param cannot
    // check its CRC-32; validate reads the record whole and names the file.
    testing::TempDir dir;
    const fs::path tag = copy_tag("zero2_world2", dir);
    const fs::path f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt";
    std::string bytes = testing::read_file(f);
    const size_t data = record_data(bytes, "zero_pp_rank_1_mp_rank_00_optim_states/data/1");
    bytes[data + 8] = static_cast<char>(bytes[data + 8] ^ 1);  // a low mantissa bit: the value stays finite
    testing::write_file(f, bytes);
    auto clean = validate_checkpoint(kSeeds / "zero2_world2", [](const fs::path& p) { return open_checkpoint(p); });
    REQUIRE(clean.ok());
    CHECK(clean->checksums_verified);  // every record's CRC-32, shared ones read whole
    auto v = validate_checkpoint(tag, [](const fs::path& p) { return open_checkpoint(p); });
    REQUIRE(v.ok());
    REQUIRE(v->findings.size() == 1);
    CHECK(v->findings[0].message.find(f.string() + ": CRC-32 of the storage holding") != std::string::npos);
  }
  {
    // A ZeRO run's model states file alone (its partitions gone): read as stage 0's would be (the
    // optimizer inside it), it holds none but the params' shapes: the missing files named.
    testing::TempDir dir;
    const fs::path tag = copy_tag("zero2_world2", dir);
    for (int r : {0, 1}) fs::remove(tag / fmt::format("zero_pp_rank_{}_mp_rank_00_optim_states.pt", r));
    CHECK(error_of(tag).find("mp_rank_00_model_states.pt: DeepSpeed's model states of a ZeRO run (['optimizer'] is "
                             "None, ['param_shapes'] set): its optimizer files (zero_pp_rank_*_optim_states.pt) are "
                             "missing") != std::string::npos);
  }
  {
    // DeepSpeed's own Adam from its config in L2 mode (adam_w_mode false), which only ds_config tells:
    // another update than AdamW's, refused naming the model states file.
    const std::string err = error_of(kSeeds / "adam_l2_zero2_world2");
    CHECK(err.find("adam_l2_zero2_world2/global_step3/mp_rank_00_model_states.pt: ds_config's optimizer is Adam with "
                   "adam_w_mode false") != std::string::npos);
    CHECK(err.find("Adam's L2 decay, not AdamW's decoupled decay") != std::string::npos);
  }
  {
    // `latest` may only name a folder beside it.
    testing::TempDir dir;
    copy_tag("zero2_world2", dir);
    testing::write_file(dir.path / "latest", "../global_step3\n");
    CHECK(!find_format("deepspeed")->sniff(dir.path));
  }
}

TEST_CASE("deepspeed: a pipeline's stages (PipelineModule, ZeRO-1) read as one state, a tied module once; its universal checkpoint") {
  // pipe2_zero1_world4: 2 stages of 2 data-parallel ranks; each stage's optimizer files are its
  // model-parallel rank's, its groups Hugging Face's two; the tied embedding is in both stages.
  auto r = open_seed(kSeeds / "pipe2_zero1_world4");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].hyper.weight_decay == 0.05);
  CHECK(m.groups[1].hyper.weight_decay == 0.0);
  // stage 0's params, then stage 1's; the tied copy of stage 1 not again
  CHECK(m.groups[0].params == std::vector<std::string>{"tied_modules.embed.weight", "1.weight", "3.weight", "5.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"1.bias", "3.bias", "4.weight", "4.bias", "5.bias"});
  CHECK(m.params.at("tied_modules.embed.weight").shape == std::vector<int64_t>{12, 8});
  CHECK(m.params.at("5.weight").shape == std::vector<int64_t>{12, 10});
  for (const auto& [fqn, ps] : m.params) {
    CHECK(ps.step == 3);
    CHECK(ps.entries.size() == 3);
  }
  const auto notes = r->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].starts_with("'tied_modules.embed.weight' is held by pipeline stages 0 and 1"));
  const auto nr = r->not_read();
  CHECK(std::any_of(nr.begin(), nr.end(), [](const std::string& s) { return s.starts_with("layer_*-model_states.pt (6 files"); }));
  auto v = validate_checkpoint(kSeeds / "pipe2_zero1_world4", [](const fs::path& p) { return open_checkpoint(p); });
  REQUIRE(v.ok());
  CHECK(v->findings.empty());
  CHECK(v->checksums_verified);
  // it converts; its universal checkpoint holds every stage's model states file and each param once
  testing::TempDir dir;
  REQUIRE(write_checkpoint(*find_format("native"), *load_all(*r), dir.path / "native", {}).ok());
  CHECK(hash_checkpoint(*open_checkpoint(dir.path / "native").value())->root == hash_checkpoint(*r)->root);
  REQUIRE(write_checkpoint(*find_format("deepspeed"), *load_all(*r), dir.path / "uni", {.source = r.get()}).ok());
  for (const char* f : {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"})
    CHECK(testing::read_file(dir.path / "uni" / f) ==
          testing::read_file(kSeeds / "pipe2_zero1_world4/global_step3" / f));
  CHECK(fs::is_regular_file(dir.path / "uni/zero/tied_modules.embed.weight/exp_avg.pt"));
  CHECK(!fs::exists(dir.path / "uni/layer_00-model_states.pt"));  // DeepSpeed loads the weights from zero/
  auto uni = open_seed(dir.path / "uni");
  CHECK(hash_checkpoint(*uni)->root == hash_checkpoint(*r)->root);
  const auto unotes = uni->read_notes();
  REQUIRE(unotes.size() == 1);
  CHECK(unotes[0] == "'tied_modules.embed.weight' is in the param_shapes of pipeline stages 0 and 1 (a tied module): one param");
}

TEST_CASE("deepspeed: a pipeline's missing stage or rank, tensor-parallel layer files and a stage of another grid are refused") {
  {
    testing::TempDir dir;
    const fs::path tag = copy_tag("pipe2_zero1_world4", dir);
    fs::remove(tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt");
    CHECK(error_of(tag).find("no optimizer file of rank 1 (zero_pp_rank_1_mp_rank_01_optim_states.pt) among 2") !=
          std::string::npos);
  }
  {
    testing::TempDir dir;
    const fs::path tag = copy_tag("pipe2_zero1_world4", dir);
    for (int rank : {0, 1}) fs::remove(tag / fmt::format("zero_pp_rank_{}_mp_rank_00_optim_states.pt", rank));
    CHECK(error_of(tag).find("no optimizer files of pipeline stage 0") != std::string::npos);
  }
  {
    testing::TempDir dir;
    const fs::path tag = copy_tag("pipe2_zero1_world4", dir);
    fs::remove(tag / "mp_rank_01_model_states.pt");
    CHECK(error_of(tag).find("no model states file (mp_rank_01_model_states.pt, or ZeRO-3's "
                             "zero_pp_rank_0_mp_rank_01_model_states.pt)") != std::string::npos);
  }
  {
    // Megatron-DeepSpeed's layer files name a tensor-parallel rank: its params are split by rules
    // no file holds
    testing::TempDir dir;
    const fs::path tag = copy_tag("pipe2_zero1_world4", dir);
    fs::rename(tag / "layer_01-model_states.pt", tag / "layer_01-model_01-model_states.pt");
    CHECK(error_of(tag).find("Megatron-DeepSpeed's tensor-parallel ZeRO checkpoints are not read") != std::string::npos);
  }
  {
    // no layer files: the model-parallel ranks would be tensor-parallel ones, which the model
    // states (pp_degree 2, tp_degree 1) say they are not
    testing::TempDir dir;
    const fs::path tag = copy_tag("pipe2_zero1_world4", dir);
    for (int l = 0; l < 6; ++l) fs::remove(tag / fmt::format("layer_{:02d}-model_states.pt", l));
    CHECK(error_of(tag).find("tp_degree 1, but") != std::string::npos);
  }
  {
    // a stage of a 1-stage run's files beside (its model states say pp_degree 1): refused
    testing::TempDir dir;
    const fs::path tag = copy_tag("pipe2_zero1_world4", dir);
    fs::copy(kSeeds / "zero2_world2/global_step3/mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt",
             fs::copy_options::overwrite_existing);
    CHECK(error_of(tag).find("mp_rank_01_model_states.pt: 1 model-parallel ranks (pp_degree 1), but") !=
          std::string::npos);
  }
}

TEST_CASE("deepspeed: AutoTP's tensor-parallel ranks put together where the affine maps place their shards") {
  // autotp2_zero1_world2: 2 tensor-parallel ranks; q/k/v split by rows, o_proj and down_proj by
  // columns, gate_up_proj's two halves each split by rows; norms, embedding and head on both.
  auto r = open_seed(kSeeds / "autotp2_zero1_world2");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"embed_tokens.weight", "layers.0.q_proj.weight",
                                                        "layers.0.k_proj.weight", "layers.0.v_proj.weight",
                                                        "layers.0.o_proj.weight", "layers.0.gate_up_proj.weight",
                                                        "layers.0.down_proj.weight", "lm_head.weight"});
  CHECK(m.params.at("layers.0.q_proj.weight").shape == std::vector<int64_t>{16, 16});     // the whole tensors
  CHECK(m.params.at("layers.0.gate_up_proj.weight").shape == std::vector<int64_t>{48, 16});
  CHECK(m.params.at("layers.0.down_proj.weight").shape == std::vector<int64_t>{16, 24});
  CHECK(m.params.at("norm.weight").shape == std::vector<int64_t>{16});
  for (const auto& [fqn, ps] : m.params) CHECK(ps.step == 3);
  const auto notes = r->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].starts_with("2 tensor-parallel ranks (DeepSpeed's AutoTP)"));
  auto v = validate_checkpoint(kSeeds / "autotp2_zero1_world2", [](const fs::path& p) { return open_checkpoint(p); });
  REQUIRE(v.ok());
  CHECK(v->findings.empty());  // the replicated params' copies on rank 1 equal rank 0's
  // down_proj (split by columns): row i of the whole is rank 0's row i, then rank 1's
  std::vector<float> whole(16 * 24);
  REQUIRE(r->read_range("layers.0.down_proj.weight", kParam, Component::kValues, 0, 16 * 24,
                        std::as_writable_bytes(std::span(whole))).ok());
  CHECK(r->locate("layers.0.down_proj.weight", kParam, Component::kValues, 12).find("mp_rank_01") != std::string::npos);
  CHECK(r->locate("layers.0.down_proj.weight", kParam, Component::kValues, 11).find("mp_rank_00") != std::string::npos);
  CHECK(r->locate("layers.0.down_proj.weight", kParam, Component::kValues, 24).find("mp_rank_00") != std::string::npos);
  // gate_up_proj: rows [0, 12) rank 0's, [12, 24) rank 1's, [24, 36) rank 0's, [36, 48) rank 1's
  for (const auto& [row, rank] : std::vector<std::pair<int, const char*>>{{0, "mp_rank_00"}, {12, "mp_rank_01"},
                                                                          {24, "mp_rank_00"}, {36, "mp_rank_01"}})
    CHECK(r->locate("layers.0.gate_up_proj.weight", kExpAvg, Component::kValues, row * 16).find(rank) != std::string::npos);
  // any format takes it; its universal checkpoint reads as the same state
  testing::TempDir dir;
  REQUIRE(write_checkpoint(*find_format("native"), *load_all(*r), dir.path / "native", {}).ok());
  CHECK(hash_checkpoint(*open_checkpoint(dir.path / "native").value())->root == hash_checkpoint(*r)->root);
  REQUIRE(write_checkpoint(*find_format("deepspeed"), *load_all(*r), dir.path / "uni", {.source = r.get()}).ok());
  CHECK(fs::is_regular_file(dir.path / "uni/mp_rank_01_model_states.pt"));
  CHECK(hash_checkpoint(*open_seed(dir.path / "uni"))->root == hash_checkpoint(*r)->root);
}

// An MoE seed (read as `r`): validate finds nothing, the native format takes it and hashes alike,
// and DeepSpeed's universal layout is refused with `refusal`, nothing written.
static void experts_validate_convert_and_refuse_universal(const char* seed, CheckpointReader& r,
                                                          const testing::TempDir& dir, const std::string& refusal) {
  auto v = validate_checkpoint(kSeeds / seed, [](const fs::path& p) { return open_checkpoint(p); });
  REQUIRE(v.ok());
  CHECK(v->findings.empty());
  REQUIRE(write_checkpoint(*find_format("native"), *load_all(r), dir.path / "native", {}).ok());
  CHECK(hash_checkpoint(*open_checkpoint(dir.path / "native").value())->root == hash_checkpoint(r)->root);
  const auto st = write_checkpoint(*find_format("deepspeed"), *load_all(r), dir.path / "uni", {.source = &r});
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find(refusal) != std::string::npos);
  CHECK(!fs::exists(dir.path / "uni"));
}

TEST_CASE("deepspeed: MoE experts read from their expert-data-parallel ranks under their global numbers") {
  // moe_zero1_world4: 4 experts over ep_size 2 on 4 ranks; expert-parallel rank e is ranks e and e+2
  // (their partitions of its experts, in order), its local experts 0 and 1 are experts 2e and 2e+1.
  auto r = open_seed(kSeeds / "moe_zero1_world4");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 4);  // weights, biases, and each one's experts (ep_size_2)
  const std::string ex = "moe.deepspeed_moe.experts.deepspeed_experts.";
  CHECK(m.groups[0].params == std::vector<std::string>{"inp.weight", "moe.deepspeed_moe.gate.wg.weight", "out.weight"});
  CHECK(m.groups[2].params == std::vector<std::string>{ex + "0.weight", ex + "1.weight", ex + "2.weight", ex + "3.weight"});
  CHECK(m.groups[3].params == std::vector<std::string>{ex + "0.bias", ex + "1.bias", ex + "2.bias", ex + "3.bias"});
  CHECK(m.groups[2].hyper.weight_decay == 0.05);
  for (const auto& [fqn, ps] : m.params) CHECK(ps.step == 3);
  // each local expert's weight (144 elements) is one half of its rank pair's 288: ranks 0 and 2
  // hold experts 0 and 1, ranks 1 and 3 experts 2 and 3
  for (const auto& [expert, rank] : std::vector<std::pair<int, int>>{{0, 0}, {1, 2}, {2, 1}, {3, 3}})
    CHECK(r->locate(ex + std::to_string(expert) + ".weight", kExpAvg, Component::kValues, 7)
              .find(fmt::format("zero_pp_rank_{}_", rank)) != std::string::npos);
  const auto notes = r->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].starts_with("DeepSpeed MoE: 1 MoE layer's experts read under their global numbers"));
  const auto nr = r->not_read();
  CHECK(std::any_of(nr.begin(), nr.end(), [](const std::string& s) {
    return s.starts_with("layer_*_expert_*_model_states.pt (4 files");
  }));
  // DeepSpeed takes MoE experts from layer_*_expert_* files, which a universal checkpoint has none of
  testing::TempDir dir;
  experts_validate_convert_and_refuse_universal(
      "moe_zero1_world4", *r, dir, "DeepSpeed MoE layers' experts, which DeepSpeed does not load from a universal");
}

TEST_CASE("deepspeed: MoE without ZeRO: each expert-parallel rank's numbered params placed among the module's and its experts'") {
  // moe_zero0_world4: the same run without ZeRO; expp_rank_e holds the dense params and expert-
  // parallel rank e's local experts 0 and 1 (experts 2e and 2e+1), numbered group by group.
  auto r = open_seed(kSeeds / "moe_zero0_world4");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 4);
  const std::string ex = "moe.deepspeed_moe.experts.deepspeed_experts.";
  CHECK(m.groups[0].params == std::vector<std::string>{"inp.weight", "moe.deepspeed_moe.gate.wg.weight", "out.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"inp.bias", "out.bias"});
  CHECK(m.groups[2].params == std::vector<std::string>{ex + "0.weight", ex + "1.weight", ex + "2.weight", ex + "3.weight"});
  CHECK(m.groups[3].params == std::vector<std::string>{ex + "0.bias", ex + "1.bias", ex + "2.bias", ex + "3.bias"});
  CHECK(m.groups[2].hyper.weight_decay == 0.05);
  for (const auto& [fqn, ps] : m.params) CHECK(ps.step == 3);
  for (const auto& [expert, rank] : std::vector<std::pair<int, int>>{{0, 0}, {1, 0}, {2, 1}, {3, 1}}) {
    CHECK(r->locate(ex + std::to_string(expert) + ".weight", kExpAvg, Component::kValues, 7)
              .find(fmt::format("expp_rank_{}_", rank)) != std::string::npos);
    CHECK(r->locate(ex + std::to_string(expert) + ".weight", kParam, Component::kValues, 7)
              .find(fmt::format("layer_0_expert_{}_", expert)) != std::string::npos);
  }
  CHECK(r->locate("inp.weight", kParam, Component::kValues, 0).find("mp_rank_00_model_states.pt") != std::string::npos);
  CHECK(r->locate("out.bias", kExpAvgSq, Component::kValues, 0).find("expp_rank_0_") != std::string::npos);
  const auto notes = r->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].starts_with("DeepSpeed MoE without ZeRO: each expert-parallel rank's numbered params named"));
  const auto nr = r->not_read();
  CHECK(std::any_of(nr.begin(), nr.end(), [](const std::string& s) { return s.starts_with("expp_rank_1.._1: their dense"); }));
  testing::TempDir dir;
  experts_validate_convert_and_refuse_universal("moe_zero0_world4", *r, dir,
                                                "DeepSpeed MoE without ZeRO (stage 0: each expert-parallel rank's");
}

TEST_CASE("deepspeed: MoE without ZeRO under FP16_Optimizer: each rank's params placed by value in its flat groups") {
  // moe_bf16_fused_zero0_world4: the same run under bf16 with DeepSpeed's AdamW (FP16_Optimizer):
  // each expp file's groups are one flat master each, the experts' too; the params are found where
  // the master rounds to the module's and the expert files' bf16 weights.
  auto r = open_seed(kSeeds / "moe_bf16_fused_zero0_world4");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 4);
  const std::string ex = "moe.deepspeed_moe.experts.deepspeed_experts.";
  CHECK(m.groups[0].params == std::vector<std::string>{"inp.weight", "moe.deepspeed_moe.gate.wg.weight", "out.weight"});
  CHECK(m.groups[2].params == std::vector<std::string>{ex + "0.weight", ex + "1.weight", ex + "2.weight", ex + "3.weight"});
  CHECK(m.groups[3].params == std::vector<std::string>{ex + "0.bias", ex + "1.bias", ex + "2.bias", ex + "3.bias"});
  for (const auto& [fqn, ps] : m.params) {
    CHECK(ps.step == 4);  // FP16_Optimizer's zero-gradient first step counts
    CHECK(ps.param_dtype == DType::kF32);  // the fp32 masters
  }
  for (const auto& [expert, rank] : std::vector<std::pair<int, int>>{{0, 0}, {1, 0}, {2, 1}, {3, 1}})
    for (const char* entry : {kExpAvg, kParam})
      CHECK(r->locate(ex + std::to_string(expert) + ".weight", entry, Component::kValues, 7)
                .find(fmt::format("expp_rank_{}_", rank)) != std::string::npos);
  // expert 1's weight: the second of rank 0's local experts, right after expert 0's 144 elements
  std::vector<float> a(144), b(144);
  REQUIRE(r->read_range(ex + "1.weight", kParam, Component::kValues, 0, 144, std::as_writable_bytes(std::span(a))).ok());
  REQUIRE(r->read_range(ex + "0.weight", kParam, Component::kValues, 0, 144, std::as_writable_bytes(std::span(b))).ok());
  CHECK(a != b);
  const auto notes = r->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].find("FP16_Optimizer's flat groups: each param placed") != std::string::npos);
  testing::TempDir dir;
  experts_validate_convert_and_refuse_universal("moe_bf16_fused_zero0_world4", *r, dir,
                                                "DeepSpeed MoE without ZeRO (stage 0: each expert-parallel rank's");
}

TEST_CASE("deepspeed: MoE's missing or extra expert files, a missing rank and model parallelism are refused") {
  const fs::path moe = "moe_zero1_world4/global_step3";
  struct Damage {
    const char* seed;
    std::function<void(const fs::path&)> edit;  // of the copied tag folder
    std::string error;
  };
  const std::vector<Damage> cases = {
      {"moe_zero1_world4", [](const fs::path& tag) { fs::remove(tag / "layer_0_expert_3_mp_rank_00_model_states.pt"); },
       "no layer_0_expert_3_mp_rank_00_model_states.pt (MoE layer 0 of 4 experts"},
      {"moe_zero1_world4",
       [](const fs::path& tag) {
         fs::copy(tag / "layer_0_expert_3_mp_rank_00_model_states.pt", tag / "layer_1_expert_0_mp_rank_00_model_states.pt");
       },
       "layer_1_expert_0_mp_rank_00_model_states.pt, past the 1 MoE layers' experts"},
      {"moe_zero1_world4", [](const fs::path& tag) { fs::remove(tag / "zero_pp_rank_3_mp_rank_00_optim_states.pt"); },
       "zero_pp_rank_0_mp_rank_00_optim_states.pt: partition_count 4, but"},
      {"moe_zero1_world4",
       [](const fs::path& tag) {
         fs::rename(tag / "layer_0_expert_3_mp_rank_00_model_states.pt", tag / "layer_0_expert_3_mp_rank_01_model_states.pt");
       },
       "DeepSpeed MoE beside model parallelism"},
      // stage 0 (no ZeRO): the state in expp_rank_* files
      {"moe_zero1_world4",
       [](const fs::path& tag) {
         for (int rank = 0; rank < 4; ++rank) fs::remove(tag / fmt::format("zero_pp_rank_{}_mp_rank_00_optim_states.pt", rank));
       },
       "without ZeRO partitions or expp_rank_*_optim_states.pt files (stage 0's optimizer)"},
      // without ZeRO: a rank's optimizer file gone, or another's number skipped; the model states gone
      {"moe_zero0_world4", [](const fs::path& tag) { fs::remove(tag / "expp_rank_1_mp_rank_00_optim_states.pt"); },
       "1 expp_rank_* files, and the largest expert-parallel group has 2 ranks (ep_size_2)"},
      {"moe_zero0_world4",
       [](const fs::path& tag) {
         fs::rename(tag / "expp_rank_1_mp_rank_00_optim_states.pt", tag / "expp_rank_2_mp_rank_00_optim_states.pt");
       },
       "no expp_rank_1_mp_rank_00_optim_states.pt (expert-parallel rank 1's optimizer) beside expp_rank_2's"},
      {"moe_zero0_world4", [](const fs::path& tag) { fs::remove(tag / "mp_rank_00_model_states.pt"); },
       "no mp_rank_00_model_states.pt (the dense params' weights"},
      {"moe_zero0_world4", [](const fs::path& tag) { fs::remove(tag / "layer_0_expert_2_mp_rank_00_model_states.pt"); },
       "no layer_0_expert_2_mp_rank_00_model_states.pt (MoE layer 0 of 4 experts"},
      // the experts' files of an MoE run beside a dense run's ZeRO files
      {"zero2_world2",
       [&](const fs::path& tag) { fs::copy(kSeeds / moe / "layer_0_expert_0_mp_rank_00_model_states.pt", tag); },
       "but no param group of experts ('moe'"},
  };
  for (const Damage& d : cases) {
    testing::TempDir dir;
    const fs::path tag = copy_tag(d.seed, dir);
    d.edit(tag);
    CHECK_MESSAGE(error_of(tag).find(d.error) != std::string::npos, d.error);
  }
}

TEST_CASE("deepspeed: AutoEP's fused experts read whole where its affine maps place each expert-parallel rank's") {
  // autoep_zero1_world4: one MoE layer of 4 experts over autoep_size 2 on 4 ranks; expert-parallel
  // rank e is ranks e and e+2, its fused w1 [2, 8, 12], w2 [2, 12, 8], w3 [2, 8, 12] (AutoEP splits
  // gate_up_proj into w1 and w3) one flat run of 576 elements split 288/288 over them.
  auto r = open_seed(kSeeds / "autoep_zero1_world4");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 3);  // weights, biases, the experts (ep_size_2)
  const std::string ex = "model.layers.0.mlp.experts.";
  CHECK(m.groups[2].params == std::vector<std::string>{ex + "w1", ex + "w2", ex + "w3"});
  CHECK(m.params.at(ex + "w1").shape == std::vector<int64_t>{4, 8, 12});  // whole: both ranks' 2 experts
  CHECK(m.params.at(ex + "w2").shape == std::vector<int64_t>{4, 12, 8});
  for (const auto& [fqn, ps] : m.params) CHECK(ps.step == 3);
  // (a tuple, not a structured binding: clang 14 cannot capture one in CHECK_MESSAGE's lambda)
  for (const auto& t : std::vector<std::tuple<std::string, int64_t, int>>{
           {"w1", 0, 0}, {"w1", 191, 0}, {"w1", 192, 1}, {"w2", 95, 0}, {"w2", 96, 2}, {"w2", 192, 1}, {"w2", 288, 3},
           {"w3", 0, 2}, {"w3", 192, 3}}) {
    const std::string param = std::get<0>(t);
    const int64_t element = std::get<1>(t);
    CHECK_MESSAGE(r->locate(ex + param, kExpAvg, Component::kValues, element)
                          .find(fmt::format("zero_pp_rank_{}_", std::get<2>(t))) != std::string::npos,
                  param, " ", element);
  }
  const auto notes = r->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].starts_with("DeepSpeed AutoEP: 1 MoE layer's fused experts (w1, w2, w3) read whole"));
  testing::TempDir dir;
  experts_validate_convert_and_refuse_universal("autoep_zero1_world4", *r, dir,
                                                "AutoEP's experts: its universal checkpoint is ds_to_universal's");
  {  // an expert file missing
    const fs::path tag = copy_tag("autoep_zero1_world4", dir);
    fs::remove(tag / "layer_0_expert_2_mp_rank_00_model_states.pt");
    CHECK(error_of(tag).find("no layer_0_expert_2_mp_rank_00_model_states.pt") != std::string::npos);
  }
}

TEST_CASE("deepspeed: AutoTP's patterns name one param each") {
  using torchsave::exact_name_of_pattern;
  CHECK(exact_name_of_pattern(R"(^layers\.0\.q_proj\.weight$)") == std::optional<std::string>("layers.0.q_proj.weight"));
  CHECK(exact_name_of_pattern(R"(^a\-b\ c$)") == std::optional<std::string>("a-b c"));
  CHECK(exact_name_of_pattern("^lm_head$") == std::optional<std::string>("lm_head"));
  CHECK(!exact_name_of_pattern(R"(^layers\.\d+\.q_proj\.weight$)"));  // a class: many params
  CHECK(!exact_name_of_pattern(R"(.*\.o_proj\.weight$)"));
  CHECK(!exact_name_of_pattern(R"(^layers.0$)"));                      // '.' unescaped
  CHECK(!exact_name_of_pattern(R"(^name\$)"));                         // the end escaped
  CHECK(!exact_name_of_pattern("^$"));
  CHECK(!exact_name_of_pattern("name"));
}

TEST_CASE("deepspeed: without ZeRO (stage 0) the optimizer in the model states file is read, named after the module") {
  // bf16_zero0_world2 (make_seeds.py): Linear(16, 24), GELU, Linear(24, 3) under bf16 without ZeRO:
  // DeepSpeed's FP16_UnfusedOptimizer dict (torch's state_dict numbered group by group: weights 0-1,
  // biases 2-3; each group's fp32 masters), the module's bf16 copies naming them.
  auto r = open_checkpoint(kSeeds / "bf16_zero0_world2");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const OptimizerState& m = (*r)->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"0.weight", "2.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"0.bias", "2.bias"});
  CHECK(m.groups[0].hyper.weight_decay == 0.05);
  for (const auto& [fqn, ps] : m.params) CHECK(ps.step == 4);  // the wrapper's zero-gradient first step, then 3
  CHECK(m.params.at("2.weight").shape == std::vector<int64_t>{3, 24});
  const auto notes = (*r)->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].starts_with("DeepSpeed's fp32 main params (['optimizer']['fp32_groups'])"));
  // The weights are the fp32 masters, not the module's bf16 copies (which they round to).
  auto all = load_all(**r);
  REQUIRE(all.ok());
  const Entry& w = all->params.at("0.weight").entries.at(kParam);
  REQUIRE(w.dtype == DType::kF32);
  bool finer = false;  // some master carries bits a bf16 value cannot
  for (size_t i = 0; i < w.values.size / 4; ++i) {
    uint32_t bits;
    std::memcpy(&bits, w.values.data + 4 * i, 4);
    finer = finer || (bits & 0xffffu) != 0;
  }
  CHECK(finer);
  auto v = validate_checkpoint(kSeeds / "bf16_zero0_world2", [](const fs::path& p) { return open_checkpoint(p); });
  REQUIRE(v.ok());
  CHECK(v->findings.empty());
  // No universal checkpoint from it (DeepSpeed loads those into ZeRO-1/2 runs).
  testing::TempDir dir;
  CHECK_FALSE(write_checkpoint(*find_format("deepspeed"), *all, dir.path / "u", {.source = r->get()}).ok());
  CHECK_FALSE(fs::exists(dir.path / "u"));
}

TEST_CASE("deepspeed: FP16_Optimizer's flat groups without ZeRO are split into the module's params") {
  // fp16_fused_zero0_world2 (make_seeds.py): the same model under fp16 with DeepSpeed's FusedAdam
  // from its config, which FP16_Optimizer wraps: each group's params one flat fp32 master
  // (fp32_groups_flat: weights 24*16 + 3*24, biases 24 + 3), FusedAdam's state of the flat params.
  auto r = open_checkpoint(kSeeds / "fp16_fused_zero0_world2");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const OptimizerState& m = (*r)->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"0.weight", "2.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"0.bias", "2.bias"});
  for (const auto& [fqn, ps] : m.params) CHECK(ps.step == 4);  // the wrapper's zero-gradient first step, then 3
  CHECK(m.params.at("2.weight").shape == std::vector<int64_t>{3, 24});
  const auto notes = (*r)->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].starts_with("DeepSpeed's FP16_Optimizer keeps each param group flat"));
  // Each param's entries are its slice of the flat ones (pytest compares them with the flat
  // tensors cut by torch, bit for bit): here their sizes, and two slices apart.
  auto all = load_all(**r);
  REQUIRE(all.ok());
  const Entry& w = all->params.at("2.weight").entries.at(kParam);
  REQUIRE(w.dtype == DType::kF32);
  REQUIRE(w.values.size == 72 * 4);
  const Entry& m0 = all->params.at("0.weight").entries.at(kExpAvg);
  const Entry& m1 = all->params.at("2.weight").entries.at(kExpAvg);
  CHECK(m0.values.size == 384 * 4);
  CHECK(std::memcmp(m0.values.data, m1.values.data, 16) != 0);  // not the same slice
  auto v = validate_checkpoint(kSeeds / "fp16_fused_zero0_world2", [](const fs::path& p) { return open_checkpoint(p); });
  REQUIRE(v.ok());
  CHECK(v->findings.empty());
  // A write from it is a plain state (nothing of the file carried: its flat masters would be stale).
  testing::TempDir dir;
  REQUIRE(write_checkpoint(*find_format("torchsave"), *all, dir.path / "plain.pt", {.source = r->get()}).ok());
  auto back = open_checkpoint(dir.path / "plain.pt");
  REQUIRE_MESSAGE(back.ok(), back.status().message());
  auto again = load_all(**back);
  REQUIRE(again.ok());
  const Entry& w2 = again->params.at("2.weight").entries.at(kParam);
  REQUIRE(w2.values.size == w.values.size);
  CHECK(std::memcmp(w2.values.data, w.values.data, w.values.size) == 0);
}

TEST_CASE("deepspeed: a pipeline under bf16 without ZeRO takes its params' shapes from the layer files") {
  // bf16_pipe2_zero0_world4: the pipeline of pipe2_zero1_world4 under bf16 without ZeRO: DeepSpeed's
  // BF16_Optimizer files name each rank's runs, the model states no shape (param_shapes None).
  auto r = open_seed(kSeeds / "bf16_pipe2_zero0_world4");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"tied_modules.embed.weight", "1.weight", "3.weight", "5.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"1.bias", "3.bias", "4.weight", "4.bias", "5.bias"});
  CHECK(m.params.at("tied_modules.embed.weight").shape == std::vector<int64_t>{12, 8});  // layer_00's 'weight'
  CHECK(m.params.at("1.weight").shape == std::vector<int64_t>{20, 12});
  CHECK(m.params.at("4.weight").shape == std::vector<int64_t>{10});  // the LayerNorm's
  for (const auto& [fqn, ps] : m.params) CHECK(ps.step == 3);
  const auto notes = r->read_notes();
  REQUIRE(notes.size() == 2);
  CHECK(notes[0].starts_with("DeepSpeed's pipeline without ZeRO (BF16_Optimizer) saves no param_shapes"));
  auto v = validate_checkpoint(kSeeds / "bf16_pipe2_zero0_world4", [](const fs::path& p) { return open_checkpoint(p); });
  REQUIRE(v.ok());
  CHECK(v->findings.empty());
  CHECK(v->checksums_verified);
  // no universal checkpoint: DeepSpeed loads none into this setup
  testing::TempDir dir;
  CHECK_FALSE(write_checkpoint(*find_format("deepspeed"), *load_all(*r), dir.path / "uni", {.source = r.get()}).ok());
  CHECK_FALSE(fs::exists(dir.path / "uni"));
  {  // a layer file gone: its params' shapes are nowhere
    testing::TempDir d;
    const fs::path tag = copy_tag("bf16_pipe2_zero0_world4", d);
    fs::remove(tag / "layer_05-model_states.pt");
    CHECK(error_of(tag).find("(param_shapes is None): no layer_05-model_states.pt in") != std::string::npos);
  }
  {  // a layer file without the key
    testing::TempDir d;
    const fs::path tag = copy_tag("bf16_pipe2_zero0_world4", d);
    fs::copy(tag / "layer_02-model_states.pt", tag / "layer_03-model_states.pt", fs::copy_options::overwrite_existing);
    CHECK(error_of(tag).find("layer_03-model_states.pt holds no 'weight'") != std::string::npos);
  }
  {  // no layer files at all: the shapes are nowhere
    testing::TempDir d;
    const fs::path tag = copy_tag("bf16_pipe2_zero0_world4", d);
    for (int l = 0; l < 6; ++l) fs::remove(tag / fmt::format("layer_{:02d}-model_states.pt", l));
    CHECK(error_of(tag).find("no pipeline layer files (layer_*-model_states.pt) to take the shapes from") !=
          std::string::npos);
  }
}
