#include <doctest/doctest.h>

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "optstate/json_strict.h"
#include "native/native_manifest.h"
#include "optstate/hash.h"
#include "optstate/io.h"
#include "optstate/transform.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;
namespace fs = std::filesystem;

namespace {

const FormatDriver& native_driver() { return *find_format("native"); }

fs::path write_sample(const testing::TempDir& dir) {
  const fs::path p = dir.path / "ckpt";
  REQUIRE(native_driver().write(testing::sample_state(), p, {}).ok());
  return p;
}

using testing::read_file;
using testing::write_file;

// Re-signs an edited manifest, so the test reaches the check behind the manifest checksum.
void rewrite_manifest(const fs::path& ckpt, const std::function<void(nlohmann::json&)>& edit) {
  auto j = nlohmann::json::parse(read_file(ckpt / "manifest.json"));
  edit(j);
  j.erase("manifest_xxh3");
  const std::string body = j.dump();
  j["manifest_xxh3"] = xxh3_64_hex(std::as_bytes(std::span(body)));
  write_file(ckpt / "manifest.json", j.dump(1));
}

Status open_and_read_all(const fs::path& p) {
  auto r = open_checkpoint(p);
  if (!r.ok()) return r.status();
  auto s = load_all(**r);
  return s.status();
}

}  // namespace

TEST_CASE("native checkpoint round-trips the canonical state exactly") {
  testing::TempDir dir;
  const fs::path p = write_sample(dir);
  CHECK(native_driver().sniff(p));
  auto r = open_checkpoint(p);
  REQUIRE(r.ok());
  CHECK((*r)->format() == "native");
  auto loaded = load_all(**r);
  REQUIRE(loaded.ok());
  const OptimizerState want = testing::sample_state();
  CHECK(loaded->kind == want.kind);
  REQUIRE(loaded->groups.size() == 2);
  CHECK(loaded->groups[0].hyper == want.groups[0].hyper);
  CHECK(loaded->groups[1].params == want.groups[1].params);
  for (const auto& [fqn, ps] : want.params) {
    const ParamState& got = loaded->params.at(fqn);
    CHECK(got.shape == ps.shape);
    CHECK(got.step == ps.step);
    CHECK(got.param_dtype == ps.param_dtype);
    for (const auto& [name, e] : ps.entries) {
      const Entry& ge = got.entries.at(name);
      CHECK(ge.dtype == e.dtype);
      REQUIRE(ge.values.size == e.values.size);
      CHECK(std::memcmp(ge.values.data, e.values.data, e.values.size) == 0);
    }
  }
  // Nothing is left beside the checkpoint: the staging directory was renamed into place.
  int entries = 0;
  for (auto& _ : fs::directory_iterator(dir.path)) ++entries, (void)_;
  CHECK(entries == 1);
}

TEST_CASE("native writer refuses to replace a checkpoint unless asked, and replaces it atomically") {
  testing::TempDir dir;
  const fs::path p = write_sample(dir);
  Status st = native_driver().write(testing::sample_state(), p, {});
  CHECK(st.code() == ErrorCode::kInvalidArgument);
  OptimizerState changed = testing::sample_state();
  changed.params["layers.0.bias"].step = 9;
  changed.params["layers.0.weight"].step = 9;
  REQUIRE(native_driver().write(changed, p, {.overwrite = true}).ok());
  auto r = open_checkpoint(p);
  REQUIRE(r.ok());
  CHECK((*r)->meta().params.at("layers.0.bias").step == 9);
}

TEST_CASE("a failed write leaves no output") {
  testing::TempDir dir;
  OptimizerState bad = testing::sample_state();
  bad.params["layers.0.bias"].entries[kExpAvg].values = testing::f32_buffer({1.0f});  // wrong size
  CHECK(!native_driver().write(bad, dir.path / "ckpt", {}).ok());
  CHECK(fs::is_empty(dir.path));
  CHECK(!native_driver().write(testing::sample_state(), dir.path / "no" / "such" / "parent", {}).ok());
  CHECK(fs::is_empty(dir.path));
}

