// Megatron-Core's torch_dist checkpoints (formats/dcp/megatron.cpp): metadata.json's backend,
// common.pt's optimizer (param groups without members, the step; the distributed optimizer's
// forms, dp_reshardable's per-group optimizer item), item keys and Megatron-Core's standard groups
// over stacked layer axes.
#include <doctest/doctest.h>

#include <array>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dcp/chunks.h"
#include "dcp/megatron.h"
#include "dcp/pickle.h"
#include "optstate/validate.h"
#include "registry.h"
#include "test_helpers.h"
#include "torchsave/torchsave_fuzz_sign.h"

using namespace optstate;
namespace mg = optstate::dcp::megatron;

namespace {

// A group dict as Megatron-Core's optimizer saves it (torch.optim.AdamW's fields and Megatron's).
void group(pickle::Writer& w, double wd, double wd_mult, const std::function<void(pickle::Writer&)>& extra = {},
           bool decoupled = true) {
  w.empty_dict();
  w.mark();
  w.str("wd_mult"), w.real(wd_mult);
  w.str("lr_mult"), w.real(1.0);
  w.str("max_lr"), w.real(1e-3);
  w.str("lr"), w.real(1e-3);
  w.str("betas"), w.mark(), w.real(0.9), w.real(0.95), w.tuple_from_mark();
  w.str("eps"), w.real(1e-8);
  w.str("weight_decay"), w.real(wd);
  w.str("amsgrad"), w.boolean(false);
  w.str("foreach"), w.none();
  w.str("decoupled_weight_decay"), w.boolean(decoupled);
  if (extra) extra(w);
  w.setitems_from_mark();
}

Result<mg::Common> common(const std::function<void(pickle::Writer&)>& optimizer, bool with_optimizer = true) {
  pickle::Writer w;
  w.empty_dict();
  w.mark();
  w.str("iteration"), w.integer(3);
  if (with_optimizer) w.str("optimizer"), optimizer(w);
  w.setitems_from_mark();
  const std::string bytes = w.finish();
  OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(std::as_bytes(std::span(bytes)), "common.pt"));
  return mg::interpret_common(p, "ck");
}

// {"param_groups": [...], "state": {"common_step": 7}}: Megatron's plain optimizer.
void plain(pickle::Writer& w, const std::function<void(pickle::Writer&)>& groups) {
  w.empty_dict();
  w.mark();
  w.str("param_groups"), w.empty_list(), w.mark(), groups(w), w.appends_from_mark();
  w.str("state"), w.empty_dict(), w.mark(), w.str("common_step"), w.integer(7), w.setitems_from_mark();
  w.setitems_from_mark();
}

dcp::ItemMeta item(std::vector<int64_t> size, std::vector<std::vector<int64_t>> chunk_sizes) {
  dcp::ItemMeta im;
  im.is_tensor = true;
  im.size = std::move(size);
  for (auto& s : chunk_sizes) im.chunks.push_back({std::vector<int64_t>(s.size(), 0), std::move(s)});
  return im;
}

}  // namespace

TEST_CASE("megatron: metadata.json names the sharded backend (torch_dist, zarr), or the folder is no Megatron checkpoint") {
  CHECK(mg::sharded_backend(R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1})") == "torch_dist");
  CHECK(mg::sharded_backend(R"({"sharded_backend": "zarr", "sharded_backend_version": 1})") == "zarr");
  CHECK(mg::sharded_backend(R"({"sharded_backend": 1})").empty());
  CHECK(mg::sharded_backend(R"(["torch_dist"])").empty());
  CHECK(mg::sharded_backend("{\"sharded_backend\": \"torch_dist\"").empty());  // truncated
  // named twice: either could be meant (nlohmann's plain parser kept the last)
  CHECK(mg::sharded_backend(R"({"sharded_backend": "zarr", "sharded_backend": "torch_dist"})").empty());
  CHECK(mg::sharded_backend("").empty());
}

