#include "native_manifest.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <unordered_set>

#include "optstate/json_strict.h"
#include "optstate/hash.h"
#include "optstate/io.h"
#include "optstate/json_fields.h"

namespace optstate::native {
namespace {

using json = nlohmann::json;

using Fields = JsonFields;

Result<uint64_t> parse_hex64(const std::string& s, const std::string& where) {
  if (s.size() != 16) return corrupt(fmt::format("{}: checksum '{}' is not 16 hex digits", where, s));
  uint64_t v = 0;
  for (char ch : s) {
    int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
    if (d < 0) return corrupt(fmt::format("{}: checksum '{}' is not lowercase hex", where, s));
    v = v << 4 | static_cast<uint64_t>(d);
  }
  return v;
}

// The checksum of the manifest's text without its "manifest_xxh3" key (removed from `body` here:
// every caller sets or has read it, and a copy of a large manifest costs more than its parse).
std::string body_checksum(json& body) {
  body.erase("manifest_xxh3");
  const std::string text = body.dump();
  return xxh3_64_hex(std::as_bytes(std::span(text)));
}

Result<Manifest> parse_body(const json& root, const std::filesystem::path& dir, const std::string& mpath) {
  Manifest m;
  Fields top{root, mpath};
  OPTSTATE_ASSIGN_OR_RETURN(const json* opt, top.get("optimizer", json::value_t::object));
  Fields fopt{*opt, mpath + ": optimizer"};
  OPTSTATE_ASSIGN_OR_RETURN(m.state.kind, fopt.str("kind"));
  OPTSTATE_ASSIGN_OR_RETURN(const json* groups, fopt.get("param_groups", json::value_t::array));
  if (groups->size() > 100000) return corrupt(mpath + ": too many param groups");
  for (size_t g = 0; g < groups->size(); ++g) {
    Fields fg{(*groups)[g], fmt::format("{}: param_groups[{}]", mpath, g)};
    OPTSTATE_ASSIGN_OR_RETURN(ParamGroup group, param_group_from_json(fg));
    m.state.groups.push_back(std::move(group));
  }

  OPTSTATE_ASSIGN_OR_RETURN(const json* files, top.get("files", json::value_t::array));
  if (files->size() > 1000000) return corrupt(mpath + ": too many data files");
  std::unordered_set<std::string> listed;
  for (size_t i = 0; i < files->size(); ++i) {
    Fields ff{(*files)[i], fmt::format("{}: files[{}]", mpath, i)};
    DataFile df;
    OPTSTATE_ASSIGN_OR_RETURN(df.rel_path, ff.str("path"));
    OPTSTATE_ASSIGN_OR_RETURN(df.size, ff.u64("size"));
    auto full = contained_path(dir, df.rel_path);
    if (!full.ok()) return corrupt(fmt::format("{}: {}", ff.where, full.status().message()));
    df.full_path = *full;
    if (!listed.insert(df.rel_path).second)
      return corrupt(fmt::format("{}: '{}' listed twice", ff.where, df.rel_path));
    m.files.push_back(std::move(df));
  }

  OPTSTATE_ASSIGN_OR_RETURN(const json* params, top.get("params", json::value_t::object));
  for (const auto& [fqn, pj] : params->items()) {
    const std::string pwhere = fmt::format("{}: param '{}'", mpath, fqn);
    Fields fp{pj, pwhere};
    OPTSTATE_ASSIGN_OR_RETURN(ParamState ps, param_header_from_json(fp, m.state.groups.size()));
    const int64_t numel = checked_numel(ps.shape).value();  // checked by param_header_from_json

    OPTSTATE_ASSIGN_OR_RETURN(const json* entries, fp.get("entries", json::value_t::object));
    for (const auto& [ename, ej] : entries->items()) {
      const std::string ewhere = fmt::format("{}: entry '{}'", mpath, entry_key(fqn, ename));
      Fields fe{ej, ewhere};
      OPTSTATE_ASSIGN_OR_RETURN(Entry e, entry_meta_from_json(fe));
      OPTSTATE_ASSIGN_OR_RETURN(const json* comps, fe.get("components", json::value_t::object));
      for (Component c : e.components()) {
        const std::string cname(component_name(c));
        const std::string cwhere = fmt::format("{} {}", ewhere, cname);
        auto cj = comps->find(cname);
        if (cj == comps->end() || !cj->is_array()) return corrupt(cwhere + ": missing chunk list");
        const int64_t count = component_count(e, c, numel);
        const int64_t elem = component_elem_size(e, c);
        std::vector<Chunk> chunks;
        for (const json& chj : *cj) {
          Fields fc{chj, cwhere};
          Chunk ch;
          OPTSTATE_ASSIGN_OR_RETURN(int64_t file, fc.i64("file"));
          if (file < 0 || file >= static_cast<int64_t>(m.files.size()))
            return corrupt(fmt::format("{}: chunk names file {} of {}", cwhere, file, m.files.size()));
          ch.file = static_cast<size_t>(file);
          OPTSTATE_ASSIGN_OR_RETURN(ch.offset, fc.u64("offset"));
          OPTSTATE_ASSIGN_OR_RETURN(ch.begin, fc.i64("begin"));
          OPTSTATE_ASSIGN_OR_RETURN(ch.end, fc.i64("end"));
          OPTSTATE_ASSIGN_OR_RETURN(std::string sum, fc.str("xxh3"));
          OPTSTATE_ASSIGN_OR_RETURN(ch.xxh3, parse_hex64(sum, cwhere));
          if (ch.begin < 0 || ch.end < ch.begin || ch.end > count)
            return corrupt(fmt::format("{}: chunk range [{}, {}) outside [0, {})", cwhere, ch.begin, ch.end, count));
          ch.length = static_cast<uint64_t>(ch.end - ch.begin) * static_cast<uint64_t>(elem);
          const uint64_t fsize = m.files[ch.file].size;
          if (ch.offset > fsize || ch.length > fsize - ch.offset)
            return corrupt(fmt::format("{}: chunk bytes [{}, {}) lie outside '{}' ({} bytes)", cwhere, ch.offset,
                                       ch.offset + ch.length, m.files[ch.file].rel_path, fsize));
          chunks.push_back(ch);
        }
        std::sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
        int64_t covered = 0;
        for (const Chunk& ch : chunks) {
          if (ch.begin != covered)
            return corrupt(fmt::format("{}: elements [{}, {}) {}", cwhere, std::min(covered, ch.begin),
                                       std::max(covered, ch.begin),
                                       ch.begin > covered ? "are not covered by any chunk" : "are covered twice"));
          covered = ch.end;
        }
        if (covered != count)
          return corrupt(fmt::format("{}: elements [{}, {}) are not covered by any chunk", cwhere, covered, count));
        m.chunks[ChunkKey{fqn, ename, c}] = std::move(chunks);
      }
      ps.entries.emplace(ename, std::move(e));
    }
    m.state.params.emplace(fqn, std::move(ps));
  }
  OPTSTATE_RETURN_IF_ERROR(check_structure(m.state, false).with_context(mpath));
  return m;
}

}  // namespace

Result<Manifest> parse_manifest(std::span<const std::byte> bytes, const std::filesystem::path& dir) {
  const std::string mpath = (dir / kManifestName).string();
  std::optional<std::string> twice;
  std::string refused;
  json root = parse_json_strict(reinterpret_cast<const char*>(bytes.data()),
                                reinterpret_cast<const char*>(bytes.data()) + bytes.size(), twice, refused);
  if (!refused.empty()) return corrupt(fmt::format("{}: JSON {}", mpath, refused));
  if (root.is_discarded() || !root.is_object()) return corrupt(mpath + ": not a valid JSON manifest");
  if (twice) return corrupt(fmt::format("{}: an object names '{}' twice", mpath, printable(*twice)));
  // Format and version first: a newer manifest may compute its checksum differently.
  Fields top{root, mpath};
  OPTSTATE_ASSIGN_OR_RETURN(std::string tag, top.str("format"));
  if (tag != kFormatTag) return corrupt(fmt::format("{}: format is '{}', expected '{}'", mpath, tag, kFormatTag));
  OPTSTATE_ASSIGN_OR_RETURN(int64_t version, top.i64("version"));
  if (version > kManifestVersion)
    return unsupported(fmt::format("{}: manifest version {} is newer than this optstate reads (up to {})", mpath,
                                   version, kManifestVersion));
  if (version < 1) return corrupt(fmt::format("{}: manifest version {} is invalid", mpath, version));
  OPTSTATE_ASSIGN_OR_RETURN(std::string sum, top.str("manifest_xxh3"));
  const std::string want = body_checksum(root);
  if (sum != want)
    return corrupt(fmt::format("{}: manifest checksum mismatch (says {}, content gives {})", mpath, sum, want));
  try {
    return parse_body(root, dir, mpath);
  } catch (const json::exception& e) {  // defensive: Fields checks types before every get<>()
    return corrupt(fmt::format("{}: {}", mpath, e.what()));
  }
}

Status check_manifest_size(uint64_t bytes, size_t params, const std::string& where) {
  if (bytes <= kMaxManifestBytes) return Status::Ok();
  return invalid_argument(fmt::format("{}: the manifest of {} params would be {} bytes, over the {} MiB the reader "
                                      "takes; write this state as dcp or hdf5",
                                      where, params, bytes, kMaxManifestBytes >> 20));
}

namespace {

json files_json(const Manifest& m) {
  json files = json::array();
  for (const DataFile& f : m.files) files.push_back({{"path", f.rel_path}, {"size", f.size}});
  return files;
}

json optimizer_json(const Manifest& m) {
  json groups = json::array();
  for (const ParamGroup& g : m.state.groups) groups.push_back(param_group_to_json(g));
  return {{"kind", m.state.kind}, {"state_version", m.state.format_version}, {"param_groups", groups}};
}

json param_json(const Manifest& m, const std::string& fqn, const ParamState& ps) {
  json entries = json::object();
  for (const auto& [name, e] : ps.entries) {
    json ej = entry_meta_to_json(e);
    json comps = json::object();
    for (Component c : e.components()) {
      json list = json::array();
      auto it = m.chunks.find(ChunkKey{fqn, name, c});
      if (it != m.chunks.end())
        for (const Chunk& ch : it->second)
          list.push_back({{"file", ch.file},
                          {"offset", ch.offset},
                          {"begin", ch.begin},
                          {"end", ch.end},
                          {"xxh3", u64_hex(ch.xxh3)}});
      comps[std::string(component_name(c))] = std::move(list);
    }
    ej["components"] = std::move(comps);
    entries[name] = std::move(ej);
  }
  return param_header_to_json(ps, std::move(entries));
}

// `text`, a value nlohmann printed with indent 1 at depth 0, as it prints it `depth` levels down:
// each line after the first indented by `depth` more (JSON text holds no raw line break in a string).
void append_at_depth(std::string& out, const std::string& text, size_t depth) {
  for (char ch : text) {
    out += ch;
    if (ch == '\n') out.append(depth, ' ');
  }
}

}  // namespace

// The text nlohmann's dump(1) gives of the whole manifest (serialize_manifest_as_one_document), and
// the checksum over its compact dump() without manifest_xxh3, made a param at a time: one document
// of every param built, printed twice and freed was a third of writing 200,000 params.
std::string serialize_manifest(const Manifest& m) {
  const json files = files_json(m), optimizer = optimizer_json(m);
  const std::string format = json(kFormatTag).dump(), version = json(kManifestVersion).dump();
  // Both texts list the root's keys sorted, as nlohmann's objects (std::map) do.
  std::string compact = "{\"files\":" + files.dump() + ",\"format\":" + format +
                        ",\"optimizer\":" + optimizer.dump() + ",\"params\":{";
  std::string params;  // the members of "params", at depth 2
  bool first = true;
  for (const auto& [fqn, ps] : m.state.params) {
    const json pj = param_json(m, fqn, ps);
    const std::string key = json(fqn).dump();
    if (!first) {
      compact += ',';
      params += ',';
    }
    first = false;
    compact += key;
    compact += ':';
    compact += pj.dump();
    params += "\n  ";
    params += key;
    params += ": ";
    append_at_depth(params, pj.dump(1), 2);
  }
  compact += "},\"version\":" + version + "}";
  const std::string sum = xxh3_64_hex(std::as_bytes(std::span(compact)));
  std::string out = "{\n \"files\": ";
  append_at_depth(out, files.dump(1), 1);
  out += ",\n \"format\": " + format + ",\n \"manifest_xxh3\": " + json(sum).dump() + ",\n \"optimizer\": ";
  append_at_depth(out, optimizer.dump(1), 1);
  out += ",\n \"params\": ";
  out += m.state.params.empty() ? "{}" : "{" + params + "\n }";
  out += ",\n \"version\": " + version + "\n}\n";
  return out;
}

std::string serialize_manifest_as_one_document(const Manifest& m) {
  json root = json::object();
  root["format"] = kFormatTag;
  root["version"] = kManifestVersion;
  root["optimizer"] = optimizer_json(m);
  root["files"] = files_json(m);
  json params = json::object();
  for (const auto& [fqn, ps] : m.state.params) params[fqn] = param_json(m, fqn, ps);
  root["params"] = std::move(params);
  root["manifest_xxh3"] = body_checksum(root);
  return root.dump(1) + "\n";
}

std::string encode_rank_file(const RankFile& rf) {
  json chunks = json::array();
  for (const auto& [key, ch] : rf.chunks)
    chunks.push_back({{"fqn", key.fqn}, {"entry", key.entry}, {"component", component_name(key.component)},
                      {"offset", ch.offset}, {"begin", ch.begin}, {"end", ch.end}, {"xxh3", u64_hex(ch.xxh3)}});
  return json{{"size", rf.size}, {"chunks", chunks}}.dump();
}

Result<RankFile> decode_rank_file(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return corrupt("rank report is not JSON");
  Fields top{j, "rank report"};
  RankFile rf;
  OPTSTATE_ASSIGN_OR_RETURN(rf.size, top.u64("size"));
  OPTSTATE_ASSIGN_OR_RETURN(const json* chunks, top.get("chunks", json::value_t::array));
  for (const json& cj : *chunks) {
    Fields f{cj, "rank report chunk"};
    ChunkKey key;
    Chunk ch;
    OPTSTATE_ASSIGN_OR_RETURN(key.fqn, f.str("fqn"));
    OPTSTATE_ASSIGN_OR_RETURN(key.entry, f.str("entry"));
    OPTSTATE_ASSIGN_OR_RETURN(std::string comp, f.str("component"));
    OPTSTATE_ASSIGN_OR_RETURN(key.component, component_from_name(comp));
    OPTSTATE_ASSIGN_OR_RETURN(ch.offset, f.u64("offset"));
    OPTSTATE_ASSIGN_OR_RETURN(ch.begin, f.i64("begin"));
    OPTSTATE_ASSIGN_OR_RETURN(ch.end, f.i64("end"));
    OPTSTATE_ASSIGN_OR_RETURN(std::string sum, f.str("xxh3"));
    OPTSTATE_ASSIGN_OR_RETURN(ch.xxh3, parse_hex64(sum, "rank report chunk"));
    rf.chunks.emplace_back(key, ch);
  }
  return rf;
}

std::optional<std::string> resign_manifest_for_tests(const std::string& text) {
  std::optional<std::string> twice;
  std::string refused;  // (the checksum's dump recurses per level: as deep as the reader reads)
  json j = parse_json_strict(text.data(), text.data() + text.size(), twice, refused);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  j["manifest_xxh3"] = body_checksum(j);
  return j.dump(1);
}

}  // namespace optstate::native
