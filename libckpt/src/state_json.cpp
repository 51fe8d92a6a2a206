#include "optstate/state_json.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "optstate/json_fields.h"
#include "optstate/json_strict.h"

namespace optstate {
namespace {

using json = nlohmann::json;

// More than any real state holds; param_header_from_json checks a param's group against it, as the
// groups may not have been read yet.
constexpr size_t kMaxParamGroups = 100000;

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
  using V = json::value_t;
  OptimizerState st;
  // Each param as it is read (its group checked by check_structure, once the groups are known: JSON
  // leaves the order of keys to the writer); the first problem is kept and reported after those of
  // the whole document and of its top-level fields, which come first.
  Status first_error = Status::Ok();
  auto on_param = [&](std::string& fqn, json&& pj) {
    const auto emplaced = st.params.try_emplace(std::move(fqn));
    const auto it = emplaced.first;  // not a structured binding: the lambda below captures it (clang < 16 cannot)
    if (!emplaced.second) {
      if (!twice) twice = it->first;
      return;
    }
    if (!first_error.ok()) return;
    first_error = [&]() -> Status {
      const std::string& name = it->first;
      const JsonFields fp{pj, fmt::format("{}: param '{}'", where, name)};
      OPTSTATE_ASSIGN_OR_RETURN(ParamState ps, param_header_from_json(fp, kMaxParamGroups));
      OPTSTATE_ASSIGN_OR_RETURN(const json* entries, fp.get("entries", V::object));
      for (const auto& [entry, ej] : entries->items()) {
        OPTSTATE_ASSIGN_OR_RETURN(Entry e, entry_meta_from_json(JsonFields{
                                               ej, fmt::format("{}: entry '{}'", where, entry_key(name, entry))}));
        ps.entries.emplace(entry, std::move(e));
      }
      it->second = std::move(ps);
      return Status::Ok();
    }();
  };
  static const std::vector<std::string_view> kParamsPath{"params"};
  const json root =
      parse_json_strict_members(text.data(), text.data() + text.size(), kParamsPath, on_param, twice, refused);
  if (!refused.empty()) return corrupt(fmt::format("{}: optstate metadata {}", where, refused));
  if (root.is_discarded()) return corrupt(fmt::format("{}: optstate metadata is not valid JSON", where));
  if (twice) return corrupt(fmt::format("{}: optstate metadata names '{}' twice in one object", where, printable(*twice)));
  const JsonFields top{root, where};
  OPTSTATE_ASSIGN_OR_RETURN(int64_t version, top.i64("optstate_state"));
  if (version > kStateJsonVersion || version < 1)
    return corrupt(fmt::format("{}: optstate metadata version {} (this build reads up to {})", where, version,
                               kStateJsonVersion));
  OPTSTATE_ASSIGN_OR_RETURN(int64_t sv, top.i64("state_version"));
  st.format_version = static_cast<int>(sv);
  OPTSTATE_ASSIGN_OR_RETURN(st.kind, top.str("kind"));
  OPTSTATE_ASSIGN_OR_RETURN(const json* groups, top.get("param_groups", V::array));
  if (groups->size() > kMaxParamGroups) return corrupt(where + ": too many param groups");
  for (size_t g = 0; g < groups->size(); ++g) {
    OPTSTATE_ASSIGN_OR_RETURN(ParamGroup pg,
                              param_group_from_json(JsonFields::of((*groups)[g], fmt::format("{}: param_groups[{}]", where, g))));
    st.groups.push_back(std::move(pg));
  }
  OPTSTATE_RETURN_IF_ERROR(top.get("params", V::object).status());  // its members were read as the text was
  OPTSTATE_RETURN_IF_ERROR(first_error);
  OPTSTATE_RETURN_IF_ERROR(check_structure(st, false).with_context(where));
  return st;
}

}  // namespace optstate
