// safetensors driver: hostile files give errors naming the file and tensor; never a crash.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "optstate/checkpoint.h"
#include "registry.h"
#include "safetensors/safetensors_layout.h"
#include "test_helpers.h"

using namespace optstate;
namespace fs = std::filesystem;

namespace {

using testing::read_file;
using testing::write_file;

std::string open_error(const fs::path& p) {
  auto r = find_format("safetensors")->open(p);
  return r.ok() ? "" : r.status().message();
}

}  // namespace

TEST_CASE("safetensors: lying, truncated and foreign files are refused with the tensor named") {
  testing::TempDir dir;
  const auto good = dir.path / "good.safetensors";
  REQUIRE(find_format("safetensors")->write(testing::sample_state(), good, {}).ok());
  const std::string bytes = read_file(good);
  const uint64_t hlen = static_cast<uint8_t>(bytes[0]) | static_cast<uint64_t>(static_cast<uint8_t>(bytes[1])) << 8;
  const std::string header = bytes.substr(8, hlen);
  const auto bad = dir.path / "bad.safetensors";

  SUBCASE("truncated data") {
    write_file(bad, bytes.substr(0, bytes.size() - 3));
    CHECK(open_error(bad).find("outside the data buffer") != std::string::npos);
  }
  SUBCASE("truncated header") {
    write_file(bad, bytes.substr(0, 20));
    CHECK(open_error(bad).find("does not fit") != std::string::npos);
  }
  SUBCASE("header length beyond the file") {
    std::string s = bytes;
    s[6] = '\x7f';
    write_file(bad, s);
    CHECK(open_error(bad).find("does not fit in a file of") != std::string::npos);
  }
  SUBCASE("a header over the 100 MiB cap, in a file that holds it: named as such, not 'no known format'") {
    // (a sparse file: the cap is checked before the header is read)
    const uint64_t n = safetensors::kMaxHeaderBytes + 8;
    std::string s(9, '{');
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    write_file(bad, s);
    fs::resize_file(bad, 8 + n + 64);
    CHECK(find_format("safetensors")->sniff(bad));
    CHECK(open_error(bad) == fmt::format("{}: header of {} bytes, over the 100 MiB every safetensors reader accepts "
                                         "(the safetensors library's limit)",
                                         bad.string(), n));
    s[0] = '\x01';  // a length of 1 (under the minimum) or past the file is no safetensors file
    write_file(bad, s);
    CHECK_FALSE(find_format("safetensors")->sniff(bad));
  }
  SUBCASE("a tensor named twice (nlohmann would keep the second; which is meant is not guessed)") {
    const auto at = header.find("\"layers.0.bias.exp_avg\"");
    REQUIRE(at != std::string::npos);
    const auto end = header.find('}', at);
    // appended piece by piece: gcc 12 warns about `"{" + std::string` (its PR 105329, a false positive)
    std::string h = "{";
    h += header.substr(at, end + 1 - at);
    h += ',';
    h += header.substr(1);
    h.resize(h.size() + (8 - h.size() % 8) % 8, ' ');
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
    write_file(bad, len + h + bytes.substr(8 + hlen));
    CHECK(open_error(bad) == bad.string() + ": header names 'layers.0.bias.exp_avg' twice");
  }
  SUBCASE("offsets that lie about a tensor's size") {
    std::string h = header;
    const auto at = h.find("\"layers.0.bias.exp_avg\"");
    REQUIRE(at != std::string::npos);
    const auto shape = h.find("[3]", at);
    REQUIRE(shape != std::string::npos);
    h.replace(shape, 3, "[4]");
    write_file(bad, bytes.substr(0, 8) + h + bytes.substr(8 + hlen));
    const std::string err = open_error(bad);
    CHECK(err.find("layers.0.bias.exp_avg") != std::string::npos);
    CHECK(err.find("bad.safetensors") != std::string::npos);
  }
  SUBCASE("a tensor the metadata does not describe") {
    auto h = safetensors::parse_header(std::as_bytes(std::span(header)), bytes.size() - 8 - hlen, "x");
    REQUIRE(h.ok());
    std::vector<std::pair<std::string, safetensors::TensorInfo>> tensors(h->tensors.begin(), h->tensors.end());
    std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.second.begin < b.second.begin; });
    safetensors::TensorInfo stray;
    stray.shape = {1};
    stray.begin = bytes.size() - 8 - hlen;
    stray.end = stray.begin + 4;
    tensors.emplace_back("layers.0.stray", stray);
    write_file(bad, safetensors::encode_header(tensors, h->metadata) + bytes.substr(8 + hlen) + std::string(4, '\0'));
    CHECK(open_error(bad) == bad.string() + ": tensor 'layers.0.stray' is not described by the optstate metadata");
  }
  SUBCASE("optstate metadata read as strictly as the header: no key twice, at most 100 levels deep") {
    auto h = safetensors::parse_header(std::as_bytes(std::span(header)), bytes.size() - 8 - hlen, "x");
    REQUIRE(h.ok());
    std::vector<std::pair<std::string, safetensors::TensorInfo>> tensors(h->tensors.begin(), h->tensors.end());
    std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.second.begin < b.second.begin; });
    const std::string text = h->metadata.at("optstate");
    REQUIRE(text.front() == '{');
    auto open_with = [&](const std::string& meta) {
      auto m = h->metadata;
      m["optstate"] = meta;
      write_file(bad, safetensors::encode_header(tensors, m) + bytes.substr(8 + hlen));
      return open_error(bad);
    };
    REQUIRE(open_with(text).empty());  // re-encoded as it was: opens
    CHECK(open_with(R"({"kind": "adamw8bit", )" + text.substr(1)) ==
          bad.string() + ": optstate metadata names 'kind' twice in one object");
    CHECK(open_with(R"({"x": )" + std::string(200, '[') + std::string(200, ']') + ", " + text.substr(1)) ==
          bad.string() + ": optstate metadata nested deeper than 100 levels");
    // Its params are read as the text is (the groups may come after them: JSON leaves the order to
    // the writer): a param's group is checked once the groups are known, a param named twice found.
    const nlohmann::json meta = nlohmann::json::parse(text);
    const std::string first = meta["params"].begin().key();
    nlohmann::json rest = meta;
    rest.erase("params");
    CHECK(open_with(R"({"params": )" + meta["params"].dump() + ", " + rest.dump().substr(1)).empty());
    nlohmann::json regrouped = meta;
    regrouped["params"][first]["group"] = 7;
    CHECK(open_with(R"({"params": )" + regrouped["params"].dump() + ", " + rest.dump().substr(1)) ==
          fmt::format("{}: param '{}' refers to group 7 of 2", bad.string(), first));
    CHECK(open_with(regrouped.dump()) == fmt::format("{}: param '{}' refers to group 7 of 2", bad.string(), first));
    std::string params_twice = meta["params"].dump();
    params_twice.insert(1, nlohmann::json(first).dump() + ": " + meta["params"][first].dump() + ", ");
    CHECK(open_with(R"({"params": )" + params_twice + ", " + rest.dump().substr(1)) ==
          fmt::format("{}: optstate metadata names '{}' twice in one object", bad.string(), first));
  }
  SUBCASE("no optstate metadata") {
    safetensors::TensorInfo t;
    t.shape = {1};
    t.end = 4;
    write_file(bad, safetensors::encode_header({{"x", t}}, {}) + std::string(4, '\0'));
    CHECK(open_error(bad).find("without optstate metadata") != std::string::npos);
  }
  SUBCASE("a hole and an overlap") {
    safetensors::TensorInfo a, b;
    a.shape = {1};
    a.end = 4;
    b.shape = {1};
    b.begin = 8;
    b.end = 12;
    write_file(bad, safetensors::encode_header({{"a", a}, {"b", b}}, {}) + std::string(12, '\0'));
    CHECK(open_error(bad).find("a hole") != std::string::npos);
    b.begin = 2;
    b.end = 6;
    write_file(bad, safetensors::encode_header({{"a", a}, {"b", b}}, {}) + std::string(6, '\0'));
    CHECK(open_error(bad).find("an overlap") != std::string::npos);
  }
}

TEST_CASE("safetensors: the writer refuses a header over the cap every reader keeps, before writing anything") {
  CHECK(safetensors::check_header_size(safetensors::kMaxHeaderBytes, 10, 5, "/x.safetensors").ok());
  const Status over = safetensors::check_header_size(safetensors::kMaxHeaderBytes + 1, 600000, 300000, "/x.safetensors");
  REQUIRE_FALSE(over.ok());
  CHECK(over.message() == fmt::format("/x.safetensors: the safetensors header of 300000 params (600000 tensors) would be "
                                      "{} bytes, over the 100 MiB every safetensors reader accepts (the safetensors "
                                      "library's limit, and optstate's); write this state as native, dcp or hdf5",
                                      safetensors::kMaxHeaderBytes + 1));
}
