// torchsave driver: real files from torch, torchao and optstate's Python optimizers
// (formats/torchsave/testdata/make_seeds.py) read as their canonical state; the state_dict encoding
// reads back through the interpretation; hostile variants are refused with the file named.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "bitsandbytes/bnb_layout.h"
#include "dcp/bnb_state.h"
#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "optstate/transform.h"
#include "optstate/validate.h"
#include "registry.h"
#include "test_helpers.h"
#include "torchsave/torchsave_archive.h"
#include "torchsave/torchsave_fuzz_sign.h"
#include "torchsave/torchsave_reader.h"
#include "torchao/torchao_layout.h"
#include "torchsave/torchsave_layout.h"

using namespace optstate;
namespace fs = std::filesystem;

namespace {

const fs::path kSeeds = fs::path(OPTSTATE_SOURCE_DIR) / "formats/torchsave/testdata";
const fs::path kLibTorchSeeds = fs::path(OPTSTATE_SOURCE_DIR) / "formats/libtorch/testdata";

size_t get_u16(const std::string& s, size_t at) {
  return static_cast<uint8_t>(s[at]) | static_cast<size_t>(static_cast<uint8_t>(s[at + 1])) << 8;
}

// Two readers of one state: the same root and entry hashes.
void check_same_hashes(CheckpointReader& x, CheckpointReader& y) {
  auto a = hash_checkpoint(x), b = hash_checkpoint(y);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->root == b->root);
  CHECK(a->entries == b->entries);
}

// An AdamW group's lr, betas, eps and weight_decay as key/value pairs, for the hand-built pickles.
void adamw_hyper(pickle::Writer& w) {
  w.str("lr");
  w.real(1e-3);
  w.str("betas");
  w.mark();
  w.real(0.9);
  w.real(0.999);
  w.tuple_from_mark();
  w.str("eps");
  w.real(1e-8);
  w.str("weight_decay");
  w.real(0.0);
}

std::unique_ptr<CheckpointReader> open_seed(const char* name, std::string_view format = "torchsave") {
  auto r = open_checkpoint(kSeeds / name);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r.value()->format() == format);
  return std::move(r.value());
}

}  // namespace

TEST_CASE("torchsave: torch AdamW's optimizer.pt, params numbered as torch numbers them") {
  auto r = open_seed("torch_adamw_amsgrad.pt");
  const OptimizerState& m = r->meta();
  CHECK(m.kind == "adamw");
  REQUIRE(m.groups.size() == 1);
  CHECK(m.groups[0].params == std::vector<std::string>{"0", "1"});
  CHECK(m.groups[0].hyper.amsgrad);
  CHECK(m.groups[0].hyper.lr == 1e-3);
  const ParamState& w = m.params.at("0");
  CHECK(w.shape == std::vector<int64_t>{64, 64});
  CHECK(w.step == 2);
  CHECK(w.entries.size() == 3);
  CHECK(w.entries.at(kMaxExpAvgSq).dtype == DType::kF32);
  CHECK(r->checksummed());
  CHECK(r->not_read().empty());
}

TEST_CASE("torchsave: torchao's OptimState8bit and optstate's plain codes read as blockwise8") {
  for (const char* seed : {"torchao_adamw8bit.pt", "optstate_adamw8bit_named.pt"}) {
    CAPTURE(seed);
    // read by the torch.save driver's reader; formats/torchao/ sniffs torchao's files
    auto r = open_seed(seed, std::string(seed).starts_with("torchao") ? "torchao" : "torchsave");
    const OptimizerState& m = r->meta();
    CHECK(m.kind == "adamw8bit");
    const std::string w = std::string(seed).starts_with("torchao") ? "0" : "weight";
    const std::string b = std::string(seed).starts_with("torchao") ? "1" : "bias";
    const Entry& e = m.params.at(w).entries.at(kExpAvg);
    CHECK(e.encoding == Encoding::kBlockwise8);
    CHECK(e.block_size == 256);
    CHECK(e.qmap == "dynamic-signed");
    CHECK(m.params.at(w).entries.at(kExpAvgSq).qmap == "dynamic-unsigned");
    CHECK(m.params.at(b).entries.at(kExpAvg).encoding == Encoding::kDense);  // 64 < 4096 elements
    auto v = validate_checkpoint(kSeeds / seed, [](const fs::path& p) { return open_checkpoint(p); });
    REQUIRE(v.ok());
    CHECK(v->findings.empty());
  }
}

TEST_CASE("torchsave: bitsandbytes' AdamW8bit state (state1/state2, absmax, qmap) reads as blockwise8") {
  // 0.50's layout (nested under __bnb_optimizer_quant_state__, blocks of 256, param_names) and the
  // older one (beside "step", blocks of 2048, numbered params).
  for (auto [seed, block, w, b] : {std::tuple{"bnb_adamw8bit_named.pt", 256, "weight", "bias"},
                                   std::tuple{"bnb_adamw8bit_2048.pt", 2048, "0", "1"}}) {
    const char* const seed_file = seed;  // a structured binding: clang 14 cannot capture it
    CAPTURE(seed_file);
    auto r = open_seed(seed, "bitsandbytes");  // read by this driver's reader; formats/bitsandbytes/ sniffs it
    const OptimizerState& m = r->meta();
    CHECK(m.kind == "adamw8bit");
    REQUIRE(m.groups.size() == 1);
    CHECK(m.groups[0].hyper.weight_decay == 0.01);
    const ParamState& wp = m.params.at(w);
    CHECK(wp.shape == std::vector<int64_t>{64, 64});
    CHECK(wp.step == 2);
    const Entry& e = wp.entries.at(kExpAvg);
    CHECK(e.encoding == Encoding::kBlockwise8);
    CHECK(e.block_size == block);
    CHECK(e.qmap == "dynamic-signed");
    CHECK(wp.entries.at(kExpAvgSq).qmap == "dynamic-unsigned");
    CHECK(m.params.at(b).entries.at(kExpAvgSq).encoding == Encoding::kDense);  // 64 < min_8bit_size: fp32
    CHECK(r->not_read().empty());  // AdEMAMix's inert group fields (alpha, t_alpha, t_beta3) are no loss
    auto v = validate_checkpoint(kSeeds / seed, [](const fs::path& p) { return open_checkpoint(p); });
    REQUIRE(v.ok());
    CHECK(v->findings.empty());
  }
}

TEST_CASE("bitsandbytes: the planned state_dict reads back through the interpretation as the state") {
  // 8-bit in blocks of 256 (bitsandbytes' own) for the weight, fp32 for the small bias.
  OptimizerState s = *quantize_state(testing::sample_state(), {256, 4});
  s.params.at("layers.0.bias").step = 7;
  auto plan = bitsandbytes::plan_state_dict(s);
  REQUIRE_MESSAGE(plan.ok(), plan.status().message());
  auto p = pickle::unpickle(std::as_bytes(std::span(plan->data_pkl)), "test");
  REQUIRE(p.ok());
  auto sd = torchsave::interpret_state_dict(*p, "test");
  REQUIRE_MESSAGE(sd.ok(), sd.status().message());
  CHECK(sd->bnb);
  CHECK(sd->optimizer_path == "['optimizer']");  // the weights ride along: {"model", "optimizer"}
  CHECK(sd->not_read.empty());                   // alpha, t_alpha, t_beta3 are bitsandbytes' inert fields
  REQUIRE(sd->params.size() == 2);
  const auto& w = sd->params[0];
  CHECK(w.fqn == "layers.0.weight");
  CHECK(*w.step.number == 5);
  CHECK(w.entries.at(kExpAvg).encoding == Encoding::kBlockwise8);
  CHECK(w.entries.at(kExpAvg).block_size == 256);
  // One storage per map, shared by every param that uses it, as bitsandbytes shares it.
  CHECK(w.entries.at(kExpAvg).qmap->storage_key != w.entries.at(kExpAvgSq).qmap->storage_key);
  size_t maps = 0;
  for (const auto& st : plan->storages) maps += !st.qmap.empty();
  CHECK(maps == 2);
  const auto& b = sd->params[1];
  CHECK(*b.step.number == 7);
  CHECK(b.entries.at(kExpAvg).encoding == Encoding::kDense);  // 3 elements: below min_8bit_size
  CHECK(b.entries.at(kExpAvg).values.dtype == DType::kF32);

  // 8-bit entries bitsandbytes would not step as its own (blocks of 4) are planned as fp32 values.
  const OptimizerState four = *quantize_state(testing::sample_state(), {4, 1});
  auto planned = bitsandbytes::plan_state_dict(four);
  REQUIRE(planned.ok());
  for (const auto& st : planned->storages)
    if (st.entry == kExpAvg || st.entry == kExpAvgSq) CHECK(st.what == torchsave::StorageSpec::What::kF32Values);
  const OptimizerState kept = bitsandbytes::kept_state(four);
  CHECK(kept.kind == "adamw");
  CHECK(kept.params.at("layers.0.weight").entries.at(kExpAvg).encoding == Encoding::kDense);

  // bitsandbytes has no amsgrad: refused, naming the group.
  OptimizerState ams = testing::sample_state();
  ams.groups[1].hyper.amsgrad = true;
  auto refused = bitsandbytes::plan_state_dict(ams);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("param group 1: amsgrad") != std::string::npos);
}