TEST_CASE("hostile native checkpoints give errors that name the file, never a crash") {
  testing::TempDir dir;
  const fs::path p = write_sample(dir);
  const fs::path data = p / "data" / "rank-00000.bin";
  const fs::path manifest = p / "manifest.json";

  SUBCASE("truncated data file") {
    fs::resize_file(data, fs::file_size(data) - 7);
    Status st = open_and_read_all(p);
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message().find(data.string()) != std::string::npos);
  }
  SUBCASE("missing data file") {
    fs::remove(data);
    Status st = open_and_read_all(p);
    CHECK(!st.ok());
    CHECK(st.message().find("rank-00000.bin") != std::string::npos);
  }
  SUBCASE("one flipped data bit is caught by the chunk checksum") {
    std::string bytes = read_file(data);
    bytes[bytes.size() - 3] ^= 0x10;
    write_file(data, bytes);
    Status st = open_and_read_all(p);
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message().find("checksum mismatch") != std::string::npos);
    CHECK(st.message().find(data.string()) != std::string::npos);
  }
  SUBCASE("one flipped manifest byte") {
    std::string text = read_file(manifest);
    const auto at = text.find("\"step\": 5");
    REQUIRE(at != std::string::npos);
    text[at + 8] = '7';
    write_file(manifest, text);
    Status st = open_and_read_all(p);
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message().find("manifest.json") != std::string::npos);
  }
  SUBCASE("newer manifest version") {
    rewrite_manifest(p, [](nlohmann::json& j) { j["version"] = 99; });
    Status st = open_and_read_all(p);
    CHECK(st.code() == ErrorCode::kUnsupported);
    CHECK(st.message().find("version 99") != std::string::npos);
  }
  SUBCASE("wrong chunk checksum in the manifest") {
    rewrite_manifest(p, [](nlohmann::json& j) {
      j["params"]["layers.0.bias"]["entries"]["exp_avg"]["components"]["values"][0]["xxh3"] = "0123456789abcdef";
    });
    Status st = open_and_read_all(p);
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message().find("layers.0.bias.exp_avg") != std::string::npos);
  }
  SUBCASE("path escaping the checkpoint") {
    rewrite_manifest(p, [](nlohmann::json& j) { j["files"][0]["path"] = "../../etc/passwd"; });
    Status st = open_and_read_all(p);
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message().find("leaves the checkpoint") != std::string::npos);
  }
  SUBCASE("a data file listed twice") {
    rewrite_manifest(p, [](nlohmann::json& j) { j["files"].push_back(j["files"][0]); });
    const Status st = open_and_read_all(p);
    CHECK(st.code() == ErrorCode::kCorrupt);
    CHECK(st.message() == manifest.string() + ": files[1]: 'data/rank-00000.bin' listed twice");
  }
  SUBCASE("declared file size lies") {
    rewrite_manifest(p, [](nlohmann::json& j) { j["files"][0]["size"] = uint64_t{1} << 50; });
    CHECK(open_and_read_all(p).code() == ErrorCode::kCorrupt);
  }
  SUBCASE("uncovered range") {
    rewrite_manifest(p, [](nlohmann::json& j) {
      j["params"]["layers.0.bias"]["entries"]["exp_avg"]["components"]["values"][0]["end"] = 2;
    });
    Status st = open_and_read_all(p);
    CHECK(st.message().find("not covered") != std::string::npos);
  }
  SUBCASE("doubly covered range") {
    rewrite_manifest(p, [](nlohmann::json& j) {
      auto& list = j["params"]["layers.0.bias"]["entries"]["exp_avg"]["components"]["values"];
      list.push_back(list[0]);
    });
    Status st = open_and_read_all(p);
    CHECK(st.message().find("covered twice") != std::string::npos);
  }
  SUBCASE("chunk beyond the end of its file") {
    rewrite_manifest(p, [](nlohmann::json& j) {
      j["params"]["layers.0.bias"]["entries"]["exp_avg"]["components"]["values"][0]["offset"] = 1 << 30;
    });
    CHECK(open_and_read_all(p).message().find("outside") != std::string::npos);
  }
  SUBCASE("huge shape") {
    rewrite_manifest(p, [](nlohmann::json& j) { j["params"]["layers.0.bias"]["shape"] = {1LL << 40, 1LL << 40}; });
    CHECK(open_and_read_all(p).code() == ErrorCode::kCorrupt);
  }
  SUBCASE("not JSON") {
    write_file(manifest, "{\"format\": ");
    CHECK(open_and_read_all(p).code() == ErrorCode::kCorrupt);
  }
  SUBCASE("wrong types") {
    rewrite_manifest(p, [](nlohmann::json& j) { j["params"]["layers.0.bias"]["step"] = "five"; });
    CHECK(open_and_read_all(p).message().find("'step'") != std::string::npos);
  }
}

