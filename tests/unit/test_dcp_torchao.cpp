// The DCP driver against real checkpoints (formats/dcp/testdata/): torchao's of FSDP2, items whose
// chunks torchao quantized on some ranks only; an optimizer's numbered state_dict saved as it is.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "optstate/transform.h"
#include "optstate/validate.h"
#include "optstate/zstd.h"
#include "dcp/dcp_layout.h"
#include "dcp/pickle.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;

TEST_CASE("dcp: a torchao item 8-bit on one rank and plain on the other reads as torchao's dequantized values") {
  // formats/dcp/testdata/make_fsdp2_torchao.py: FSDP2 on two ranks; 0.weight (257x32) is 129 rows
  // on rank 0 (4128 elements: not whole blocks, kept plain by torchao) and 128 rows on rank 1
  // (quantized); the reference values are torchao's own dequantize() of each rank's part.
  const std::filesystem::path data = std::filesystem::path(OPTSTATE_SOURCE_DIR) / "formats/dcp/testdata";
  auto r = open_checkpoint(data / "fsdp2_torchao");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  // torchao's state, though no moment is 8-bit on every rank (rank 0's chunks, read first, are plain).
  CHECK((*r)->meta().kind == "adamw8bit");
  const Entry& e = (*r)->meta().params.at("0.weight").entries.at(kExpAvg);
  CHECK(e.encoding == Encoding::kDense);
  CHECK(e.dtype == DType::kF32);
  const std::vector<std::pair<std::string, std::string>> entries = {
      {"0.weight", kExpAvg}, {"0.weight", kExpAvgSq}, {"1.weight", kExpAvg}, {"1.weight", kExpAvgSq}};
  for (const auto& fe : entries) {
    const std::string& fqn = fe.first;  // not a structured binding: clang 14 cannot capture those
    const std::string& entry = fe.second;
    CAPTURE(fqn);
    CAPTURE(entry);
    const std::string want = testing::read_file(data / "fsdp2_torchao_values" / (fqn + "." + entry + ".f32"));
    std::string got;
    REQUIRE((*r)->stream(fqn, entry, Component::kValues, [&](std::span<const std::byte> b) {
                   got.append(reinterpret_cast<const char*>(b.data()), b.size());
                   return Status::Ok();
                 }).ok());
    CHECK(got.size() == want.size());
    CHECK(got == want);
    // A range across the plain rows and the 8-bit ones (rows 128..130 of 0.weight).
    if (fqn == "0.weight") {
      std::vector<float> part(32 * 2);
      REQUIRE((*r)->read_range(fqn, entry, Component::kValues, 32 * 128, 32 * 130, std::as_writable_bytes(std::span(part))).ok());
      CHECK(std::memcmp(part.data(), want.data() + 4 * 32 * 128, part.size() * 4) == 0);
    }
  }
  // Every chunk's CRC-32 (codes and scales of the 8-bit one too) checks out in a validate.
  auto report = validate_checkpoint(data / "fsdp2_torchao", [](const std::filesystem::path& p) { return open_checkpoint(p); });
  REQUIRE(report.ok());
  CHECK(report->ok());
}

