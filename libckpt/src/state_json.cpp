#include "optstate/state_json.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace optstate {
namespace {

using json = nlohmann::json;

Result<const json*> field(const json& j, const char* key, json::value_t type, const std::string& where) {
  if (!j.is_object()) return corrupt(fmt::format("{}: expected an object", where));
  auto it = j.find(key);
  if (it == j.end()) return corrupt(fmt::format("{}: missing field '{}'", where, key));
  const bool ok = type == json::value_t::number_integer ? it->is_number_integer()
                  : type == json::value_t::number_float ? it->is_number()
                                                        : it->type() == type;
  if (!ok) return corrupt(fmt::format("{}: field '{}' has the wrong type", where, key));
  return &*it;
}

template <class T>
Result<T> get(const json& j, const char* key, json::value_t type, const std::string& where) {
  OPTSTATE_ASSIGN_OR_RETURN(const json* v, field(j, key, type, where));
  if constexpr (std::is_same_v<T, int64_t>)
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      return corrupt(fmt::format("{}: field '{}' is out of range", where, key));
  return v->get<T>();
}

}  // namespace

std::string encode_state_meta(const OptimizerState& state) {
  json groups = json::array();
  for (const ParamGroup& g : state.groups) {
    const Hyperparameters& h = g.hyper;
    groups.push_back({{"lr", h.lr},
                      {"betas", {h.beta1, h.beta2}},
                      {"eps", h.eps},
                      {"weight_decay", h.weight_decay},
                      {"amsgrad", h.amsgrad},
                      {"maximize", h.maximize},
                      {"params", g.params}});
  }
  json params = json::object();
  for (const auto& [fqn, ps] : state.params) {
    json entries = json::object();
    for (const auto& [name, e] : ps.entries) {
      json ej = {{"encoding", encoding_name(e.encoding)}};
      if (e.encoding == Encoding::kDense) {
        ej["dtype"] = dtype_name(e.dtype);
      } else {
        ej["block_size"] = e.block_size;
        ej["qmap"] = e.qmap;
      }
      entries[name] = ej;
    }
    params[fqn] = {{"shape", ps.shape},
                   {"dtype", dtype_name(ps.param_dtype)},
                   {"step", ps.step},
                   {"group", ps.group},
                   {"entries", entries}};
  }
  json root = {{"optstate_state", kStateJsonVersion},
               {"state_version", state.format_version},
               {"kind", state.kind},
               {"param_groups", groups},
               {"params", params}};
  return root.dump();
}