TEST_CASE("manifest parsing is a pure function of bytes") {
  const std::string junk = "\x00\x01garbage";
  auto m = native::parse_manifest(std::as_bytes(std::span(junk)), "/x");
  CHECK(!m.ok());
  // An object with a key twice, at any depth, is refused before any field is read.
  const std::string twice = R"({"format": "optstate", "x": {"a": 1, "b": {"c": 1}, "a": 2}})";
  m = native::parse_manifest(std::as_bytes(std::span(twice)), "/x");
  CHECK(m.status().message() == "/x/manifest.json: an object names 'a' twice");
  // The same key in different objects is no duplicate.
  const std::string apart = R"({"x": {"a": 1}, "y": {"a": 2}, "z": [{"a": 1}, {"a": 2}]})";
  m = native::parse_manifest(std::as_bytes(std::span(apart)), "/x");
  CHECK(m.status().message().find("twice") == std::string::npos);
}

TEST_CASE("parse_json_strict reads what nlohmann's parser reads, and finds a key given twice") {
  // Every kind of value, nesting, escapes, numbers of each kind, and an object of 3,000 keys (the
  // shape of a manifest's params: the document must come back whole, in order of keys).
  std::string many = "{";
  for (int i = 0; i < 3000; ++i) many += fmt::format("{}\"p{}\": {{\"step\": {}, \"e\": [1, 2.5, -3]}}", i ? ", " : "", i, i);
  many += "}";
  const std::vector<std::string> docs = {
      R"({"a": null, "b": true, "c": false, "d": -12, "e": 18446744073709551615, "f": 1.5e-300, "g": "x\"\u00e9"})",
      R"([[], {}, [{}], {"a": [[{"b": []}]]}, "s", 0])", R"("just a string")", "42", many};
  for (const std::string& doc : docs) {
    std::optional<std::string> twice;
    std::string refused = "stale";
    const nlohmann::json strict = parse_json_strict(doc.data(), doc.data() + doc.size(), twice, refused);
    CHECK(!twice);
    CHECK(refused.empty());
    CHECK(strict == nlohmann::json::parse(doc));
    CHECK(strict.dump() == nlohmann::json::parse(doc).dump());
  }
  // Not one JSON document: discarded, as nlohmann's parser discards it.
  for (const std::string bad : {"", "{", "{\"a\": 1,}", "[1 2]", "{\"a\": 1} x", "{\"a\" 1}", "nul", "\"\\x\""}) {
    std::optional<std::string> twice;
    std::string refused = "stale";
    CHECK_MESSAGE(parse_json_strict(bad.data(), bad.data() + bad.size(), twice, refused).is_discarded(), bad);
    CHECK(refused.empty());
  }
  // The first key given twice in one object, at any depth; the same key in other objects is none.
  auto duplicate = [](const std::string& doc) {
    std::optional<std::string> twice;
    std::string refused;
    parse_json_strict(doc.data(), doc.data() + doc.size(), twice, refused);
    return twice.value_or("");
  };
  CHECK(duplicate(R"({"a": 1, "a": 2})") == "a");
  CHECK(duplicate(R"([{"x": {"y": [{"k": 1, "j": 2, "k": 3}]}}])") == "k");
  CHECK(duplicate(R"({"b": {"a": 1, "a": 2}, "b": 3})") == "a");
  CHECK(duplicate(R"({"a": {"a": {"a": 1}}, "b": [{"a": 1}, {"a": 2}]})") == "");
  CHECK(duplicate(many + "") == "");
  many.back() = ',';
  CHECK(duplicate(many + R"( "p1234": 0})") == "p1234");
  // Nesting: kMaxJsonDepth levels of arrays and objects are read, one more is refused (nlohmann's
  // dump and copies recurse per level: a manifest of millions of brackets overflowed the stack).
  auto nested = [](size_t levels, bool objects) {
    std::string doc;
    for (size_t k = 0; k < levels; ++k) doc += objects ? "{\"a\": " : "[";
    doc += "1";
    for (size_t k = 0; k < levels; ++k) doc += objects ? "}" : "]";
    return doc;
  };
  for (bool objects : {false, true}) {
    std::optional<std::string> twice;
    std::string refused = "stale";
    const std::string at_cap = nested(kMaxJsonDepth, objects);
    const nlohmann::json doc = parse_json_strict(at_cap.data(), at_cap.data() + at_cap.size(), twice, refused);
    CHECK(refused.empty());
    CHECK(doc == nlohmann::json::parse(at_cap));
    for (size_t levels : {kMaxJsonDepth + 1, size_t{3'000'000}}) {
      const std::string deep = nested(levels, objects);
      CHECK(parse_json_strict(deep.data(), deep.data() + deep.size(), twice, refused).is_discarded());
      CHECK(refused == fmt::format("nested deeper than {} levels", kMaxJsonDepth));
    }
  }
  // Values: capped (by default at a quarter of the machine's memory, kJsonBytesPerValue each; a
  // 256 MB manifest of `{},` took 9.2 GB). A document of exactly the cap reads, one more is refused.
  {
    std::optional<std::string> twice;
    std::string refused;
    const std::string five = R"([{}, [], 1, "s"])";  // 5 values with the array
    CHECK(!parse_json_strict(five.data(), five.data() + five.size(), twice, refused, 5).is_discarded());
    CHECK(refused.empty());
    CHECK(parse_json_strict(five.data(), five.data() + five.size(), twice, refused, 4).is_discarded());
    CHECK(refused.find("of more than 4 values, which would take more than") == 0);
    CHECK(refused.find("quarter") == std::string::npos);
    std::string objects = "[{}";
    for (int k = 1; k < 3000; ++k) objects += ",{}";
    objects += "]";
    CHECK(parse_json_strict(objects.data(), objects.data() + objects.size(), twice, refused, 1000).is_discarded());
    CHECK(refused.find("of more than 1000 values") == 0);
    CHECK(!parse_json_strict(objects.data(), objects.data() + objects.size(), twice, refused).is_discarded());
    CHECK(refused.empty());
  }
  // The manifest whose checksum took the whole stack: an error naming the file now.
  const std::string brackets = R"({"format": "optstate-native", "version": 1, "manifest_xxh3": "0000000000000000", "x": )" +
                               nested(3'000'000, false) + "}";
  const auto m = native::parse_manifest(std::as_bytes(std::span(brackets)), "/x");
  CHECK(m.status().message() == fmt::format("/x/manifest.json: JSON nested deeper than {} levels", kMaxJsonDepth));
}

