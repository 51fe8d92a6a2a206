// Fuzz target for the DCP parsers: the pickle interpreter + metadata interpretation (seed: a real
// `.metadata` written by torch 2.13) and the zip + torch.save payload parsing of one item (seeds:
// real tensor items, one stored channels_last). Any bytes give a result or an error; never a crash,
// hang or unbounded allocation. A tensor accepted as stored permuted is put in logical order and
// checked against an oracle (check_logical_order): the strides' check is what makes that safe.
// libFuzzer entry point plus a bounded mutation run (CTest: fuzz.dcp).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

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

// to_logical_order over a permuted tensor's stored elements numbered 0..numel-1: logical element i
// must be the stored one at sum(index_k * stride_k), its multi-index taken apart by division, and
// the result each number once (reads stay in the span: ASan checks that).
long permuted_checked = 0;

void check_logical_order(const dcp::TensorRef& t) {
  int64_t numel = 1;
  for (int64_t d : t.shape) numel *= d;
  if (!t.permuted() || numel > (int64_t{1} << 16)) return;
  std::vector<int64_t> stored(static_cast<size_t>(numel)), logical(stored.size());
  std::iota(stored.begin(), stored.end(), int64_t{0});
  dcp::to_logical_order(t, sizeof(int64_t), std::as_bytes(std::span(stored)), std::as_writable_bytes(std::span(logical)));
  for (int64_t i = 0; i < numel; ++i) {
    int64_t rest = i, at = 0;
    for (size_t k = t.shape.size(); k-- > 0;) {
      at += (rest % t.shape[k]) * t.stride[k];
      rest /= t.shape[k];
    }
    if (logical[static_cast<size_t>(i)] != at) {
      std::fprintf(stderr, "fuzz.dcp: logical element %lld is stored element %lld, not %lld\n",
                   static_cast<long long>(i), static_cast<long long>(logical[static_cast<size_t>(i)]),
                   static_cast<long long>(at));
      std::abort();
    }
  }
  std::sort(logical.begin(), logical.end());
  if (logical != stored) {
    std::fprintf(stderr, "fuzz.dcp: to_logical_order did not take each stored element once\n");
    std::abort();
  }
  ++permuted_checked;
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
    if (!p.ok()) continue;
    auto payload = dcp::interpret_payload(*p, "/fuzz/item");
    if (payload.ok() && payload->kind == dcp::Payload::Kind::kTensor) check_logical_order(payload->tensor);
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
    std::fprintf(stderr, "usage: %s METADATA ITEM [ITERATIONS] [SEED] [ITEM...]\n", argv[0]);
    return 2;
  }
  std::vector<std::string> seeds;
  for (int k = 1; k < argc; ++k) {
    if (k == 3 || k == 4) continue;  // ITERATIONS, SEED
    std::ifstream f(argv[k], std::ios::binary);
    seeds.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    if (seeds.back().empty()) return 2;
  }
  const long iterations = argc > 3 ? std::atol(argv[3]) : 5000;
  std::mt19937_64 rng(argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 1);
  for (long i = 0; i < iterations; ++i) {
    std::string s = seeds[static_cast<size_t>(i) % seeds.size()];
    optstate::fuzz::mutate(s, rng, {});
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  std::printf("fuzz.dcp: %ld inputs, no crash; %ld tensors stored permuted put in logical order\n", iterations,
              permuted_checked);
  return 0;
}
#endif
