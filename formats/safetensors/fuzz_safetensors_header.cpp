// Fuzz target for the safetensors header parser and the optstate metadata it carries: any bytes must
// give a header or an error, never a crash, a hang or an unbounded allocation. libFuzzer entry point
// plus a bounded mutation run of a valid header (CTest: fuzz.safetensors_header).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_mutate.h"
#include "optstate/json_strict.h"
#include "optstate/state_json.h"
#include "safetensors_layout.h"

using namespace optstate;

namespace {

// The parse that hands an object's members over as they are read (how the header and the metadata
// are read) agrees with the whole document's: the same refusals, each member the document's, the
// rest the document with that object emptied.
void check_members_agree(std::string_view text, const std::vector<std::string_view>& path) {
  using json = nlohmann::json;
  constexpr size_t kValues = 1 << 20;
  std::optional<std::string> twice_whole, twice_rest;
  std::string refused_whole, refused_rest;
  json whole = parse_json_strict(text.data(), text.data() + text.size(), twice_whole, refused_whole, kValues);
  json members = json::object();
  bool member_twice = false;
  const json rest = parse_json_strict_members(
      text.data(), text.data() + text.size(), path,
      [&](std::string& key, json&& value) { member_twice |= !members.emplace(key, std::move(value)).second; },
      twice_rest, refused_rest, kValues);
  if (whole.is_discarded() != rest.is_discarded() || refused_whole != refused_rest) __builtin_trap();
  if (whole.is_discarded()) return;
  if (twice_whole.has_value() != (twice_rest.has_value() || member_twice)) __builtin_trap();
  if (twice_whole) return;
  json* streamed = &whole;
  for (std::string_view key : path) {
    auto it = streamed->is_object() ? streamed->find(std::string(key)) : streamed->end();
    streamed = it == streamed->end() ? nullptr : &*it;
    if (!streamed) break;
  }
  if (streamed && streamed->is_object()) {
    if (*streamed != members) __builtin_trap();
    *streamed = json::object();
  } else if (!members.empty()) {
    __builtin_trap();
  }
  if (rest != whole) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  auto n = safetensors::parse_header_length(bytes, size, "/fuzz");
  if (!n.ok()) return 0;
  const std::string_view header(reinterpret_cast<const char*>(data) + 8, *n);
  check_members_agree(header, {});
  check_members_agree(header, {"__metadata__"});
  auto h = safetensors::parse_header(bytes.subspan(8, *n), size - 8 - *n, "/fuzz");
  if (!h.ok()) return 0;
  auto meta = h->metadata.find("optstate");
  if (meta != h->metadata.end()) {
    check_members_agree(meta->second, {"params"});
    auto st = decode_state_meta(meta->second, "/fuzz");
    // Metadata that decodes must re-encode and decode to the same params.
    if (st.ok() && decode_state_meta(encode_state_meta(*st), "/fuzz")->params.size() != st->params.size())
      __builtin_trap();
  }
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  OptimizerState st;
  st.groups.push_back({});
  st.groups[0].params = {"w"};
  ParamState ps;
  ps.shape = {2, 3};
  ps.step = 4;
  Entry e;
  ps.entries.emplace("exp_avg", e);
  st.params.emplace("w", ps);
  safetensors::TensorInfo t;
  t.shape = {2, 3};
  t.end = 24;
  std::string seed = safetensors::encode_header({{"w.exp_avg", t}}, {{"optstate", encode_state_meta(st)}});
  seed.append(24, '\x01');
  const long iterations = argc > 1 ? std::atol(argv[1]) : 5000;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  long parsed = 0;
  for (long i = 0; i < iterations; ++i) {
    std::string s = seed;
    optstate::fuzz::mutate(s, rng, optstate::fuzz::kJsonAlphabet);
    const auto* d = reinterpret_cast<const uint8_t*>(s.data());
    auto n = safetensors::parse_header_length(std::as_bytes(std::span(d, s.size())), s.size(), "/fuzz");
    parsed += n.ok() && safetensors::parse_header(std::as_bytes(std::span(d, s.size())).subspan(8, *n),
                                                  s.size() - 8 - *n, "/fuzz").ok();
    LLVMFuzzerTestOneInput(d, s.size());
  }
  std::printf("fuzz.safetensors_header: %ld inputs, %ld parsed, no crash\n", iterations, parsed);
  return 0;
}
#endif