TEST_CASE("dcp: --to 8bit writes torchao's OptimState8bit items where each rank's rows are whole blocks") {
  const FormatDriver* d = find_format("dcp");
  REQUIRE(d != nullptr);
  // layers.0.weight [2, 3] in blocks of 3: one block a row; layers.0.bias [3]: one block.
  const OptimizerState eight = *quantize_state(testing::sample_state(), {3, 1});
  const WriteOptions to8{.quantized = true};
  CHECK(d->writes_blockwise8(to8));
  CHECK_FALSE(d->writes_blockwise8({}));
  CHECK_FALSE(d->writes_blockwise8({.float_lr = true, .quantized = true}));  // torch.optim.AdamW's state
  testing::TempDir dir;
  for (int world : {1, 2}) {
    CAPTURE(world);
    WriteOptions o = to8;
    o.world_size = world;
    const auto path = dir.path / fmt::format("w{}", world);
    REQUIRE(d->write(eight, path, o).ok());
    auto r = open_checkpoint(path);
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    const OptimizerState kept = d->kept_by_write(eight, o);
    // Codes and scales as they were, lr a float32 tensor (torchao's step takes no float).
    CHECK(hash_checkpoint(**r)->root == hash_state(kept)->root);
    CHECK((*r)->meta().kind == "adamw8bit");
    CHECK((*r)->meta().params.at("layers.0.weight").entries.at(kExpAvg).encoding == Encoding::kBlockwise8);
    // Over two ranks the bias's rows (2 and 1) are not whole blocks: torchao could not slice its
    // state there, so it is written as fp32 values.
    const Encoding bias = (*r)->meta().params.at("layers.0.bias").entries.at(kExpAvgSq).encoding;
    CHECK(bias == (world == 1 ? Encoding::kBlockwise8 : Encoding::kDense));
    CHECK(kept.params.at("layers.0.bias").entries.at(kExpAvgSq).encoding == bias);
    CHECK(hash_checkpoint(**r, {.values = true})->root == hash_state(kept, {.values = true})->root);
    CHECK(validate_checkpoint(path, [](const std::filesystem::path& p) { return open_checkpoint(p); })->ok());
    // DCP -> DCP from it keeps the items (a torchao source), --float-lr dequantizes them.
    auto again = load_all(**r);
    REQUIRE(again.ok());
    REQUIRE(d->write(*again, dir.path / fmt::format("again{}", world), {.source = r->get()}).ok());
    CHECK(hash_checkpoint(**open_checkpoint(dir.path / fmt::format("again{}", world)))->root ==
          hash_checkpoint(**r)->root);
    REQUIRE(d->write(*again, dir.path / fmt::format("float{}", world), {.float_lr = true, .source = r->get()}).ok());
    auto plain = open_checkpoint(dir.path / fmt::format("float{}", world));
    REQUIRE(plain.ok());
    CHECK((*plain)->meta().kind == "adamw");
    CHECK(hash_checkpoint(**plain, {.values = true})->root == hash_state(kept, {.values = true})->root);
  }
  // torchao's AdamW has no maximize: its load would drop the flag, so such a state is refused.
  OptimizerState maximize = eight;
  maximize.groups[1].hyper.maximize = true;
  const Status st = d->write(maximize, dir.path / "maximize", to8);
  CHECK(st.code() == ErrorCode::kInvalidArgument);
  CHECK(st.message().find("param group 1: maximize") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir.path / "maximize"));
  CHECK(d->write(maximize, dir.path / "maximize", {}).ok());  // torch.optim.AdamW's state has it
}

TEST_CASE("dcp: an Accelerate folder (optimizer_0/ beside pytorch_model_fsdp_0/) is one DCP; a key in both is refused") {
  const FormatDriver* d = find_format("dcp");
  REQUIRE(d != nullptr);
  testing::TempDir dir;
  const auto folder = dir.path / "checkpoint-3";
  // Both parts written whole: every key (optim.*, model.*) is in both.
  for (const char* part : {"optimizer_0", "pytorch_model_fsdp_0"}) {
    std::filesystem::create_directories(folder);
    REQUIRE(d->write(testing::sample_state(), folder / part, {}).ok());
  }
  CHECK(d->sniff(folder));
  auto r = d->open(folder);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("is in both optimizer_0/ and pytorch_model_fsdp_0/") != std::string::npos);
  CHECK_FALSE(d->replaceable(folder));  // a training run's folder
  CHECK(d->replaceable(folder / "optimizer_0"));
  // Either part alone is an ordinary DCP.
  CHECK(d->open(folder / "optimizer_0").ok());
  // Without the model's part the folder is no checkpoint.
  std::filesystem::remove_all(folder / "pytorch_model_fsdp_0");
  CHECK_FALSE(d->sniff(folder));
}

