// Fuzz target for the HDF5 driver: a mutated optstate HDF5 file must open and hash, or give an
// error; never a crash or a hang. The bytes go through libhdf5 itself (its parsing is its own; this
// exercises our checks around it: metadata, dataset types and shapes, ranges). Bounded mutation run
// of a real file (CTest: fuzz.hdf5_file).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "optstate/checkpoint.h"
#include "optstate/hash.h"
#include "registry.h"

using namespace optstate;

int main(int argc, char** argv) {
  const FormatDriver* d = find_format("hdf5");
  if (!d) return 0;
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("optstate-fuzz-hdf5-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  OptimizerState st;
  st.groups.push_back({});
  st.groups[0].params = {"w"};
  ParamState ps;
  ps.shape = {40, 30};
  ps.step = 3;
  Entry e;
  std::vector<float> v(1200);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * static_cast<float>(i);
  e.values = Buffer::copy_of(std::as_bytes(std::span(v)));
  ps.entries.emplace("exp_avg", e);
  st.params.emplace("w", ps);
  if (!d->write(st, dir / "seed.h5", {}).ok()) return 1;
  std::string seed;
  {
    std::ifstream f(dir / "seed.h5", std::ios::binary);
    seed.assign(std::istreambuf_iterator<char>(f), {});
  }
  const long iterations = argc > 1 ? std::atol(argv[1]) : 500;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  long opened = 0, hashed = 0;
  for (long i = 0; i < iterations; ++i) {
    std::string s = seed;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < edits; ++k) {
      const size_t at = rng() % s.size();
      if (rng() % 8 == 0) s.resize(at);
      else if (!s.empty()) s[at] = static_cast<char>(s[at] ^ (1 << (rng() % 8)));
    }
    const auto p = dir / "m.h5";
    std::ofstream(p, std::ios::binary | std::ios::trunc) << s;
    auto r = d->open(p);
    if (!r.ok()) continue;
    ++opened;
    hashed += hash_checkpoint(**r).ok();
  }
  std::filesystem::remove_all(dir);
  std::printf("fuzz.hdf5_file: %ld inputs, %ld opened, %ld hashed, no crash\n", iterations, opened, hashed);
  return 0;
}
