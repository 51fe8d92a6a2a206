#include <doctest/doctest.h>

#include <fmt/format.h>

#include <thread>

#include "native/native_sharded.h"
#include "optstate/coordinator.h"
#include "optstate/hash.h"
#include "optstate/transform.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;
using namespace std::chrono_literals;

namespace {

// Runs save_sharded on `world` threads; `skip` ranks never call it (a rank that died).
std::vector<Status> save_on_threads(const OptimizerState& full, const std::filesystem::path& path, int world,
                                    native::ShardedSaveOptions options, int skip = -1,
                                    const std::function<void(OptimizerState&, int)>& spoil = {}) {
  auto store = std::make_shared<InProcessStore>();
  // Threads share one process, so the default id (a per-process count of saves) would differ
  // between them: every rank passes the same explicit id, as ranks of one job would.
  if (options.save_id.empty()) options.save_id = path.string();
  std::vector<Status> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    if (r == skip) continue;
    threads.emplace_back([&, r] {
      InProcessCoordinator coord(store, r, world);
      OptimizerState local = native::local_shard(full, world, r);
      if (spoil) spoil(local, r);
      results[static_cast<size_t>(r)] = native::save_sharded(local, path, coord, options);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

}  // namespace

TEST_CASE("ranks saving their shards in parallel give the checkpoint of the whole state") {
  testing::TempDir dir;
  const OptimizerState dense = testing::sample_state();
  const OptimizerState eight = *quantize_state(dense, {4, 1});
  for (const OptimizerState* s : {&dense, &eight})
    for (int world = 1; world <= 4; ++world) {
      CAPTURE(world);
      const auto path = dir.path / fmt::format("w{}{}", world, s == &eight ? "q" : "");
      native::ShardedSaveOptions quick;
      quick.timeout = 5s;
      for (const Status& st : save_on_threads(*s, path, world, quick)) CHECK_MESSAGE(st.ok(), st.message());
      auto r = open_checkpoint(path);
      REQUIRE(r.ok());
      CHECK(hash_checkpoint(**r)->root == hash_state(*s)->root);
    }
}

TEST_CASE("a failed or silent rank means no commit, and the previous checkpoint stays") {
  testing::TempDir dir;
  const OptimizerState s = testing::sample_state();
  const auto path = dir.path / "ckpt";
  REQUIRE(find_format("native")->write(s, path, {}).ok());
  const std::string before = hash_checkpoint(**open_checkpoint(path))->root;
  native::ShardedSaveOptions o;
  o.overwrite = true;
  o.timeout = 300ms;

  SUBCASE("a rank whose shard is wrong") {
    auto results = save_on_threads(s, path, 3, o, -1, [](OptimizerState& local, int r) {
      if (r == 1) local.params.at("layers.0.bias").entries.at(kExpAvg).values.size = 0;
    });
    CHECK(!results[1].ok());
    CHECK(!results[0].ok());
    CHECK(results[0].message().find("rank 1 failed") != std::string::npos);
    CHECK(!results[2].ok());
  }
  SUBCASE("a rank that never reports") {
    auto results = save_on_threads(s, path, 3, o, /*skip=*/2);
    CHECK(!results[0].ok());
    CHECK(results[0].message().find("rank 2 did not report") != std::string::npos);
  }
  auto r = open_checkpoint(path);
  REQUIRE(r.ok());
  CHECK(hash_checkpoint(**r)->root == before);
  int entries = 0;
  for (auto& _ : std::filesystem::directory_iterator(dir.path)) ++entries, (void)_;
  CHECK(entries == 1);  // no staging directory left behind
}
