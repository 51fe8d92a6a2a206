// JSON as the format drivers read it: no object may hold a key twice. JSON leaves duplicates to the
// reader and nlohmann keeps the last one, so a file could say two things and be read as one of them
// (a safetensors header naming a tensor twice, at two places): such a document is refused.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace optstate {

// Parses [begin, end) as one JSON document (discarded when it is not one), setting `duplicate` to
// the first key that appears twice in one object. A SAX handler that builds the document as
// nlohmann's own parser does and sees each key on the way: nlohmann's callback parser, the other
// way to see keys, scans an object's parent at the end of each object (quadratic: a manifest of
// 3,000 params spent a third of its parse there).
inline nlohmann::json parse_json_strict(const char* begin, const char* end, std::optional<std::string>& duplicate) {
  using json = nlohmann::json;
  struct StrictDom {
    nlohmann::detail::json_sax_dom_parser<json> dom;
    std::vector<std::unordered_set<std::string>> open_objects;
    std::optional<std::string>& duplicate;

    bool null() { return dom.null(); }
    bool boolean(bool v) { return dom.boolean(v); }
    bool number_integer(json::number_integer_t v) { return dom.number_integer(v); }
    bool number_unsigned(json::number_unsigned_t v) { return dom.number_unsigned(v); }
    bool number_float(json::number_float_t v, const json::string_t& s) { return dom.number_float(v, s); }
    bool string(json::string_t& v) { return dom.string(v); }
    bool binary(json::binary_t& v) { return dom.binary(v); }
    bool start_object(std::size_t n) {
      open_objects.emplace_back();
      return dom.start_object(n);
    }
    bool key(json::string_t& k) {
      if (!duplicate && !open_objects.empty() && !open_objects.back().insert(k).second) duplicate = k;
      return dom.key(k);
    }
    bool end_object() {
      if (!open_objects.empty()) open_objects.pop_back();
      return dom.end_object();
    }
    bool start_array(std::size_t n) { return dom.start_array(n); }
    bool end_array() { return dom.end_array(); }
    bool parse_error(std::size_t pos, const std::string& token, const nlohmann::detail::exception& e) {
      return dom.parse_error(pos, token, e);
    }
  };
  json root;
  StrictDom sax{nlohmann::detail::json_sax_dom_parser<json>(root, /*allow_exceptions=*/false), {}, duplicate};
  if (!json::sax_parse(begin, end, &sax) || sax.dom.is_errored()) return json(json::value_t::discarded);
  return root;
}

}  // namespace optstate
