// Fuzz target for the safetensors header parser and the optstate metadata it carries: any bytes must
// give a header or an error, never a crash, a hang or an unbounded allocation. libFuzzer entry point
// plus a bounded mutation run of a valid header (CTest: fuzz.safetensors_header).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "fuzz_mutate.h"
#include "optstate/state_json.h"
#include "safetensors_layout.h"

using namespace optstate;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  auto n = safetensors::parse_header_length(bytes, size, "/fuzz");
  if (!n.ok()) return 0;
  auto h = safetensors::parse_header(bytes.subspan(8, *n), size - 8 - *n, "/fuzz");
  if (!h.ok()) return 0;
  auto meta = h->metadata.find("optstate");
  if (meta != h->metadata.end()) {
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
