#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "progress.h"
#include "optstate/hash.h"
#include "registry.h"

namespace optstate::cli {

int run_hash(int argc, char** argv) {
  const CommandSpec spec{"hash",
                         "optstate hash CKPT [--values] [--json]",
                         "Prints one XXH3-128 hash per entry ('HEX  <fqn>.<entry>', sorted by name), then the\n"
                         "root hash. Equal states hash equal whatever their sharding, file layout or format.\n"
                         "The byte-level definition is docs/hash.md.",
                         {{"--values", false, "hash (dequantized) fp32 values instead of the stored encoding"},
                          {"--json", false, "print {\"root\": HEX, \"entries\": {NAME: HEX}}"}},
                         1,
                         1};
  auto args = parse_args(spec, argc, argv);
  if (!args.ok()) return fail("hash", args.status());
  if (args->has("--help")) {
    std::fputs(help_text(spec).c_str(), stdout);
    return kExitOk;
  }
  Progress progress("hash");
  auto reader = open_with_progress(args->positional[0], progress);
  if (!reader.ok()) return fail("hash", reader.status());
  HashOptions options;
  options.values = args->has("--values");
  auto h = hash_checkpoint(**reader, options);
  progress.finish();
  if (!h.ok()) return fail("hash", h.status());
  if (args->has("--json")) {
    nlohmann::json j = {{"root", h->root}, {"entries", h->entries}, {"mode", options.values ? "values" : "raw"}};
    print_json(j);
  } else {
    for (const auto& [name, hex] : h->entries) std::fputs(fmt::format("{}  {}\n", hex, name).c_str(), stdout);
    std::fputs(fmt::format("{}  (root)\n", h->root).c_str(), stdout);
  }
  return kExitOk;
}

}  // namespace optstate::cli
