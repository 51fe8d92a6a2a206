#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fnmatch.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "progress.h"
#include "dcp/dcp_layout.h"
#include "optstate/json_fields.h"
#include "optstate/values.h"
#include "registry.h"

namespace optstate::cli {
namespace {

std::string encoding_text(const Entry& e) {
  if (e.encoding == Encoding::kDense) return fmt::format("dense {}", dtype_name(e.dtype));
  return fmt::format("8bit/{} {}", e.block_size, e.qmap);
}

}  // namespace

// A group's plain key as JSON: its value; a one-element tensor as {"tensor": value, "shape": [...]}.
nlohmann::json group_value_json(const GroupValue& v) {
  switch (v.kind) {
    case GroupValue::Kind::kNone: return nullptr;
    case GroupValue::Kind::kBool: return v.i != 0;
    case GroupValue::Kind::kInt: return v.i;
    case GroupValue::Kind::kFloat: return v.f;
    case GroupValue::Kind::kString: return v.s;
    case GroupValue::Kind::kTensor: return {{"tensor", v.f}, {"shape", v.shape}};
  }
  return nullptr;
}

int run_inspect(int argc, char** argv) {
  const CommandSpec spec{"inspect",
                         "optstate inspect CKPT [--json] [--no-stats] [--params GLOB]",
                         "Shows the format, how many ranks' files it holds where they are named by rank\n"
                         "(native, DCP, FSDP's, DeepSpeed's, Megatron's and nanotron's per-rank files), the\n"
                         "optimizer, its param groups and every param's entries: shape, encoding, bytes, step\n"
                         "and value statistics (min/max/mean/non-finite; reading them verifies every chunk\n"
                         "checksum). With --params, only the params whose name matches are shown and read\n"
                         "(the totals stay the checkpoint's).",
                         {{"--json", false, "print one JSON document"},
                          {"--no-stats", false, "metadata only: do not read the values"},
                          {"--params", true, "show only the params whose name matches this shell pattern (* ? [...]; "
                           "e.g. 'layers.3.*')"}},
                         1,
                         1};
  auto args = parse_args(spec, argc, argv);
  if (!args.ok()) return fail("inspect", args.status());
  if (args->has("--help")) {
    std::fputs(help_text(spec).c_str(), stdout);
    return kExitOk;
  }
  Progress progress("inspect");
  auto opened = open_with_progress(args->positional[0], progress);
  if (!opened.ok()) return fail("inspect", opened.status());
  CheckpointReader& reader = **opened;
  const OptimizerState& meta = reader.meta();
  const bool stats = !args->has("--no-stats");
  // One of the two faces is built: at hundreds of thousands of params the JSON document alone
  // took longer than reading every value.
  const bool as_json = args->has("--json");
  const std::string pattern = args->value("--params").value_or("");
  if (args->has("--params") && pattern.empty()) return fail("inspect", invalid_argument("--params needs a pattern"));
  auto shown = [&](const std::string& fqn) { return pattern.empty() || fnmatch(pattern.c_str(), fqn.c_str(), 0) == 0; };
  size_t shown_params = 0;
  for (const auto& [fqn, ps] : meta.params) shown_params += shown(fqn);
  if (shown_params == 0 && !meta.params.empty() && !pattern.empty())
    return fail("inspect", invalid_argument(fmt::format("{}: no param matches '{}' (of {} params)",
                                                        reader.path().string(), pattern, meta.params.size())));

  nlohmann::json j;
  j["path"] = reader.path().string();
  j["format"] = std::string(reader.format());
  const std::optional<int64_t> ranks = reader.ranks();
  j["ranks"] = ranks ? nlohmann::json(*ranks) : nlohmann::json();  // null: not saved per rank
  j["optimizer"] = meta.kind;
  // torch.optim.AdamW's switches (fused, foreach, ...) as the file kept them: how the run stepped.
  const std::span<const AdamWFlags> switches = reader.adamw_flags();
  // The groups' other plain keys (a scheduler's initial_lr, a layer's lr_scale).
  const std::span<const GroupExtras> extras = reader.group_extras();
  auto switch_text = [](FlagValue v) { return v == FlagValue::kNone ? "None" : v == FlagValue::kTrue ? "True" : "False"; };
  nlohmann::json groups = nlohmann::json::array();
  for (size_t g = 0; as_json && g < meta.groups.size(); ++g) {
    nlohmann::json gj = param_group_to_json(meta.groups[g]);
    gj["params"] = meta.groups[g].params.size();  // inspect reports the count; the members are in the param table
    if (switches.size() == meta.groups.size()) {
      nlohmann::json sj = nlohmann::json::object();
      for (const auto& [name, v] : switches[g])
        sj[name] = v == FlagValue::kNone ? nlohmann::json(nullptr) : nlohmann::json(v == FlagValue::kTrue);
      gj["adamw_switches"] = std::move(sj);
    }
    if (extras.size() == meta.groups.size()) {
      nlohmann::json ej = nlohmann::json::object();
      for (const auto& [key, v] : extras[g]) ej[key] = group_value_json(v);
      gj["extras"] = std::move(ej);
    }
    groups.push_back(std::move(gj));
  }
  j["param_groups"] = groups;

  int64_t total_numel = 0, total_state_bytes = 0, total_param_bytes = 0;
  nlohmann::json params = nlohmann::json::object();
  std::string table;
  if (!as_json) {
    table += fmt::format("{:<36} {:<16} {:<5} {:>7} {:>7}  {:<15} {:<26} {:>10}", "PARAM", "SHAPE", "DTYPE", "STEP",
                         "B/PARAM", "ENTRY", "ENCODING", "BYTES");
    if (stats) table += fmt::format(" {:>12} {:>12} {:>12} {:>6}", "MIN", "MAX", "MEAN", "NONFIN");
    table += "\n";
  }
  for (const auto& [fqn, ps] : meta.params) {
    auto numel = checked_numel(ps.shape);
    if (!numel.ok()) return fail("inspect", numel.status());
    total_numel += *numel;
    int64_t param_state_bytes = 0;  // optimizer state of this param (weights excluded)
    for (const auto& [name, e] : ps.entries) {
      int64_t bytes = 0;
      for (Component c : e.components()) bytes += component_bytes(e, c, *numel);
      (name == kParam ? total_param_bytes : param_state_bytes) += bytes;
    }
    total_state_bytes += param_state_bytes;  // the totals are the checkpoint's, shown or not
    if (!shown(fqn)) continue;
    nlohmann::json pj;
    if (as_json)
      pj = {{"shape", ps.shape}, {"dtype", dtype_name(ps.param_dtype)}, {"step", ps.step}, {"group", ps.group},
            {"numel", *numel}};
    nlohmann::json entries = nlohmann::json::object();
    bool first = true;
    const double bpp = *numel ? static_cast<double>(param_state_bytes) / static_cast<double>(*numel) : 0.0;
    if (as_json) pj["state_bytes_per_param"] = bpp;
    for (const auto& [name, e] : ps.entries) {
      int64_t bytes = 0;
      for (Component c : e.components()) bytes += component_bytes(e, c, *numel);
      nlohmann::json ej;
      if (as_json) {
        ej = {{"encoding", encoding_name(e.encoding)}, {"bytes", bytes}};
        if (e.encoding == Encoding::kDense) ej["dtype"] = dtype_name(e.dtype);
        else {
          ej["block_size"] = e.block_size;
          ej["qmap"] = e.qmap;
        }
      } else
        table += fmt::format("{:<36} {:<16} {:<5} {:>7} {:>7}  {:<15} {:<26} {:>10}", first ? fqn : "",
                           first ? format_shape(ps.shape) : "", first ? std::string(dtype_name(ps.param_dtype)) : "",
                           first ? std::to_string(ps.step) : "", first ? fmt::format("{:.3f}", bpp) : "", name,
                           encoding_text(e), human_bytes(bytes));
      if (stats) {
        auto s = entry_stats(reader, fqn, name);
        if (!s.ok()) return fail("inspect", s.status());
        if (as_json)
          ej["stats"] = {{"min", s->min}, {"max", s->max}, {"mean", s->mean()}, {"nonfinite", s->nonfinite}};
        else
          table += fmt::format(" {:>12.4g} {:>12.4g} {:>12.4g} {:>6}", s->min, s->max, s->mean(), s->nonfinite);
      }
      if (as_json) entries[name] = std::move(ej);
      else table += "\n";
      first = false;
    }
    if (!as_json && ps.entries.empty())
      table += fmt::format("{:<36} {:<16} {:<5} {:>7} {:>7}  (no state yet)\n", fqn, format_shape(ps.shape),
                           dtype_name(ps.param_dtype), ps.step, "-");
    if (as_json) {
      pj["entries"] = std::move(entries);
      params[fqn] = std::move(pj);
    }
  }
  progress.finish();
  j["params"] = std::move(params);
  j["not_read"] = reader.not_read();
  j["read_notes"] = reader.all_read_notes();
  nlohmann::json model_tensors = nlohmann::json::array();
  for (const ModelTensorInfo& t : reader.model_tensors())
    model_tensors.push_back({{"name", t.name}, {"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}});
  j["model_tensors"] = model_tensors;
  if (!reader.torchao_package().empty()) j["torchao_package"] = std::string(reader.torchao_package());
  const double per_param = total_numel ? static_cast<double>(total_state_bytes) / static_cast<double>(total_numel) : 0;
  if (!pattern.empty()) j["selected"] = {{"pattern", pattern}, {"params", shown_params}};
  j["totals"] = {{"params", meta.params.size()},
                 {"numel", total_numel},
                 {"state_bytes", total_state_bytes},
                 {"param_bytes", total_param_bytes},
                 {"state_bytes_per_param", per_param}};

  if (as_json) {
    print_json(j);
    return kExitOk;
  }
  std::string out = fmt::format("checkpoint  {} ({}{})\noptimizer   {}, {} param group(s), {} params, {} elements\n",
                                reader.path().string(), reader.format(),
                                ranks ? fmt::format(", files of {} rank{}", *ranks, *ranks == 1 ? "" : "s") : "",
                                meta.kind, meta.groups.size(),
                                meta.params.size(), total_numel);
  // One line per group; a run of groups alike (an optimizer per param: torchtune's optimizer in
  // backward has one group per param) one line for the run.
  std::vector<std::string> group_lines;
  for (size_t g = 0; g < meta.groups.size(); ++g) {
    const auto& h = meta.groups[g].hyper;
    // Only the switches set otherwise than torch's defaults (fused=True), as in a constructor call.
    std::string set;
    if (switches.size() == meta.groups.size())
      for (const auto& [name, fallback] : kAdamWFlagDefaults)
        if (const auto it = switches[g].find(name); it != switches[g].end() && it->second != fallback)
          set += fmt::format(" {}={}", name, switch_text(it->second));
    if (extras.size() == meta.groups.size())
      for (const auto& [key, v] : extras[g]) set += fmt::format(" {}={}", key, dcp::group_value_text(v));
    group_lines.push_back(fmt::format("lr={:g} betas=({:g}, {:g}) eps={:g} weight_decay={:g} amsgrad={} maximize={}{} "
                                      "({} params",
                                      h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.amsgrad, h.maximize, set,
                                      meta.groups[g].params.size()));
  }
  for (size_t g = 0, end = 0; g < group_lines.size(); g = end) {
    for (end = g + 1; end < group_lines.size() && group_lines[end] == group_lines[g];) ++end;
    out += end - g == 1 ? fmt::format("group {:<5} {})\n", g, group_lines[g])
                        : fmt::format("group {:<5} {} each)\n", fmt::format("{}-{}", g, end - 1), group_lines[g]);
  }
  // A pickle names the module that defined the class: each torchao loads only its own package's.
  if (const std::string_view package = reader.torchao_package(); !package.empty())
    out += fmt::format("torchao     moments of {}'s classes: {}\n", package,
                       package == dcp::kTorchaoDefaultPackage ? "torchao 0.11 and later load them"
                                                  : "torchao before 0.11 loads them (for later releases: convert "
                                                    "--torchao-package torchao.optim)");
  // Beside the weights: buffers, a tied weight's second name, frozen params (what a DCP write keeps).
  if (const auto tensors = reader.model_tensors(); !tensors.empty())
    out += fmt::format("model       {}: beside the params' weights, outside the state\n", model_tensors_text(tensors));
  if (const auto rest = reader.not_read(); !rest.empty())
    // Not optimizer state (train_state, a model's buffers), or an encoding read as fp32 values.
    out += fmt::format("other       {}: outside the state read\n", fmt::join(rest, ", "));
  for (const std::string& note : reader.all_read_notes()) out += fmt::format("note        {}\n", note);
  if (!pattern.empty())
    out += fmt::format("shown       {} of {} params, those matching '{}'\n", shown_params, meta.params.size(), pattern);
  out += fmt::format("state       {} ({:.2f} bytes/param){}\n\n", human_bytes(static_cast<double>(total_state_bytes)),
                     per_param,
                     total_param_bytes ? fmt::format(", model weights {}", human_bytes(total_param_bytes)) : "");
  std::fputs((out + table).c_str(), stdout);
  return kExitOk;
}

}  // namespace optstate::cli