TEST_CASE("megatron: item keys optimizer.state.<entry>.<key>") {
  const auto a = mg::state_item("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight");
  REQUIRE(a);
  CHECK(a->chain == -1);
  CHECK(a->entry == "exp_avg");
  CHECK(a->key == "decoder.layers.mlp.linear_fc1.weight");
  const auto b = mg::state_item("chained_1.optimizer.state.exp_avg_sq.decoder.layers.mlp.experts.experts.linear_fc1.weight");
  REQUIRE(b);
  CHECK(b->chain == 1);
  CHECK(b->entry == "exp_avg_sq");
  CHECK_FALSE(mg::state_item("chained_.optimizer.state.exp_avg.w"));
  CHECK_FALSE(mg::state_item("chained_x.optimizer.state.exp_avg.w"));
  CHECK_FALSE(mg::state_item("chained_123.optimizer.state.exp_avg.w"));
  CHECK_FALSE(mg::state_item("optimizer.state.exp_avg"));
  CHECK_FALSE(mg::state_item("optimizer.state.exp_avg."));
  CHECK_FALSE(mg::state_item("optimizer.state..w"));
  CHECK_FALSE(mg::state_item("decoder.layers.mlp.linear_fc1.weight"));
}

TEST_CASE("megatron: stacked layer axes are left out of the standard groups' one-dimensional test") {
  // a layer norm stacked over 2 layers: [2, 16] in chunks of [1, 16]
  CHECK(mg::stacked_axes(item({2, 16}, {{1, 16}, {1, 16}})) == 1);
  CHECK(mg::standard_no_decay("decoder.layers.input_layernorm.weight", item({2, 16}, {{1, 16}, {1, 16}})));
  // a stacked matrix, split over tensor-parallel ranks too: decayed
  CHECK_FALSE(mg::standard_no_decay("decoder.layers.mlp.linear_fc1.weight", item({2, 64, 16}, {{1, 32, 16}, {1, 32, 16}})));
  // experts stacked under layers: two axes
  CHECK(mg::stacked_axes(item({2, 4, 8, 8}, {{1, 1, 8, 8}})) == 2);
  // unstacked: an embedding (rows split over ranks) decayed, the final norm not
  CHECK_FALSE(mg::standard_no_decay("embedding.word_embeddings.weight", item({32, 16}, {{16, 16}, {16, 16}})));
  CHECK(mg::standard_no_decay("decoder.final_layernorm.weight", item({16}, {{16}})));
  // a bias by its name, whatever its shape; never every axis counted as stacked
  CHECK(mg::standard_no_decay("output_layer.bias", item({1, 4}, {{1, 4}})));
  CHECK(mg::stacked_axes(item({1}, {{1}})) == 0);
  CHECK(mg::stacked_axes(item({2, 16}, {})) == 0);
}

TEST_CASE("megatron: common.pt's plain optimizer: groups and the common step") {
  auto c = common([](pickle::Writer& w) {
    plain(w, [](pickle::Writer& w) {
      group(w, 0.1, 1.0);
      group(w, 0.0, 0.0);
    });
  });
  REQUIRE(c.ok());
  REQUIRE(c->optimizers[0].groups.size() == 2);
  CHECK(c->optimizers[0].sharding.empty());
  CHECK(c->optimizers[0].groups[0].hyper.weight_decay == 0.1);
  CHECK(c->optimizers[0].groups[0].hyper.beta2 == 0.95);
  CHECK(c->optimizers[0].groups[1].wd_mult == 0.0);
  CHECK(c->optimizers[0].step_ref != pickle::kNoRef);
  CHECK_FALSE(c->optimizers[0].group_step);
  CHECK(c->other_keys == std::vector<std::string>{"iteration"});
  bool has_wd_mult = false;
  for (const auto& [k, v] : c->optimizers[0].groups[1].extras) has_wd_mult |= k == "wd_mult";
  CHECK(has_wd_mult);
}

