#include "optstate/state_json.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "optstate/json_fields.h"
#include "optstate/json_strict.h"

namespace optstate {
namespace {

using json = nlohmann::json;

}  // namespace

Status check_json_numbers(const OptimizerState& state) {
  for (size_t g = 0; g < state.groups.size(); ++g)
    if (const auto bad = nonfinite_hyperparameter(state.groups[g].hyper))
      return invalid_argument(fmt::format("param group {}: {} is {}: optstate's JSON metadata holds finite numbers "
                                          "only, so this format cannot record it", g, bad->first, bad->second));
  return Status::Ok();
}

std::string encode_state_meta(const OptimizerState& state) {
  json groups = json::array();
  for (const ParamGroup& g : state.groups) groups.push_back(param_group_to_json(g));
  json params = json::object();
  for (const auto& [fqn, ps] : state.params) {
    json entries = json::object();
    for (const auto& [name, e] : ps.entries) entries[name] = entry_meta_to_json(e);
    params[fqn] = param_header_to_json(ps, std::move(entries));
  }
  json root = {{"optstate_state", kStateJsonVersion},
               {"state_version", state.format_version},
               {"kind", state.kind},
               {"param_groups", groups},
               {"params", params}};
  return root.dump();
}

Result<OptimizerState> decode_state_meta(std::string_view text, const std::string& where) {
  std::optional<std::string> twice;
  std::string refused;
  json root = parse_json_strict(text.data(), text.data() + text.size(), twice, refused);
  if (!refused.empty()) return corrupt(fmt::format("{}: optstate metadata {}", where, refused));
  if (root.is_discarded()) return corrupt(fmt::format("{}: optstate metadata is not valid JSON", where));
  if (twice) return corrupt(fmt::format("{}: optstate metadata names '{}' twice in one object", where, printable(*twice)));
  using V = json::value_t;
  const JsonFields top{root, where};
  OPTSTATE_ASSIGN_OR_RETURN(int64_t version, top.i64("optstate_state"));
  if (version > kStateJsonVersion || version < 1)
    return corrupt(fmt::format("{}: optstate metadata version {} (this build reads up to {})", where, version,
                               kStateJsonVersion));
  OptimizerState st;
  OPTSTATE_ASSIGN_OR_RETURN(int64_t sv, top.i64("state_version"));
  st.format_version = static_cast<int>(sv);
  OPTSTATE_ASSIGN_OR_RETURN(st.kind, top.str("kind"));
  OPTSTATE_ASSIGN_OR_RETURN(const json* groups, top.get("param_groups", V::array));
  if (groups->size() > 100000) return corrupt(where + ": too many param groups");
  for (size_t g = 0; g < groups->size(); ++g) {
    OPTSTATE_ASSIGN_OR_RETURN(ParamGroup pg,
                              param_group_from_json(JsonFields::of((*groups)[g], fmt::format("{}: param_groups[{}]", where, g))));
    st.groups.push_back(std::move(pg));
  }
  OPTSTATE_ASSIGN_OR_RETURN(const json* params, top.get("params", V::object));
  for (const auto& [fqn, pj] : params->items()) {
    const std::string pw = fmt::format("{}: param '{}'", where, fqn);
    const JsonFields fp{pj, pw};
    OPTSTATE_ASSIGN_OR_RETURN(ParamState ps, param_header_from_json(fp, st.groups.size()));
    OPTSTATE_ASSIGN_OR_RETURN(const json* entries, fp.get("entries", V::object));
    for (const auto& [name, ej] : entries->items()) {
      OPTSTATE_ASSIGN_OR_RETURN(Entry e, entry_meta_from_json(
                                             JsonFields{ej, fmt::format("{}: entry '{}'", where, entry_key(fqn, name))}));
      ps.entries.emplace(name, std::move(e));
    }
    st.params.emplace(fqn, std::move(ps));
  }
  OPTSTATE_RETURN_IF_ERROR(check_structure(st, false).with_context(where));
  return st;
}

}  // namespace optstate
