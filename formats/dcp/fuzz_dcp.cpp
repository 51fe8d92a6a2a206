// Fuzz target for the DCP parsers: the pickle interpreter + metadata interpretation (seed: a real
// `.metadata` written by torch 2.13) and the zip + torch.save payload parsing of one item (seed: a
// real tensor item). Any bytes give a result or an error; never a crash, hang or unbounded
// allocation. libFuzzer entry point plus a bounded mutation run (CTest: fuzz.dcp).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "fuzz_mutate.h"
#include "dcp_layout.h"
#include "pickle.h"
#include "zip.h"

using namespace optstate;

namespace {

void parse_metadata(std::span<const std::byte> b) {
  auto p = pickle::unpickle(b, "/fuzz/.metadata");
  if (p.ok()) (void)dcp::interpret_metadata(*p, "/fuzz/.metadata");
}

void parse_item(std::span<const std::byte> b) {
  const size_t tail = std::min<size_t>(b.size(), zip::kMaxTailBytes);
  auto cd = zip::find_central_directory(b.subspan(b.size() - tail), b.size(), "/fuzz/item");
  if (!cd.ok()) return;
  auto entries = zip::parse_central_directory(b.subspan(cd->offset, cd->size), *cd, "/fuzz/item");
  if (!entries.ok()) return;
  for (const auto& e : *entries) {
    if (e.local_header_offset + 30 > b.size()) continue;
    auto at = zip::data_offset(b.subspan(e.local_header_offset, 30), e, cd->offset, "/fuzz/item");
    if (!at.ok() || e.name.size() < 8 || e.name.substr(e.name.size() - 8) != "data.pkl") continue;
    auto p = pickle::unpickle(b.subspan(*at, e.size), "/fuzz/item data.pkl");
    if (p.ok()) (void)dcp::interpret_payload(*p, "/fuzz/item");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto b = std::as_bytes(std::span(data, size));
  parse_metadata(b);
  parse_item(b);
  return 0;
}

#ifndef OPTSTATE_LIBFUZZER
int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s METADATA ITEM [ITERATIONS] [SEED]\n", argv[0]);
    return 2;
  }
  std::string seeds[2];
  for (int k = 0; k < 2; ++k) {
    std::ifstream f(argv[1 + k], std::ios::binary);
    seeds[k].assign(std::istreambuf_iterator<char>(f), {});
    if (seeds[k].empty()) return 2;
  }
  const long iterations = argc > 3 ? std::atol(argv[3]) : 5000;
  std::mt19937_64 rng(argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 1);
  for (long i = 0; i < iterations; ++i) {
    std::string s = seeds[i % 2];
    optstate::fuzz::mutate(s, rng, {});
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  std::printf("fuzz.dcp: %ld inputs, no crash\n", iterations);
  return 0;
}
#endif
