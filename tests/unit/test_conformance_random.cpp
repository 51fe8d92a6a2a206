// Random states through every format driver (the fixed-state conformance case, widened): scalars and
// 3-d params, empty params, bf16/f16 weights or none, one to three groups with their own
// hyperparameters, amsgrad groups beside plain ones, steps that differ per param, 8-bit moments in
// blocks of several sizes with partial last blocks. Each write either round-trips (the hash of what
// the format keeps, as the fixed case checks it) or is refused with a message and nothing left at
// DST or beside it. Fixed seeds: the same states every run.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "optstate/hash.h"
#include "optstate/transform.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;

namespace {

Buffer random_f32(std::mt19937_64& rng, int64_t n, float scale, bool non_negative) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = non_negative ? std::abs(normal(rng)) : normal(rng);
  return testing::f32_buffer(v);
}

Buffer random_weights(std::mt19937_64& rng, int64_t n, DType dtype) {
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<std::byte> bytes(static_cast<size_t>(n) * dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    } else if (dtype == DType::kBF16) {
      const uint16_t h = static_cast<uint16_t>(bits >> 16);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    } else {  // f16: a normal half from the float's sign, a small exponent and the top mantissa bits
      const uint16_t h = static_cast<uint16_t>(((bits >> 16) & 0x8000u) | (0x3800u + ((bits >> 13) & 0x03ffu)));
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return Buffer::take(std::move(bytes));
}

OptimizerState random_state(std::mt19937_64& rng) {
  auto pick = [&](int n) { return static_cast<int>(std::uniform_int_distribution<int>(0, n - 1)(rng)); };
  OptimizerState s;
  s.kind = "adamw";
  const int groups = 1 + pick(3);
  const double lrs[] = {1e-3, 3e-4, 0.1}, beta1s[] = {0.9, 0.8}, beta2s[] = {0.999, 0.95}, epss[] = {1e-8, 1e-6},
               wds[] = {0.0, 0.01, 0.1};
  // amsgrad and maximize in some groups of a quarter of the states each (bitsandbytes' AdamW has
  // neither, torchao's no maximize: those writers refuse such states)
  const bool some_amsgrad = pick(4) == 0, some_maximize = pick(4) == 0;
  for (int g = 0; g < groups; ++g) {
    ParamGroup pg;
    pg.hyper = {lrs[pick(3)], beta1s[pick(2)], beta2s[pick(2)], epss[pick(2)], wds[pick(3)],
                some_amsgrad && pick(2) == 0, some_maximize && pick(2) == 0};
    s.groups.push_back(pg);
  }
  const bool weights = pick(2) == 0;
  const DType wdtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  const DType wdtype = wdtypes[pick(3)];
  const int64_t common_step = 1 + pick(5000);
  const int params = 1 + pick(6);
  const char* stems[] = {"layers.{}.attn.q_proj.weight", "layers.{}.mlp.bias", "embed.weight", "h.{}.ln_1.w",
                         "lm_head.weight", "blocks.{}.0.weight"};
  std::set<std::string> used;
  for (int i = 0; i < params; ++i) {
    std::string name;
    do name = fmt::format(fmt::runtime(stems[pick(6)]), pick(12));
    while (!used.insert(name).second);
    ParamState p;
    switch (pick(6)) {
      case 0: p.shape = {}; break;                                 // a scalar (a learned temperature)
      case 1: p.shape = {1 + pick(300)}; break;
      case 2: p.shape = {1 + pick(40), 1 + pick(70)}; break;
      case 3: p.shape = {1 + pick(5), 1 + pick(9), 1 + pick(33)}; break;
      case 4: p.shape = {64, 64}; break;                           // whole blocks of 256, 64 and 32
      default: p.shape = {pick(8) == 0 ? 0 : 1 + pick(9), 17}; break;  // sometimes empty
    }
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    p.group = pick(groups);
    p.step = pick(5) == 0 ? 1 + pick(5000) : common_step;
    p.param_dtype = weights ? wdtype : DType::kF32;
    Entry m, v;
    m.values = random_f32(rng, n, 1e-3f, false);
    v.values = random_f32(rng, n, 1e-6f, true);
    p.entries[kExpAvg] = m;
    p.entries[kExpAvgSq] = v;
    if (s.groups[static_cast<size_t>(p.group)].hyper.amsgrad) {
      Entry x;
      x.values = random_f32(rng, n, 2e-6f, true);
      p.entries[kMaxExpAvgSq] = x;
    }
    if (weights) {
      Entry w;
      w.dtype = wdtype;
      w.values = random_weights(rng, n, wdtype);
      p.entries[kParam] = w;
    }
    s.groups[static_cast<size_t>(p.group)].params.push_back(name);
    s.params[name] = std::move(p);
  }
  // groups without params are not a state any optimizer saves: drop them, renumbering the rest
  std::vector<ParamGroup> kept;
  std::map<int, int> renumber;
  for (size_t g = 0; g < s.groups.size(); ++g)
    if (!s.groups[g].params.empty()) {
      renumber[static_cast<int>(g)] = static_cast<int>(kept.size());
      kept.push_back(s.groups[g]);
    }
  s.groups = kept;
  for (auto& [name, p] : s.params) p.group = renumber.at(p.group);
  return s;
}

// Files in `dir` other than `keep`: what a refused or failed write must not leave.
std::vector<std::string> leftovers(const std::filesystem::path& dir, const std::set<std::string>& keep) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (!keep.count(e.path().filename().string())) out.push_back(e.path().filename().string());
  return out;
}

}  // namespace