TEST_CASE("bitsandbytes: the flat layout (before 0.49.2) and the nested one hold the same state; a write keeps the source's") {
  const OptimizerState s = *quantize_state(testing::sample_state(), {256, 4});
  for (const auto layout : {bitsandbytes::Layout::kNested, bitsandbytes::Layout::kFlat}) {
    const bool nested = layout == bitsandbytes::Layout::kNested;
    CAPTURE(nested);
    auto plan = bitsandbytes::plan_state_dict(s, layout);
    REQUIRE(plan.ok());
    // The nested dict's key is in the pickle only in the nested layout.
    CHECK((plan->data_pkl.find(std::string(dcp::kBnbQuantState)) != std::string::npos) == nested);
    auto p = pickle::unpickle(std::as_bytes(std::span(plan->data_pkl)), "test");
    REQUIRE(p.ok());
    auto sd = torchsave::interpret_state_dict(*p, "test");
    REQUIRE_MESSAGE(sd.ok(), sd.status().message());
    CHECK(sd->bnb);
    REQUIRE(sd->bnb_nested.has_value());
    CHECK(*sd->bnb_nested == nested);
    CHECK(sd->params.at(0).entries.at(kExpAvg).encoding == Encoding::kBlockwise8);
  }
  // Written through the driver: the source's layout unless one is asked for; a bad name refused.
  const FormatDriver* d = find_format("bitsandbytes");
  REQUIRE(d != nullptr);
  testing::TempDir dir;
  WriteOptions flat;
  flat.bitsandbytes_layout = "flat";
  REQUIRE(d->write(s, dir.path / "flat.pt", flat).ok());
  auto flat_r = open_checkpoint(dir.path / "flat.pt");
  REQUIRE(flat_r.ok());
  CHECK(torchsave::bnb_nested(**flat_r) == std::optional<bool>(false));
  CHECK(d->write_notes(d->kept(s), flat).empty());
  const auto note = d->write_notes(d->kept(s), {});  // nested, from no bitsandbytes file: which releases load it
  REQUIRE(note.size() == 1);
  CHECK(note[0].find("bitsandbytes 0.49.2 and later") != std::string::npos);
  auto all = load_all(**flat_r);
  REQUIRE(all.ok());
  REQUIRE(d->write(*all, dir.path / "kept.pt", {.source = flat_r->get()}).ok());
  WriteOptions nested{.source = flat_r->get()};
  nested.bitsandbytes_layout = "nested";
  REQUIRE(d->write(*all, dir.path / "nested.pt", nested).ok());
  auto kept_r = open_checkpoint(dir.path / "kept.pt");
  auto nested_r = open_checkpoint(dir.path / "nested.pt");
  REQUIRE(kept_r.ok());
  REQUIRE(nested_r.ok());
  CHECK(torchsave::bnb_nested(**kept_r) == std::optional<bool>(false));
  CHECK(torchsave::bnb_nested(**nested_r) == std::optional<bool>(true));
  CHECK(hash_checkpoint(**kept_r)->root == hash_checkpoint(**flat_r)->root);
  CHECK(hash_checkpoint(**nested_r)->root == hash_checkpoint(**flat_r)->root);
  CHECK(d->write_notes(d->kept(*all), {.source = nested_r->get()}).empty());  // from a nested file: nothing to say
  WriteOptions bad;
  bad.bitsandbytes_layout = "wrapped";
  const Status st = d->write(s, dir.path / "bad.pt", bad);
  CHECK(st.code() == ErrorCode::kInvalidArgument);
  CHECK(st.message().find("bitsandbytes layout 'wrapped'") != std::string::npos);
  CHECK_FALSE(fs::exists(dir.path / "bad.pt"));
}

TEST_CASE("torchao: the planned state_dict reads back through the interpretation as torchao's state") {
  // Blocks of 1 (torchao keeps the block size per tensor): both params' moments are OptimState8bit.
  OptimizerState s = *quantize_state(testing::sample_state(), {1, 3});
  auto plan = torchao::plan_state_dict(s);
  REQUIRE_MESSAGE(plan.ok(), plan.status().message());
  auto p = pickle::unpickle(std::as_bytes(std::span(plan->data_pkl)), "test");
  REQUIRE(p.ok());
  auto sd = torchsave::interpret_state_dict(*p, "test");
  REQUIRE_MESSAGE(sd.ok(), sd.status().message());
  CHECK(sd->torchao);
  CHECK(sd->optimizer_path == "['optimizer']");  // the weights ride along
  CHECK(sd->not_read.empty());
  REQUIRE(sd->groups.size() == 2);
  CHECK(sd->groups[0].lr.tensor.has_value());  // torchao's step refuses a float lr
  const auto& w = sd->params[0];
  CHECK(w.fqn == "layers.0.weight");
  CHECK(w.step.tensor.has_value());
  const auto& e = w.entries.at(kExpAvg);
  CHECK(e.encoding == Encoding::kBlockwise8);
  CHECK(e.block_size == 1);
  CHECK(e.qmap.has_value());
  CHECK(e.apparent_dtype == DType::kBF16);  // the param's dtype, as torchao's subclass claims it
  // one storage per map, shared by every param that uses it
  CHECK(w.entries.at(kExpAvgSq).qmap->storage_key == sd->params[1].entries.at(kExpAvgSq).qmap->storage_key);
  CHECK(w.entries.at(kExpAvg).qmap->storage_key != w.entries.at(kExpAvgSq).qmap->storage_key);
  CHECK(sd->params[1].entries.at(kExpAvg).encoding == Encoding::kBlockwise8);
  CHECK(sd->params[1].entries.at(kExpAvg).apparent_dtype == DType::kF32);
  size_t maps = 0, scalars = 0;
  for (const auto& st : plan->storages) {
    maps += st.what == torchsave::StorageSpec::What::kQMap;
    scalars += st.what == torchsave::StorageSpec::What::kScalar;
  }
  CHECK(maps == 2);
  CHECK(scalars == 4);  // two steps, two lrs
  CHECK(torchao::kept_state(s).kind == "adamw8bit");

  // Blocks of 4: the weight's 6 elements end in a partial block, which torchao never has: fp32 values.
  const OptimizerState four = *quantize_state(testing::sample_state(), {4, 4});
  auto planned = torchao::plan_state_dict(four);
  REQUIRE(planned.ok());
  for (const auto& st : planned->storages)
    if (st.fqn == "layers.0.weight" && st.entry != kParam) CHECK(st.what == torchsave::StorageSpec::What::kF32Values);
  const OptimizerState kept = torchao::kept_state(four);
  CHECK(kept.kind == "adamw");
  CHECK(kept.params.at("layers.0.weight").entries.at(kExpAvg).encoding == Encoding::kDense);
  CHECK(kept.groups[0].hyper.lr == static_cast<double>(static_cast<float>(1e-3)));
  // The quantize rule the torchao driver gives `convert --to 8bit`: whole blocks only.
  const FormatDriver* d = find_format("torchao");
  REQUIRE(d);
  const QuantizeOptions rule = d->quantize_rule({4, 4});
  CHECK(rule.whole_blocks);
  CHECK(!has_blockwise8(*quantize_state(testing::sample_state(), rule)));

  // torchao has no maximize, and keeps step as float32: refused by name.
  OptimizerState mx = testing::sample_state();
  mx.groups[1].hyper.maximize = true;
  auto refused = torchao::plan_state_dict(mx);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("param group 1: maximize") != std::string::npos);
  OptimizerState far = testing::sample_state();
  far.params.at("layers.0.bias").step = (int64_t{1} << 24) + 1;
  auto beyond = torchao::plan_state_dict(far);
  REQUIRE_FALSE(beyond.ok());
  CHECK(beyond.status().message().find("'layers.0.bias': step 16777217") != std::string::npos);
}

TEST_CASE("torchsave: torchao's OptimStateFp8 and OptimState4bit read as fp32 values, code value times the block's scale") {
  const auto& fp8 = dcp::float8_e4m3fn_values();
  CHECK(fp8[0x38] == 1.0f);
  CHECK(fp8[0xb8] == -1.0f);
  CHECK(fp8[0x7e] == 448.0f);  // the largest
  CHECK(fp8[0x01] == std::ldexp(1.0f, -9));  // the smallest subnormal
  CHECK(fp8[0x08] == std::ldexp(1.0f, -6));  // the smallest normal
  CHECK(std::isnan(fp8[0x7f]));
  CHECK(std::isnan(fp8[0xff]));
  // AdamWFp8's seed, and AdamW4bit's (two codes a byte, high nibble first, its 16-entry map).
  for (auto [seed, what] : {std::pair{"torchao_adamwfp8.pt", "float8"}, std::pair{"torchao_adamw4bit.pt", "4-bit"}}) {
    const char* const seed_file = seed;  // a structured binding (see above)
    CAPTURE(seed_file);
    auto r = open_seed(seed, "torchao");
    const OptimizerState& m = r->meta();
    CHECK(m.kind == "adamw");  // no canonical map: AdamW's fp32 state once read
    const Entry& e = m.params.at("0").entries.at(kExpAvg);
    CHECK(e.encoding == Encoding::kDense);
    CHECK(e.dtype == DType::kF32);
    REQUIRE(r->not_read().size() == 1);
    CHECK(r->not_read()[0].find(fmt::format("{} encoding of 0.exp_avg, 0.exp_avg_sq", what)) != std::string::npos);
    auto v = validate_checkpoint(kSeeds / seed, [](const fs::path& p) { return open_checkpoint(p); });
    REQUIRE(v.ok());
    CHECK(v->findings.empty());
  }
}

TEST_CASE("torchsave: a {model, optimizer} checkpoint carries the weights by param name") {
  auto r = open_seed("torch_model_and_optimizer.pt");
  const OptimizerState& m = r->meta();
  CHECK(m.params.at("weight").entries.count(kParam) == 1);
  CHECK(m.params.at("bias").entries.count(kParam) == 1);
  CHECK(r->not_read() == std::vector<std::string>{"['step']"});
}

TEST_CASE("torchsave: numbered params beside their model are named after it (decay groups, tied head, BatchNorm)") {
  auto r = open_seed("torch_numbered_model_and_optimizer.pt");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"0.weight", "1.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"1.bias", "2.weight", "2.bias"});
  for (const auto& kv : m.params) CHECK_MESSAGE(kv.second.entries.count(kParam) == 1, kv.first);
  CHECK(m.params.at("0.weight").shape == std::vector<int64_t>{10, 8});
  // the head's tied weight (3.weight) and the three BatchNorm buffers are the model's other entries
  CHECK(r->not_read() == std::vector<std::string>{"['iter_num']"});
  // ... which it streams for a DCP write (model_tensors), named as torch's state dicts name them.
  std::vector<std::string> others;
  for (const ModelTensorInfo& t : r->model_tensors()) others.push_back(t.name);
  CHECK(others == std::vector<std::string>{"2.running_mean", "2.running_var", "2.num_batches_tracked", "3.weight"});
  auto bytes_of = [&](size_t i) {
    std::string out;
    const Status st = r->stream_model_tensor(i, [&](std::span<const std::byte> piece) {
      out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
      return Status::Ok();
    });
    REQUIRE_MESSAGE(st.ok(), st.message());
    return out;
  };
  CHECK(r->model_tensors()[2].dtype == DType::kI64);
  CHECK(r->model_tensors()[2].shape.empty());
  const std::string count = bytes_of(2);
  REQUIRE(count.size() == 8);
  int64_t batches = 0;
  std::memcpy(&batches, count.data(), 8);
  CHECK(batches == 2);  // two training steps
  // The tied head's second name holds the embedding's weights.
  auto all = load_all(*r);
  REQUIRE(all.ok());
  const Entry& emb = all->params.at("0.weight").entries.at(kParam);
  CHECK(bytes_of(3) == std::string(reinterpret_cast<const char*>(emb.values.data), emb.values.size));
  CHECK(!r->stream_model_tensor(4, [](std::span<const std::byte>) { return Status::Ok(); }).ok());
  // A DCP written from it holds them as model.<name> items beside the weights.
  testing::TempDir dir;
  const Status st = write_checkpoint(*find_format("dcp"), *all, dir.path / "out.dcp", {.source = r.get()});
  REQUIRE_MESSAGE(st.ok(), st.message());
  auto back = open_checkpoint(dir.path / "out.dcp");
  REQUIRE(back.ok());
  CHECK((*back)->not_read().empty());
  CHECK(hash_checkpoint(**back)->root == hash_checkpoint(*r)->root);
  // ... which the DCP reads as the model's other tensors again, and a torch.save file written from
  // it holds in its model dict beside the weights, byte for byte.
  auto names_of = [](const CheckpointReader& c) {
    std::vector<std::string> out;
    for (const ModelTensorInfo& t : c.model_tensors()) out.push_back(t.name);
    return out;
  };
  CHECK(names_of(**back) == std::vector<std::string>{"2.num_batches_tracked", "2.running_mean", "2.running_var", "3.weight"});
  const Status again = write_checkpoint(*find_format("torchsave"), *load_all(**back), dir.path / "again.pt",
                                        {.source = back->get()});
  REQUIRE_MESSAGE(again.ok(), again.message());
  auto pt = open_checkpoint(dir.path / "again.pt");
  REQUIRE_MESSAGE(pt.ok(), pt.status().message());
  CHECK(hash_checkpoint(**pt)->root == hash_checkpoint(*r)->root);
  CHECK((*pt)->not_read().empty());
  REQUIRE(names_of(**pt) == names_of(**back));
  for (size_t i = 0; i < (*pt)->model_tensors().size(); ++i) {
    const ModelTensorInfo& t = (*pt)->model_tensors()[i];
    const auto from = std::find_if(r->model_tensors().begin(), r->model_tensors().end(),
                                   [&](const ModelTensorInfo& o) { return o.name == t.name; });
    REQUIRE(from != r->model_tensors().end());
    CHECK(t.dtype == from->dtype);
    CHECK(t.shape == from->shape);
    std::string bytes;
    REQUIRE((*pt)->stream_model_tensor(i, [&](std::span<const std::byte> piece) {
      bytes.append(reinterpret_cast<const char*>(piece.data()), piece.size());
      return Status::Ok();
    }).ok());
    CHECK_MESSAGE(bytes == bytes_of(static_cast<size_t>(from - r->model_tensors().begin())), t.name);
  }
}