TEST_CASE("megatron: Megatron-Core 0.19's common_state item: the dict inside a list of one, named in errors") {
  // torch.save([common]): the dict is the list's element, not the pickle's root
  auto embedded = [](bool with_optimizer) -> Result<mg::Common> {
    pickle::Writer w;
    w.empty_list(), w.mark();
    w.empty_dict(), w.mark();
    w.str("iteration"), w.integer(3);
    if (with_optimizer) w.str("optimizer"), plain(w, [](pickle::Writer& w) { group(w, 0.1, 1.0); });
    w.setitems_from_mark();
    w.appends_from_mark();
    const std::string bytes = w.finish();
    OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(std::as_bytes(std::span(bytes)), "item"));
    const pickle::Value& list = p.at(p.root());
    REQUIRE(list.kind == pickle::Kind::kList);
    REQUIRE(list.items.size() == 1);
    return mg::interpret_common(p, "ck", list.items[0], "item 'common_state/shard_0_1'");
  };
  auto c = embedded(true);
  REQUIRE(c.ok());
  REQUIRE(c->optimizers.size() == 1);
  CHECK(c->optimizers[0].groups.size() == 1);
  CHECK(c->other_keys == std::vector<std::string>{"iteration"});
  auto none = embedded(false);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message().find("item 'common_state/shard_0_1' has no 'optimizer'") != std::string::npos);
  // the list itself as the common state: not a dict
  pickle::Writer w;
  w.empty_list(), w.mark(), w.integer(1), w.appends_from_mark();
  const std::string bytes = w.finish();
  auto p = pickle::unpickle(std::as_bytes(std::span(bytes)), "item");
  REQUIRE(p.ok());
  auto bad = mg::interpret_common(*p, "ck: item 'common_state/shard_0_1'");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("the common state is not a dict") != std::string::npos);
}

TEST_CASE("megatron: the mixed-precision optimizer's state dict one level down") {
  auto c = common([](pickle::Writer& w) {
    w.empty_dict(), w.mark();
    w.str("optimizer"), plain(w, [](pickle::Writer& w) { group(w, 0.1, 1.0); });
    w.str("grad_scaler"), w.none();
    w.setitems_from_mark();
  });
  REQUIRE(c.ok());
  CHECK(c->optimizers[0].groups.size() == 1);
  CHECK(c->optimizers[0].step_ref != pickle::kNoRef);
}

TEST_CASE("megatron: the distributed optimizer's per-param, per-bucket and gathered forms read; Megatron-FSDP's refused") {
  auto dist = [](const char* sharding, double step1) {
    return common([=](pickle::Writer& w) {
      w.empty_dict();
      w.mark();
      w.str("optimizer"), w.empty_dict(), w.mark(), w.str("param_groups"), w.empty_list(), w.mark();
      group(w, 0.1, 1.0, [](pickle::Writer& w) { w.str("step"), w.real(3.0); });
      group(w, 0.0, 0.0, [=](pickle::Writer& w) { w.str("step"), w.real(step1); });
      w.appends_from_mark(), w.setitems_from_mark();
      w.str("param_state_sharding_type"), w.str(sharding);
      w.setitems_from_mark();
    });
  };
  auto ok = dist("fully_reshardable", 3.0);
  REQUIRE(ok.ok());
  CHECK(ok->optimizers[0].group_step == 3.0);
  bool step_extra = false;
  for (const auto& [k, v] : ok->optimizers[0].groups[0].extras) step_extra |= k == "step";
  CHECK_FALSE(step_extra);
  // Megatron-Core up to 0.13: per-key items too (N-D flattened, ItemMeta::nd_shape)
  auto model_space = dist("fully_sharded_model_space", 3.0);
  REQUIRE_MESSAGE(model_space.ok(), model_space.status().message());
  CHECK(model_space->optimizers[0].sharding == "fully_sharded_model_space");
  // dp_reshardable: its groups are in each data-parallel group's own item (interpret_group_optimizer)
  auto flat = dist("dp_reshardable", 3.0);
  REQUIRE_MESSAGE(flat.ok(), flat.status().message());
  CHECK(flat->optimizers[0].sharding == "dp_reshardable");
  CHECK(flat->optimizers[0].groups.empty());
  // dp_zero_gather_scatter: the same, its buffers gathered flat per data-parallel group
  auto gathered = dist("dp_zero_gather_scatter", 3.0);
  REQUIRE_MESSAGE(gathered.ok(), gathered.status().message());
  CHECK(gathered->optimizers[0].sharding == "dp_zero_gather_scatter");
  CHECK(gathered->optimizers[0].groups.empty());
  auto fsdp = dist("fsdp_dtensor", 3.0);
  REQUIRE_FALSE(fsdp.ok());
  CHECK(fsdp.status().message().find("saved 'fsdp_dtensor'") != std::string::npos);
  auto steps = dist("fully_reshardable", 2.0);
  REQUIRE_FALSE(steps.ok());
  CHECK(steps.status().message().find("step 2") != std::string::npos);
}