TEST_CASE("every format driver round-trips random states, or refuses them cleanly") {
  std::map<std::string, std::pair<int, int>> tally;  // driver -> (round trips, refusals)
  std::map<std::string, std::set<std::string>> reasons;
  std::map<std::string, int> seen;
  for (uint64_t seed = 1; seed <= 160; ++seed) {
    std::mt19937_64 rng(seed);
    const int64_t blocks[] = {256, 64, 32, 100};
    const OptimizerState dense = random_state(rng);
    REQUIRE(check_structure(dense, true).ok());
    std::set<std::string> has;
    std::set<int64_t> steps;
    for (const auto& [fqn, p] : dense.params) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      if (p.shape.empty()) has.insert("scalar");
      if (n == 0) has.insert("empty");
      if (p.shape.size() == 3) has.insert("3-d");
      if (p.entries.count(kParam)) has.insert(std::string(dtype_name(p.param_dtype)) + " weights");
      if (p.entries.count(kMaxExpAvgSq)) has.insert("amsgrad");
      if (n > 0 && n % blocks[seed % 4] != 0 && n >= ((seed % 3 == 0) ? 1 : 64)) has.insert("partial block");
      steps.insert(p.step);
    }
    if (steps.size() > 1) has.insert("steps differ");
    for (const auto& h : has) ++seen[h];
    const QuantizeOptions q{blocks[seed % 4], (seed % 3 == 0) ? 1 : 64};
    auto quantized = quantize_state(dense, q);
    REQUIRE(quantized.ok());
    const OptimizerState* eight = &*quantized;
    for (const OptimizerState* sp : {&dense, eight})
      for (const FormatDriver* d : format_drivers()) {
        if (!d->writes()) continue;
        const OptimizerState& state = *sp;
        CAPTURE(seed);
        CAPTURE(d->name());
        CAPTURE(sp == eight);
        // sharding formats as 1 to 5 ranks (some ranks' shards empty), and dequantize-on-save
        WriteOptions options;
        options.world_size = d->shards() && seed % 2 == 0 ? 2 + static_cast<int>((seed * 7 + d->name().size()) % 4) : 1;
        options.dequantize = seed % 5 == 0;
        CAPTURE(options.world_size);
        CAPTURE(options.dequantize);
        testing::TempDir dir;
        const auto path = dir.path / ("ckpt." + std::string(d->name()));
        const Status written = write_checkpoint(*d, state, path, options);
        if (!written.ok()) {
          // Refused: said why, and nothing written.
          CHECK(!written.message().empty());
          CHECK(leftovers(dir.path, {}).empty());
          ++tally[std::string(d->name())].second;
          std::string why = written.message();
          for (size_t at; (at = why.find(path.string())) != std::string::npos;) why.replace(at, path.string().size(), "DST");
          reasons[std::string(d->name())].insert(why.substr(0, 140));
          continue;
        }
        ++tally[std::string(d->name())].first;
        const OptimizerState kept = d->kept_by_write(state, options);
        auto reader = open_checkpoint(path);
        REQUIRE_MESSAGE(reader.ok(), reader.status().message());
        CHECK((*reader)->format() == d->name());
        const bool raw = !options.dequantize && (d->writes_blockwise8(options) || sp == &dense);
        auto got = hash_checkpoint(**reader, {.values = !raw});
        REQUIRE_MESSAGE(got.ok(), got.status().message());
        auto want = hash_state(kept, {.values = !raw});
        REQUIRE(want.ok());
        CHECK(got->root == want->root);
        // Ranges as a rank loads its shard (read_range), across chunk and shard boundaries: the
        // bytes of what was written, where the stored encoding is the state's.
        if (raw) {
          std::mt19937_64 rr(seed * 1000 + d->name().size());
          for (const auto& param : kept.params) {  // no structured bindings: clang 14's CHECK_MESSAGE can't capture them
            const std::string& fqn = param.first;
            const auto& ps = param.second;
            int64_t numel = 1;
            for (int64_t dim : ps.shape) numel *= dim;
            for (const auto& entry : ps.entries)
              for (Component c : entry.second.components()) {
                const std::string& name = entry.first;
                const auto& e = entry.second;
                const int64_t count = component_count(e, c, numel), size = component_elem_size(e, c);
                if (count == 0) continue;
                const int64_t b = std::uniform_int_distribution<int64_t>(0, count - 1)(rr);
                const int64_t en = std::uniform_int_distribution<int64_t>(b + 1, count)(rr);
                std::vector<std::byte> out(static_cast<size_t>((en - b) * size));
                const Status st = (*reader)->read_range(fqn, name, c, b, en, out);
                CHECK_MESSAGE(st.ok(), fqn, ".", name, ": ", st.message());
                CHECK_MESSAGE(std::memcmp(out.data(), e.buffer(c).data + b * size, out.size()) == 0, fqn, ".",
                              name, " ", component_name(c), " [", b, ", ", en, ")");
              }
          }
        }
        if (got->entries != want->entries)
          for (const auto& kh : want->entries) {
            const auto it = got->entries.find(kh.first);
            CHECK_MESSAGE(it != got->entries.end(), "missing ", kh.first);
            if (it != got->entries.end()) CHECK_MESSAGE(it->second == kh.second, "entry ", kh.first);
          }
      }
  }
  // what the states held, so a change to the generator cannot quietly drop a case
  CHECK(seen["scalar"] > 0);
  CHECK(seen["empty"] > 0);
  CHECK(seen["3-d"] > 0);
  CHECK(seen["f16 weights"] > 0);
  CHECK(seen["bf16 weights"] > 0);
  CHECK(seen["amsgrad"] > 0);
  CHECK(seen["steps differ"] > 0);
  CHECK(seen["partial block"] > 0);
  for (const auto& [what, n] : seen) MESSAGE(fmt::format("{} states with {}", n, what));
  for (const auto& [name, t] : tally) {
    MESSAGE(fmt::format("{}: {} round trips, {} refusals", name, t.first, t.second));
    for (const auto& r : reasons[name]) MESSAGE((std::string("  refused: ") + r));
  }
}