TEST_CASE("torchsave: buffers of complex64, int16, bool, float8 and uint16 go with the model through DCP and back") {
  auto r = open_seed("torch_rotary_model_and_optimizer.pt");
  auto bytes_of = [](const CheckpointReader& c, size_t i) {
    std::string out;
    const Status st = c.stream_model_tensor(i, [&](std::span<const std::byte> piece) {
      out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
      return Status::Ok();
    });
    REQUIRE_MESSAGE(st.ok(), st.message());
    return out;
  };
  const auto tensors = r->model_tensors();
  REQUIRE(tensors.size() == 6);
  CHECK(tensors[0].name == "freqs_cis");
  CHECK(tensors[0].dtype == DType::kC64);
  CHECK(tensors[0].shape == std::vector<int64_t>{4, 2});
  CHECK(tensors[1].name == "positions");
  CHECK(tensors[1].dtype == DType::kI16);
  CHECK(tensors[2].name == "keep");
  CHECK(tensors[2].dtype == DType::kBool);
  // torch.polar(1, angle): (cos, sin) pairs of float32; angle[1][0] is 1.
  const std::string freqs = bytes_of(*r, 0);
  REQUIRE(freqs.size() == 4 * 2 * 8);
  float pair[2];
  std::memcpy(pair, freqs.data(), 8);
  CHECK(pair[0] == 1.0f);
  CHECK(pair[1] == 0.0f);
  std::memcpy(pair, freqs.data() + 2 * 8, 8);
  CHECK(pair[0] == doctest::Approx(std::cos(1.0)).epsilon(1e-6));
  CHECK(pair[1] == doctest::Approx(std::sin(1.0)).epsilon(1e-6));
  const std::string positions = bytes_of(*r, 1);
  REQUIRE(positions.size() == 8);
  int16_t pos[4];
  std::memcpy(pos, positions.data(), 8);
  CHECK((pos[0] == 0 && pos[1] == 1 && pos[2] == 2 && pos[3] == 3));
  CHECK(bytes_of(*r, 2) == std::string("\x01\x00\x01", 3));
  // _rebuild_tensor_v3 over an UntypedStorage of bytes: float8_e4m3fn [[0.5, -1], [448, 0]], the
  // e8m0 scales 0.5 and 4 (biased exponents), uint16 [1, 60000].
  CHECK(tensors[3].name == "base_fp8");
  CHECK(tensors[3].dtype == DType::kF8E4M3FN);
  CHECK(tensors[3].shape == std::vector<int64_t>{2, 2});
  CHECK(bytes_of(*r, 3) == std::string("\x30\xb8\x7e\x00", 4));
  CHECK(tensors[4].dtype == DType::kF8E8M0FNU);
  CHECK(bytes_of(*r, 4) == std::string("\x7e\x81", 2));
  CHECK(tensors[5].dtype == DType::kU16);
  CHECK(bytes_of(*r, 5) == std::string("\x01\x00\x60\xea", 4));
  // Through a DCP (model.<name> items in their dtypes) and back into a torch.save file's model dict.
  testing::TempDir dir;
  auto all = load_all(*r);
  REQUIRE(all.ok());
  Status st = write_checkpoint(*find_format("dcp"), *all, dir.path / "out.dcp", {.source = r.get()});
  REQUIRE_MESSAGE(st.ok(), st.message());
  auto dcp = open_checkpoint(dir.path / "out.dcp");
  REQUIRE_MESSAGE(dcp.ok(), dcp.status().message());
  st = write_checkpoint(*find_format("torchsave"), *load_all(**dcp), dir.path / "back.pt", {.source = dcp->get()});
  REQUIRE_MESSAGE(st.ok(), st.message());
  auto back = open_checkpoint(dir.path / "back.pt");
  REQUIRE_MESSAGE(back.ok(), back.status().message());
  CHECK(hash_checkpoint(**back)->root == hash_checkpoint(*r)->root);
  for (const auto* c : {dcp->get(), back->get()}) {
    REQUIRE(c->model_tensors().size() == tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const ModelTensorInfo& t = c->model_tensors()[i];
      const auto from = std::find_if(tensors.begin(), tensors.end(), [&](const ModelTensorInfo& o) { return o.name == t.name; });
      REQUIRE(from != tensors.end());
      CHECK(t.dtype == from->dtype);
      CHECK(t.shape == from->shape);
      CHECK_MESSAGE(bytes_of(*c, i) == bytes_of(*r, static_cast<size_t>(from - tensors.begin())), t.name);
    }
  }
}

// `r` written by the torch.save driver into its own file's layout at `out` (the file's other
// entries carried), read again: the same state and the same entries beside it.
std::unique_ptr<CheckpointReader> carried_back(CheckpointReader& r, const fs::path& out) {
  const FormatDriver* ts = find_format("torchsave");
  CHECK(ts->carries(r, out));
  const Status st = write_checkpoint(*ts, *load_all(r), out, {.source = &r});
  REQUIRE_MESSAGE(st.ok(), st.message());
  auto back = open_checkpoint(out);
  REQUIRE_MESSAGE(back.ok(), back.status().message());
  CHECK(hash_checkpoint(**back)->root == hash_checkpoint(r)->root);
  CHECK((*back)->not_read() == r.not_read());
  CHECK((*back)->model_tensors().size() == r.model_tensors().size());
  return std::move(*back);
}

TEST_CASE("torchsave: written from a {model, optimizer, iter_num} file, the file's other entries are carried") {
  auto r = open_checkpoint(kSeeds / "torch_numbered_model_and_optimizer.pt");
  REQUIRE(r.ok());
  const FormatDriver* ts = find_format("torchsave");
  testing::TempDir dir;
  const fs::path out = dir.path / "back.pt";
  // the same entries beside the state: the model's tied head and BatchNorm buffers, 'iter_num'
  auto back = carried_back(**r, out);
  // written again from the written file: the same bytes (nothing added or lost on the way)
  const fs::path again = dir.path / "again.pt";
  REQUIRE(write_checkpoint(*ts, *load_all(*back), again, {.source = back.get()}).ok());
  CHECK(testing::read_file(again) == testing::read_file(out));
  // Without the source the file is optimizer and weights only.
  const fs::path plain = dir.path / "plain.pt";
  REQUIRE(write_checkpoint(*ts, *load_all(**r), plain, {}).ok());
  auto p = open_checkpoint(plain);
  REQUIRE(p.ok());
  CHECK((*p)->not_read().empty());
  // A plain optimizer file carries its groups' other keys (none here): written from it, the same
  // bytes as written from its state alone.
  auto alone = open_seed("torch_adamw_amsgrad.pt");
  CHECK(ts->carries(*alone, plain));
  const fs::path from_file = dir.path / "from_file.pt", from_state = dir.path / "from_state.pt";
  REQUIRE(write_checkpoint(*ts, *load_all(*alone), from_file, {.source = alone.get()}).ok());
  REQUIRE(write_checkpoint(*ts, *load_all(*alone), from_state, {}).ok());
  CHECK(testing::read_file(from_file) == testing::read_file(from_state));
}

TEST_CASE("torchsave: a compiled model's file (keys under '_orig_mod.') names its params as torch's state dicts do") {
  // nanoGPT with compile=True: the model's keys '_orig_mod.0.weight', ...; the head tied to the
  // embedding; the optimizer's params numbered in two groups.
  auto r = open_checkpoint(kSeeds / "torch_compiled_model_and_optimizer.pt");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const OptimizerState& m = (*r)->meta();
  std::vector<std::string> names;
  for (const auto& [fqn, ps] : m.params) names.push_back(fqn);
  CHECK(names == std::vector<std::string>{"0.weight", "1.bias", "1.weight"});
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"0.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"1.weight", "1.bias"});
  for (const auto& [fqn, ps] : m.params) CHECK(ps.entries.count(kParam) == 1);  // weights from '_orig_mod.<fqn>'
  // Written back into the file's layout, the model's keys stay the file's: read again, the same
  // state and the same other entries (the tied head's '_orig_mod.2.weight').
  testing::TempDir dir;
  const fs::path out = dir.path / "back.pt";
  carried_back(**r, out);
  const std::string pkl = testing::read_file(out);
  CHECK(pkl.find("_orig_mod.0.weight") != std::string::npos);
  CHECK(pkl.find("_orig_mod.2.weight") != std::string::npos);
}