TEST_CASE("parse_json_strict_members hands over the members of one object as each is read, keeping the rest") {
  using json = nlohmann::json;
  const std::string doc =
      R"({"a": 1, "params": {"x": {"params": {"y": 1}}, "z": [1, {"k": 2}], "w": 3, "v": {}, "u": "s"},)"
      R"( "b": {"params": {"q": [true, null]}}, "c": [{"params": {"r": 1}}]})";
  auto members_of = [&](const std::vector<std::string_view>& path, std::vector<std::pair<std::string, json>>& got,
                        const std::string& text) {
    std::optional<std::string> twice;
    std::string refused = "stale";
    json rest = parse_json_strict_members(
        text.data(), text.data() + text.size(), path,
        [&](std::string& key, json&& value) { got.emplace_back(key, std::move(value)); }, twice, refused);
    CHECK(refused.empty());
    CHECK(!twice);
    return rest;
  };
  const json whole = json::parse(doc);
  {
    std::vector<std::pair<std::string, json>> got;
    const json rest = members_of({"params"}, got, doc);
    // In the order of the text (not of keys), each whole; the object stays in the document, empty.
    REQUIRE(got.size() == 5);
    const std::vector<std::string> keys = {"x", "z", "w", "v", "u"};
    for (size_t k = 0; k < got.size(); ++k) {
      CHECK(got[k].first == keys[k]);
      CHECK(got[k].second == whole["params"][keys[k]]);
    }
    json expect = whole;
    expect["params"] = json::object();
    CHECK(rest == expect);  // "params" deeper down (in b, in c's array, in x) is kept whole
  }
  {
    std::vector<std::pair<std::string, json>> got;
    CHECK(members_of({}, got, doc) == json::object());  // the root's own members
    REQUIRE(got.size() == 4);
    CHECK(got[1].first == "params");
    CHECK(got[1].second == whole["params"]);
    CHECK(got[3].second == whole["c"]);
  }
  {
    std::vector<std::pair<std::string, json>> got;
    const json rest = members_of({"b", "params"}, got, doc);
    REQUIRE(got.size() == 1);
    CHECK(got[0].first == "q");
    CHECK(got[0].second == json::parse("[true, null]"));
    CHECK(rest["b"] == json::parse(R"({"params": {}})"));
    CHECK(rest["params"] == whole["params"]);
  }
  for (const std::vector<std::string_view>& path :  // no such object: the document whole, nothing handed over
       std::vector<std::vector<std::string_view>>{{"nope"}, {"a"}, {"c", "params"}, {"params", "z"}}) {
    std::vector<std::pair<std::string, json>> got;
    CHECK(members_of(path, got, doc) == whole);
    CHECK(got.empty());
  }
  // Keys twice inside a member are found; the streamed object's own keys are the receiver's to check.
  auto twice_in = [](const std::string& text, size_t& delivered) {
    std::optional<std::string> twice;
    std::string refused;
    delivered = 0;
    parse_json_strict_members(text.data(), text.data() + text.size(), {"params"},
                              [&](std::string&, json&&) { ++delivered; }, twice, refused);
    return twice.value_or("");
  };
  size_t delivered = 0;
  CHECK(twice_in(R"({"params": {"x": {"k": 1, "k": 2}}})", delivered) == "k");
  CHECK(twice_in(R"({"params": {"x": 1, "x": 2}})", delivered).empty());
  CHECK(delivered == 2);
  CHECK(twice_in(R"({"params": {}, "params": {"x": 1}})", delivered) == "params");
  // The caps hold inside the members: values (the root, the object and its members count) and depth.
  {
    std::optional<std::string> twice;
    std::string refused;
    const std::string three = R"({"params": {"a": 1, "b": [], "c": {}}})";
    auto ignore = [](std::string&, json&&) {};
    CHECK(!parse_json_strict_members(three.data(), three.data() + three.size(), {"params"}, ignore, twice, refused, 5)
               .is_discarded());
    CHECK(parse_json_strict_members(three.data(), three.data() + three.size(), {"params"}, ignore, twice, refused, 4)
              .is_discarded());
    CHECK(refused.find("of more than 4 values") == 0);
    const std::string deep = R"({"params": {"a": )" + std::string(150, '[') + std::string(150, ']') + "}}";
    CHECK(parse_json_strict_members(deep.data(), deep.data() + deep.size(), {"params"}, ignore, twice, refused)
              .is_discarded());
    CHECK(refused == fmt::format("nested deeper than {} levels", kMaxJsonDepth));
  }
  // A text that breaks off: discarded, the members read before the break handed over already.
  {
    std::optional<std::string> twice;
    std::string refused;
    std::vector<std::string> keys;
    const std::string cut = R"({"params": {"a": 1, "b": {"c": 2}, "d": )";
    CHECK(parse_json_strict_members(cut.data(), cut.data() + cut.size(), {"params"},
                                    [&](std::string& k, json&&) { keys.push_back(k); }, twice, refused)
              .is_discarded());
    CHECK(keys == std::vector<std::string>{"a", "b"});
  }
}

