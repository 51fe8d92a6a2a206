// Fuzz target for the native manifest parser: any bytes must give a Manifest or an error, never a
// crash, a hang or an unbounded allocation. Built for libFuzzer with clang (OPTSTATE_LIBFUZZER,
// docs/fuzzing.md), otherwise as a bounded mutation run (CTest: fuzz.native_manifest) of a real manifest.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_mutate.h"
#include "native_manifest.h"

namespace {

// Whether `bytes` parsed; a manifest that parses must re-encode and parse again to the same structure.
bool check(std::string_view bytes) {
  auto m = optstate::native::parse_manifest(std::as_bytes(std::span(bytes)), "/fuzz");
  if (!m.ok()) return false;
  const std::string again = optstate::native::serialize_manifest(*m);
  // Written a param at a time, byte for byte the whole document's text.
  if (again != optstate::native::serialize_manifest_as_one_document(*m)) __builtin_trap();
  auto m2 = optstate::native::parse_manifest(std::as_bytes(std::span(again)), "/fuzz");
  if (!m2.ok() || m2->chunks.size() != m->chunks.size()) __builtin_trap();
  return true;
}

// The input as it is, then re-signed: the manifest checksum stops nearly every mutation before the
// structural checks behind it, the same input re-signed reaches them. How many of the two parsed.
int check_raw_and_resigned(std::string_view raw) {
  int parsed = check(raw);
  if (auto signed_input = optstate::native::resign_manifest_for_tests(std::string(raw))) parsed += check(*signed_input);
  return parsed;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check_raw_and_resigned(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
// Bounded mutation run: byte flips, splices and digit changes of a valid seed manifest, each tried
// as it is and re-signed.
int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s SEED_MANIFEST [ITERATIONS] [SEED]\n", argv[0]);
    return 2;
  }
  FILE* f = std::fopen(argv[1], "rb");
  if (!f) return 2;
  std::string seed;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) seed.append(buf, n);
  std::fclose(f);
  const long iterations = argc > 2 ? std::atol(argv[2]) : 5000;
  std::mt19937_64 rng(argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1);
  long parsed = 0;
  for (long i = 0; i < iterations; ++i) {
    std::string s = seed;
    optstate::fuzz::mutate(s, rng, optstate::fuzz::kJsonAlphabet);
    parsed += check_raw_and_resigned(s);
  }
  std::printf("fuzz.native_manifest: %ld inputs (each also re-signed), %ld parsed, no crash\n", iterations, parsed);
  return 0;
}
#endif
