// Checked field access for the JSON documents optstate reads (native manifests, the state metadata
// of safetensors/HDF5): a missing or mistyped field is a corrupt error naming the document and field.
// Header-only; needs nlohmann-json (a dependency of the package).
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "optstate/state.h"
#include "optstate/status.h"

namespace optstate {

struct JsonFields {
  using json = nlohmann::json;
  const json& j;
  std::string where;

  // A function form, for use inside macro arguments.
  static JsonFields of(const json& j, std::string where) { return {j, std::move(where)}; }

  Result<const json*> get(const char* key, json::value_t type) const {
    if (!j.is_object()) return corrupt(fmt::format("{}: expected an object", where));
    auto it = j.find(key);
    if (it == j.end()) return corrupt(fmt::format("{}: missing field '{}'", where, key));
    const bool ok = type == json::value_t::number_integer ? it->is_number_integer()
                    : type == json::value_t::number_float ? it->is_number()
                                                          : it->type() == type;
    if (!ok) return corrupt(fmt::format("{}: field '{}' has the wrong type", where, key));
    return &*it;
  }
  Result<int64_t> i64(const char* key) const {
    OPTSTATE_ASSIGN_OR_RETURN(const json* v, get(key, json::value_t::number_integer));
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      return corrupt(fmt::format("{}: field '{}' is out of range", where, key));
    return v->get<int64_t>();
  }
  Result<uint64_t> u64(const char* key) const {
    OPTSTATE_ASSIGN_OR_RETURN(int64_t v, i64(key));
    if (v < 0) return corrupt(fmt::format("{}: field '{}' is negative", where, key));
    return static_cast<uint64_t>(v);
  }
  Result<double> f64(const char* key) const {
    OPTSTATE_ASSIGN_OR_RETURN(const json* v, get(key, json::value_t::number_float));
    return v->get<double>();
  }
  Result<bool> boolean(const char* key) const {
    OPTSTATE_ASSIGN_OR_RETURN(const json* v, get(key, json::value_t::boolean));
    return v->get<bool>();
  }
  Result<std::string> str(const char* key) const {
    OPTSTATE_ASSIGN_OR_RETURN(const json* v, get(key, json::value_t::string));
    return v->get<std::string>();
  }
};

// A param group as JSON: {lr, betas: [b1, b2], eps, weight_decay, amsgrad, maximize, params: [...]}.
inline nlohmann::json param_group_to_json(const ParamGroup& g) {
  const Hyperparameters& h = g.hyper;
  return {{"lr", h.lr},           {"betas", {h.beta1, h.beta2}}, {"eps", h.eps}, {"weight_decay", h.weight_decay},
          {"amsgrad", h.amsgrad}, {"maximize", h.maximize},      {"params", g.params}};
}

inline Result<ParamGroup> param_group_from_json(const JsonFields& f) {
  ParamGroup g;
  Hyperparameters& h = g.hyper;
  OPTSTATE_ASSIGN_OR_RETURN(h.lr, f.f64("lr"));
  OPTSTATE_ASSIGN_OR_RETURN(const nlohmann::json* betas, f.get("betas", nlohmann::json::value_t::array));
  if (betas->size() != 2 || !(*betas)[0].is_number() || !(*betas)[1].is_number())
    return corrupt(fmt::format("{}: 'betas' must be two numbers", f.where));
  h.beta1 = (*betas)[0].get<double>();
  h.beta2 = (*betas)[1].get<double>();
  OPTSTATE_ASSIGN_OR_RETURN(h.eps, f.f64("eps"));
  OPTSTATE_ASSIGN_OR_RETURN(h.weight_decay, f.f64("weight_decay"));
  OPTSTATE_ASSIGN_OR_RETURN(h.amsgrad, f.boolean("amsgrad"));
  OPTSTATE_ASSIGN_OR_RETURN(h.maximize, f.boolean("maximize"));
  OPTSTATE_ASSIGN_OR_RETURN(const nlohmann::json* members, f.get("params", nlohmann::json::value_t::array));
  for (const nlohmann::json& name : *members) {
    if (!name.is_string()) return corrupt(f.where + ": 'params' must hold strings");
    g.params.push_back(name.get<std::string>());
  }
  return g;
}

}  // namespace optstate
