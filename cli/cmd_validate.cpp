#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "progress.h"
#include "optstate/validate.h"
#include "registry.h"

namespace optstate::cli {

int run_validate(int argc, char** argv) {
  const CommandSpec spec{"validate",
                         "optstate validate CKPT [--json]",
                         "Checks a checkpoint: manifest and sizes, every chunk's checksum, coverage of every\n"
                         "element exactly once, and state sanity (finite values, exp_avg_sq >= 0, absmax finite\n"
                         "and >= 0 (0: a block of zeros, as bitsandbytes leaves it), steps consistent with the\n"
                         "state, hyperparameters finite and in what torch.optim.AdamW takes). Exit 1 when\n"
                         "anything is found, each finding named.",
                         {{"--json", false, "print {\"ok\": bool, \"findings\": [...]}"}},
                         1,
                         1};
  auto args = parse_args(spec, argc, argv);
  if (!args.ok()) return fail("validate", args.status());
  if (args->has("--help")) {
    std::fputs(help_text(spec).c_str(), stdout);
    return kExitOk;
  }
  const std::filesystem::path path = args->positional[0];
  Progress progress("validate");
  auto report = validate_checkpoint(path, [&](const std::filesystem::path& p) { return open_with_progress(p, progress); });
  progress.finish();
  if (!report.ok()) return fail("validate", report.status());
  if (args->has("--json")) {
    nlohmann::json findings = nlohmann::json::array();
    for (const auto& f : report->findings) findings.push_back({{"entry", f.entry}, {"message", f.message}});
    nlohmann::json j = {{"path", path.string()},
                        {"ok", report->ok()},
                        {"entries_checked", report->entries_checked},
                        {"values_checked", report->values_checked},
                        {"checksums_verified", report->checksums_verified},
                        {"unchecked", report->checksums_verified ? nlohmann::json()  // null
                                                                 : nlohmann::json(report->unchecked)},
                        {"file_digests", report->file_digests.empty() ? nlohmann::json()  // null
                                                                      : nlohmann::json(report->file_digests)},
                        {"findings", findings}};
    print_json(j);
  } else if (report->ok()) {
    std::printf("ok: %s: %lld entries, %lld values, %s%s%s\n", path.c_str(),
                static_cast<long long>(report->entries_checked), static_cast<long long>(report->values_checked),
                report->checksums_verified ? "every chunk checksum verified"
                                           : (report->unchecked + " (sizes, coverage and values checked)").c_str(),
                report->file_digests.empty() ? "" : "; ", report->file_digests.c_str());
  } else {
    for (const auto& f : report->findings) std::printf("FINDING  %s\n", f.message.c_str());
    std::printf("%s: %zu finding(s)\n", path.c_str(), report->findings.size());
  }
  return report->ok() ? kExitOk : kExitFindings;
}

}  // namespace optstate::cli