TEST_CASE("shard ranges split rows like torch.chunk and 8-bit entries by whole blocks") {
  Entry dense;
  std::vector<FlatRange> got;
  for (int r = 0; r < 4; ++r) got.push_back(shard_range(dense, Component::kValues, {10, 7}, 4, r));
  // torch.chunk(10 rows, 4) -> 3, 3, 3, 1 rows
  CHECK(got[0].begin == 0);
  CHECK(got[0].end == 21);
  CHECK(got[2].end == 63);
  CHECK(got[3].begin == 63);
  CHECK(got[3].end == 70);
  // more ranks than rows: trailing ranks empty
  CHECK(shard_range(dense, Component::kValues, {2, 5}, 3, 2).size() == 0);
  CHECK(shard_range(dense, Component::kValues, {}, 2, 0).size() == 1);  // a 0-d tensor lives on rank 0
  Entry q;
  q.encoding = Encoding::kBlockwise8;
  q.block_size = 256;
  q.qmap = "dynamic-signed";
  // 1000 elements = 4 blocks (last partial); 3 ranks -> 2, 2, 0 blocks
  const auto c0 = shard_range(q, Component::kCodes, {1000}, 3, 0), c1 = shard_range(q, Component::kCodes, {1000}, 3, 1);
  const auto a1 = shard_range(q, Component::kAbsmax, {1000}, 3, 1);
  CHECK(c0.end == 512);
  CHECK(c1.begin == 512);
  CHECK(c1.end == 1000);
  CHECK(a1.begin == 2);
  CHECK(a1.end == 4);
  CHECK(shard_range(q, Component::kCodes, {1000}, 3, 2).size() == 0);
  // 3 rows of 2 blocks on 2 ranks: FSDP2's rows (2 and 1) begin on blocks, so they are the split
  // (whole blocks would give 3 and 3); codes in elements, absmax in blocks.
  CHECK(shard_range(q, Component::kCodes, {3, 512}, 2, 0).end == 1024);
  CHECK(shard_range(q, Component::kCodes, {3, 512}, 2, 1).begin == 1024);
  CHECK(shard_range(q, Component::kAbsmax, {3, 512}, 2, 1).begin == 4);
  CHECK(shard_range(q, Component::kAbsmax, {3, 512}, 2, 1).end == 6);
  // a 1-d param of 1000 on 2 ranks: 500 per rank is not whole blocks, so blocks: 2 and 2
  CHECK(shard_range(q, Component::kCodes, {1000}, 2, 0).end == 512);
  // rows of 100 elements: rows never line up with blocks of 256 here, so blocks
  CHECK(shard_range(q, Component::kCodes, {97, 100}, 2, 0).end == 4864);
}

