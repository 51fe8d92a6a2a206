// A tensor's chunk boxes as runs of its flat elements (formats/dcp/chunks.cpp): RunList keeps a
// column shard's rows as one strided group and visits every chunk's runs in flat order.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dcp/chunks.h"

using namespace optstate;

namespace {

struct Where {
  size_t chunk;
  int64_t local;
  bool operator==(const Where&) const = default;
};

// Every element's chunk and place in it, run by run, over [from, to).
std::vector<Where> walk(const dcp::RunList& runs, int64_t from, int64_t to) {
  std::vector<Where> out;
  int64_t at = from;
  const auto st = runs.for_each(from, to, [&](const dcp::Segment& s) {
    const int64_t a = std::max(from, s.begin), b = std::min(to, s.begin + s.count);
    REQUIRE(a < b);  // only runs that overlap the window
    REQUIRE(a == at);  // in flat order, none skipped
    for (int64_t e = a; e < b; ++e) out.push_back({s.chunk, s.local + (e - s.begin)});
    at = b;
    return Status::Ok();
  });
  REQUIRE(st.ok());
  return out;
}

dcp::RunList sealed(const std::vector<int64_t>& g, const std::vector<dcp::ChunkMeta>& chunks, Status* status = nullptr) {
  dcp::RunList runs;
  for (size_t k = 0; k < chunks.size(); ++k) REQUIRE(dcp::chunk_segments(g, chunks[k], k, runs, "t").ok());
  int64_t numel = 1;
  for (int64_t d : g) numel *= d;
  const Status st = runs.seal(numel, "t");
  if (status) *status = st;
  else REQUIRE_MESSAGE(st.ok(), st.message());
  return runs;
}

}  // namespace

TEST_CASE("chunks: a column shard is one strided group, its rows interleaved with its neighbours'") {
  // [6, 8] in two column shards (RowwiseParallel's Shard(1) over 2 ranks)
  const auto runs = sealed({6, 8}, {{{0, 0}, {6, 4}}, {{0, 4}, {6, 4}}});
  REQUIRE(runs.groups().size() == 2);
  for (const auto& g : runs.groups()) {
    CHECK(g.rows == 6);
    CHECK(g.stride == 8);
    CHECK(g.count == 4);
  }
  const auto all = walk(runs, 0, 48);
  REQUIRE(all.size() == 48);
  CHECK(all[0] == Where{0, 0});
  CHECK(all[4] == Where{1, 0});
  CHECK(all[8] == Where{0, 4});
  CHECK(all[47] == Where{1, 23});
  // a window that starts and ends inside runs
  const auto part = walk(runs, 10, 30);
  CHECK(std::equal(part.begin(), part.end(), all.begin() + 10, all.begin() + 30));
  // dims the box covers whole fold into the rows: [4, 6, 8] cut only along its last axis
  const auto folded = sealed({4, 6, 8}, {{{0, 0, 0}, {4, 6, 3}}, {{0, 0, 3}, {4, 6, 5}}});
  REQUIRE(folded.groups().size() == 2);
  CHECK(folded.groups()[0].rows == 24);
  CHECK(folded.groups()[1].rows == 24);
  // a row shard is one run
  const auto rowwise = sealed({6, 8}, {{{3, 0}, {3, 8}}, {{0, 0}, {3, 8}}});
  REQUIRE(rowwise.groups().size() == 2);
  CHECK(rowwise.groups()[0].rows == 1);
  CHECK(rowwise.groups()[0].count == 24);
  CHECK(rowwise.groups()[0].chunk == 1);
}

