#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "progress.h"
#include "optstate/diff.h"
#include "registry.h"

namespace optstate::cli {
namespace {
Result<double> parse_tolerance(const std::string& name, const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && v >= 0 && std::isfinite(v)) return v;
  } catch (...) {
  }
  return invalid_argument(fmt::format("{} needs a non-negative number, got '{}'", name, text));
}
}  // namespace

int run_diff(int argc, char** argv) {
  const CommandSpec spec{"diff",
                         "optstate diff A B [--rtol R] [--atol A] [--params GLOB] [--by-position] [--no-weights] [--json]",
                         "Compares two checkpoints entry by entry on their (dequantized) fp32 values: max abs and\n"
                         "relative difference, and how many elements lie outside |a - b| <= atol + rtol * |b|\n"
                         "(default 0 and 0: exact). Metadata must match: kind, steps, and each param's\n"
                         "hyperparameters (compared param by param: how params are grouped does not matter;\n"
                         "numbers within rtol, so --rtol 1e-7 passes an lr kept as float32, torchao's).\n"
                         "Exit 1 when anything differs beyond tolerance.",
                         {{"--rtol", true, "relative tolerance (default 0)"},
                          {"--atol", true, "absolute tolerance (default 0)"},
                          {"--params", true, "compare only the params whose name matches this shell pattern (* ? [...]; "
                           "e.g. 'layers.3.*'), on either side"},
                          {"--by-position", false, "match params by position in group order, as torch numbers them (a "
                           "side with numbered params, such as a LibTorch archive, by its numbers), not by name"},
                          {"--no-weights", false, "compare optimizer state only: weights ('param' entries) and "
                           "param dtypes are left out"},
                          {"--json", false, "print one JSON document"}},
                         2,
                         2};
  auto args = parse_args(spec, argc, argv);
  if (!args.ok()) return fail("diff", args.status());
  if (args->has("--help")) {
    std::fputs(help_text(spec).c_str(), stdout);
    return kExitOk;
  }
  DiffOptions options;
  for (auto [flag, target] : {std::pair{"--rtol", &options.rtol}, std::pair{"--atol", &options.atol}})
    if (auto v = args->value(flag)) {
      auto t = parse_tolerance(flag, *v);
      if (!t.ok()) return fail("diff", t.status());
      *target = *t;
    }
  options.by_position = args->has("--by-position");
  options.no_weights = args->has("--no-weights");
  options.params = args->value("--params").value_or("");
  if (args->has("--params") && options.params.empty()) return fail("diff", invalid_argument("--params needs a pattern"));
  Progress progress("diff");
  auto a = open_with_progress(args->positional[0], progress);
  if (!a.ok()) return fail("diff", a.status());
  auto b = open_with_progress(args->positional[1], progress);
  if (!b.ok()) return fail("diff", b.status());
  auto report = diff_checkpoints(**a, **b, options);
  progress.finish();
  if (!report.ok()) return fail("diff", report.status());
  if (args->has("--json")) {
    nlohmann::json entries = nlohmann::json::object();
    for (const auto& e : report->entries) {
      nlohmann::json j = {{"count", e.count}, {"outside", e.outside}, {"max_abs", e.max_abs},
                          {"max_rel", e.max_rel}, {"ok", e.ok()}};
      if (!e.problem.empty()) j["problem"] = e.problem;
      entries[e.key] = j;
    }
    nlohmann::json j = {{"ok", report->ok()}, {"rtol", options.rtol}, {"atol", options.atol},
                        {"metadata", report->metadata}, {"entries", entries}};
    if (!report->hint.empty()) j["hint"] = report->hint;
    print_json(j);
  } else {
    for (const auto& m : report->metadata) std::printf("DIFF  %s\n", m.c_str());
    std::printf("%-48s %12s %12s %10s\n", "ENTRY", "MAX ABS", "MAX REL", "OUTSIDE");
    for (const auto& e : report->entries) {
      if (!e.problem.empty())
        std::printf("%-48s %s\n", e.key.c_str(), e.problem.c_str());
      else
        std::printf("%-48s %12.4g %12.4g %10lld%s\n", e.key.c_str(), e.max_abs, e.max_rel,
                    static_cast<long long>(e.outside), e.ok() ? "" : "  <-");
    }
    if (!report->hint.empty()) std::printf("hint: %s\n", report->hint.c_str());
    std::printf("%s\n", report->ok() ? "equal within tolerance" : "different");
  }
  return report->ok() ? kExitOk : kExitFindings;
}

}  // namespace optstate::cli
