// Checked field access for the JSON documents optstate reads (native manifests, the state metadata
// of safetensors/HDF5): a missing or mistyped field is a corrupt error naming the document and field.
// Header-only; needs nlohmann-json (a dependency of the package).
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "optstate/dtype.h"
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

// A param's own fields {shape, dtype, step, group} (its entries are read by the caller); `groups` is
// how many param groups exist. The native manifest and the safetensors/HDF5 metadata share it.
inline Result<ParamState> param_header_from_json(const JsonFields& f, size_t groups) {
  ParamState ps;
  OPTSTATE_ASSIGN_OR_RETURN(const nlohmann::json* shape, f.get("shape", nlohmann::json::value_t::array));
  if (shape->size() > static_cast<size_t>(kMaxRank)) return corrupt(f.where + ": too many dimensions");
  for (const nlohmann::json& d : *shape) {
    if (!d.is_number_integer()) return corrupt(f.where + ": shape must hold integers");
    ps.shape.push_back(d.get<int64_t>());
  }
  auto numel = checked_numel(ps.shape);
  if (!numel.ok()) return numel.status().with_context(f.where);
  OPTSTATE_ASSIGN_OR_RETURN(std::string dtype, f.str("dtype"));
  auto pd = dtype_from_name(dtype);
  if (!pd) return corrupt(fmt::format("{}: unknown dtype '{}'", f.where, dtype));
  ps.param_dtype = *pd;
  OPTSTATE_ASSIGN_OR_RETURN(ps.step, f.i64("step"));
  OPTSTATE_ASSIGN_OR_RETURN(int64_t group, f.i64("group"));
  if (group < 0 || group >= static_cast<int64_t>(groups))
    return corrupt(fmt::format("{}: group {} does not exist", f.where, group));
  ps.group = static_cast<int>(group);
  return ps;
}

// A param's own fields {shape, dtype, step, group} and its `entries` object.
inline nlohmann::json param_header_to_json(const ParamState& ps, nlohmann::json entries) {
  return {{"shape", ps.shape},
          {"dtype", dtype_name(ps.param_dtype)},
          {"step", ps.step},
          {"group", ps.group},
          {"entries", std::move(entries)}};
}

// An entry's encoding fields: {encoding: "dense", dtype} or {encoding: "blockwise8", block_size, qmap}.
inline nlohmann::json entry_meta_to_json(const Entry& e) {
  nlohmann::json j = {{"encoding", encoding_name(e.encoding)}};
  if (e.encoding == Encoding::kDense) {
    j["dtype"] = dtype_name(e.dtype);
  } else {
    j["block_size"] = e.block_size;
    j["qmap"] = e.qmap;
  }
  return j;
}

inline Result<Entry> entry_meta_from_json(const JsonFields& f) {
  Entry e;
  OPTSTATE_ASSIGN_OR_RETURN(std::string enc, f.str("encoding"));
  auto encoding = encoding_from_name(enc);
  if (!encoding.ok()) return encoding.status().with_context(f.where);
  e.encoding = *encoding;
  if (e.encoding == Encoding::kDense) {
    OPTSTATE_ASSIGN_OR_RETURN(std::string edt, f.str("dtype"));
    auto d = dtype_from_name(edt);
    if (!d) return corrupt(fmt::format("{}: unknown dtype '{}'", f.where, edt));
    e.dtype = *d;
  } else {
    e.dtype = DType::kU8;
    OPTSTATE_ASSIGN_OR_RETURN(e.block_size, f.i64("block_size"));
    OPTSTATE_ASSIGN_OR_RETURN(e.qmap, f.str("qmap"));
    if (e.block_size <= 0 || e.block_size > (int64_t{1} << 20))
      return corrupt(fmt::format("{}: block size {} out of range", f.where, e.block_size));
  }
  return e;
}

}  // namespace optstate
