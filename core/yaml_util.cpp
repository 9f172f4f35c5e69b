// Strict YAML reading: key tracking, locations and error messages with file, line and key path.
#include "core/yaml_util.h"

#include "core/files.h"

namespace kiln::yaml {

namespace {

// yaml-cpp keeps both entries of a repeated key and reads the first; a config must not say two things.
void check_unique_keys(const YAML::Node& node, const std::string& file) {
  if (node.IsSequence()) {
    for (const auto& item : node) check_unique_keys(item, file);
  } else if (node.IsMap()) {
    std::map<std::string, int> seen;  // key -> its first line
    for (const auto& kv : node) {
      const int line = kv.first.Mark().line + 1;
      // Found by fuzz_recipe: a key that is a mapping or a list ('{a: 1}: 2') threw yaml-cpp's bad
      // conversion wherever a reader took keys as names.
      KILN_CHECK(kv.first.IsScalar(), "config: ", file, ":", line, ": a key must be a name, not a ",
                 kv.first.IsMap() ? "mapping" : kv.first.IsSequence() ? "list" : "null");
      if (kv.first.IsScalar()) {
        const auto [it, fresh] = seen.emplace(kv.first.Scalar(), line);
        KILN_CHECK(fresh, "config: ", file, ":", line, ": key '", kv.first.Scalar(), "' appears twice in one mapping (first at line ",
                   it->second, "); delete one");
      }
      check_unique_keys(kv.second, file);
    }
  }
}

}  // namespace

std::vector<std::string> diff(const YAML::Node& a, const YAML::Node& b, const std::string& path) {
  const std::string here = path.empty() ? "(the document)" : path;
  if (a.Type() != b.Type()) return {here};
  std::vector<std::string> out;
  auto add = [&](std::vector<std::string> more) { out.insert(out.end(), more.begin(), more.end()); };
  if (a.IsScalar()) {
    if (a.Scalar() != b.Scalar()) out.push_back(here);
  } else if (a.IsSequence()) {
    if (a.size() != b.size()) return {here};
    for (size_t i = 0; i < a.size(); ++i) add(diff(a[i], b[i], path + "[" + std::to_string(i) + "]"));
  } else if (a.IsMap()) {
    std::set<std::string> keys;
    for (const auto& kv : a) keys.insert(kv.first.as<std::string>());
    for (const auto& kv : b) keys.insert(kv.first.as<std::string>());
    for (const auto& k : keys) {
      const std::string sub = path.empty() ? k : path + "." + k;
      const YAML::Node x = a[k], y = b[k];
      if (!x.IsDefined() || !y.IsDefined()) out.push_back(sub);
      else add(diff(x, y, sub));
    }
  }
  return out;
}

YAML::Node load_file(const std::string& path) {
  check_input_file(path, "config", "give a YAML file");
  try {
    YAML::Node root = YAML::LoadFile(path);
    check_unique_keys(root, path);
    return root;
  } catch (const YAML::BadFile&) {
    KILN_FAIL("config: cannot open file (path=", path, "); check the path");
  } catch (const YAML::ParserException& e) {
    KILN_FAIL("config: ", path, ":", e.mark.line + 1, ": YAML syntax error: ", e.msg);
  }
}

MapReader::MapReader(YAML::Node node, std::string file, std::string path)
    // An absent or empty section reads as an empty mapping: every key keeps its default. (A
    // missing key's node cannot be assigned to, so the choice is made while constructing.)
    : node_(node.IsDefined() && !node.IsNull() ? node : YAML::Node(YAML::NodeType::Map)),
      file_(std::move(file)), path_(std::move(path)), locations_(std::make_shared<Locations>()) {
  KILN_CHECK(node_.IsMap(), "config: ", where(), ": expected a mapping of keys to values");
}

namespace {
thread_local KeyRecorder* active_recorder = nullptr;
}  // namespace

KeyRecorder::KeyRecorder() : outer_(active_recorder) { active_recorder = this; }
KeyRecorder::~KeyRecorder() { active_recorder = outer_; }
KeyRecorder* KeyRecorder::active() { return active_recorder; }

void KeyRecorder::add(const std::string& key_path, bool list) {
  // "reward.parts[2].weight" -> "reward.parts[].weight": every entry of a list takes the same keys.
  std::string out;
  for (size_t i = 0; i < key_path.size(); ++i) {
    out += key_path[i];
    if (key_path[i] != '[') continue;
    while (i + 1 < key_path.size() && key_path[i + 1] != ']') ++i;
  }
  keys_.insert(out);
  if (list) lists_.insert(out);
}

void MapReader::mark(const std::string& key) {
  known_.insert(key);
  if (KeyRecorder* r = KeyRecorder::active()) r->add(key_path(key), false);
  if (std::as_const(node_)[key].IsDefined()) (*locations_)[key_path(key)] = where(key);
}

MapReader MapReader::child(const std::string& key) {
  mark(key);
  MapReader c(std::as_const(node_)[key], file_, key_path(key));
  c.locations_ = locations_;
  return c;
}

std::vector<MapReader> MapReader::children(const std::string& key) {
  mark(key);
  if (KeyRecorder* r = KeyRecorder::active()) r->add(key_path(key), true);
  YAML::Node list = std::as_const(node_)[key];
  std::vector<MapReader> out;
  if (!list.IsDefined() || list.IsNull()) return out;
  if (!list.IsSequence()) fail(key, "expected a list of mappings");
  for (size_t i = 0; i < list.size(); ++i) {
    MapReader c(list[i], file_, key_path(key) + "[" + std::to_string(i) + "]");
    c.locations_ = locations_;
    out.push_back(std::move(c));
  }
  return out;
}

std::string MapReader::where(const std::string& key) const {
  YAML::Mark m = (!key.empty() && std::as_const(node_)[key].IsDefined()) ? std::as_const(node_)[key].Mark() : node_.Mark();
  std::string loc = file_;
  if (m.line >= 0) loc += ":" + std::to_string(m.line + 1);
  std::string p = key.empty() ? path_ : key_path(key);
  return p.empty() ? loc : loc + ": " + p;
}

void MapReader::fail(const std::string& key, const std::string& msg) const {
  KILN_FAIL("config: ", where(key), ": ", msg);
}

void MapReader::finish() const {
  if (!node_.IsMap()) return;
  for (const auto& kv : node_) {
    std::string key = kv.first.as<std::string>();
    if (known_.count(key)) continue;
    std::string list;
    for (const auto& k : known_) list += (list.empty() ? "" : ", ") + k;
    std::string loc = file_ + ":" + std::to_string(kv.first.Mark().line + 1);
    KILN_FAIL("config: ", loc, ": ", key_path(key), ": unknown key; known keys are: ", list);
  }
}

}  // namespace kiln::yaml
