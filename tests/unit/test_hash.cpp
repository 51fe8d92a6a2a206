#include <doctest/doctest.h>
#include <xxhash.h>

#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "optstate/diff.h"
#include "optstate/hash.h"
#include "optstate/sha256.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;

namespace {
std::string xxh128_hex(const std::string& bytes) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(bytes.data(), bytes.size()));
  std::string out;
  for (unsigned char b : c.digest) out += fmt::format("{:02x}", b);
  return out;
}
std::string bytes_of(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}
OptimizerState one_param_state() {
  OptimizerState s;
  ParamGroup g;
  g.params = {"w"};
  s.groups = {g};
  ParamState ps;
  ps.shape = {2};
  ps.step = 3;
  Entry m, v;
  m.values = testing::f32_buffer({1.0f, -2.0f});
  v.values = testing::f32_buffer({0.25f, 4.0f});
  ps.entries = {{kExpAvg, m}, {kExpAvgSq, v}};
  s.params = {{"w", ps}};
  return s;
}
}  // namespace

TEST_CASE("hash follows the byte-level definition in docs/hash.md") {
  const OptimizerState s = one_param_state();
  auto h = hash_state(s);
  REQUIRE(h.ok());
  const std::string hyper =
      "lr:3f50624dd2f1a9fc,beta1:3feccccccccccccd,beta2:3feff7ced916872b,eps:3e45798ee2308c3a,"
      "weight_decay:3f847ae147ae147b,amsgrad:0,maximize:0";
  CHECK(hyper_string(s.groups[0].hyper) == hyper);
  const std::string m_pre = "optstate-entry-v1\nname=w.exp_avg\nshape=2\nstep=3\nhyper=" + hyper +
                            "\nencoding=dense,dtype=f32\n\n" + bytes_of({1.0f, -2.0f});
  const std::string v_pre = "optstate-entry-v1\nname=w.exp_avg_sq\nshape=2\nstep=3\nhyper=" + hyper +
                            "\nencoding=dense,dtype=f32\n\n" + bytes_of({0.25f, 4.0f});
  CHECK(h->entries.at("w.exp_avg") == xxh128_hex(m_pre));
  CHECK(h->entries.at("w.exp_avg_sq") == xxh128_hex(v_pre));
  const std::string root_pre = "optstate-root-v1\nmode=raw\nkind=adamw\nparam w shape=2 dtype=f32 step=3 hyper=" +
                               hyper + "\n" + h->entries.at("w.exp_avg") + "  w.exp_avg\n" +
                               h->entries.at("w.exp_avg_sq") + "  w.exp_avg_sq\n";
  CHECK(h->root == xxh128_hex(root_pre));
  // The published test vectors (docs/hash.md); a change here is a format change.
  CHECK(h->entries.at("w.exp_avg") == "2420549cc6a0a91dc90f7c6528c0856b");
  CHECK(h->entries.at("w.exp_avg_sq") == "abb64f37030c1e374c9800902d496055");
  CHECK(h->root == "d973e5b32f0965e7d9578d5d3a5e2d2b");
}

TEST_CASE("hash of selected params: their entries, and the root a state of only them has") {
  const OptimizerState base = testing::sample_state();
  HashOptions weights;
  weights.params = [](const std::string& fqn) { return fqn == "layers.0.weight"; };
  auto selected = hash_state(base, weights);
  auto all = hash_state(base);
  REQUIRE(selected.ok());
  REQUIRE(all.ok());
  CHECK(selected->entries.size() == 3);
  for (const auto& entry : selected->entries) {
    const std::string key = entry.first;  // CAPTURE names a copy, not a structured binding (clang 14)
    CAPTURE(key);
    CHECK(key.rfind("layers.0.weight.", 0) == 0);
    CHECK(all->entries.at(key) == entry.second);
  }
  CHECK(selected->root != all->root);
  OptimizerState only = base;
  only.params.erase("layers.0.bias");
  only.groups.resize(1);
  auto alone = hash_state(only);
  REQUIRE(alone.ok());
  CHECK(selected->root == alone->root);
  weights.values = true;
  auto selected_values = hash_state(base, weights);
  auto alone_values = hash_state(only, {.values = true});
  REQUIRE(selected_values.ok());
  REQUIRE(alone_values.ok());
  CHECK(selected_values->root == alone_values->root);
  // Nothing selected: no entries, and the root of no params.
  HashOptions none;
  none.params = [](const std::string&) { return false; };
  auto empty = hash_state(base, none);
  REQUIRE(empty.ok());
  CHECK(empty->entries.empty());
}