TEST_CASE("dcp: NeMo RL's step folder reads its policy's two DCPs, from step_N/ or policy/, unless value/ is beside") {
  const FormatDriver* d = find_format("dcp");
  REQUIRE(d != nullptr);
  testing::TempDir dir;
  const auto step = dir.path / "step_4";
  // The first DTensor worker's parts, both written whole: every key is in both.
  for (const char* part : {"policy/optimizer", "policy/weights"}) {
    std::filesystem::create_directories((step / part).parent_path());
    REQUIRE(d->write(testing::sample_state(), step / part, {}).ok());
  }
  for (const auto& [folder, parts] : {std::pair{step, "policy/optimizer/ and policy/weights/"},
                                      std::pair{step / "policy", "optimizer/ and weights/"}}) {
    CHECK(d->sniff(folder));
    auto r = d->open(folder);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().message().find(fmt::format("is in both {}", parts)) != std::string::npos);
    CHECK_FALSE(d->replaceable(folder));
  }
  CHECK(d->open(step / "policy" / "optimizer").ok());
  // A critic's value/ beside policy/: step_N/ is two models' folder, each read on its own.
  std::filesystem::create_directories(step / "value");
  CHECK_FALSE(d->sniff(step));
  CHECK(d->sniff(step / "policy"));
  // The default worker's parts one level down (NeMo Automodel's optim/ and model/).
  std::filesystem::remove_all(step);
  for (const char* part : {"policy/optimizer/optim", "policy/weights/model"}) {
    std::filesystem::create_directories((step / part).parent_path());
    REQUIRE(d->write(testing::sample_state(), step / part, {}).ok());
  }
  auto r = d->open(step);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("is in both policy/optimizer/optim/ and policy/weights/model/") != std::string::npos);
  CHECK(d->sniff(step / "policy"));
  // Without the weights the folder is no checkpoint.
  std::filesystem::remove_all(step / "policy" / "weights");
  CHECK_FALSE(d->sniff(step));
  CHECK_FALSE(d->sniff(step / "policy"));
}

TEST_CASE("torchao: 8-bit moments are the package's subclasses that was asked for, else the source's") {
  // torchao before 0.11 defined OptimState8bit in torchao.prototype.low_bit_optim, and a pickle
  // names the defining module: a reshard or conversion of such state keeps that package, so the
  // release that wrote it still loads it; --torchao-package chooses.
  constexpr std::string_view kOld = "torchao.prototype.low_bit_optim", kNew = "torchao.optim";
  const FormatDriver* dcp = find_format("dcp");
  const FormatDriver* ao = find_format("torchao");
  REQUIRE(dcp != nullptr);
  REQUIRE(ao != nullptr);
  const OptimizerState eight = *quantize_state(testing::sample_state(), {3, 1});
  testing::TempDir dir;
  WriteOptions old_items{.quantized = true};
  old_items.torchao_package = std::string(kOld);
  REQUIRE(dcp->write(eight, dir.path / "old", old_items).ok());
  REQUIRE(dcp->write(eight, dir.path / "new", {.quantized = true}).ok());
  auto old_dcp = open_checkpoint(dir.path / "old");
  auto new_dcp = open_checkpoint(dir.path / "new");
  REQUIRE(old_dcp.ok());
  REQUIRE(new_dcp.ok());
  CHECK((*old_dcp)->torchao_package() == kOld);
  CHECK((*new_dcp)->torchao_package() == kNew);
  CHECK(hash_checkpoint(**old_dcp)->root == hash_checkpoint(**new_dcp)->root);  // the same state
  REQUIRE(find_format("native")->write(eight, dir.path / "native", {}).ok());
  CHECK((*open_checkpoint(dir.path / "native"))->torchao_package().empty());
  // Notes: the older package says which torchao loads it; today's after an older source too.
  const OptimizerState kept = dcp->kept_by_write(eight, old_items);
  REQUIRE(dcp->write_notes(kept, old_items).size() == 1);
  CHECK(dcp->write_notes(kept, old_items)[0].find("torchao before 0.11") != std::string::npos);
  CHECK(dcp->write_notes(kept, {.quantized = true}).empty());
  CHECK(dcp->write_notes(kept, {}).empty());  // torch.optim.AdamW's state: dequantized, no torchao class

  auto all = load_all(**old_dcp);
  REQUIRE(all.ok());
  for (const FormatDriver* d : {dcp, ao}) {
    CAPTURE(d->name());
    const std::string n(d->name());
    // From the older package's DCP: kept by default, replaced when asked for.
    REQUIRE(d->write(*all, dir.path / (n + "-kept"), {.source = old_dcp->get()}).ok());
    WriteOptions to_new{.source = old_dcp->get()};
    to_new.torchao_package = std::string(kNew);
    REQUIRE(d->write(*all, dir.path / (n + "-new"), to_new).ok());
    auto kept_r = open_checkpoint(dir.path / (n + "-kept"));
    auto new_r = open_checkpoint(dir.path / (n + "-new"));
    REQUIRE(kept_r.ok());
    REQUIRE(new_r.ok());
    CHECK((*kept_r)->torchao_package() == kOld);
    CHECK((*new_r)->torchao_package() == kNew);
    CHECK(hash_checkpoint(**kept_r)->root == hash_checkpoint(**new_r)->root);
    const auto note = d->write_notes(d->kept_by_write(*all, to_new), to_new);
    REQUIRE(note.size() == 1);
    CHECK(note[0].find("the source's were torchao.prototype.low_bit_optim's") != std::string::npos);
    // A package that defines no torchao state is refused before anything is written.
    WriteOptions bad{.quantized = true};
    bad.torchao_package = "torchao.prototype";
    const Status st = d->write(*all, dir.path / (n + "-bad"), bad);
    CHECK(st.code() == ErrorCode::kInvalidArgument);
    CHECK(st.message().find("'torchao.prototype' defines no torchao optimizer state") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir.path / (n + "-bad")));
  }
}

