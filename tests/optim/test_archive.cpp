// torch::save / torch::load of the optimizers (LibTorch's optimizer archive, optim/archive.h):
// training continues with the same bits, archives move between torch::optim::AdamW and ours, and
// a bad archive is refused before anything changes.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <doctest/doctest.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <optional>
#include <sstream>

#include "adamw8bit.h"
#include "archive.h"
#include "fused_adamw.h"
#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "optstate/transform.h"
#include "registry.h"
#include "test_tensors.h"
#include "torch_bridge.h"

using namespace optstate;
using namespace optstate::optim;

namespace {

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) { return test::randn_tensor(std::move(shape), seed); }

// Two groups: a 64x80 weight (8-bit in AdamW8bit: 5120 elements) with amsgrad and weight decay,
// and a bias (dense everywhere) with another lr.
template <class Opt, class Options>
std::unique_ptr<Opt> build(std::vector<at::Tensor>& ps, double lr_scale = 1) {
  ps = {randn({64, 80}, 1), randn({80}, 2)};
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{ps[0]},
                      std::make_unique<Options>(Options(1e-2 * lr_scale).weight_decay(0.1).amsgrad(true)));
  groups.emplace_back(std::vector<at::Tensor>{ps[1]}, std::make_unique<Options>(Options(3e-2 * lr_scale)));
  return std::make_unique<Opt>(groups);
}

void train(torch::optim::Optimizer& opt, std::vector<at::Tensor>& ps, int from, int to) {
  for (int s = from; s < to; ++s) {
    for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = randn(ps[i].sizes().vec(), 100 * s + i);
    opt.step();
  }
}

std::string saved(const torch::optim::Optimizer& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

void load_into(torch::optim::Optimizer& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::load(opt, in);
}

std::string root_hash(const OptimizerState& s) {
  auto h = hash_state(s);
  REQUIRE(h.ok());
  return h->root;
}

template <class Opt, class Options>
void check_resume_is_exact() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> a, b;
  auto oa = build<Opt, Options>(a);
  auto ob = build<Opt, Options>(b, /*lr_scale=*/5);  // the archive's hyperparameters win
  train(*oa, a, 0, 3);
  const std::string bytes = saved(*oa);
  load_into(*ob, bytes);
  CHECK(static_cast<Options&>(ob->param_groups()[1].options()).lr() == 3e-2);
  const auto names = numbered_names(*oa);
  CHECK(root_hash(*export_state(*oa, names, false)) == root_hash(*export_state(*ob, names, false)));
  for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);  // the weights travel in the model's archive
  train(*oa, a, 3, 6);
  train(*ob, b, 3, 6);
  for (size_t i = 0; i < a.size(); ++i) CHECK(at::equal(a[i], b[i]));
  CHECK(ob->step_count(b[0]) == 6);
}

}  // namespace

TEST_CASE("torch::save / torch::load: FusedAdamW and AdamW8bit resume with the same bits") {
  SUBCASE("FusedAdamW") { check_resume_is_exact<FusedAdamW, FusedAdamWOptions>(); }
  SUBCASE("AdamW8bit") { check_resume_is_exact<AdamW8bit, AdamW8bitOptions>(); }
}