TEST_CASE("megatron: dp_reshardable's per-group optimizer item: its groups and step, in a ShardedObject's list") {
  auto parse = [](bool listed, bool groups) -> Result<mg::Optimizer> {
    pickle::Writer w;
    if (listed) w.empty_list(), w.mark();
    w.empty_dict();
    w.mark();
    if (groups) {
      w.str("param_groups"), w.empty_list(), w.mark();
      group(w, 0.1, 1.0, [](pickle::Writer& w) { w.str("step"), w.real(5.0); });
      group(w, 0.0, 0.0, [](pickle::Writer& w) { w.str("step"), w.real(5.0); });
      w.appends_from_mark();
    }
    w.setitems_from_mark();
    if (listed) w.appends_from_mark();
    const std::string bytes = w.finish();
    OPTSTATE_ASSIGN_OR_RETURN(pickle::Pickle p, pickle::unpickle(std::as_bytes(std::span(bytes)), "item"));
    return mg::interpret_group_optimizer(p, "ck: item 'optimizer.distributed.dp_group_idx_0.optimizer'");
  };
  for (const bool listed : {true, false}) {
    auto o = parse(listed, true);
    REQUIRE_MESSAGE(o.ok(), o.status().message());
    CHECK(o->sharding == "dp_reshardable");
    CHECK(o->groups.size() == 2);
    CHECK(o->group_step == 5.0);
    CHECK(o->groups[1].wd_mult == 0);
  }
  auto none = parse(true, false);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message().find("dp_group_idx_0.optimizer'") != std::string::npos);
}

TEST_CASE("megatron: what is not AdamW's, or not there, is refused by name") {
  auto none = common([](pickle::Writer&) {}, false);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message().find("--no-save-optim") != std::string::npos);
  // NeMo 2's list of Lightning's optimizers: one read, more refused
  auto nemo = [](int n) {
    return common([=](pickle::Writer& w) {
      w.empty_list(), w.mark();
      for (int i = 0; i < n; ++i) plain(w, [](pickle::Writer& w) { group(w, 0.1, 1.0); });
      w.appends_from_mark();
    });
  };
  REQUIRE(nemo(1).ok());
  CHECK(nemo(1)->optimizers.size() == 1);
  auto two = nemo(2);
  REQUIRE_FALSE(two.ok());
  CHECK(two.status().message().find("a list of 2 optimizers") != std::string::npos);
  CHECK_FALSE(nemo(0).ok());
  auto l2 = common([](pickle::Writer& w) {
    plain(w, [](pickle::Writer& w) {
      group(w, 0.1, 1.0, {}, /*decoupled=*/false);
    });
  });
  REQUIRE_FALSE(l2.ok());
  CHECK(l2.status().message().find("Adam's L2 decay") != std::string::npos);
  auto sgd = common([](pickle::Writer& w) {
    plain(w, [](pickle::Writer& w) {  // Megatron's --optimizer sgd: torch.optim.SGD's group
      w.empty_dict(), w.mark();
      w.str("lr"), w.real(0.1), w.str("momentum"), w.real(0.9), w.str("dampening"), w.real(0);
      w.str("weight_decay"), w.real(0.1), w.str("nesterov"), w.boolean(false);
      w.setitems_from_mark();
    });
  });
  REQUIRE_FALSE(sgd.ok());
  CHECK(sgd.status().message().find("SGD") != std::string::npos);
  auto no_groups = common([](pickle::Writer& w) { plain(w, [](pickle::Writer&) {}); });
  CHECK_FALSE(no_groups.ok());
}