TEST_CASE("dcp: optimizer.state_dict() saved as it is (numbered) is named after the model and written numbered again") {
  // formats/dcp/testdata/make_numbered.py: dcp.save({"model": model.state_dict(), "optimizer":
  // opt.state_dict()}) of Linear(6, 8), BatchNorm1d(8), Linear(8, 3); weights in group 0, the rest
  // in group 1 (numbered group by group: 0.weight 0, 2.weight 1, 0.bias 2, ...); 2.bias never stepped.
  const std::filesystem::path data = std::filesystem::path(OPTSTATE_SOURCE_DIR) / "formats/dcp/testdata";
  auto r = open_checkpoint(data / "numbered");
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const OptimizerState& m = (*r)->meta();
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].params == std::vector<std::string>{"0.weight", "2.weight"});
  CHECK(m.groups[1].params == std::vector<std::string>{"0.bias", "1.weight", "1.bias", "2.bias"});
  CHECK(m.groups[1].hyper.weight_decay == 0.0);
  CHECK(m.params.at("0.weight").step == 2);
  CHECK(m.params.at("0.weight").entries.count(kParam) == 1);
  // never stepped: listed, with its weights and no moments
  CHECK(m.params.at("2.bias").entries.count(kExpAvg) == 0);
  CHECK(m.params.at("2.bias").entries.count(kParam) == 1);
  std::vector<std::string> others;
  for (const ModelTensorInfo& t : (*r)->model_tensors()) others.push_back(t.name);
  std::sort(others.begin(), others.end());
  CHECK(others == std::vector<std::string>{"1.num_batches_tracked", "1.running_mean", "1.running_var"});
  CHECK((*r)->not_read().empty());
  // Written back on two ranks: keyed by number again (not by name), the same state and hash.
  testing::TempDir dir;
  auto all = load_all(**r);
  REQUIRE(all.ok());
  Status st = write_checkpoint(*find_format("dcp"), *all, dir.path / "out", {.world_size = 2, .source = r->get()});
  REQUIRE_MESSAGE(st.ok(), st.message());
  const std::string md = testing::read_file(dir.path / "out" / ".metadata");
  CHECK(md.find("optimizer.state.0.exp_avg") != std::string::npos);
  CHECK(md.find("optimizer.state.0.weight") == std::string::npos);
  auto back = open_checkpoint(dir.path / "out");
  REQUIRE_MESSAGE(back.ok(), back.status().message());
  CHECK((*back)->meta().groups[1].params == m.groups[1].params);
  CHECK(hash_checkpoint(**back)->root == hash_checkpoint(**r)->root);
  CHECK((*back)->model_tensors().size() == 3);
}