TEST_CASE("the manifest is written a param at a time, byte for byte the text of the whole document") {
  // Dense and 8-bit states, one to three data files, names that JSON escapes (quote, backslash,
  // non-ASCII), a param without state, no params at all: the text equals nlohmann's dump(1) of one
  // document (whose compact dump is what the checksum covers, as a reader recomputes it), and a
  // checkpoint's own manifest.json is what serialize_manifest gives of it.
  testing::TempDir dir;
  OptimizerState dense = testing::sample_state();
  OptimizerState odd = dense;
  auto rename = [&](const std::string from, const std::string& to) {  // a copy: the node's key changes
    auto node = odd.params.extract(from);
    node.key() = to;
    odd.params.insert(std::move(node));
    for (ParamGroup& g : odd.groups) std::replace(g.params.begin(), g.params.end(), from, to);
  };
  REQUIRE(odd.params.size() >= 2);
  rename(odd.params.begin()->first, "blocks.\"q\\k\".w\u00e9ight");
  ParamState bare = odd.params.begin()->second;
  bare.entries.clear();
  bare.step = 0;
  odd.params.emplace("z.no_state_yet", bare);
  odd.groups[static_cast<size_t>(bare.group)].params.push_back("z.no_state_yet");
  OptimizerState none;
  none.kind = dense.kind;
  none.groups = {ParamGroup{}};
  const OptimizerState eight = *quantize_state(dense, {4, 1});
  int written = 0;
  for (const OptimizerState* s : std::initializer_list<const OptimizerState*>{&dense, &eight, &odd, &none})
    for (int world : {1, 3}) {
      const fs::path path = dir.path / fmt::format("c{}", written++);
      CAPTURE(path);
      const Status st = native_driver().write(*s, path, {.world_size = world});
      REQUIRE_MESSAGE(st.ok(), st.message());
      const std::string text = read_file(path / "manifest.json");
      auto m = native::parse_manifest(std::as_bytes(std::span(text)), path);
      REQUIRE(m.ok());
      CHECK(native::serialize_manifest(*m) == text);
      CHECK(native::serialize_manifest_as_one_document(*m) == text);
    }
}