TEST_CASE("pickle: a dict that sets a key twice is refused (Python keeps the last, a reader might take the first)") {
  for (const bool text : {true, false}) {
    pickle::Writer w;
    w.empty_dict();
    w.mark();
    if (text) w.str("decoupled_weight_decay"), w.boolean(true), w.str("decoupled_weight_decay"), w.boolean(false);
    else w.integer(1), w.str("a"), w.boolean(true), w.str("b");  // True == 1 as a key
    w.setitems_from_mark();
    const std::string bytes = w.finish();
    auto p = pickle::unpickle(std::as_bytes(std::span(bytes)), "x.pkl");
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().message().find("twice") != std::string::npos);
  }
  pickle::Writer ok;
  ok.empty_dict(), ok.mark(), ok.str("a"), ok.integer(1), ok.str("b"), ok.integer(2), ok.setitems_from_mark();
  const std::string bytes = ok.finish();
  CHECK(pickle::unpickle(std::as_bytes(std::span(bytes)), "x.pkl").ok());
  // Across SETITEMS, small (scanned) and large (hashed, its earlier keys taken in when it grows):
  // `first` keys in one SETITEMS, `second` in the next, the last of them again key 0 if `dup`.
  auto built = [](int first, int second, bool dup) {
    pickle::Writer w;
    w.empty_dict();
    w.mark();
    for (int k = 0; k < first; ++k) w.str("key" + std::to_string(k)), w.integer(k);
    w.setitems_from_mark();
    w.mark();
    for (int k = first; k < first + second; ++k) w.str("key" + std::to_string(dup && k == first + second - 1 ? 0 : k)), w.integer(k);
    w.setitems_from_mark();
    const std::string b = w.finish();
    return pickle::unpickle(std::as_bytes(std::span(b)), "x.pkl");
  };
  for (const auto& sizes : std::vector<std::pair<int, int>>{{3, 2}, {10, 10}, {20, 5}, {2, 40}}) {
    const int first = sizes.first, second = sizes.second;  // copies: clang 14 cannot CAPTURE a binding
    CAPTURE(first);
    CAPTURE(second);
    const auto good = built(first, second, false);
    REQUIRE_MESSAGE(good.ok(), good.status().message());
    CHECK(good->at(good->root()).items.size() == static_cast<size_t>(2 * (first + second)));
    const auto bad = built(first, second, true);
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.status().message().find("sets key 'key0' twice") != std::string::npos);
  }
}