TEST_CASE("every change of value, shape, name, step or hyperparameter changes the hash it touches") {
  const OptimizerState base = testing::sample_state();
  auto h0 = hash_state(base);
  REQUIRE(h0.ok());
  auto changed = [&](const OptimizerState& s) {
    auto h = hash_state(s);
    REQUIRE(h.ok());
    return *h;
  };
  SUBCASE("one value bit") {
    OptimizerState s = base;
    std::vector<std::byte> bytes(s.params["layers.0.bias"].entries[kExpAvgSq].values.span().begin(),
                                 s.params["layers.0.bias"].entries[kExpAvgSq].values.span().end());
    bytes[5] ^= std::byte{0x01};
    s.params["layers.0.bias"].entries[kExpAvgSq].values = Buffer::take(bytes);
    auto h = changed(s);
    CHECK(h.root != h0->root);
    CHECK(h.entries["layers.0.bias.exp_avg_sq"] != h0->entries["layers.0.bias.exp_avg_sq"]);
    CHECK(h.entries["layers.0.bias.exp_avg"] == h0->entries["layers.0.bias.exp_avg"]);
  }
  SUBCASE("step") {
    OptimizerState s = base;
    s.params["layers.0.bias"].step = 6;
    auto h = changed(s);
    CHECK(h.root != h0->root);
    CHECK(h.entries["layers.0.bias.exp_avg"] != h0->entries["layers.0.bias.exp_avg"]);
    CHECK(h.entries["layers.0.weight.exp_avg"] == h0->entries["layers.0.weight.exp_avg"]);
  }
  SUBCASE("hyperparameter") {
    OptimizerState s = base;
    s.groups[1].hyper.lr = 2e-3;
    auto h = changed(s);
    CHECK(h.root != h0->root);
    CHECK(h.entries["layers.0.bias.exp_avg"] != h0->entries["layers.0.bias.exp_avg"]);
    CHECK(h.entries["layers.0.weight.exp_avg"] == h0->entries["layers.0.weight.exp_avg"]);
  }
  SUBCASE("shape with the same bytes") {
    OptimizerState s = base;
    s.params["layers.0.weight"].shape = {3, 2};
    auto h = changed(s);
    CHECK(h.root != h0->root);
    CHECK(h.entries["layers.0.weight.exp_avg"] != h0->entries["layers.0.weight.exp_avg"]);
  }
  SUBCASE("name") {
    OptimizerState s = base;
    auto node = s.params.extract("layers.0.bias");
    node.key() = "layers.1.bias";
    s.params.insert(std::move(node));
    s.groups[1].params = {"layers.1.bias"};
    auto h = changed(s);
    CHECK(h.root != h0->root);
    CHECK(h.entries.count("layers.1.bias.exp_avg") == 1);
  }
  SUBCASE("encoding dtype with equal values hashes equal only with --values") {
    OptimizerState s = base;
    Entry& p = s.params["layers.0.weight"].entries[kParam];
    std::vector<float> widened;
    for (size_t i = 0; i < p.values.size / 2; ++i) {
      uint16_t h;
      std::memcpy(&h, p.values.data + 2 * i, 2);
      widened.push_back(bf16_to_f32(h));
    }
    p.dtype = DType::kF32;
    p.values = testing::f32_buffer(widened);
    auto raw = changed(s);
    CHECK(raw.entries["layers.0.weight.param"] != h0->entries["layers.0.weight.param"]);
    auto v0 = hash_state(base, {.values = true});
    auto v1 = hash_state(s, {.values = true});
    REQUIRE(v0.ok());
    REQUIRE(v1.ok());
    CHECK(v0->root == v1->root);
  }
}

TEST_CASE("hash is the same after a native round trip and independent of stream piece size") {
  testing::TempDir dir;
  const OptimizerState s = testing::sample_state();
  REQUIRE(find_format("native")->write(s, dir.path / "ckpt", {}).ok());
  auto reader = open_checkpoint(dir.path / "ckpt");
  REQUIRE(reader.ok());
  auto from_disk = hash_checkpoint(**reader);
  auto in_memory = hash_state(s);
  REQUIRE(from_disk.ok());
  REQUIRE(in_memory.ok());
  CHECK(from_disk->root == in_memory->root);
  CHECK(from_disk->entries == in_memory->entries);
}

TEST_CASE("verify_resume names the entries that differ from the checkpoint") {
  testing::TempDir dir;
  const OptimizerState s = testing::sample_state();
  REQUIRE(find_format("native")->write(s, dir.path / "c", {}).ok());
  auto reader = open_checkpoint(dir.path / "c");
  REQUIRE(reader.ok());
  auto same = verify_resume(s, **reader);
  REQUIRE(same.ok());
  CHECK(same->ok());
  OptimizerState changed = s;
  changed.params["layers.0.bias"].entries[kExpAvg].values = testing::f32_buffer({1.0f, 2.0f, 3.5f});
  changed.params["layers.0.bias"].entries.erase(kExpAvgSq);
  auto diff = verify_resume(changed, **reader);
  REQUIRE(diff.ok());
  REQUIRE(diff->differences.size() == 2);
  CHECK(diff->differences[0].find("layers.0.bias.exp_avg' differs") != std::string::npos);
  CHECK(diff->differences[1].find("layers.0.bias.exp_avg_sq' is in") != std::string::npos);
  OptimizerState hyper = s;
  hyper.groups[0].hyper.lr = 0.5;
  CHECK(!verify_resume(hyper, **reader)->ok());
}