Result<OptimizerState> decode_state_meta(std::string_view text, const std::string& where) {
  json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return corrupt(fmt::format("{}: optstate metadata is not valid JSON", where));
  using V = json::value_t;
  OPTSTATE_ASSIGN_OR_RETURN(int64_t version, get<int64_t>(root, "optstate_state", V::number_integer, where));
  if (version > kStateJsonVersion || version < 1)
    return corrupt(fmt::format("{}: optstate metadata version {} (this build reads up to {})", where, version,
                               kStateJsonVersion));
  OptimizerState st;
  OPTSTATE_ASSIGN_OR_RETURN(int64_t sv, get<int64_t>(root, "state_version", V::number_integer, where));
  st.format_version = static_cast<int>(sv);
  OPTSTATE_ASSIGN_OR_RETURN(st.kind, get<std::string>(root, "kind", V::string, where));
  OPTSTATE_ASSIGN_OR_RETURN(const json* groups, field(root, "param_groups", V::array, where));
  if (groups->size() > 100000) return corrupt(where + ": too many param groups");
  for (size_t g = 0; g < groups->size(); ++g) {
    const std::string gw = fmt::format("{}: param_groups[{}]", where, g);
    const json& gj = (*groups)[g];
    ParamGroup pg;
    Hyperparameters& h = pg.hyper;
    OPTSTATE_ASSIGN_OR_RETURN(h.lr, get<double>(gj, "lr", V::number_float, gw));
    OPTSTATE_ASSIGN_OR_RETURN(const json* betas, field(gj, "betas", V::array, gw));
    if (betas->size() != 2 || !(*betas)[0].is_number() || !(*betas)[1].is_number())
      return corrupt(gw + ": 'betas' must be two numbers");
    h.beta1 = (*betas)[0].get<double>();
    h.beta2 = (*betas)[1].get<double>();
    OPTSTATE_ASSIGN_OR_RETURN(h.eps, get<double>(gj, "eps", V::number_float, gw));
    OPTSTATE_ASSIGN_OR_RETURN(h.weight_decay, get<double>(gj, "weight_decay", V::number_float, gw));
    OPTSTATE_ASSIGN_OR_RETURN(h.amsgrad, get<bool>(gj, "amsgrad", V::boolean, gw));
    OPTSTATE_ASSIGN_OR_RETURN(h.maximize, get<bool>(gj, "maximize", V::boolean, gw));
    OPTSTATE_ASSIGN_OR_RETURN(const json* members, field(gj, "params", V::array, gw));
    for (const json& m : *members) {
      if (!m.is_string()) return corrupt(gw + ": 'params' must hold strings");
      pg.params.push_back(m.get<std::string>());
    }
    st.groups.push_back(std::move(pg));
  }
  OPTSTATE_ASSIGN_OR_RETURN(const json* params, field(root, "params", V::object, where));
  for (const auto& [fqn, pj] : params->items()) {
    const std::string pw = fmt::format("{}: param '{}'", where, fqn);
    ParamState ps;
    OPTSTATE_ASSIGN_OR_RETURN(const json* shape, field(pj, "shape", V::array, pw));
    if (shape->size() > static_cast<size_t>(kMaxRank)) return corrupt(pw + ": too many dimensions");
    for (const json& d : *shape) {
      if (!d.is_number_integer()) return corrupt(pw + ": shape must hold integers");
      ps.shape.push_back(d.get<int64_t>());
    }
    auto numel = checked_numel(ps.shape);
    if (!numel.ok()) return numel.status().with_context(pw);
    OPTSTATE_ASSIGN_OR_RETURN(std::string dtype, get<std::string>(pj, "dtype", V::string, pw));
    auto pd = dtype_from_name(dtype);
    if (!pd) return corrupt(fmt::format("{}: unknown dtype '{}'", pw, dtype));
    ps.param_dtype = *pd;
    OPTSTATE_ASSIGN_OR_RETURN(ps.step, get<int64_t>(pj, "step", V::number_integer, pw));
    OPTSTATE_ASSIGN_OR_RETURN(int64_t group, get<int64_t>(pj, "group", V::number_integer, pw));
    if (group < 0 || group >= static_cast<int64_t>(st.groups.size()))
      return corrupt(fmt::format("{}: group {} does not exist", pw, group));
    ps.group = static_cast<int>(group);
    OPTSTATE_ASSIGN_OR_RETURN(const json* entries, field(pj, "entries", V::object, pw));
    for (const auto& [name, ej] : entries->items()) {
      const std::string ew = fmt::format("{}: entry '{}'", where, entry_key(fqn, name));
      Entry e;
      OPTSTATE_ASSIGN_OR_RETURN(std::string enc, get<std::string>(ej, "encoding", V::string, ew));
      auto encoding = encoding_from_name(enc);
      if (!encoding.ok()) return encoding.status().with_context(ew);
      e.encoding = *encoding;
      if (e.encoding == Encoding::kDense) {
        OPTSTATE_ASSIGN_OR_RETURN(std::string edt, get<std::string>(ej, "dtype", V::string, ew));
        auto d = dtype_from_name(edt);
        if (!d) return corrupt(fmt::format("{}: unknown dtype '{}'", ew, edt));
        e.dtype = *d;
      } else {
        e.dtype = DType::kU8;
        OPTSTATE_ASSIGN_OR_RETURN(e.block_size, get<int64_t>(ej, "block_size", V::number_integer, ew));
        OPTSTATE_ASSIGN_OR_RETURN(e.qmap, get<std::string>(ej, "qmap", V::string, ew));
      }
      ps.entries.emplace(name, std::move(e));
    }
    st.params.emplace(fqn, std::move(ps));
  }
  OPTSTATE_RETURN_IF_ERROR(check_structure(st, false).with_context(where));
  return st;
}

}  // namespace optstate