TEST_CASE("megatron: a chain of optimizers (MoE's experts under expert parallelism) by place") {
  auto chain = [](int second) {
    return common([=](pickle::Writer& w) {
      w.empty_dict(), w.mark();
      w.integer(0), plain(w, [](pickle::Writer& w) {
        group(w, 0.1, 1.0);
        group(w, 0.0, 0.0);
      });
      w.integer(second), plain(w, [](pickle::Writer& w) { group(w, 0.1, 1.0); });
      w.setitems_from_mark();
    });
  };
  auto ok = chain(1);
  REQUIRE(ok.ok());
  CHECK(ok->chained);
  REQUIRE(ok->optimizers.size() == 2);
  CHECK(ok->optimizers[0].groups.size() == 2);
  CHECK(ok->optimizers[1].groups.size() == 1);
  CHECK_FALSE(ok->avoid_prefix);
  // unprefixed items: the experts' optimizer is the one whose groups are is_expert_parallel
  ok->optimizers[1].groups[0].expert_parallel = true;
  CHECK_FALSE(mg::unprefixed_chain(*ok, "decoder.layers.mlp.linear_fc1.weight").value_or(9) == 9);
  CHECK(mg::unprefixed_chain(*ok, "decoder.layers.mlp.experts.experts.linear_fc1.weight") == 1u);
  CHECK(mg::unprefixed_chain(*ok, "decoder.layers.mlp.shared_experts.linear_fc1.weight") == 0u);
  CHECK(mg::unprefixed_chain(*ok, "decoder.layers.mlp.router.weight") == 0u);
  ok->optimizers[0].groups[0].expert_parallel = true;  // no dense optimizer: not told
  CHECK_FALSE(mg::unprefixed_chain(*ok, "decoder.layers.mlp.router.weight"));
  auto gap = chain(2);
  REQUIRE_FALSE(gap.ok());
  CHECK(gap.status().message().find("is not 1") != std::string::npos);
}

namespace {

// An N-D flattened item (Megatron-Core <= 0.13's fully_sharded_model_space) of a tensor of shape
// `nd`, cut in `cuts` chunks per axis, with DCP chunks (box index..., start) of (1..., count).
dcp::ItemMeta nd_item(std::vector<int64_t> nd, std::vector<int64_t> cuts,
                      std::vector<std::pair<std::vector<int64_t>, int64_t>> chunks) {
  dcp::ItemMeta im;
  im.is_tensor = true;
  im.size = cuts;
  int64_t box = 1;
  for (size_t d = 0; d < nd.size(); ++d) box *= nd[d] / cuts[d];
  im.size.push_back(box);
  for (auto& [offsets, count] : chunks) {
    std::vector<int64_t> sizes(nd.size(), 1);
    sizes.push_back(count);
    im.chunks.push_back({offsets, sizes});
  }
  im.nd_shape = std::move(nd);
  return im;
}

std::vector<std::array<int64_t, 3>> segments_of(const dcp::ItemMeta& im, size_t chunk) {
  dcp::RunList runs;
  REQUIRE(dcp::item_segments(im, chunk, runs, "item").ok());
  std::vector<std::array<int64_t, 3>> out;
  for (const dcp::Runs& g : runs.groups())
    for (int64_t r = 0; r < g.rows; ++r) {
      const dcp::Segment s = g.run(r);
      CHECK(s.chunk == chunk);
      out.push_back({s.begin, s.count, s.local});
    }
  return out;
}

}  // namespace

