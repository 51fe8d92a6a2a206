// JSON as the format drivers read it: no object may hold a key twice. JSON leaves duplicates to the
// reader and nlohmann keeps the last one, so a file could say two things and be read as one of them
// (a safetensors header naming a tensor twice, at two places): such a document is refused.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace optstate {

// How deep arrays and objects may nest. What optstate reads nests a few levels (a native manifest:
// 8); nlohmann's parser and destructor keep their own stacks, but its dump() (the manifest
// checksum) and copies recurse once per level: a hostile 10 MB manifest of brackets overflowed the
// call stack there.
inline constexpr std::size_t kMaxJsonDepth = 100;

// Parses [begin, end) as one JSON document (discarded when it is not one, or when it nests deeper
// than kMaxJsonDepth: then `too_deep` is set), setting `duplicate` to the first key that appears
// twice in one object. A SAX handler that builds the document itself:
// a key is inserted into its object's map as it is read, and the insertion says whether the object
// held it already, so the check costs no lookup of its own. (nlohmann's callback parser, the other
// way to see keys, scans an object's parent at the end of each object: quadratic; a set of each
// object's keys beside nlohmann's DOM builder copied every key twice more.)
inline nlohmann::json parse_json_strict(const char* begin, const char* end, std::optional<std::string>& duplicate,
                                        bool& too_deep) {
  using json = nlohmann::json;
  struct StrictDom {
    json& root;
    std::optional<std::string>& duplicate;
    bool& too_deep;
    std::vector<json*> open;   // the arrays and objects being filled, innermost last
    json* member = nullptr;    // the slot the last key made in the innermost object

    // Where the next value goes: the root, the end of the innermost array, or the object's slot.
    json* place(json&& v) {
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
      if (open.size() >= kMaxJsonDepth) return too_deep = true, false;  // stops the parse: discarded
      open.push_back(place(json(kind)));
      return true;
    }
    bool null() { return place(json(nullptr)), true; }
    bool boolean(bool v) { return place(json(v)), true; }
    bool number_integer(json::number_integer_t v) { return place(json(v)), true; }
    bool number_unsigned(json::number_unsigned_t v) { return place(json(v)), true; }
    bool number_float(json::number_float_t v, const json::string_t&) { return place(json(v)), true; }
    bool string(json::string_t& v) { return place(json(v)), true; }
    bool binary(json::binary_t& v) { return place(json(json::binary_t(v))), true; }
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
  too_deep = false;
  StrictDom sax{root, duplicate, too_deep, {}, nullptr};
  if (!json::sax_parse(begin, end, &sax)) return json(json::value_t::discarded);
  return root;
}

}  // namespace optstate