TEST_CASE("torchsave: a DDP model's state_dict (every key under 'module.') names params and buffers without it") {
  // make_seeds.py ddp: nanoGPT's loop over DistributedDataParallel(Embedding, BatchNorm1d, Linear),
  // torch.save of ddp.state_dict(): 'module.0.weight', ...; params numbered in two groups.
  auto r = open_checkpoint(kSeeds / "torch_ddp_model_and_optimizer.pt");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const OptimizerState& m = (*r)->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"0.weight", "2.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"1.weight", "1.bias", "2.bias"});
  for (const auto& [fqn, ps] : m.params) CHECK(ps.entries.count(kParam) == 1);  // weights from 'module.<fqn>'
  std::vector<std::string> others;
  for (const ModelTensorInfo& t : (*r)->model_tensors()) others.push_back(t.name);
  CHECK(others == std::vector<std::string>{"1.running_mean", "1.running_var", "1.num_batches_tracked"});
  // Written back into the file's layout, the model's keys stay the file's.
  testing::TempDir dir;
  const fs::path out = dir.path / "back.pt";
  carried_back(**r, out);
  const std::string pkl = testing::read_file(out);
  CHECK(pkl.find("module.0.weight") != std::string::npos);
  CHECK(pkl.find("module.1.running_mean") != std::string::npos);
}

TEST_CASE("torchsave: an optimizer per param (torchtune's optimizer in backward) reads as one group each, named by its key") {
  // make_seeds.py in_backward: recipe_state.pt of a run with optimizer_in_bwd, {"optimizer": {fqn:
  // AdamW([p]).state_dict()}, "seed", "epochs_run", ...}; the norm and biases without decay, a
  // scheduler's initial_lr in each group; the optimizers of an unused head ('3.weight', '3.bias')
  // never stepped.
  auto r = open_checkpoint(kSeeds / "torchtune_optimizer_in_backward.pt");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const OptimizerState& m = (*r)->meta();
  const std::vector<std::string> order{"0.weight", "1.weight", "1.bias", "2.weight", "2.bias"};
  REQUIRE(m.groups.size() == order.size() + 2);
  CHECK(m.params.size() == order.size());
  CHECK(m.groups[5].params.empty());  // no state: no shape, not in the state
  CHECK(m.groups[6].params.empty());
  for (size_t g = 0; g < order.size(); ++g) {
    CHECK(m.groups[g].params == std::vector<std::string>{order[g]});
    CHECK(m.groups[g].hyper.weight_decay == (m.params.at(order[g]).shape.size() == 1 ? 0.0 : 0.1));
    CHECK(m.params.at(order[g]).group == static_cast<int>(g));
    CHECK(m.params.at(order[g]).step == 2);
  }
  REQUIRE((*r)->group_extras().size() == order.size() + 2);
  CHECK((*r)->group_extras()[4].at(0).first == "initial_lr");
  CHECK((*r)->not_read() == std::vector<std::string>{"['seed']", "['epochs_run']", "['total_epochs']",
                                                     "['max_steps_per_epoch']",
                                                     "2 params without state or weights (never stepped: no shape in the file)"});
  // Written back into the file's layout: an optimizer per param again, under the same names (the
  // head's carried as they were), and written again from that, the same bytes.
  testing::TempDir dir;
  const fs::path out = dir.path / "back.pt";
  auto back = carried_back(**r, out);
  const std::string pkl = testing::read_file(out);
  CHECK(pkl.find("epochs_run") != std::string::npos);
  CHECK(pkl.find("3.bias") != std::string::npos);
  CHECK(back->meta().groups.size() == order.size() + 2);
  const fs::path again = dir.path / "again.pt";
  const FormatDriver* ts = find_format("torchsave");
  REQUIRE(write_checkpoint(*ts, *load_all(*back), again, {.source = back.get()}).ok());
  CHECK(testing::read_file(again) == testing::read_file(out));
  // A state whose groups hold several params has no such layout, nor one whose params sit in other
  // groups than the file's optimizers: refused, naming the file.
  OptimizerState merged = *load_all(**r);
  const std::string moved = merged.groups[1].params[0];
  merged.groups[0].params.push_back(moved);
  merged.groups[1].params.clear();
  merged.params.at(moved).group = 0;
  Status st = write_checkpoint(*ts, merged, dir.path / "merged.pt", {.source = r->get()});
  CHECK(st.message().find("a param group of 2 params") != std::string::npos);
  OptimizerState swapped = *load_all(**r);
  std::swap(swapped.groups[0].params, swapped.groups[3].params);
  std::swap(swapped.params.at("0.weight").group, swapped.params.at("2.weight").group);
  st = write_checkpoint(*ts, swapped, dir.path / "swapped.pt", {.source = r->get()});
  CHECK(st.message().find("param group 0 is not the optimizer of '0.weight'") != std::string::npos);
  CHECK(!fs::exists(dir.path / "merged.pt"));
  CHECK(!fs::exists(dir.path / "swapped.pt"));
}

TEST_CASE("torchsave: the written state_dict reads back through the interpretation") {
  OptimizerState s = testing::sample_state();
  const auto order = torchsave::param_order(s);
  CHECK(order == std::vector<std::string>{"layers.0.weight", "layers.0.bias"});
  auto plan = torchsave::plan_of([&](pickle::Writer& w, const torchsave::SpecSink& add,
                                     const torchsave::FrameOptions& fo) {
    return torchsave::plan_adamw_frame(s, w, add, fo);
  });
  REQUIRE(plan.ok());
  std::string bias_exp_avg_key;  // the storage the plan gave layers.0.bias's exp_avg
  for (size_t k = 0; k < plan->storages.size(); ++k)
    if (plan->storages[k].fqn == "layers.0.bias" && plan->storages[k].entry == kExpAvg) bias_exp_avg_key = std::to_string(k);
  const std::string& pkl = plan->data_pkl;
  auto p = pickle::unpickle(std::as_bytes(std::span(pkl)), "test");
  REQUIRE(p.ok());
  auto sd = torchsave::interpret_state_dict(*p, "test");
  REQUIRE_MESSAGE(sd.ok(), sd.status().message());
  CHECK(sd->optimizer_path == "['optimizer']");  // weights present: {"model", "optimizer"}
  REQUIRE(sd->groups.size() == 2);
  CHECK(sd->groups[0].hyper.weight_decay == 0.1);
  CHECK(sd->groups[1].hyper.weight_decay == 0.0);
  CHECK(*sd->groups[0].lr.number == s.groups[0].hyper.lr);
  REQUIRE(sd->params.size() == 2);
  CHECK(sd->params[0].fqn == "layers.0.weight");  // param_names written: the names are not numbers
  CHECK(sd->params[0].shape == std::vector<int64_t>{2, 3});
  CHECK(sd->params[0].weight.has_value());
  CHECK(sd->params[0].weight->dtype == DType::kBF16);
  CHECK(sd->params[1].fqn == "layers.0.bias");
  CHECK(!sd->params[1].weight.has_value());
  CHECK(sd->params[1].entries.at(kExpAvg).values.storage_key == bias_exp_avg_key);
  CHECK(sd->not_read.empty());
}

namespace {
// torch.optim.AdamW's frame of `s` written with `options`, read back through the interpretation.
torchsave::StateDict framed_state_dict(const OptimizerState& s, const torchsave::FrameOptions& options) {
  auto plan = torchsave::plan_of(
      [&](pickle::Writer& w, const torchsave::SpecSink& add, const torchsave::FrameOptions& fo) {
        return torchsave::plan_adamw_frame(s, w, add, fo);
      },
      options);
  REQUIRE(plan.ok());
  auto p = pickle::unpickle(std::as_bytes(std::span(plan->data_pkl)), "test");
  REQUIRE(p.ok());
  auto sd = torchsave::interpret_state_dict(*p, "test");
  REQUIRE_MESSAGE(sd.ok(), sd.status().message());
  REQUIRE(sd->groups.size() == s.groups.size());
  return std::move(*sd);
}
}  // namespace

TEST_CASE("torchsave: torch.optim.AdamW's switches (fused, foreach, ...) are written as the source kept them, else torch's defaults") {
  const OptimizerState s = testing::sample_state();  // two groups
  auto groups_of = [&](std::span<const AdamWFlags> kept) {
    torchsave::FrameOptions options;
    options.adamw_flags = kept;
    const torchsave::StateDict sd = framed_state_dict(s, options);
    return std::vector<AdamWFlags>{sd.groups[0].flags, sd.groups[1].flags};
  };
  const AdamWFlags defaults = {{"foreach", FlagValue::kNone}, {"capturable", FlagValue::kFalse},
                               {"differentiable", FlagValue::kFalse}, {"fused", FlagValue::kNone},
                               {"decoupled_weight_decay", FlagValue::kTrue}};
  CHECK(groups_of({}) == std::vector<AdamWFlags>{defaults, defaults});
  // A fused run's groups (one with foreach=False of its own); a switch the source lacks is the default.
  const std::vector<AdamWFlags> kept = {{{"fused", FlagValue::kTrue}},
                                        {{"fused", FlagValue::kTrue}, {"foreach", FlagValue::kFalse}}};
  const auto written = groups_of(kept);
  AdamWFlags g0 = defaults, g1 = defaults;
  g0["fused"] = g1["fused"] = FlagValue::kTrue;
  g1["foreach"] = FlagValue::kFalse;
  CHECK(written[0] == g0);
  CHECK(written[1] == g1);
  // Switches for another number of groups than the state's are not this state's: the defaults.
  CHECK(groups_of(std::span(kept).first(1)) == std::vector<AdamWFlags>{defaults, defaults});
}

TEST_CASE("torchsave: a group's other plain keys (initial_lr, lr_scale, a name) are written by value and read back") {
  const OptimizerState s = testing::sample_state();  // two groups
  auto value = [](GroupValue::Kind k, int64_t i = 0, double f = 0, std::string str = "") {
    GroupValue v;
    v.kind = k;
    v.i = i;
    v.f = f;
    v.s = std::move(str);
    return v;
  };
  using K = GroupValue::Kind;
  std::vector<GroupExtras> extras(2);
  extras[0] = {{"lr_scale", value(K::kFloat, 0, 0.5)}, {"name", value(K::kString, 0, 0, "body")},
               {"layer", value(K::kInt, 7)}, {"frozen", value(K::kBool, 1)}, {"tag", value(K::kNone)}};
  extras[1] = {{"initial_lr", value(K::kTensor, 0, 1e-3)}};  // a tensor: a float where lr is one
  torchsave::FrameOptions options;
  options.group_extras = extras;
  const torchsave::StateDict sd = framed_state_dict(s, options);
  CHECK(sd.not_read.empty());
  const auto& g0 = sd.groups[0].extras;
  REQUIRE(g0.size() == 5);
  CHECK((g0[0].key == "lr_scale" && g0[0].value.kind == K::kFloat && g0[0].value.f == 0.5));
  CHECK((g0[1].key == "name" && g0[1].value.kind == K::kString && g0[1].value.s == "body"));
  CHECK((g0[2].key == "layer" && g0[2].value.kind == K::kInt && g0[2].value.i == 7));
  CHECK((g0[3].key == "frozen" && g0[3].value.kind == K::kBool && g0[3].value.i == 1));
  CHECK((g0[4].key == "tag" && g0[4].value.kind == K::kNone));
  const auto& g1 = sd.groups[1].extras;
  REQUIRE(g1.size() == 1);
  CHECK((g1[0].key == "initial_lr" && g1[0].value.kind == K::kFloat && g1[0].value.f == 1e-3 && !g1[0].tensor));
  // Extras for another number of groups than the state's are not this state's: none written.
  options.group_extras = std::span(extras).first(1);
  const torchsave::StateDict one = framed_state_dict(s, options);
  CHECK((one.groups[0].extras.empty() && one.groups[1].extras.empty()));
}