TEST_CASE("megatron: an N-D flattened item's chunks are runs of its tensor's elements") {
  using Runs = std::vector<std::array<int64_t, 3>>;  // {begin, count, local}
  // 3 stacked layers of [64, 16], not tensor-parallel: layer 1's box split between two
  // data-parallel ranks at element 640; a box spans whole rows, so each range is one run
  const auto dp = nd_item({3, 64, 16}, {3, 1, 1}, {{{1, 0, 0, 0}, 640}, {{1, 0, 0, 640}, 384}, {{0, 0, 0, 0}, 1024}});
  CHECK(segments_of(dp, 0) == Runs{{1024, 640, 0}});
  CHECK(segments_of(dp, 1) == Runs{{1024 + 640, 384, 0}});
  CHECK(segments_of(dp, 2) == Runs{{0, 1024, 0}});
  // row-parallel [2, 32, 8] (columns cut in two: boxes of [1, 32, 4]): layer 0's second box,
  // elements [8, 18) = rows 2, 3 and half of row 4, at columns 4.. of the tensor
  const auto tp = nd_item({2, 32, 8}, {2, 1, 2}, {{{0, 0, 1, 8}, 10}, {{1, 0, 0, 0}, 128}});
  CHECK(segments_of(tp, 0) == Runs{{2 * 8 + 4, 4, 0}, {3 * 8 + 4, 4, 4}, {4 * 8 + 4, 2, 8}});
  const auto whole = segments_of(tp, 1);  // layer 1's first box: 32 rows of 4
  REQUIRE(whole.size() == 32);
  CHECK(whole[0] == std::array<int64_t, 3>{256, 4, 0});
  CHECK(whole[31] == std::array<int64_t, 3>{256 + 31 * 8, 4, 124});
  // column-parallel [2, 32, 8] (rows cut in two): a box of [1, 16, 8] is consecutive
  const auto col = nd_item({2, 32, 8}, {2, 2, 1}, {{{1, 1, 0, 5}, 100}});
  CHECK(segments_of(col, 0) == Runs{{256 + 128 + 5, 100, 0}});
  // a scalar, and a range that is empty
  CHECK(segments_of(nd_item({}, {}, {{{0}, 1}}), 0) == Runs{{0, 1, 0}});
  CHECK(segments_of(nd_item({4, 4}, {1, 1}, {{{0, 0, 3}, 0}}), 0).empty());
}

TEST_CASE("megatron: an N-D flattened item that cannot be its tensor's is refused, naming both shapes") {
  auto refused = [](const dcp::ItemMeta& im, const std::vector<int64_t>& nd, const char* why) {
    const auto st = dcp::check_nd_flattened(im, nd, "ck: item 'k'");
    REQUIRE_FALSE(st.ok());
    CHECK_MESSAGE(st.message().find(why) != std::string::npos, st.message());
    CHECK(st.message().find("ck: item 'k'") != std::string::npos);
  };
  const auto good = nd_item({3, 64, 16}, {3, 1, 1}, {{{1, 0, 0, 640}, 384}});
  CHECK(dcp::check_nd_flattened(good, {3, 64, 16}, "k").ok());
  refused(good, {3, 64}, "not one axis more");
  refused(good, {3, 64, 15}, "a chunk of that shape holds 960 elements");
  refused(good, {4, 64, 16}, "axis 0 is not cut in equal chunks");
  refused(good, {3, 0, 16}, "an empty or oversized tensor");
  refused(good, {3, int64_t{1} << 40, int64_t{1} << 40}, "an empty or oversized tensor");
  auto spanning = good;
  spanning.chunks[0].sizes = {2, 1, 1, 384};
  refused(spanning, {3, 64, 16}, "spans several chunk boxes");
  auto zero_cut = good;
  zero_cut.size[1] = 0;
  refused(zero_cut, {3, 64, 16}, "axis 1 is not cut in equal chunks");
}

TEST_CASE("megatron: stacked axes of an N-D flattened item are those its chunk boxes are one wide on") {
  CHECK(mg::stacked_axes(nd_item({3, 64, 16}, {3, 1, 1}, {{{0, 0, 0, 0}, 1024}})) == 1);
  CHECK(mg::standard_no_decay("decoder.layers.mlp.linear_fc1.layer_norm_weight",
                              nd_item({3, 16}, {3, 1}, {{{0, 0, 0}, 16}})));
  CHECK_FALSE(mg::standard_no_decay("decoder.layers.mlp.linear_fc1.weight",
                                    nd_item({3, 64, 16}, {3, 2, 1}, {{{0, 0, 0, 0}, 512}})));
  CHECK_FALSE(mg::standard_no_decay("embedding.word_embeddings.weight", nd_item({16, 16}, {2, 1}, {{{0, 0, 0}, 128}})));
}

