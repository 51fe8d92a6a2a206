// JSON as the format drivers read it: no object may hold a key twice. JSON leaves duplicates to the
// reader and nlohmann keeps the last one, so a file could say two things and be read as one of them
// (a safetensors header naming a tensor twice, at two places): such a document is refused.
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "optstate/io.h"

namespace optstate {

// How deep arrays and objects may nest. What optstate reads nests a few levels (a native manifest:
// 8); nlohmann's parser and destructor keep their own stacks, but its dump() (the manifest
// checksum) and copies recurse once per level: a hostile 10 MB manifest of brackets overflowed the
// call stack there.
inline constexpr std::size_t kMaxJsonDepth = 100;

// What one value of the document costs at most, its slot and its container's share (a 256 MB
// manifest of `{},` took 9.2 GB: 105 bytes a value). The values are capped at parser_memory_budget
// (a quarter of the memory this process may use): a real manifest holds a value per 13 bytes or
// more, so even the largest one read (256 MB) stays under the cap of a 16 GB machine.
inline constexpr std::size_t kJsonBytesPerValue = 128;

// Parses [begin, end) as one JSON document (discarded when it is not one, or when it nests deeper
// than kMaxJsonDepth or holds more values than `max_values`, 0: the memory cap above; then
// `refused` says which, e.g. "nested deeper than 100 levels"), setting `duplicate` to the first key
// that appears twice in one object. A SAX handler that builds the document itself:
// a key is inserted into its object's map as it is read, and the insertion says whether the object
// held it already, so the check costs no lookup of its own. (nlohmann's callback parser, the other
// way to see keys, scans an object's parent at the end of each object: quadratic; a set of each
// object's keys beside nlohmann's DOM builder copied every key twice more.)
inline nlohmann::json parse_json_strict(const char* begin, const char* end, std::optional<std::string>& duplicate,
                                        std::string& refused, std::size_t max_values = 0) {
  using json = nlohmann::json;
  const bool by_machine = max_values == 0;
  if (by_machine) max_values = static_cast<std::size_t>(parser_memory_budget() / kJsonBytesPerValue);
  struct StrictDom {
    json& root;
    std::optional<std::string>& duplicate;
    std::string& refused;
    std::size_t values_left;
    bool over_cap = false;
    std::vector<json*> open;   // the arrays and objects being filled, innermost last
    json* member = nullptr;    // the slot the last key made in the innermost object

    // Where the next value goes: the root, the end of the innermost array, or the object's slot;
    // nullptr (which stops the parse) past the cap on values.
    json* place(json&& v) {
      if (values_left == 0) return over_cap = true, nullptr;
      --values_left;
      if (open.empty()) {
        root = std::move(v);
        return &root;
      }
      json& top = *open.back();
      if (top.is_array()) return &top.get_ref<json::array_t&>().emplace_back(std::move(v));
      *member = std::move(v);
      return member;
    }
    bool enter(json::value_t kind) {
      if (open.size() >= kMaxJsonDepth) {  // stops the parse: discarded
        refused = fmt::format("nested deeper than {} levels", kMaxJsonDepth);
        return false;
      }
      json* slot = place(json(kind));
      if (slot) open.push_back(slot);
      return slot != nullptr;
    }
    bool null() { return place(json(nullptr)) != nullptr; }
    bool boolean(bool v) { return place(json(v)) != nullptr; }
    bool number_integer(json::number_integer_t v) { return place(json(v)) != nullptr; }
    bool number_unsigned(json::number_unsigned_t v) { return place(json(v)) != nullptr; }
    bool number_float(json::number_float_t v, const json::string_t&) { return place(json(v)) != nullptr; }
    bool string(json::string_t& v) { return place(json(v)) != nullptr; }
    bool binary(json::binary_t& v) { return place(json(json::binary_t(v))) != nullptr; }
    bool start_object(std::size_t) { return enter(json::value_t::object); }
    bool key(json::string_t& k) {
      auto [it, inserted] = open.back()->get_ref<json::object_t&>().try_emplace(k);
      if (!inserted && !duplicate) duplicate = k;
      member = &it->second;
      return true;
    }
    bool end_object() { return open.pop_back(), true; }
    bool start_array(std::size_t) { return enter(json::value_t::array); }
    bool end_array() { return open.pop_back(), true; }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }
  };
  json root;
  refused.clear();
  StrictDom sax{root, duplicate, refused, max_values, false, {}, nullptr};
  if (!json::sax_parse(begin, end, &sax)) {
    if (sax.over_cap)
      refused = fmt::format("of more than {} values, which would take more than {:.3g} GiB of memory{}", max_values,
                            static_cast<double>(max_values) * kJsonBytesPerValue / double(1 << 30),
                            by_machine ? " (a quarter of this machine's)" : "");
    return json(json::value_t::discarded);
  }
  return root;
}

}  // namespace optstate