TEST_CASE("torchsave: damaged files are refused naming the file") {
  testing::TempDir dir;
  const std::string good = testing::read_file(kSeeds / "torch_adamw_amsgrad.pt");
  const auto bad = dir.path / "bad.pt";
  const FormatDriver* d = find_format("torchsave");
  auto error = [&](const std::string& bytes) {
    testing::write_file(bad, bytes);
    auto r = d->open(bad);
    if (!r.ok()) return r.status().message();
    auto all = load_all(**r);
    return all.ok() ? std::string() : all.status().message();
  };
  SUBCASE("truncated") {
    const std::string e = error(good.substr(0, good.size() / 2));
    CHECK(e.find("bad.pt") != std::string::npos);
  }
  SUBCASE("a flipped byte in a moment fails its storage's CRC-32, naming the tensor") {
    // data/1 is param 0's exp_avg (torch numbers storages as it pickles them: step, exp_avg, ...)
    const std::string name = "torch_adamw_amsgrad/data/1";
    const size_t at = good.find(name);  // first in its local header, 30 bytes in
    REQUIRE(at != std::string::npos);
    std::string b = good;
    b[at + name.size() + get_u16(good, at - 2) + 100] ^= 0x01;
    const std::string e = error(b);
    CHECK(e.find("bad.pt") != std::string::npos);
    CHECK(e.find("CRC-32") != std::string::npos);
    CHECK(e.find("'0.exp_avg'") != std::string::npos);
  }
  SUBCASE("a flipped byte in data.pkl (hyperparameters, steps) fails its CRC-32") {
    const std::string name = "torch_adamw_amsgrad/data.pkl";
    REQUIRE(good.compare(30, name.size(), name) == 0);  // torch.save writes data.pkl first
    std::string b = good;
    b[30 + name.size() + get_u16(good, 28) + 40] ^= 0x01;
    const std::string e = error(b);
    CHECK(e.find("bad.pt") != std::string::npos);
    CHECK(e.find("CRC-32 of record 'torch_adamw_amsgrad/data.pkl'") != std::string::npos);
  }
  SUBCASE("not a zip at all") { CHECK(error(std::string(100, 'x')).find("bad.pt") != std::string::npos); }
}

TEST_CASE("torchsave: LibTorch's optimizer archives (C++ torch::save) read as the live optimizer's state") {
  // tests/optim/write_libtorch_archives.cpp: torch::optim::AdamW's and optstate's AdamW8bit's
  // archives, and the same states written from the live optimizers.
  for (const char* name : {"libtorch_adamw", "libtorch_adamw8bit"}) {
    CAPTURE(name);
    auto opened = open_checkpoint(kLibTorchSeeds / (std::string(name) + ".pt"));
    REQUIRE_MESSAGE(opened.ok(), opened.status().message());
    auto& r = *opened;
    CHECK(r->format() == "libtorch");  // formats/libtorch/ sniffs it; the torch.save driver reads it
    auto expected = open_checkpoint(kLibTorchSeeds / (std::string(name) + ".expected.safetensors"));
    REQUIRE(expected.ok());
    check_same_hashes(*r, **expected);
    const OptimizerState& m = r->meta();
    REQUIRE(m.groups.size() == 2);
    CHECK(m.groups[0].params == std::vector<std::string>{"0"});
    CHECK(m.groups[1].params == std::vector<std::string>{"1"});  // "2" never stepped: no shape, not read
    CHECK(m.groups[0].hyper.amsgrad);
    CHECK(m.groups[1].hyper.lr == 3e-2);
    CHECK(m.params.at("0").step == 3);
    CHECK(r->checksummed());
    REQUIRE(r->not_read().size() == 1);
    CHECK(r->not_read()[0].find("1 param without state") != std::string::npos);
    const Entry& w = m.params.at("0").entries.at(kExpAvgSq);
    if (std::string(name) == "libtorch_adamw8bit") {
      CHECK(m.kind == "adamw8bit");
      CHECK((w.encoding == Encoding::kBlockwise8));
      CHECK(w.block_size == 256);
      CHECK(w.qmap == "dynamic-unsigned");
      CHECK((m.params.at("1").entries.at(kExpAvg).encoding == Encoding::kDense));  // 80 elements
    } else {
      CHECK((w.encoding == Encoding::kDense));
      CHECK(m.params.at("0").entries.count(kMaxExpAvgSq) == 1);
    }
  }
}

TEST_CASE("torchsave: a damaged LibTorch optimizer archive is refused naming the file") {
  testing::TempDir dir;
  const std::string good = testing::read_file(kLibTorchSeeds / "libtorch_adamw.pt");
  const auto bad = dir.path / "bad.pt";
  auto error = [&](const std::string& bytes) {
    testing::write_file(bad, bytes);
    auto r = open_checkpoint(bad);
    if (!r.ok()) return r.status().message();
    auto all = load_all(**r);
    return all.ok() ? std::string() : all.status().message();
  };
  CHECK(error(good).empty());
  SUBCASE("a count that lies: param_groups/size (data/5, an int64) says 3 for 2 groups") {
    const std::string name = "libtorch_adamw/data/5";
    const size_t at = good.find(name);
    REQUIRE(at != std::string::npos);
    std::string b = good;
    const size_t data = at + name.size() + get_u16(good, at - 2);
    REQUIRE(b[data] == 2);
    b[data] = 3;
    const std::string e = error(b);
    CHECK(e.find("bad.pt (LibTorch optimizer archive) param_groups 'param_groups/size' is 3, but 2 are listed") !=
          std::string::npos);
  }
  SUBCASE("data.pkl compressed (the code/ records may be; what is read may not)") {
    const std::string name = "libtorch_adamw/data.pkl";
    const size_t central = good.find(name, good.find(name) + 1);  // its central directory record
    REQUIRE(central != std::string::npos);
    std::string b = good;
    b[central - 46 + 10] = 8;
    CHECK(error(b).find("zip entry 'libtorch_adamw/data.pkl' is compressed") != std::string::npos);
  }
  SUBCASE("a TorchScript archive that is no optimizer's") {
    std::string b = good;
    const size_t at = b.find("pytorch_version");
    REQUIRE(at != std::string::npos);
    b[at + 14] = 'X';
    const auto signed_ = torchsave::with_pickle_crc(b);
    REQUIRE(signed_);
    CHECK(error(*signed_).find("bad.pt: a TorchScript archive, but not LibTorch's optimizer archive") !=
          std::string::npos);
  }
}

namespace {

// A LibTorch optimizer archive's data.pkl, made with the pickle writer: each archive level a
// __torch__ Module (NEWOBJ + BUILD of its attributes), one group of `keys`, state for `state_keys`.
std::string archive_pickle(const std::string& version, const std::vector<std::string>& group_names,
                           const std::vector<std::string>& keys, const std::vector<std::string>& state_keys) {
  pickle::Writer w;
  auto module = [&](const std::function<void()>& attrs) {
    w.global("__torch__", "Module");
    w.empty_tuple();
    w.newobj();
    w.empty_dict();
    w.mark();
    attrs();
    w.setitems_from_mark();
    w.build();
  };
  int storage = 0;
  auto tensor = [&](DType d, std::vector<int64_t> shape) { dcp::encode_tensor(w, d, shape, std::to_string(storage++)); };
  module([&] {
    w.str("pytorch_version");
    w.str(version);
    w.str("state");
    module([&] {
      for (const std::string& k : state_keys) {
        w.str(k);
        module([&] {
          w.str("step");
          w.integer(2);
          w.str("exp_avg");
          tensor(DType::kF32, {3});
          w.str("exp_avg_sq");
          tensor(DType::kF32, {3});
        });
      }
    });
    w.str("param_groups");
    module([&] {
      w.str("param_groups/size");
      tensor(DType::kI64, {});
      for (const std::string& g : group_names) {
        w.str(g);
        module([&] {
          w.str("params/size");
          tensor(DType::kI64, {});
          for (size_t j = 0; j < keys.size(); ++j) {
            w.str("params/" + std::to_string(j));
            w.str(keys[j]);
          }
          w.str("options");
          module([&] {
            adamw_hyper(w);
            w.str("amsgrad");
            w.boolean(false);
          });
        });
      }
    });
  });
  return w.finish();
}

std::string archive_error(const std::string& bytes) {
  auto p = pickle::unpickle(std::as_bytes(std::span(bytes)), "x.pt");
  REQUIRE(p.ok());
  auto sd = torchsave::interpret_state_dict(*p, "x.pt");
  return sd.ok() ? std::string() : sd.status().message();
}

}  // namespace

TEST_CASE("torchsave: a LibTorch archive's groups and state must pair up; its layout version is known") {
  CHECK(archive_error(archive_pickle("1.5.0", {"param_groups/0"}, {"11", "12"}, {"11"})).empty());
  CHECK(archive_error(archive_pickle("1.5.0", {"param_groups/0"}, {"11"}, {"11", "13"})) ==
        "x.pt (LibTorch optimizer archive): state of param '13', which no param group lists");
  CHECK(archive_error(archive_pickle("1.5.0", {"param_groups/0"}, {"11", "11"}, {"11"})) ==
        "x.pt (LibTorch optimizer archive) param group 0: param '11' is listed twice");
  CHECK(archive_error(archive_pickle("1.5.0", {"param_groups/0", "param_groups/2"}, {"11"}, {"11"})).find(
            "'param_groups/1' is missing") != std::string::npos);
  CHECK(archive_error(archive_pickle("9.9.9", {"param_groups/0"}, {"11"}, {"11"})) ==
        "x.pt: LibTorch optimizer archive of layout '9.9.9' (known: 1.5.0)");
}