TEST_CASE("the hash does not depend on the world size the checkpoint was written with") {
  testing::TempDir dir;
  OptimizerState dense = testing::sample_state();
  OptimizerState eight = *quantize_state(dense, {4, 1});
  for (const OptimizerState* s : {&dense, &eight}) {
    const auto want = hash_state(*s);
    REQUIRE(want.ok());
    for (int world = 1; world <= 5; ++world) {
      CAPTURE(world);
      const auto path = dir.path / fmt::format("w{}-{}", world, s == &dense ? "dense" : "8bit");
      REQUIRE(native_driver().write(*s, path, {.world_size = world}).ok());
      int files = 0;
      for (auto& _ : fs::directory_iterator(path / "data")) ++files, (void)_;
      CHECK(files == world);
      auto r = open_checkpoint(path);
      REQUIRE(r.ok());
      auto got = hash_checkpoint(**r);
      REQUIRE(got.ok());
      CHECK(got->root == want->root);
      auto loaded = load_all(**r);
      REQUIRE(loaded.ok());
      CHECK(hash_state(*loaded)->root == want->root);
    }
  }
}

TEST_CASE("a rank reads exactly its range of a checkpoint written by another world size") {
  testing::TempDir dir;
  OptimizerState s = testing::sample_state();
  // One large entry (5 Mi floats = 20 MiB) so chunks are capped and a range spans several.
  ParamState big;
  big.shape = {5 << 10, 1024};
  big.step = 1;
  big.group = 0;
  std::vector<float> values(static_cast<size_t>(5) << 20);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 9973) * 0.5f;
  Entry m, v;
  m.values = testing::f32_buffer(values);
  v.values = testing::f32_buffer(values);
  big.entries = {{kExpAvg, m}, {kExpAvgSq, v}};
  s.params["big.weight"] = big;
  s.groups[0].params.push_back("big.weight");
  REQUIRE(native_driver().write(s, dir.path / "c", {.world_size = 2}).ok());
  auto manifest = nlohmann::json::parse(read_file(dir.path / "c" / "manifest.json"));
  CHECK(manifest["params"]["big.weight"]["entries"]["exp_avg"]["components"]["values"].size() >= 2);
  auto r = open_checkpoint(dir.path / "c");
  REQUIRE(r.ok());
  for (int world : {1, 3, 4}) {
    for (int rank = 0; rank < world; ++rank) {
      const Entry& e = (*r)->meta().params.at("big.weight").entries.at(kExpAvg);
      const FlatRange fr = shard_range(e, Component::kValues, big.shape, world, rank);
      std::vector<float> out(static_cast<size_t>(fr.size()));
      REQUIRE((*r)->read_range("big.weight", kExpAvg, Component::kValues, fr.begin, fr.end,
                               std::as_writable_bytes(std::span(out))).ok());
      CHECK(std::equal(out.begin(), out.end(), values.begin() + fr.begin));
    }
  }
  std::vector<float> small(2);
  CHECK(!(*r)->read_range("big.weight", kExpAvg, Component::kValues, -1, 1, std::as_writable_bytes(std::span(small)))
             .ok());
  CHECK(!(*r)->read_range("big.weight", kExpAvg, Component::kValues, 0, 3, std::as_writable_bytes(std::span(small)))
             .ok());
}

TEST_CASE("the native writer refuses a manifest over the reader's cap") {
  CHECK(native::check_manifest_size(native::kMaxManifestBytes, 10, "manifest.json").ok());
  const Status over = native::check_manifest_size(native::kMaxManifestBytes + 1, 400000, "manifest.json");
  REQUIRE_FALSE(over.ok());
  CHECK(over.message() == fmt::format("manifest.json: the manifest of 400000 params would be {} bytes, over the 256 "
                                      "MiB the reader takes; write this state as dcp or hdf5",
                                      native::kMaxManifestBytes + 1));
}