TEST_CASE("chunks: random grids of boxes read element for element as the brute-force map says") {
  std::mt19937_64 rng(20261204);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t n = 1 + rng() % 4;
    std::vector<int64_t> g(n);
    std::vector<std::vector<int64_t>> cuts(n);  // each axis cut at sorted points
    for (size_t d = 0; d < n; ++d) {
      g[d] = 1 + static_cast<int64_t>(rng() % 7);
      cuts[d] = {0};
      for (int64_t x = 1; x < g[d]; ++x)
        if (rng() % 3 == 0) cuts[d].push_back(x);
      cuts[d].push_back(g[d]);
    }
    std::vector<dcp::ChunkMeta> chunks;
    std::vector<size_t> idx(n, 0);
    while (true) {
      dcp::ChunkMeta c;
      for (size_t d = 0; d < n; ++d) {
        c.offsets.push_back(cuts[d][idx[d]]);
        c.sizes.push_back(cuts[d][idx[d] + 1] - cuts[d][idx[d]]);
      }
      chunks.push_back(c);
      size_t d = n;
      while (d > 0 && ++idx[d - 1] + 1 >= cuts[d - 1].size()) idx[--d] = 0;
      if (d == 0) break;
    }
    std::shuffle(chunks.begin(), chunks.end(), rng);
    // The brute-force map: each element's chunk and its C-order index inside the chunk's box.
    const int64_t numel = std::accumulate(g.begin(), g.end(), int64_t{1}, std::multiplies<>());
    std::vector<Where> expect(static_cast<size_t>(numel));
    for (int64_t e = 0; e < numel; ++e) {
      std::vector<int64_t> at(n);
      int64_t rest = e;
      for (size_t d = n; d-- > 0;) {
        at[d] = rest % g[d];
        rest /= g[d];
      }
      for (size_t k = 0; k < chunks.size(); ++k) {
        bool in = true;
        int64_t local = 0;
        for (size_t d = 0; d < n && in; ++d) {
          in = at[d] >= chunks[k].offsets[d] && at[d] < chunks[k].offsets[d] + chunks[k].sizes[d];
          local = local * chunks[k].sizes[d] + (at[d] - chunks[k].offsets[d]);
        }
        if (in) expect[static_cast<size_t>(e)] = {k, local};
      }
    }
    const auto runs = sealed(g, chunks);
    CHECK(walk(runs, 0, numel) == expect);
    for (int w = 0; w < 5; ++w) {
      const int64_t a = static_cast<int64_t>(rng() % static_cast<uint64_t>(numel));
      const int64_t b = a + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(numel - a));
      const auto part = walk(runs, a, b);
      CHECK(std::equal(part.begin(), part.end(), expect.begin() + a, expect.begin() + b));
      // for_each_group: each group's rows [r0, r1) are exactly its runs that overlap [a, b)
      int64_t seen = 0;
      REQUIRE(runs.for_each_group(a, b, [&](const dcp::Runs& g, int64_t r0, int64_t r1) {
                    REQUIRE(r0 < r1);
                    for (int64_t r = 0; r < g.rows; ++r) {
                      const dcp::Segment s = g.run(r);
                      const bool overlaps = s.begin < b && s.begin + s.count > a;
                      CHECK(overlaps == (r >= r0 && r < r1));
                      if (overlaps) seen += std::min(b, s.begin + s.count) - std::max(a, s.begin);
                    }
                    return Status::Ok();
                  }).ok());
      CHECK(seen == b - a);
    }
  }
}

TEST_CASE("chunks: holes and overlaps are refused, naming the elements") {
  auto refused = [](const std::vector<int64_t>& g, const std::vector<dcp::ChunkMeta>& chunks, const std::string& why) {
    Status st;
    sealed(g, chunks, &st);
    REQUIRE_FALSE(st.ok());
    CHECK_MESSAGE(st.message() == "t: " + why, st.message());
  };
  // column shards: one missing, two over the same columns
  refused({6, 8}, {{{0, 0}, {6, 4}}}, "elements [4, 8) are in no chunk");
  refused({6, 8}, {{{0, 0}, {6, 4}}, {{0, 3}, {6, 5}}}, "elements [3, 4) are in two chunks");
  refused({6, 8}, {{{0, 0}, {6, 4}}, {{0, 4}, {5, 4}}}, "elements [44, 48) are in no chunk");
  // row shards
  refused({6, 8}, {{{0, 0}, {3, 8}}}, "elements [24, 48) are in no chunk");
  refused({6, 8}, {{{0, 0}, {3, 8}}, {{2, 0}, {4, 8}}}, "elements [16, 24) are in two chunks");
  refused({6, 8}, {{{0, 0}, {2, 8}}, {{3, 0}, {3, 8}}}, "elements [16, 24) are in no chunk");
}