TEST_CASE("torchsave: a DTensor's box is torch.chunk's piece on each sharded mesh dim") {
  using torchsave::DTensorSpec;
  using torchsave::Placement;
  const Placement shard0{Placement::Kind::kShard, 0}, shard1{Placement::Kind::kShard, 1}, rep{};
  auto box = [](const DTensorSpec& s, std::vector<int64_t> mesh) {
    auto b = torchsave::dtensor_box(s, mesh, "t");
    REQUIRE_MESSAGE(b.ok(), b.status().message());
    return *b;
  };
  SUBCASE("FSDP2's Shard(0): ceil-sized rows, the last short, then empty") {
    // 5 rows over 4 ranks: torch.chunk gives 2, 2, 1 and nothing for the fourth.
    const std::vector<std::pair<int64_t, int64_t>> rows = {{0, 2}, {2, 2}, {4, 1}, {5, 0}};
    for (int64_t r = 0; r < 4; ++r) {
      const auto b = box({{5, 33}, {shard0}, {r}}, {4});
      CHECK(b.offsets == std::vector<int64_t>{rows[static_cast<size_t>(r)].first, 0});
      CHECK(b.sizes == std::vector<int64_t>{rows[static_cast<size_t>(r)].second, 33});
      CHECK(!b.replica);
    }
  }
  SUBCASE("HSDP (Replicate, Shard(0)): replicas beyond coordinate 0 are marked") {
    CHECK(box({{8, 2}, {rep, shard0}, {0, 1}}, {2, 2}).offsets == std::vector<int64_t>{4, 0});
    CHECK(!box({{8, 2}, {rep, shard0}, {0, 1}}, {2, 2}).replica);
    CHECK(box({{8, 2}, {rep, shard0}, {1, 1}}, {2, 2}).replica);
  }
  SUBCASE("two mesh dims on two tensor dims (FSDP x TP), and on one dim, in mesh order") {
    const auto b = box({{6, 10}, {shard0, shard1}, {1, 2}}, {2, 3});
    CHECK(b.offsets == std::vector<int64_t>{3, 8});
    CHECK(b.sizes == std::vector<int64_t>{3, 2});
    // Shard(0) twice: the second splits the first's piece (10 -> 5 + 5 -> 3 + 2).
    const auto c = box({{10}, {shard0, shard0}, {1, 1}}, {2, 2});
    CHECK(c.offsets == std::vector<int64_t>{8});
    CHECK(c.sizes == std::vector<int64_t>{2});
  }
  SUBCASE("a coordinate outside the mesh is refused") {
    CHECK(!torchsave::dtensor_box({{4}, {shard0}, {2}}, {2}, "t").ok());
    CHECK(!torchsave::dtensor_box({{4}, {shard0}, {0}}, {2, 2}, "t").ok());
  }
}

TEST_CASE("torchsave: FSDP1's flat parameters are split into the model's params as FSDP flattens them") {
  // emb, two wrapped blocks (a.weight, a.bias, norm.weight, norm.bias, b.weight), head: the root's
  // unit holds emb and head, around the blocks (tests/python/test_fsdp_ranks.py's model).
  const std::vector<std::string> names = {"emb.weight", "layers.0.a.weight", "layers.0.a.bias", "layers.0.norm.weight",
                                          "layers.0.norm.bias", "layers.0.b.weight", "layers.1.a.weight",
                                          "layers.1.a.bias", "layers.1.norm.weight", "layers.1.norm.bias",
                                          "layers.1.b.weight", "head.weight", "head.bias"};
  const std::vector<int64_t> numels = {176, 112, 7, 7, 7, 112, 112, 7, 7, 7, 112, 80, 5};
  SUBCASE("root first, then the blocks; padding to 3 ranks") {
    // root: 176 + 80 + 5 = 261 = 3 * 87; each block 245 -> 3 * 82 (one element of padding)
    auto u = torchsave::match_flat_units(names, numels, {87, 82, 82}, 3, "t");
    REQUIRE_MESSAGE(u.ok(), u.status().message());
    CHECK(u->unit_of == std::vector<int>{0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0});
    CHECK(u->offset == std::vector<int64_t>{0, 0, 112, 119, 126, 133, 0, 112, 119, 126, 133, 176, 256});
    CHECK(u->numel == std::vector<int64_t>{261, 245, 245});
  }
  SUBCASE("everything wrapped: no root unit (the same split as the first module unwrapped in the root's)") {
    auto u = torchsave::match_flat_units({"a.x", "a.y", "b.x"}, {10, 7, 20}, {9, 10}, 2, "t");
    REQUIRE_MESSAGE(u.ok(), u.status().message());
    CHECK(u->unit_of == std::vector<int>{0, 0, 1});
    CHECK(u->offset == std::vector<int64_t>{0, 10, 0});
  }
  SUBCASE("two wrapped blocks of one size and nothing else: either could be the root's") {
    const std::vector<std::string> two(names.begin() + 1, names.begin() + 11);
    const std::vector<int64_t> sizes(numels.begin() + 1, numels.begin() + 11);
    auto u = torchsave::match_flat_units(two, sizes, {123, 123}, 2, "t");  // 245 -> 2 * 123
    REQUIRE(!u.ok());
    CHECK(u.status().message().find("more than one way") != std::string::npos);
  }
  SUBCASE("sizes no split gives, and sizes two splits give, are refused") {
    auto none = torchsave::match_flat_units(names, numels, {87, 80, 82}, 3, "t");
    REQUIRE(!none.ok());
    CHECK(none.status().message().find("do not split into the optimizer's 3 FSDP units") != std::string::npos);
    // Two one-param modules of equal size, one of them wrapped: which one cannot be told.
    auto two = torchsave::match_flat_units({"x.w", "y.w"}, {4, 4}, {4, 4}, 1, "t");
    REQUIRE(!two.ok());
    CHECK(two.status().message().find("more than one way") != std::string::npos);
  }
  SUBCASE("a hostile file cannot make the search run long") {
    // 600 one-element modules and 300 one-element units, the root's size unreachable: every choice
    // is tried until the bound.
    std::vector<std::string> many;
    for (int i = 0; i < 600; ++i) many.push_back(fmt::format("m{}.w", i));  // GCC 12 -Wrestrict misfires on "m" + string
    std::vector<int64_t> shard(301, 1);
    shard[0] = 1000;
    auto r = torchsave::match_flat_units(many, std::vector<int64_t>(600, 1), shard, 1, "t");
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("too many ways") != std::string::npos);
  }
}

TEST_CASE("torchsave: a param's fqn drops the segments wrappers insert, as torch's state dicts do") {
  CHECK(torch_param_fqn("_orig_mod.transformer.wte.weight") == "transformer.wte.weight");  // nanoGPT
  CHECK(torch_param_fqn("layers.0._orig_mod.attention.wq.weight") == "layers.0.attention.wq.weight");
  CHECK(torch_param_fqn("0._orig_mod._checkpoint_wrapped_module.weight") == "0.weight");
  CHECK(torch_param_fqn("_fsdp_wrapped_module.layer._fsdp_wrapped_module.bias") == "layer.bias");
  // What only looks like a wrapper's segment, DDP's 'module.' (a submodule may be named so) and
  // empty segments stay.
  CHECK(torch_param_fqn("_orig_mod_x.weight") == "_orig_mod_x.weight");
  CHECK(torch_param_fqn("a._orig_modx") == "a._orig_modx");
  CHECK(torch_param_fqn("module.fc.weight") == "module.fc.weight");
  CHECK(torch_param_fqn(".a..b.") == ".a..b.");
  CHECK(torch_param_fqn("_orig_mod..w") == ".w");
  CHECK(torch_param_fqn("7") == "7");
  // A name that is all wrapper (no module under it) is kept whole, never empty.
  CHECK(torch_param_fqn("_orig_mod") == "_orig_mod");
  CHECK(torch_param_fqn("") == "");
}

TEST_CASE("torchsave: numbered params placed among the model's tensors, each group in order") {
  using Shape = std::vector<int64_t>;
  using Groups = std::vector<std::vector<std::optional<Shape>>>;
  const Shape emb{50, 8}, pos{16, 8}, ln{8}, qkv{24, 8}, proj{8, 8}, up{32, 8}, down{8, 32};
  SUBCASE("one group of model.parameters(): the tensors in order") {
    auto r = place_params_in_model(Groups{{emb, ln, proj, ln}}, {emb, ln, proj, ln});
    REQUIRE_MESSAGE(r.why.empty(), r.why);
    CHECK(r.tensor_of == std::vector<std::vector<size_t>>{{0, 1, 2, 3}});
  }
  SUBCASE("nanoGPT's decay (2-d) and no-decay (1-d) groups, interleaved in the model") {
    // wte, wpe, then per block ln_1, c_attn, c_proj, ln_2, c_fc, c_proj; ln_f
    std::vector<Shape> model = {emb, pos};
    Groups groups(2);
    groups[0] = {emb, pos};
    for (int b = 0; b < 3; ++b) {
      for (const Shape& s : {ln, qkv, proj, ln, up, down}) model.push_back(s);
      for (const Shape& s : {qkv, proj, up, down}) groups[0].push_back(s);
      groups[1].push_back(ln);
      groups[1].push_back(ln);
    }
    model.push_back(ln);
    groups[1].push_back(ln);
    auto r = place_params_in_model(groups, model);
    REQUIRE_MESSAGE(r.why.empty(), r.why);
    CHECK(r.tensor_of[0] == std::vector<size_t>{0, 1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19});
    CHECK(r.tensor_of[1] == std::vector<size_t>{2, 5, 8, 11, 14, 17, 20});
  }
  SUBCASE("buffers and frozen params of other shapes are passed over (a LoRA's adapters alone)") {
    const Shape a{2, 8}, b{8, 2};
    auto r = place_params_in_model(Groups{{a, b, a, b}}, {emb, proj, a, b, proj, Shape{}, a, b, ln});
    REQUIRE_MESSAGE(r.why.empty(), r.why);
    CHECK(r.tensor_of == std::vector<std::vector<size_t>>{{2, 3, 6, 7}});
  }
  SUBCASE("a param without state takes the shape of the one tensor left for it") {
    auto r = place_params_in_model(Groups{{emb, std::nullopt, proj}}, {emb, ln, proj});
    REQUIRE_MESSAGE(r.why.empty(), r.why);
    CHECK(r.tensor_of == std::vector<std::vector<size_t>>{{0, 1, 2}});
  }
  SUBCASE("a spare tensor shaped like a param leaves more than one way: refused") {
    // weight, bias, and a buffer of their shape (what norm_buffer's names exist to take out)
    auto r = place_params_in_model(Groups{{proj, ln, ln}}, {proj, ln, ln, ln});
    CHECK(r.tensor_of.empty());
    CHECK(r.why.find("more than one way") != std::string::npos);
    // two groups whose next params have one shape: which group a tensor is cannot be told
    auto two = place_params_in_model(Groups{{ln}, {ln}}, {ln, ln});
    CHECK(two.why.find("more than one way") != std::string::npos);
  }
  SUBCASE("shapes out of order, or fewer tensors than params: refused saying so") {
    auto r = place_params_in_model(Groups{{proj, emb}}, {emb, proj});
    CHECK(r.why.find("not among its 2 tensors in order") != std::string::npos);
    auto fewer = place_params_in_model(Groups{{emb, proj}}, {emb});
    CHECK(fewer.why.find("fewer than the optimizer's 2 params") != std::string::npos);
  }
  SUBCASE("one group among many spare tensors (a large LoRA): found by two scans, unique or not") {
    // 1,120 adapters among 723 frozen tensors, as a 70B model's LoRA on every projection
    std::vector<Shape> model;
    std::vector<std::optional<Shape>> adapters;
    std::vector<size_t> where;
    for (int layer = 0; layer < 80; ++layer)
      for (int proj = 0; proj < 7; ++proj) {
        model.push_back(proj < 4 ? Shape{64, 64} : Shape{256, 64});
        if (layer % 9 == 0 && proj == 0) model.push_back(ln);  // frozen norms between them
        for (const Shape& s : {Shape{8, 64}, Shape{64, 8}}) {
          where.push_back(model.size());
          model.push_back(s);
          adapters.push_back(s);
        }
      }
    auto r = place_params_in_model(Groups{{}, adapters}, model);
    REQUIRE_MESSAGE(r.why.empty(), r.why);
    CHECK(r.tensor_of[0].empty());
    CHECK(r.tensor_of[1] == where);
    // a frozen tensor shaped like an adapter, between two adapters: two ways
    model.insert(model.begin() + static_cast<std::ptrdiff_t>(where[1]), Shape{8, 64});
    auto two = place_params_in_model(Groups{adapters}, model);
    CHECK(two.why.find("more than one way") != std::string::npos);
  }
  SUBCASE("nothing to place, and nothing to place it in") {
    auto r = place_params_in_model(Groups{{}}, {});
    CHECK(r.why.empty());
  }
  SUBCASE("a hostile file cannot make the search run long or large") {
    // 8 groups of 60 one-element params among 1200 one-element tensors: the ways grow past the bound.
    Groups groups(8, std::vector<std::optional<Shape>>(60, Shape{1}));
    auto r = place_params_in_model(groups, std::vector<Shape>(1200, Shape{1}));
    CHECK(r.tensor_of.empty());
    CHECK(r.why.find("too many ways") != std::string::npos);
    // 3000 groups of one param each: every state's key is long, and each tensor fits every group.
    Groups wide(3000, std::vector<std::optional<Shape>>(1, Shape{1}));
    auto w = place_params_in_model(wide, std::vector<Shape>(3000, Shape{1}));
    CHECK(w.why.find("too many ways") != std::string::npos);
  }
}