TEST_CASE("archives move between torch::optim::AdamW and FusedAdamW, and into AdamW8bit") {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> t, f, q;
  auto ot = build<torch::optim::AdamW, torch::optim::AdamWOptions>(t);
  train(*ot, t, 0, 3);
  auto of = build<FusedAdamW, FusedAdamWOptions>(f, 2);
  load_into(*of, saved(*ot));
  // torch's own moments, bit for bit, and its hyperparameters
  for (size_t i = 0; i < t.size(); ++i) {
    const auto& ts = static_cast<torch::optim::AdamWParamState&>(*ot->state().at(t[i].unsafeGetTensorImpl()));
    const auto& fs = static_cast<FusedAdamWParamState&>(*of->state().at(f[i].unsafeGetTensorImpl()));
    CHECK(fs.step() == ts.step());
    CHECK(at::equal(fs.exp_avg(), ts.exp_avg()));
    CHECK(at::equal(fs.exp_avg_sq(), ts.exp_avg_sq()));
    CHECK(fs.max_exp_avg_sq().defined() == (i == 0));
    if (i == 0) CHECK(at::equal(fs.max_exp_avg_sq(), ts.max_exp_avg_sq()));
  }
  CHECK(static_cast<FusedAdamWOptions&>(of->param_groups()[0].options()).weight_decay() == 0.1);
  CHECK(static_cast<FusedAdamWOptions&>(of->param_groups()[0].options()).amsgrad());
  // and back: FusedAdamW's archive loads into torch::optim::AdamW (which reads every AdamW option)
  std::vector<at::Tensor> t2;
  auto ot2 = build<torch::optim::AdamW, torch::optim::AdamWOptions>(t2, 7);
  load_into(*ot2, saved(*of));
  for (size_t i = 0; i < t.size(); ++i) {
    const auto& a = static_cast<torch::optim::AdamWParamState&>(*ot->state().at(t[i].unsafeGetTensorImpl()));
    const auto& b = static_cast<torch::optim::AdamWParamState&>(*ot2->state().at(t2[i].unsafeGetTensorImpl()));
    CHECK(a.step() == b.step());
    CHECK(at::equal(a.exp_avg(), b.exp_avg()));
    CHECK(at::equal(a.exp_avg_sq(), b.exp_avg_sq()));
  }
  CHECK(static_cast<torch::optim::AdamWOptions&>(ot2->param_groups()[1].options()).lr() == 3e-2);
  // AdamW8bit quantizes the dense moments of its 8-bit params as an import of the same state does
  auto oq = build<AdamW8bit, AdamW8bitOptions>(q);
  load_into(*oq, saved(*ot));
  std::vector<at::Tensor> q2;
  auto oq2 = build<AdamW8bit, AdamW8bitOptions>(q2);
  const auto names = numbered_names(*oq);
  REQUIRE(import_state(*oq2, names, *export_state(*of, names, false), false).ok());
  const auto exported = export_state(*oq, names, false);
  CHECK((exported->params.at("0").entries.at(kExpAvg).encoding == Encoding::kBlockwise8));
  CHECK((exported->params.at("1").entries.at(kExpAvg).encoding == Encoding::kDense));
  CHECK(root_hash(*exported) == root_hash(*export_state(*oq2, names, false)));
  // AdamW8bit's archive (codes + absmax) loads into FusedAdamW dequantized
  std::vector<at::Tensor> f2;
  auto of2 = build<FusedAdamW, FusedAdamWOptions>(f2);
  load_into(*of2, saved(*oq));
  OptimizerState dequantized = *dequantize_state(*export_state(*oq, names, false));
  dequantized.kind = "adamw";  // the hash covers the optimizer kind
  CHECK(root_hash(*export_state(*of2, names, false)) == root_hash(dequantized));
}

TEST_CASE("torch::optim::AdamW's bf16 state loads as fp32, exactly") {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> t{randn({33, 7}, 3).to(at::kBFloat16)};
  torch::optim::AdamW ot(t, torch::optim::AdamWOptions(1e-2));
  train(ot, t, 0, 2);
  std::vector<at::Tensor> f{t[0].clone()};
  FusedAdamW of(f, FusedAdamWOptions(1e-3));
  load_into(of, saved(ot));
  const auto& ts = static_cast<torch::optim::AdamWParamState&>(*ot.state().at(t[0].unsafeGetTensorImpl()));
  const auto& fs = static_cast<FusedAdamWParamState&>(*of.state().at(f[0].unsafeGetTensorImpl()));
  CHECK((ts.exp_avg().scalar_type() == at::kBFloat16));
  CHECK((fs.exp_avg().scalar_type() == at::kFloat));
  CHECK(at::equal(fs.exp_avg(), ts.exp_avg().to(at::kFloat)));
  CHECK(at::equal(fs.exp_avg_sq(), ts.exp_avg_sq().to(at::kFloat)));
}