TEST_CASE("dcp: items stored zstd-compressed (torch's ZStandard extension) read, and carry DCP -> DCP as stored") {
  // formats/dcp/testdata/make_zstd.py: get_state_dict's model and AdamW state of Linear(6, 8),
  // Linear(8, 3) after a step, and "extra" values, every item's archive one zstd stream.
  const std::filesystem::path data = std::filesystem::path(OPTSTATE_SOURCE_DIR) / "formats/dcp/testdata";
  const std::string md_bytes = testing::read_file(data / "zstd" / ".metadata");
  CHECK(md_bytes.find("stream.zstd/1") != std::string::npos);
  auto r = open_checkpoint(data / "zstd");
  if (!zstd_available()) {
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().message().find("without libzstd") != std::string::npos);
    return;
  }
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  const OptimizerState& m = (*r)->meta();
  REQUIRE(m.groups.size() == 1);
  CHECK(m.params.size() == 4);
  CHECK(m.params.at("0.weight").step == 1);
  auto all = load_all(**r);
  REQUIRE(all.ok());
  // Moments as torch computed them after one step from zero: |exp_avg| = 0.1 |g|, exp_avg_sq = 0.001 g^2.
  const auto& ea = all->params.at("1.bias").entries.at(kExpAvg);
  const auto& eq = all->params.at("1.bias").entries.at(kExpAvgSq);
  for (int64_t i = 0; i < 3; ++i) {
    float a, q;
    std::memcpy(&a, ea.values.data + 4 * i, 4);
    std::memcpy(&q, eq.values.data + 4 * i, 4);
    CHECK(q == doctest::Approx(a * a / 10.0).epsilon(1e-5));
  }
  // DCP -> DCP: the values it carries stay compressed (their descriptors with them), the state it
  // writes is plain; read back as the same state.
  testing::TempDir dir;
  Status st = write_checkpoint(*find_format("dcp"), *all, dir.path / "out", {.world_size = 2, .source = r->get()});
  REQUIRE_MESSAGE(st.ok(), st.message());
  auto back = open_checkpoint(dir.path / "out");
  REQUIRE_MESSAGE(back.ok(), back.status().message());
  CHECK(hash_checkpoint(**back, {.values = true})->root == hash_checkpoint(**r, {.values = true})->root);
  const std::string out_md = testing::read_file(dir.path / "out" / ".metadata");
  auto p = pickle::unpickle(std::as_bytes(std::span(out_md)), "out");
  REQUIRE(p.ok());
  auto md = dcp::interpret_metadata(*p, "out");
  REQUIRE_MESSAGE(md.ok(), md.status().message());
  std::set<std::string> compressed;
  for (const auto& [k, loc] : md->storage)
    if (!loc.transforms.empty()) {
      CHECK(loc.transforms == std::vector<std::string>{"stream.zstd/1"});
      compressed.insert(k.first);
    }
  CHECK(compressed.count("extra.history") == 1);
  CHECK(compressed.count("extra.step") == 1);
  for (const std::string& k : compressed) CHECK(k.rfind("optim.state.", 0) != 0);
  // A damaged stream names its item.
  testing::TempDir bad;
  std::filesystem::copy(data / "zstd", bad.path / "ck");
  std::string bytes = testing::read_file(bad.path / "ck" / "__0_0.distcp");
  for (char& c : bytes) c = static_cast<char>(c == '\x28' ? '\x29' : c);  // every frame's magic (28 b5 2f fd) broken
  testing::write_file(bad.path / "ck" / "__0_0.distcp", bytes);
  auto broken = open_checkpoint(bad.path / "ck");
  Status seen = broken.ok() ? hash_checkpoint(**broken).status() : broken.status();
  REQUIRE_FALSE(seen.ok());
  CHECK(seen.message().find("item '") != std::string::npos);
  CHECK(seen.message().find("zstd") != std::string::npos);
}
