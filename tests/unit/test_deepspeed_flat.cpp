// deepspeed::place_in_flat_groups: FP16_Optimizer's flat masters (one per param group) and the
// module's tensors that lie in them, found from the values.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "deepspeed/deepspeed_flat.h"

using optstate::deepspeed::FlatPlace;
using optstate::deepspeed::FlatValues;
using optstate::deepspeed::place_in_flat_groups;

namespace {

// Groups' masters and tensors as numbers (the masters' "rounding" is the identity here).
struct FakeFlat {
  std::vector<std::vector<uint32_t>> groups, tensors;
  FlatValues values() const {
    FlatValues v;
    v.flat = [this](size_t g, int64_t begin, std::span<const int64_t> at, size_t) {
      std::vector<uint32_t> out;
      for (int64_t i : at) out.push_back(groups.at(g).at(static_cast<size_t>(begin + i)));
      return optstate::Result<std::vector<uint32_t>>(out);
    };
    v.tensor = [this](size_t t, std::span<const int64_t> at) {
      std::vector<uint32_t> out;
      for (int64_t i : at) out.push_back(tensors.at(t).at(static_cast<size_t>(i)));
      return optstate::Result<std::vector<uint32_t>>(out);
    };
    return v;
  }
};

// Tensors of `numels` with distinct values, each put in group `in[t]` (-1: none) after the ones
// before it there.
FakeFlat fake(const std::vector<int64_t>& numels, const std::vector<int>& in, size_t groups) {
  FakeFlat f;
  f.groups.resize(groups);
  uint32_t next = 1;
  for (size_t t = 0; t < numels.size(); ++t) {
    auto& w = f.tensors.emplace_back();
    for (int64_t i = 0; i < numels[t]; ++i) w.push_back(next++);
    if (in[t] >= 0) f.groups[static_cast<size_t>(in[t])].insert(f.groups[static_cast<size_t>(in[t])].end(), w.begin(), w.end());
  }
  return f;
}

std::vector<int64_t> sizes(const FakeFlat& f) {
  std::vector<int64_t> out;
  for (const auto& g : f.groups) out.push_back(static_cast<int64_t>(g.size()));
  return out;
}

bool same(const std::vector<std::optional<FlatPlace>>& got, const std::vector<std::optional<FlatPlace>>& want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].has_value() != want[i].has_value()) return false;
    if (got[i] && (got[i]->group != want[i]->group || got[i]->begin != want[i]->begin)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("deepspeed flat groups: Hugging Face's decay / no-decay groups found in their masters") {
  // module order: w0 b0 w1 b1 frozen w2 b2; group 0 the weights, group 1 the biases
  const std::vector<int64_t> numels{40, 8, 60, 5, 12, 33, 3};
  const std::vector<std::string> names{"w0", "b0", "w1", "b1", "frozen", "w2", "b2"};
  FakeFlat f = fake(numels, {0, 1, 0, 1, -1, 0, 1}, 2);
  auto placed = place_in_flat_groups(sizes(f), numels, names, f.values(), "flat");
  REQUIRE(placed.ok());
  CHECK(same(*placed, {FlatPlace{0, 0}, FlatPlace{1, 0}, FlatPlace{0, 40}, FlatPlace{1, 8}, std::nullopt,
                       FlatPlace{0, 100}, FlatPlace{1, 13}}));
  // one group of everything (model.parameters())
  f = fake(numels, {0, 0, 0, 0, 0, 0, 0}, 1);
  placed = place_in_flat_groups(sizes(f), numels, names, f.values(), "flat");
  REQUIRE(placed.ok());
  CHECK((*placed)[6]->begin == 40 + 8 + 60 + 5 + 12 + 33);
  // a tensor of no elements is in no group; groups of no elements hold none
  placed = place_in_flat_groups({0, 0}, {0, 3}, {"empty", "x"}, fake({0, 3}, {-1, -1}, 2).values(), "flat");
  REQUIRE(placed.ok());
  CHECK(same(*placed, {std::nullopt, std::nullopt}));
}

TEST_CASE("deepspeed flat groups: weights that fit nowhere, params out of module order, equal weights") {
  const std::vector<int64_t> numels{40, 8, 60, 5};
  const std::vector<std::string> names{"w0", "b0", "w1", "b1"};
  // w1's weights not its master's (another step's): group 0 ends unfilled at w1's place
  FakeFlat f = fake(numels, {0, 1, 0, 1}, 2);
  f.tensors[2][0] ^= 7;
  auto placed = place_in_flat_groups(sizes(f), numels, names, f.values(), "flat");
  REQUIRE(!placed.ok());
  CHECK(placed.status().message().find("param group 0's flat master (100 elements) holds no model tensor at element 40") !=
        std::string::npos);
  // group 0 given w1 before w0: no placement in module order
  f = fake(numels, {0, 1, 0, 1}, 2);
  std::vector<uint32_t> swapped(f.groups[0].begin() + 40, f.groups[0].end());
  swapped.insert(swapped.end(), f.groups[0].begin(), f.groups[0].begin() + 40);
  f.groups[0] = swapped;
  placed = place_in_flat_groups(sizes(f), numels, names, f.values(), "flat");
  REQUIRE(!placed.ok());
  CHECK(placed.status().message().find("holds no model tensor at element 0") != std::string::npos);
  // a master longer than its params: refused (nothing fills its end)
  f = fake(numels, {0, 1, 0, 1}, 2);
  f.groups[1].push_back(99);
  CHECK(!place_in_flat_groups(sizes(f), numels, names, f.values(), "flat").ok());
  // b0 and b1 equal (as zero-initialised biases before a step) and b0 frozen or b1 frozen: which
  // one is the group's param cannot be told
  f = fake({40, 5, 5}, {0, 1, -1}, 2);
  f.tensors[2] = f.tensors[1];
  placed = place_in_flat_groups(sizes(f), {40, 5, 5}, {"w0", "b0", "b1"}, f.values(), "flat");
  REQUIRE(!placed.ok());
  CHECK(placed.status().message().find("fit the flat masters in more than one way ('b0' in param group 1 or in no "
                                       "group") != std::string::npos);
  // ... but equal tensors that keep their order within one group are one placement
  f = fake({5, 40, 5}, {1, 0, 1}, 2);
  f.tensors[2] = f.tensors[0];
  f.groups[1] = f.tensors[0];
  f.groups[1].insert(f.groups[1].end(), f.tensors[0].begin(), f.tensors[0].end());
  placed = place_in_flat_groups(sizes(f), {5, 40, 5}, {"ln0", "w", "ln1"}, f.values(), "flat");
  REQUIRE(placed.ok());
  CHECK(same(*placed, {FlatPlace{1, 0}, FlatPlace{0, 0}, FlatPlace{1, 5}}));
}

TEST_CASE("deepspeed flat groups: the search gives up after its visits") {
  // 24 equal tensors, 12 of them in each of 2 groups: placements without end; the cap stops it
  std::vector<int64_t> numels(24, 4);
  std::vector<std::string> names;
  FakeFlat f;
  f.groups.assign(2, {});
  for (size_t t = 0; t < numels.size(); ++t) {
    names.push_back("t" + std::to_string(t));
    f.tensors.push_back({1, 2, 3, 4});
    auto& g = f.groups[t % 2];
    g.insert(g.end(), {1, 2, 3, 4});
  }
  auto placed = place_in_flat_groups(sizes(f), numels, names, f.values(), "flat", {}, 50);
  REQUIRE(!placed.ok());
  const std::string m = placed.status().message();
  CHECK((m.find("after 50 steps") != std::string::npos || m.find("more than one way") != std::string::npos));
  // uncapped it finds the two (or more) placements and says so
  placed = place_in_flat_groups(sizes(f), numels, names, f.values(), "flat");
  REQUIRE(!placed.ok());
  CHECK(placed.status().message().find("more than one way") != std::string::npos);
}

TEST_CASE("deepspeed flat groups: a model of thousands of tensors is placed in a walk about as long") {
  // 4000 distinct tensors alternating between two groups, every 10th frozen: one placement, found
  // in a walk of no more states than tensors (the cap; without the pruning it grew with their square).
  const size_t n = 4000;
  std::vector<int64_t> numels;
  std::vector<int> in;
  std::vector<std::string> names;
  for (size_t t = 0; t < n; ++t) {
    numels.push_back(1 + static_cast<int64_t>(t % 5));
    in.push_back(t % 10 == 9 ? -1 : static_cast<int>(t % 2));
    names.push_back("t" + std::to_string(t));
  }
  FakeFlat f = fake(numels, in, 2);
  auto placed = place_in_flat_groups(sizes(f), numels, names, f.values(), "flat", {}, static_cast<int64_t>(n));
  REQUIRE_MESSAGE(placed.ok(), placed.status().message());
  size_t frozen = 0;
  for (const auto& p : *placed) frozen += p ? 0 : 1;
  CHECK(frozen == n / 10);
}