TEST_CASE("diff by position: the k-th param in group order, a numbered side by its numbers") {
  const OptimizerState named = testing::sample_state();
  const FormatDriver* lt = find_format("libtorch");
  REQUIRE(lt);
  // what a LibTorch archive keeps of it: numbered, no weights
  const OptimizerState numbered = lt->kept(named);
  auto a = memory_reader(named), b = memory_reader(numbered);
  auto by_name = diff_checkpoints(*a, *b, {});
  REQUIRE(by_name.ok());
  CHECK(!by_name->ok());
  // no name in common: the report says which side is numbered and points at --by-position
  CHECK(by_name->hint.find("B's params are numbered") != std::string::npos);
  CHECK(by_name->hint.find("--by-position") != std::string::npos);
  auto by_position = diff_checkpoints(*a, *b, {.by_position = true, .no_weights = true});
  REQUIRE(by_position.ok());
  CHECK_MESSAGE(by_position->ok(), fmt::format("{}", fmt::join(by_position->metadata, "; ")));
  CHECK(by_position->hint.empty());
  auto self = diff_checkpoints(*a, *a, {});
  REQUIRE(self.ok());
  CHECK(self->hint.empty());
  std::vector<std::string> order;
  for (const ParamGroup& g : named.groups) order.insert(order.end(), g.params.begin(), g.params.end());
  CHECK(by_position->entries.front().key.rfind(order.front() + "=0.", 0) == 0);
  // weights count unless left out
  auto with_weights = diff_checkpoints(*a, *b, {.by_position = true});
  REQUIRE(with_weights.ok());
  CHECK(!with_weights->ok());
  // a numbered side's gap (a param it left out) does not shift the others: drop "0" from B
  OptimizerState gap = numbered;
  gap.params.erase("0");
  for (ParamGroup& g : gap.groups) std::erase(g.params, "0");
  auto c = memory_reader(gap);
  auto shifted = diff_checkpoints(*a, *c, {.by_position = true, .no_weights = true});
  REQUIRE(shifted.ok());
  REQUIRE(shifted->metadata.size() == 1);
  CHECK(shifted->metadata[0] == fmt::format("param '{}' only in A (by position)", order.front()));
  for (const EntryDiff& e : shifted->entries) CHECK(e.ok());
}

TEST_CASE("diff: hyperparameters within rtol (an lr torchao keeps as float32), never within atol") {
  const OptimizerState s = testing::sample_state();
  OptimizerState f32 = s;
  for (ParamGroup& g : f32.groups) g.hyper.lr = static_cast<double>(static_cast<float>(g.hyper.lr));
  REQUIRE(f32.groups[0].hyper.lr != s.groups[0].hyper.lr);
  auto a = memory_reader(s), b = memory_reader(f32);
  auto exact = diff_checkpoints(*a, *b, {});
  REQUIRE(exact.ok());
  CHECK(!exact->ok());
  REQUIRE(!exact->metadata.empty());
  CHECK(exact->metadata[0].find("hyperparameters of") != std::string::npos);
  CHECK(diff_checkpoints(*a, *b, {.rtol = 1e-7})->ok());
  CHECK(!diff_checkpoints(*a, *b, {.atol = 1.0})->ok());  // atol is for values only
  OptimizerState other = s;
  other.groups[0].hyper.amsgrad = !other.groups[0].hyper.amsgrad;
  CHECK(!diff_checkpoints(*a, *memory_reader(other), {.rtol = 1.0})->ok());  // flags exactly
}

TEST_CASE("sha256: FIPS 180-4's test vectors, whole or in pieces of any size, by SHA-NI and the portable rounds") {
  using Impl = optstate::Sha256::Impl;
  std::vector<Impl> impls{Impl::kPortable};
  if (optstate::Sha256::sha_ni_available()) impls.push_back(Impl::kBest);
  MESSAGE(std::string(optstate::Sha256::sha_ni_available() ? "SHA-NI available: both paths checked"
                                                            : "no SHA-NI on this CPU: the portable rounds only"));
  for (const Impl impl : impls) {
    auto hex = [&](std::string_view s) {
      optstate::Sha256 h(impl);
      h.update(std::as_bytes(std::span(s.data(), s.size())));
      return h.finish_hex();
    };
    CHECK(hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // padding spills
    CHECK(hex(two_blocks) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    const std::string million(1000000, 'a');
    CHECK(hex(million) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    for (const size_t piece : {1, 7, 63, 64, 65, 4096}) {
      optstate::Sha256 h(impl);
      for (size_t at = 0; at < million.size(); at += piece) {
        const size_t n = std::min(piece, million.size() - at);
        h.update(std::as_bytes(std::span(million.data() + at, n)));
      }
      CHECK(h.finish_hex() == hex(million));
    }
  }
  // both paths agree on every length around the block and padding boundaries
  std::string bytes;
  for (int i = 0; i < 300; ++i) bytes += static_cast<char>(i * 131 + 7);
  for (size_t n = 0; n <= bytes.size(); ++n) {
    const auto span = std::as_bytes(std::span(bytes.data(), n));
    optstate::Sha256 portable(Impl::kPortable), best;
    portable.update(span), best.update(span);
    CHECK(portable.finish_hex() == best.finish_hex());
  }
}
