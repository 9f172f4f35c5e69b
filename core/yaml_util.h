// Strict YAML reading for configs: every key is consumed or reported, and every error names the
// file, the line and the key path ("configs/x.yaml:7: model.num_layers: expected ...").
#pragma once
#include <yaml-cpp/yaml.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace kiln::yaml {

// Parses a YAML file; a syntax error or a key given twice in one mapping names the file and line.
YAML::Node load_file(const std::string& path);

// The key paths ("optim.lr", "reward.parts[1].weight") where two documents differ: a value, a
// type, or a key present in one only. Equal documents give an empty list.
std::vector<std::string> diff(const YAML::Node& a, const YAML::Node& b, const std::string& path = "");

// Where each key was read from ("file:line: path.key"), for validation errors after parsing.
using Locations = std::map<std::string, std::string>;

// Reads the keys of one mapping node and rejects the ones nobody asked for.
class MapReader {
 public:
  MapReader(YAML::Node node, std::string file, std::string path);

  bool has(const std::string& key) const { return std::as_const(node_)[key].IsDefined(); }
  // Reads `key` into `out` when present; leaves `out` untouched otherwise.
  template <typename T>
  void get(const std::string& key, T& out);
  // Reads `key` into `out`; throws when absent.
  template <typename T>
  void require(const std::string& key, T& out) {
    if (!has(key)) fail(key, "required key is missing");
    get(key, out);
  }
  MapReader child(const std::string& key);
  // The raw node under `key` (undefined when absent), marked as read: for free-form values such as
  // a map of template variables.
  YAML::Node raw(const std::string& key) {
    mark(key);
    return std::as_const(node_)[key];
  }
  // A list of mappings under `key` (absent: empty), each read as "path.key[i]".
  std::vector<MapReader> children(const std::string& key);
  // Throws for the first key that was not read, listing the known keys.
  void finish() const;
  // "file:line: path.key" for key (or for this map when key is empty).
  std::string where(const std::string& key = "") const;
  std::string key_path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const;
  // Records where every key read so far lives, under its full key path.
  const Locations& locations() const { return *locations_; }
  // An enum written by name: `parse` turns the name into the value (throwing kiln::Error naming the
  // accepted names), `name` the value into its name; a bad name fails at this key's file and line.
  template <typename E>
  void get_enum(const std::string& key, E& out, E (*parse)(const std::string&), const char* (*name)(E));
  // Runs `check` (a validate(), say) and reports a kiln::Error it throws at `key` (empty: this map),
  // so a value out of range names the file and line it came from.
  template <typename F>
  void check(const std::string& key, F&& check_fn) {
    try {
      check_fn();
    } catch (const Error& e) {
      fail(key, e.what());
    }
  }

 private:
  YAML::Node node_;
  std::string file_;
  std::string path_;
  std::set<std::string> known_;
  std::shared_ptr<Locations> locations_;
  void mark(const std::string& key);
  template <typename T>
  static const char* type_name();
};

template <typename E>
void MapReader::get_enum(const std::string& key, E& out, E (*parse)(const std::string&), const char* (*name)(E)) {
  std::string s = name(out);
  get(key, s);
  check(key, [&] { out = parse(s); });
}

// Writes `key:` and a mapping whose keys `body` writes: a section of a resolved config.
template <typename F>
void write_map(YAML::Emitter& e, const std::string& key, F&& body) {
  e << YAML::Key << key << YAML::Value << YAML::BeginMap;
  body();
  e << YAML::EndMap;
}

// Collects the key path of every key a MapReader asks for (present or not) while one is alive on
// this thread, a list's entries written "[]" ("optim.rules[].match"): the keys the parser accepts,
// taken from the parser itself (tests/trainer/test_recipe_keys.cpp checks docs/CONFIG.md with it).
class KeyRecorder {
 public:
  KeyRecorder();
  ~KeyRecorder();
  KeyRecorder(const KeyRecorder&) = delete;
  KeyRecorder& operator=(const KeyRecorder&) = delete;
  const std::set<std::string>& keys() const { return keys_; }
  // The keys read as lists of mappings (MapReader::children), whose entries' keys need an entry to be seen.
  const std::set<std::string>& lists() const { return lists_; }
  // Where one is alive on this thread, the innermost; else null.
  static KeyRecorder* active();
  void add(const std::string& key_path, bool list);

 private:
  std::set<std::string> keys_, lists_;
  KeyRecorder* outer_;
};

template <typename T>
const char* MapReader::type_name() {
  if constexpr (std::is_same_v<T, bool>) return "a boolean";
  else if constexpr (std::is_integral_v<T>) return "an integer";
  else if constexpr (std::is_floating_point_v<T>) return "a number";
  else if constexpr (std::is_same_v<T, std::string>) return "a string";
  else return "a list";
}

template <typename T>
void MapReader::get(const std::string& key, T& out) {
  mark(key);
  YAML::Node v = std::as_const(node_)[key];
  if (!v.IsDefined()) return;
  try {
    if constexpr (std::is_same_v<T, std::string> || std::is_arithmetic_v<T>) {
      KILN_CHECK(v.IsScalar(), where(key), ": expected ", type_name<T>(), ", got a ",
                 v.IsMap() ? "mapping" : "sequence");
    }
    out = v.as<T>();
  } catch (const YAML::BadConversion&) {
    fail(key, str_cat("expected ", type_name<T>(), ", got '", YAML::Dump(v), "'"));
  }
}

}  // namespace kiln::yaml