TEST_CASE("torchsave: FSDP2's per-rank files (verl's layout) read as the state torch gathers") {
  const fs::path set = kSeeds / "fsdp2_world2";
  auto r = open_checkpoint(set);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK((*r)->format() == "torchsave");
  const OptimizerState& m = (*r)->meta();
  // Named after the model's files; weights carried from them.
  CHECK(m.groups.at(0).params == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
  CHECK(m.params.at("0.weight").shape == std::vector<int64_t>{33, 16});
  CHECK(m.params.at("0.weight").entries.count(kParam) == 1);
  CHECK(m.params.at("2.bias").step == 2);
  const auto nr = (*r)->not_read();
  CHECK(std::find(nr.begin(), nr.end(), "extra_state_world_size_2_rank_*.pt (2 files)") != nr.end());
  // The same state, put together by torch (DTensor.full_tensor()) into one file, hashes alike.
  auto full = open_checkpoint(kSeeds / "fsdp2_world2_full.pt");
  REQUIRE(full.ok());
  check_same_hashes(**r, **full);
  // A rank's part of a row: read_range reads across both ranks' files.
  std::vector<float> rows(16 * 2);
  REQUIRE((*r)->read_range("0.weight", kExpAvg, Component::kValues, 16 * 16, 16 * 18, std::as_writable_bytes(std::span(rows))).ok());
  std::vector<float> want(16 * 2);
  REQUIRE((*full)->read_range("0.weight", kExpAvg, Component::kValues, 16 * 16, 16 * 18, std::as_writable_bytes(std::span(want))).ok());
  CHECK(rows == want);
  // Every tensor's storage CRC-32 is checked, the weights' too: FSDP2's local params are views into
  // padded storages, whose padding is read for the check.
  CHECK((*r)->checksummed());
  // A training run's folder: a write never replaces it.
  const Status st = check_destination(set, true);
  CHECK(!st.ok());
  CHECK(st.message().find("never replaces") != std::string::npos);
}

TEST_CASE("torchsave: FSDP2's per-rank files written for another world size: each rank's rows, the mesh anew") {
  // tests/python/test_fsdp_ranks.py resumes FSDP2 from such files; here: the files and the pickles.
  auto r = open_checkpoint(kSeeds / "fsdp2_world2");
  REQUIRE(r.ok());
  const FormatDriver* ts = find_format("torchsave");
  REQUIRE(ts->shards());
  const auto want = hash_checkpoint(**r);
  testing::TempDir dir;
  for (int world : {1, 3, 5}) {  // 5: 33 rows in pieces of 7, the last 5; 16-element biases, one rank empty
    CAPTURE(world);
    const fs::path out = dir.path / fmt::format("w{}", world);
    const Status st = write_checkpoint(*ts, *load_all(**r), out, {.world_size = world, .source = r->get()});
    REQUIRE_MESSAGE(st.ok(), st.message());
    CHECK(ts->carries(**r, out));
    for (const char* kind : {"optim", "model", "extra_state"})
      for (int k = 0; k < world; ++k)
        CHECK(fs::is_regular_file(out / fmt::format("{}_world_size_{}_rank_{}.pt", kind, world, k)));
    CHECK(static_cast<int>(std::distance(fs::directory_iterator(out), {})) == 3 * world);
    auto back = open_checkpoint(out);
    REQUIRE_MESSAGE(back.ok(), back.status().message());
    CHECK(hash_checkpoint(**back)->root == want->root);
    CHECK(validate_checkpoint(out, [](const fs::path& p) { return open_checkpoint(p); })->findings.empty());
    // The last rank's file: its rows of 0.weight (33 x 16) and its place in a mesh of `world`.
    const fs::path last = out / fmt::format("optim_world_size_{}_rank_{}.pt", world, world - 1);
    auto archive = torchsave::open_archive(last);
    REQUIRE(archive.ok());
    auto sd = torchsave::interpret_state_dict(archive->second, last.string());
    REQUIRE(sd.ok());
    const auto& w0 = sd->params.at(0).entries.at(kExpAvg);
    REQUIRE(w0.dtensor.has_value());
    const int64_t chunk = (33 + world - 1) / world;
    CHECK(w0.dtensor->coordinate == std::vector<int64_t>{world - 1});
    CHECK(w0.values.shape == std::vector<int64_t>{std::max<int64_t>(0, 33 - (world - 1) * chunk), 16});
    const std::string bytes = testing::read_file(last);
    CHECK(bytes.find("_hash") != std::string::npos);  // written, as None: torch computes it again
  }
  // One file (.pt) is the one-file writer's: a world size there is refused, nothing written.
  const Status one = write_checkpoint(*ts, *load_all(**r), dir.path / "x.pt", {.world_size = 2, .source = r->get()});
  CHECK(one.message().find("a torch.save file is one state") != std::string::npos);
  CHECK_FALSE(fs::exists(dir.path / "x.pt"));
  // The state must be the source's.
  OptimizerState other = *load_all(**r);
  other.params.at("0.bias").step += 1;
  const Status stepped = write_checkpoint(*ts, other, dir.path / "y", {.world_size = 2, .source = r->get()});
  CHECK(stepped.message().find("step 3, the source's files hold 2") != std::string::npos);
  OptimizerState fewer = *load_all(**r);
  fewer.params.erase("2.bias");
  for (auto& g : fewer.groups) std::erase(g.params, "2.bias");
  CHECK_FALSE(write_checkpoint(*ts, fewer, dir.path / "y", {.world_size = 2, .source = r->get()}).ok());
  CHECK_FALSE(fs::exists(dir.path / "y"));
  // 8-bit state (quantized for this write) is not laid out per rank.
  const OptimizerState eight = *quantize_state(*load_all(**r), {16, 1});
  const Status q = write_checkpoint(*ts, eight, dir.path / "z", {.world_size = 2, .source = r->get()});
  CHECK(q.message().find("8-bit state") != std::string::npos);
  // FSDP1's files with use_orig_params (where each param lies in a flat parameter, the files do not
  // say) are not written per rank: said so.
  auto orig = open_checkpoint(kSeeds / "fsdp1_world2_orig");
  REQUIRE(orig.ok());
  const Status o = write_checkpoint(*ts, *load_all(**orig), dir.path / "o", {.world_size = 2, .source = orig->get()});
  CHECK(o.message().find("FSDP1's with use_orig_params") != std::string::npos);
  CHECK(std::distance(fs::directory_iterator(dir.path), {}) == 3);  // w1, w3, w5 only
}

TEST_CASE("torchsave: FSDP1's per-rank files (flat parameters) written for another world size, padding zeros") {
  auto r = open_checkpoint(kSeeds / "fsdp1_world2");
  REQUIRE(r.ok());
  const FormatDriver* ts = find_format("torchsave");
  const auto want = hash_checkpoint(**r);
  testing::TempDir dir;
  for (int world : {1, 3, 4}) {
    CAPTURE(world);
    const fs::path out = dir.path / fmt::format("w{}", world);
    const Status st = write_checkpoint(*ts, *load_all(**r), out, {.world_size = world, .source = r->get()});
    REQUIRE_MESSAGE(st.ok(), st.message());
    auto back = open_checkpoint(out);
    REQUIRE_MESSAGE(back.ok(), back.status().message());
    CHECK(hash_checkpoint(**back)->root == want->root);
    // Every rank holds ceil(numel / world) elements of each flat parameter; the last rank's tail is zeros.
    std::vector<int64_t> parts;
    std::vector<float> last;
    for (int k = 0; k < world; ++k) {
      auto a = torchsave::open_archive(out / fmt::format("optim_world_size_{}_rank_{}.pt", world, k));
      REQUIRE(a.ok());
      auto sd = torchsave::interpret_state_dict(a->second, "optim");
      REQUIRE(sd.ok());
      const auto& m = sd->params.at(0).entries.at(kExpAvg);
      CHECK_FALSE(m.dtensor.has_value());
      parts.push_back(m.values.shape.at(0));
      if (k == world - 1) {
        auto bytes = torchsave::read_storage(a->first, m.values.storage_key);
        REQUIRE(bytes.ok());
        last.resize(bytes->size() / 4);
        std::memcpy(last.data(), bytes->data(), bytes->size());
      }
    }
    CHECK(std::all_of(parts.begin(), parts.end(), [&](int64_t n) { return n == parts[0]; }));
    const int64_t unit = static_cast<int64_t>(torchsave::fsdp_set(**r)->flat_units.at(0).size());
    CHECK(unit > 0);
    int64_t numel = 0;
    for (const auto& fp : torchsave::fsdp_set(**r)->flat_units.at(0)) numel += fp.numel;
    CHECK(parts[0] == (numel + world - 1) / world);
    const int64_t pad = parts[0] * world - numel;
    for (int64_t i = 0; i < pad; ++i) CHECK(last.at(last.size() - 1 - static_cast<size_t>(i)) == 0.0f);
  }
}

TEST_CASE("torchsave: FSDP1's per-rank files (flat parameters, or runs of each param) read as the state FSDP places") {
  for (const char* name : {"fsdp1_world2", "fsdp1_world2_orig"}) {
    CAPTURE(name);
    auto r = open_checkpoint(kSeeds / name);
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    const OptimizerState& m = (*r)->meta();
    REQUIRE(m.groups.size() == 1);
    CHECK(m.groups[0].params.size() == 13);
    CHECK(m.groups[0].params.front() == "emb.weight");
    CHECK(m.params.at("layers.1.b.weight").shape == std::vector<int64_t>{8, 3});
    CHECK(m.params.at("head.bias").step == 2);
    CHECK(m.params.at("head.bias").entries.count(kParam) == 1);
    for (const std::string& line : (*r)->not_read()) CHECK(line.find("without state") == std::string::npos);
    // The same state put together from FSDP's own flat-parameter metadata hashes alike.
    auto full = open_checkpoint(kSeeds / (std::string(name) + "_full.pt"));
    REQUIRE(full.ok());
    check_same_hashes(**r, **full);
    // A range across both ranks' parts of the root's flat parameter (emb.weight is 40 elements).
    std::vector<float> got(30), want(30);
    REQUIRE((*r)->read_range("emb.weight", kExpAvgSq, Component::kValues, 5, 35, std::as_writable_bytes(std::span(got))).ok());
    REQUIRE((*full)->read_range("emb.weight", kExpAvgSq, Component::kValues, 5, 35, std::as_writable_bytes(std::span(want))).ok());
    CHECK(got == want);
  }
  SUBCASE("a rank's model file missing, or the model's files of another model, are refused by name") {
    testing::TempDir tmp;
    const fs::path set = tmp.path / "set";
    fs::copy(kSeeds / "fsdp1_world2", set);
    fs::remove(set / "model_world_size_2_rank_1.pt");
    auto r = open_checkpoint(set);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("rank 1's model file model_world_size_2_rank_1.pt is missing") != std::string::npos);
    // FSDP2's model files beside FSDP1's optimizer files: they do not split into its units
    fs::copy_file(kSeeds / "fsdp2_world2/model_world_size_2_rank_0.pt", set / "model_world_size_2_rank_0.pt",
                  fs::copy_options::overwrite_existing);
    fs::copy_file(kSeeds / "fsdp2_world2/model_world_size_2_rank_1.pt", set / "model_world_size_2_rank_1.pt");
    r = open_checkpoint(set);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("FSDP units") != std::string::npos);
  }
}

