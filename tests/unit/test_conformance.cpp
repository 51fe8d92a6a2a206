// The conformance test every format driver passes: write the canonical sample state, sniff it, read
// it back, and get the same hash; refuse to overwrite unless asked. A new driver folder is picked
// up here without touching this file.
#include <doctest/doctest.h>

#include "optstate/hash.h"
#include "registry.h"
#include "test_helpers.h"

using namespace optstate;

TEST_CASE("every format driver round-trips the canonical state with an equal hash") {
  const OptimizerState state = testing::sample_state();
  auto want = hash_state(state);
  REQUIRE(want.ok());
  REQUIRE(!format_drivers().empty());
  for (const FormatDriver* d : format_drivers()) {
    CAPTURE(d->name());
    testing::TempDir dir;
    const auto path = dir.path / ("ckpt." + std::string(d->name()));
    REQUIRE(d->write(state, path, {}).ok());
    CHECK(d->sniff(path));
    for (const FormatDriver* other : format_drivers())
      if (other != d) CHECK_FALSE(other->sniff(path));
    auto reader = open_checkpoint(path);
    REQUIRE(reader.ok());
    CHECK((*reader)->format() == d->name());
    auto got = hash_checkpoint(**reader);
    REQUIRE(got.ok());
    CHECK(got->root == want->root);
    CHECK(got->entries == want->entries);
    CHECK(!d->write(state, path, {}).ok());
    CHECK(d->write(state, path, {.overwrite = true}).ok());
    CHECK(!d->sniff(dir.path / "missing"));
  }
}