TEST_CASE("chunks: single runs join the runs they continue; hostile chunking meets the caps") {
  dcp::RunList runs;
  REQUIRE(runs.add(dcp::Segment{0, 4, 0, 0}, "t").ok());
  REQUIRE(runs.add(dcp::Segment{4, 4, 0, 4}, "t").ok());   // the next elements
  REQUIRE(runs.add(dcp::Segment{16, 8, 0, 8}, "t").ok());  // the next row, 16 on
  REQUIRE(runs.add(dcp::Segment{32, 8, 0, 16}, "t").ok());
  REQUIRE(runs.add(dcp::Segment{40, 4, 0, 24}, "t").ok());  // consecutive, but after rows: a group of its own
  REQUIRE(runs.add(dcp::Segment{8, 8, 1, 0}, "t").ok());    // another chunk
  REQUIRE(runs.groups().size() == 3);
  CHECK(runs.groups()[0].rows == 3);
  CHECK(runs.groups()[0].stride == 16);
  CHECK(runs.groups()[0].count == 8);
  CHECK(runs.groups()[1].count == 4);
  // a [2^29, 2] tensor in column shards of one element a row: 2^30 runs
  dcp::RunList many;
  const int64_t rows = int64_t{1} << 29;
  const Status st = dcp::chunk_segments({rows, 2}, {{0, 1}, {rows, 1}}, 0, many, "t");
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("too many pieces") != std::string::npos);
}

TEST_CASE("chunks: random boxes that overlap or leave holes are refused exactly where a brute-force count says") {
  std::mt19937_64 rng(46);
  int refused = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t n = 1 + rng() % 3;
    std::vector<int64_t> g(n);
    for (auto& d : g) d = 1 + static_cast<int64_t>(rng() % 6);
    const int64_t numel = std::accumulate(g.begin(), g.end(), int64_t{1}, std::multiplies<>());
    std::vector<dcp::ChunkMeta> chunks(1 + rng() % 4);
    for (auto& c : chunks)
      for (size_t d = 0; d < n; ++d) {
        c.offsets.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(g[d])));
        c.sizes.push_back(1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(g[d] - c.offsets[d])));
      }
    // How many chunks hold each element, and the first element held by none or by two.
    std::vector<int> held(static_cast<size_t>(numel));
    for (const auto& c : chunks) {
      dcp::RunList one;
      REQUIRE(dcp::chunk_segments(g, c, 0, one, "t").ok());
      for (const auto& grp : one.groups())
        for (int64_t r = 0; r < grp.rows; ++r)
          for (int64_t e = 0; e < grp.count; ++e) ++held[static_cast<size_t>(grp.run(r).begin + e)];
    }
    const auto bad = std::find_if(held.begin(), held.end(), [](int h) { return h != 1; });
    Status st;
    sealed(g, chunks, &st);
    CHECK_MESSAGE(st.ok() == (bad == held.end()), st.message());
    if (bad != held.end() && !st.ok()) {
      ++refused;
      const auto at = bad - held.begin();
      const std::string why = *bad == 0 ? "are in no chunk" : "are in two chunks";
      CHECK_MESSAGE(st.message().find(fmt::format("elements [{}, ", at)) != std::string::npos, st.message());
      CHECK_MESSAGE(st.message().find(why) != std::string::npos, st.message());
    }
  }
  CHECK(refused > 1000);
}