TEST_CASE("torchsave: a one-rank FSDP2 file (DTensors on a mesh of one) reads alone; one rank of two does not") {
  auto one = open_checkpoint(kSeeds / "fsdp2_world1_optim.pt");
  REQUIRE_MESSAGE(one.ok(), one.status().message());
  CHECK((*one)->meta().params.at("0").shape == std::vector<int64_t>{33, 16});
  auto part = open_checkpoint(kSeeds / "fsdp2_world2" / "optim_world_size_2_rank_1.pt");
  REQUIRE(!part.ok());
  CHECK(part.status().message().find("pass the directory that holds every rank's file") != std::string::npos);
}

TEST_CASE("torchsave: a per-rank set with a missing or duplicated rank is refused naming it") {
  testing::TempDir dir;
  for (const auto& e : fs::directory_iterator(kSeeds / "fsdp2_world2")) fs::copy(e.path(), dir.path / e.path().filename());
  SUBCASE("missing") {
    fs::remove(dir.path / "optim_world_size_2_rank_1.pt");
    auto r = open_checkpoint(dir.path);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("rank 1's file optim_world_size_2_rank_1.pt is missing") != std::string::npos);
  }
  SUBCASE("rank 0's missing") {
    fs::remove(dir.path / "optim_world_size_2_rank_0.pt");
    auto r = open_checkpoint(dir.path);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("rank 0's file optim_world_size_2_rank_0.pt is missing") != std::string::npos);
  }
  SUBCASE("rank 0's file under rank 1's name") {
    fs::copy_file(dir.path / "optim_world_size_2_rank_0.pt", dir.path / "optim_world_size_2_rank_1.pt",
                  fs::copy_options::overwrite_existing);
    auto r = open_checkpoint(dir.path);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("two files hold mesh position [0]") != std::string::npos);
  }
  SUBCASE("whole state_dicts (one per epoch) are not a set of ranks") {
    testing::TempDir epochs;
    fs::copy_file(kSeeds / "torch_adamw_amsgrad.pt", epochs.path / "optim_epoch_0.pt");
    fs::copy_file(kSeeds / "torch_adamw_amsgrad.pt", epochs.path / "optim_epoch_1.pt");
    auto r = open_checkpoint(epochs.path);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("optim_epoch_*.pt holds 2 files of whole optimizer state_dicts") != std::string::npos);
  }
  SUBCASE("a changed byte in the padding of a weight's storage fails its CRC-32") {
    // Rank 1 holds 16 of 0.weight's 33 rows in a storage padded to 17: its last row is padding.
    const fs::path model1 = dir.path / "model_world_size_2_rank_1.pt";
    std::string b = testing::read_file(model1);
    const std::string name = "model_world_size_2_rank_1/data/0";  // 0.weight's storage, pickled first
    const size_t header = b.find(name) - 30;                       // its local header
    REQUIRE(header < b.size());
    const size_t data = header + 30 + get_u16(b, header + 26) + get_u16(b, header + 28);
    b[data + 16 * 16 * 4] ^= 0x01;  // the first byte past rank 1's 16 rows
    testing::write_file(model1, b);
    auto r = open_checkpoint(dir.path);
    REQUIRE(r.ok());
    auto all = load_all(**r);
    REQUIRE(!all.ok());
    CHECK(all.status().message().find("model_world_size_2_rank_1.pt: tensor '") != std::string::npos);
    CHECK(all.status().message().find("CRC-32") != std::string::npos);
  }
  SUBCASE("two sets of optimizer files") {
    fs::copy_file(dir.path / "optim_world_size_2_rank_0.pt", dir.path / "optim_old_0.pt");
    auto r = open_checkpoint(dir.path);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("holds 2 sets of per-rank optimizer files") != std::string::npos);
  }
}

TEST_CASE("torchsave: a state_dict keyed by fqn (get_optimizer_state_dict) reads by those names") {
  auto r = open_seed("torch_adamw_fqn.pt");
  const OptimizerState& m = r->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"0.weight", "1.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"0.bias", "1.bias"});
  CHECK(m.groups[1].hyper.weight_decay == 0.0);
  CHECK(m.params.at("1.weight").shape == std::vector<int64_t>{4, 8});
  CHECK(m.params.at("0.bias").step == 2);
  CHECK(load_all(*r).ok());
  // Written back (numbered, with param_names, as torch.optim.AdamW keeps it), the same state.
  testing::TempDir dir;
  const FormatDriver* d = find_format("torchsave");
  auto state = load_all(*r);
  REQUIRE(state.ok());
  REQUIRE(d->write(*state, dir.path / "back.pt", {}).ok());
  auto back = d->open(dir.path / "back.pt");
  REQUIRE(back.ok());
  CHECK(hash_checkpoint(**back)->root == hash_checkpoint(*r)->root);
}

TEST_CASE("torchsave: params listed by number and by name in one state_dict are refused") {
  // A state_dict whose first group lists an id and whose second lists a name.
  pickle::Writer w;
  w.empty_dict();
  w.mark();
  w.str("state");
  w.empty_dict();
  w.str("param_groups");
  w.empty_list();
  w.mark();
  for (int g = 0; g < 2; ++g) {
    w.empty_dict();
    w.mark();
    adamw_hyper(w);
    w.str("params");
    w.empty_list();
    w.mark();
    if (g == 0) {
      w.integer(0);
    } else {
      w.str("layer.weight");
    }
    w.appends_from_mark();
    w.setitems_from_mark();
  }
  w.appends_from_mark();
  w.setitems_from_mark();
  const std::string bytes = w.finish();
  auto p = pickle::unpickle(std::as_bytes(std::span(bytes)), "t");
  REQUIRE(p.ok());
  auto sd = torchsave::interpret_state_dict(*p, "mixed.pt");
  REQUIRE(!sd.ok());
  CHECK(sd.status().message().find("mixed.pt param group 1: params listed by number and by name") != std::string::npos);
}

TEST_CASE("torchsave: DeepSpeed's FusedAdam group is read at its last param's step, the only one it counts on") {
  // deepspeed_fused_adam.pt (make_seeds.py): FusedAdam over Linear(64, 64), 3 steps: the weight's
  // state says step 0, the bias's (the group's last) 3, and the group 'step' 0.
  auto r = open_checkpoint(kSeeds / "deepspeed_fused_adam.pt");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const OptimizerState& m = (*r)->meta();
  CHECK(m.params.at("weight").step == 3);
  CHECK(m.params.at("bias").step == 3);
  const auto notes = (*r)->read_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0] == "DeepSpeed's FusedAdam counts param group 0's steps on its last param only (its params held 0, 3): "
                    "all 2 read at step 3");
  // torch's own AdamW keeps a step per param, as do groups without FusedAdam's keys: not touched
  // (torch_model_and_optimizer.pt: both at 2, no note).
  auto plain = open_checkpoint(kSeeds / "torch_model_and_optimizer.pt");
  REQUIRE(plain.ok());
  CHECK((*plain)->read_notes().empty());
  // Written as torch's AdamW (a step per param, no FusedAdam keys) and read back: both at 3.
  testing::TempDir dir;
  auto all = load_all(**r);
  REQUIRE(all.ok());
  REQUIRE(write_checkpoint(*find_format("torchsave"), *all, dir.path / "out.pt", {}).ok());
  auto back = open_checkpoint(dir.path / "out.pt");
  REQUIRE(back.ok());
  CHECK((*back)->meta().params.at("weight").step == 3);
  CHECK(hash_checkpoint(**back)->root == hash_checkpoint(**r)->root);
}
