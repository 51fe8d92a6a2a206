#include <fmt/format.h>

#include <fnmatch.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "progress.h"
#include "optstate/hash.h"
#include "registry.h"

namespace optstate::cli {

int run_hash(int argc, char** argv) {
  const CommandSpec spec{"hash",
                         "optstate hash CKPT [--values] [--params GLOB] [--json]",
                         "Prints one XXH3-128 hash per entry ('HEX  <fqn>.<entry>', sorted by name), then the\n"
                         "root hash. Equal states hash equal whatever their sharding, file layout or format.\n"
                         "With --params, only the params whose name matches are read and hashed, and the\n"
                         "root is theirs alone (what a checkpoint of only those params hashes to).\n"
                         "The byte-level definition is docs/hash.md.",
                         {{"--values", false, "hash (dequantized) fp32 values instead of the stored encoding"},
                          {"--params", true, "hash only the params whose name matches this shell pattern (* ? [...]; "
                                             "e.g. 'layers.3.*')"},
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
  const std::string pattern = args->value("--params").value_or("");
  size_t selected = 0;
  if (args->has("--params")) {
    if (pattern.empty()) return fail("hash", invalid_argument("--params needs a pattern"));
    options.params = [&](const std::string& fqn) { return fnmatch(pattern.c_str(), fqn.c_str(), 0) == 0; };
    const auto& params = (*reader)->meta().params;
    selected = static_cast<size_t>(
        std::count_if(params.begin(), params.end(), [&](const auto& p) { return options.params(p.first); }));
    if (!params.empty() && selected == 0)
      return fail("hash", invalid_argument(fmt::format("{}: no param matches '{}' (of {} params)",
                                                       (*reader)->path().string(), pattern, params.size())));
  }
  auto h = hash_checkpoint(**reader, options);
  progress.finish();
  if (!h.ok()) return fail("hash", h.status());
  if (args->has("--json")) {
    nlohmann::json j = {{"root", h->root}, {"entries", h->entries}, {"mode", options.values ? "values" : "raw"}};
    if (!pattern.empty()) j["selected"] = {{"pattern", pattern}, {"params", selected}};
    print_json(j);
  } else {
    for (const auto& [name, hex] : h->entries) std::fputs(fmt::format("{}  {}\n", hex, name).c_str(), stdout);
    std::fputs(fmt::format("{}  (root)\n", h->root).c_str(), stdout);
  }
  return kExitOk;
}

}  // namespace optstate::cli