TEST_CASE("megatron: integrity.json lists plain file names with 64-hex-digit SHA-256 digests, once each") {
  const std::string d(64, 'a');
  auto parse = [](const std::string& text) { return mg::parse_integrity_manifest(text, "ck/integrity.json"); };
  auto ok = parse(R"({"algorithm": "sha256", "files": {".metadata": ")" + d + R"(", "__0_0.distcp": ")" + d + R"("}})");
  REQUIRE(ok.ok());
  CHECK(ok->size() == 2);
  CHECK(parse(R"({"files": {}})").ok());  // Megatron's default algorithm
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"[]", "not a JSON object"},
      {R"({"files": {"a": ")" + d + R"("}, "files": {}})", "key 'files' twice"},
      {R"({"files": {"a": ")" + d + R"(", "a": ")" + d + R"("}})", "key 'a' twice"},
      {R"({"algorithm": "md5", "files": {}})", "digests by 'md5'"},
      {R"({"algorithm": 1, "files": {}})", "digests by '1'"},
      {R"({"files": []})", "no 'files' object"},
      {R"({"files": {"sub/a": ")" + d + R"("}})", "'sub/a' is not a file name"},
      {R"({"files": {"..": ")" + d + R"("}})", "'..' is not a file name"},
      {R"({"files": {"integrity.json": ")" + d + R"("}})", "'integrity.json' is not a file name"},
      {R"({"files": {"a": ")" + std::string(64, 'A') + R"("}})", "not 64 lowercase hex digits"},
      {R"({"files": {"a": ")" + std::string(63, 'a') + R"("}})", "not 64 lowercase hex digits"},
      {R"({"files": {"a": 7}})", "not 64 lowercase hex digits"},
  };
  for (const auto& [text, why] : refused) {
    auto r = parse(text);
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.status().message().find(why) != std::string::npos, r.status().message());
    CHECK(r.status().message().starts_with("ck/integrity.json"));
  }
}

// The fuzz targets' signer for a DCP data file (torchsave_fuzz_sign.h): each torch.save record
// re-signed, so a change inside one (here the common_state item's pickle, 20 KB in, after other
// records) reaches the reader instead of failing its CRC-32.
TEST_CASE("fuzz signer: every record of a DCP data file is re-signed, so a changed pickle reaches the reader") {
  const std::filesystem::path src =
      std::filesystem::path(OPTSTATE_SOURCE_DIR) / "tests/data/writers/megatron-core-0.19.0_torch-2.13.0/tp2";
  const std::string data = testing::read_file(src / "__0_0.distcp");
  REQUIRE(data.size() > 100000);
  size_t eocds = 0;
  for (size_t at = data.find("PK\x05\x06"); at != std::string::npos; at = data.find("PK\x05\x06", at + 4)) ++eocds;
  std::string same = data;
  CHECK(torchsave::resign_records(same) == eocds);  // every record parsed (each ends in ZIP64's records)
  CHECK(same == data);                               // and was signed right already

  testing::TempDir dir;
  std::filesystem::copy(src, dir.path / "ck");
  const size_t at = data.find("num_layers");
  REQUIRE(at != std::string::npos);
  std::string changed = data;
  changed[at + 9] = 'z';  // a trainer argument's name in the common state: num_layerz
  const auto validate = [&](const std::string& bytes) -> std::string {
    testing::write_file(dir.path / "ck" / "__0_0.distcp", bytes);
    auto v = validate_checkpoint(dir.path / "ck", [](const std::filesystem::path& p) { return open_checkpoint(p); });
    return v.ok() ? (v->ok() ? "" : v->findings.front().message) : v.status().message();
  };
  CHECK(validate(changed).find("CRC-32") != std::string::npos);
  const auto signed_ = torchsave::with_record_crcs(changed);
  REQUIRE(signed_);
  CHECK(validate(*signed_) == "");
  CHECK(validate(data) == "");
}