namespace {

// Expects load to throw naming `what`, with the optimizer as it was.
void check_refused(FusedAdamW& opt, const std::string& bytes, const std::string& what) {
  const auto before = root_hash(*export_state(opt, numbered_names(opt), true));
  std::string message;
  try {
    load_into(opt, bytes);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  CAPTURE(message);
  CHECK(message.find(what) != std::string::npos);
  CHECK(root_hash(*export_state(opt, numbered_names(opt), true)) == before);
}

// An archive of one param group with one param (key "42"), written field by field (an archive
// attribute cannot be written twice): the defaults make a valid one of shape [4, 5].
struct Handmade {
  std::vector<int64_t> shape{4, 5};
  c10::IValue step = int64_t{2};
  std::optional<c10::IValue> exp_avg = std::nullopt, exp_avg_sq = std::nullopt;  // unset: zeros of `shape`
  bool dense = true;                              // false: no exp_avg / exp_avg_sq at all
  std::function<void(torch::serialize::OutputArchive&)> more = [](auto&) {};  // further state fields
  c10::IValue lr = 1e-3;
  c10::IValue betas = std::make_tuple(0.9, 0.999);

  std::string bytes() const {
    torch::serialize::OutputArchive top;
    const auto cu = top.compilation_unit();
    torch::serialize::OutputArchive states(cu), groups(cu), group(cu), options(cu), one(cu);
    top.write("pytorch_version", c10::IValue("1.5.0"));
    one.write("step", step);
    if (dense) {
      one.write("exp_avg", exp_avg.value_or(c10::IValue(at::zeros(shape))));
      one.write("exp_avg_sq", exp_avg_sq.value_or(c10::IValue(at::zeros(shape))));
    }
    more(one);
    options.write("lr", lr);
    options.write("betas", betas);
    options.write("eps", c10::IValue(1e-8));
    options.write("weight_decay", c10::IValue(0.0));
    options.write("amsgrad", c10::IValue(false));
    states.write("42", one);
    groups.write("param_groups/size", at::tensor(int64_t{1}));
    group.write("params/size", at::tensor(int64_t{1}));
    group.write("params/0", c10::IValue(std::string("42")));
    group.write("options", options);
    groups.write("param_groups/0", group);
    top.write("state", states);
    top.write("param_groups", groups);
    std::ostringstream out;
    top.save_to(out);
    return out.str();
  }
};

}  // namespace

TEST_CASE("a bad optimizer archive is refused naming the group, param and entry; nothing changes") {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> f;
  auto of = build<FusedAdamW, FusedAdamWOptions>(f);
  train(*of, f, 0, 2);
  std::vector<at::Tensor> one{randn({4, 5}, 9)};
  FusedAdamW small(one, FusedAdamWOptions(1e-3));
  train(small, one, 0, 1);

  // another model's archive: the groups do not match
  check_refused(small, saved(*of), "has 2 param groups; the optimizer has 1");
  CHECK_NOTHROW(load_into(small, Handmade{}.bytes()));
  check_refused(small, Handmade{.shape = {5, 4}}.bytes(),
                "param group 0, param 0 (#0), entry 'exp_avg': shape [5, 4] differs");
  check_refused(small, Handmade{.step = int64_t{-3}}.bytes(), "param 0 (#0): 'step' is -3");
  check_refused(small, Handmade{.exp_avg_sq = c10::IValue(std::string("x"))}.bytes(),
                "entry 'exp_avg_sq': 'exp_avg_sq' is not a tensor");
  check_refused(small, Handmade{.exp_avg = c10::IValue(at::zeros({4, 5}, at::kInt))}.bytes(),
                "entry 'exp_avg': dtype Int is not floating point");
  check_refused(small, Handmade{.betas = std::make_tuple(0.9, 1.5)}.bytes(), "param group 0: beta2 is 1.5");
  check_refused(small, Handmade{.lr = std::nan("")}.bytes(), "param group 0: 'lr' is nan");
  check_refused(small, Handmade{.dense = false}.bytes(), "state without exp_avg and exp_avg_sq");
  check_refused(small,
                Handmade{.more = [](auto& s) { s.write("exp_avg_codes", c10::IValue(at::zeros({4, 5}, at::kByte))); }}
                    .bytes(),
                "entry 'exp_avg': both dense and 8-bit");
  // 8-bit moments whose absmax does not cover the blocks
  check_refused(small,
                Handmade{.dense = false,
                         .more =
                             [](auto& s) {
                               s.write("exp_avg_codes", c10::IValue(at::zeros({4, 5}, at::kByte)));
                               s.write("exp_avg_absmax", c10::IValue(at::zeros({3})));
                               s.write("exp_avg_sq_codes", c10::IValue(at::zeros({4, 5}, at::kByte)));
                               s.write("exp_avg_sq_absmax", c10::IValue(at::zeros({1})));
                               s.write("block_size", c10::IValue(int64_t{256}));
                             }}
                    .bytes(),
                "optimizer archive: entry '0.exp_avg' absmax holds 12 bytes, shape [4, 5] needs 4");
  torch::serialize::OutputArchive empty;
  std::ostringstream out;
  empty.save_to(out);
  check_refused(small, out.str(), "no 'pytorch_version'");
}

TEST_CASE("a step refuses state that does not fit its param (the kernels take raw pointers)") {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> f{randn({64, 80}, 1)}, q{randn({64, 80}, 1)};
  FusedAdamW of(f, FusedAdamWOptions(1e-3));
  AdamW8bit oq(q, AdamW8bitOptions(1e-3));
  train(of, f, 0, 1);
  train(oq, q, 0, 1);
  auto& fs = static_cast<FusedAdamWParamState&>(*of.state().at(f[0].unsafeGetTensorImpl()));
  fs.exp_avg_sq(at::zeros({64, 79}));
  CHECK_THROWS_WITH_AS(train(of, f, 1, 2), doctest::Contains("must be float32 tensors of as many elements"), c10::Error);
  auto& qs = static_cast<AdamW8bitParamState&>(*oq.state().at(q[0].unsafeGetTensorImpl()));
  Moment8bit m = qs.exp_avg();
  m.absmax = m.absmax.narrow(0, 0, m.absmax.numel() - 1).clone();
  qs.exp_avg(m);
  CHECK_THROWS_WITH_AS(train(oq, q, 1, 2), doctest::Contains("does not fit it"), c10::Error);
}

TEST_CASE("optstate's reader (no LibTorch) reads what torch::save wrote as the live state") {
  at::NoGradGuard no_grad;
  const auto dir = std::filesystem::temp_directory_path() / ("optstate_archive_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto read_hash = [&](const torch::optim::Optimizer& opt, const char* name) {
    const auto path = dir / name;
    torch::save(opt, path.string());
    auto reader = open_checkpoint(path);
    REQUIRE_MESSAGE(reader.ok(), reader.status().message());
    CHECK((*reader)->format() == "libtorch");
    auto h = hash_checkpoint(**reader);
    REQUIRE_MESSAGE(h.ok(), h.status().message());
    return h->root;
  };
  std::vector<at::Tensor> t, f, q, g;
  auto ot = build<torch::optim::AdamW, torch::optim::AdamWOptions>(t);
  auto of = build<FusedAdamW, FusedAdamWOptions>(f);
  auto oq = build<AdamW8bit, AdamW8bitOptions>(q);
  train(*ot, t, 0, 3);
  train(*of, f, 0, 3);
  train(*oq, q, 0, 3);
  const auto names = numbered_names(*of);
  CHECK(read_hash(*of, "fused.pt") == root_hash(*export_state(*of, names, false)));
  CHECK(read_hash(*oq, "8bit.pt") == root_hash(*export_state(*oq, names, false)));
  auto og = build<FusedAdamW, FusedAdamWOptions>(g);
  load_into(*og, saved(*ot));  // torch's state, read by LibTorch itself
  CHECK(read_hash(*ot, "torch.pt") == root_hash(*export_state(*og, names, false)));
  std::filesystem::remove_all(dir);
}

TEST_CASE("optstate convert --format libtorch writes archives torch::load takes into every AdamW") {
  at::NoGradGuard no_grad;
  const auto dir = std::filesystem::temp_directory_path() / ("optstate_libtorch_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const OptimizerState& state, const char* name, bool dequantize) {
    const auto path = dir / name;
    WriteOptions wo;
    wo.dequantize = dequantize;
    const Status st = find_format("libtorch")->write(state, path, wo);
    REQUIRE_MESSAGE(st.ok(), st.message());
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  std::vector<at::Tensor> f, q;
  auto of = build<FusedAdamW, FusedAdamWOptions>(f);
  auto oq = build<AdamW8bit, AdamW8bitOptions>(q);
  train(*of, f, 0, 3);
  train(*oq, q, 0, 3);
  const auto names = numbered_names(*of);
  const OptimizerState dense = *export_state(*of, names, false), eight = *export_state(*oq, names, false);

  // torch::optim::AdamW takes the dense archive: its moments and options are FusedAdamW's
  std::vector<at::Tensor> t;
  auto ot = build<torch::optim::AdamW, torch::optim::AdamWOptions>(t, 4);
  load_into(*ot, write(dense, "dense.pt", false));
  for (size_t i = 0; i < t.size(); ++i) {
    const auto& ts = static_cast<torch::optim::AdamWParamState&>(*ot->state().at(t[i].unsafeGetTensorImpl()));
    const auto& fs = static_cast<FusedAdamWParamState&>(*of->state().at(f[i].unsafeGetTensorImpl()));
    CHECK(ts.step() == fs.step());
    CHECK(at::equal(ts.exp_avg(), fs.exp_avg()));
    CHECK(at::equal(ts.exp_avg_sq(), fs.exp_avg_sq()));
  }
  CHECK(static_cast<torch::optim::AdamWOptions&>(ot->param_groups()[0].options()).amsgrad());
  CHECK(static_cast<torch::optim::AdamWOptions&>(ot->param_groups()[1].options()).lr() == 3e-2);
  // FusedAdamW takes it back exactly; AdamW8bit takes the 8-bit archive exactly (codes kept)
  std::vector<at::Tensor> f2, q2, t2;
  auto of2 = build<FusedAdamW, FusedAdamWOptions>(f2, 4);
  load_into(*of2, write(dense, "dense2.pt", false));
  CHECK(root_hash(*export_state(*of2, names, false)) == root_hash(dense));
  auto oq2 = build<AdamW8bit, AdamW8bitOptions>(q2, 4);
  load_into(*oq2, write(eight, "eight.pt", false));
  CHECK(root_hash(*export_state(*oq2, names, false)) == root_hash(eight));
  // dequantized on write, torch::optim::AdamW takes the 8-bit state too
  auto ot2 = build<torch::optim::AdamW, torch::optim::AdamWOptions>(t2, 4);
  load_into(*ot2, write(eight, "eight_fp32.pt", true));
  const auto m0 = static_cast<torch::optim::AdamWParamState&>(*ot2->state().at(t2[0].unsafeGetTensorImpl())).exp_avg();
  OptimizerState dq = *dequantize_state(eight);
  const Entry& e = dq.params.at("0").entries.at(kExpAvg);
  CHECK(std::memcmp(m0.const_data_ptr(), e.values.data, e.values.size) == 0);
  std::filesystem::remove_all(dir);
}
