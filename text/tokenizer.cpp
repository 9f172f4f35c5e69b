// The Tokenizer base (decode), the byte tokenizer, StreamDecoder, load_tokenizer and the config
// files beside a tokenizer (tokenizer_config.json, generation_config.json, chat_template.jinja).
#include "text/tokenizer.h"

#include <dirent.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "text/tokenizer_internal.h"
#include "text/unicode.h"

namespace kiln::text {
namespace {

using nlohmann::json;

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_name(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Sorted names of the entries of `dir` (not . and ..).
std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> tiktoken_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& name : list_dir(dir))
    if (ends_with(name, ".tiktoken") && is_file(dir + "/" + name)) out.push_back(name);
  return out;
}

json read_json(const std::string& path, const std::string& what) {
  const std::string text = read_file(path, what);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    KILN_FAIL("tokenizer: ", path, " is not valid JSON: ", e.what(), "; give ", what);
  }
}

// A special token in tokenizer_config.json: a string, or an AddedToken object {"content": ...}.
std::optional<std::string> config_token(const json& config, const char* key, const std::string& path) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  KILN_FAIL("tokenizer: ", path, ": ", key, " must be a string or {\"content\": ...} (got ", it->dump(),
            "); fix tokenizer_config.json");
}

std::vector<int64_t> config_ids(const json& config, const char* key, const std::string& path) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return {};
  if (it->is_number_integer()) return {it->get<int64_t>()};
  std::vector<int64_t> ids;
  if (it->is_array()) {
    for (const json& v : *it) {
      KILN_CHECK(v.is_number_integer(), "tokenizer: ", path, ": ", key, " must be an id or a list of ids (got ",
                 it->dump(), "); fix generation_config.json");
      ids.push_back(v.get<int64_t>());
    }
    return ids;
  }
  KILN_FAIL("tokenizer: ", path, ": ", key, " must be an id or a list of ids (got ", it->dump(),
            "); fix generation_config.json");
}

}  // namespace

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "tokenizer: cannot open ", path, "; give ", what);
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// ---- Tokenizer ----

std::string Tokenizer::token_bytes(int64_t id, bool skip_special_tokens) const {
  std::string out;
  append_bytes(id, skip_special_tokens, out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int64_t id : ids) append_bytes(id, skip_special_tokens, bytes);
  if (unicode::is_valid_utf8(bytes)) return bytes;
  return unicode::to_valid_utf8(bytes);
}

void Tokenizer::append_bytes(int64_t id, bool skip_special_tokens, std::string& out) const {
  out += decode({id}, skip_special_tokens);
}

// ---- config files ----

void TokenizerFiles::apply(Tokenizer& t, const std::string& dir) {
  json config = json::object(), generation = json::object();
  const std::string config_path = dir + "/tokenizer_config.json";
  const std::string generation_path = dir + "/generation_config.json";
  if (is_file(config_path)) config = read_json(config_path, "the tokenizer's tokenizer_config.json");
  if (is_file(generation_path)) generation = read_json(generation_path, "the model's generation_config.json");
  KILN_CHECK(config.is_object(), "tokenizer: ", config_path, " must hold a JSON object; fix the file");
  KILN_CHECK(generation.is_object(), "tokenizer: ", generation_path, " must hold a JSON object; fix the file");

  auto id_of = [&](const std::string& token, const char* key) {
    const std::optional<int64_t> id = t.token_to_id(token);
    KILN_CHECK(id.has_value(), "tokenizer: ", config_path, ": ", key, " '", token,
               "' is not in the vocabulary; fix tokenizer_config.json or the tokenizer");
    return *id;
  };
  // bos and eos: tokenizer_config names them; generation_config's ids stand in when it does not.
  if (auto bos = config_token(config, "bos_token", config_path)) {
    t.bos_id_ = id_of(*bos, "bos_token");
    t.bos_token_ = *bos;
  } else if (auto ids = config_ids(generation, "bos_token_id", generation_path); !ids.empty()) {
    t.bos_id_ = ids[0];
    t.bos_token_ = t.id_to_token(ids[0]);
  }
  const std::vector<int64_t> generation_eos = config_ids(generation, "eos_token_id", generation_path);
  if (auto eos = config_token(config, "eos_token", config_path)) {
    t.eos_id_ = id_of(*eos, "eos_token");
    t.eos_token_ = *eos;
  } else if (!generation_eos.empty()) {
    t.eos_id_ = generation_eos[0];
    t.eos_token_ = t.id_to_token(generation_eos[0]);
  }
  t.stop_ids_.clear();
  if (t.eos_id_) t.stop_ids_.push_back(*t.eos_id_);
  for (int64_t id : generation_eos)
    if (std::find(t.stop_ids_.begin(), t.stop_ids_.end(), id) == t.stop_ids_.end()) t.stop_ids_.push_back(id);
  if (auto pad = config_token(config, "pad_token", config_path))
    t.pad_id_ = id_of(*pad, "pad_token");
  else
    t.pad_id_ = t.eos_id_.value_or(0);

  auto flag = [&](const char* key) {
    auto it = config.find(key);
    if (it == config.end() || it->is_null()) return false;
    KILN_CHECK(it->is_boolean(), "tokenizer: ", config_path, ": ", key, " must be true or false (got ", it->dump(),
               "); fix tokenizer_config.json");
    return it->get<bool>();
  };
  t.add_bos_token_ = flag("add_bos_token");
  t.add_eos_token_ = flag("add_eos_token");

  // chat_template.jinja wins over tokenizer_config's entry, as in transformers.
  t.chat_template_.clear();
  const std::string jinja_path = dir + "/chat_template.jinja";
  auto it = config.find("chat_template");
  if (is_file(jinja_path)) {
    t.chat_template_ = read_file(jinja_path, "a Jinja chat template");
  } else if (it != config.end() && it->is_string()) {
    t.chat_template_ = it->get<std::string>();
  } else if (it != config.end() && it->is_array()) {
    for (const json& entry : *it) {
      KILN_CHECK(entry.is_object() && entry.contains("name") && entry.contains("template"), "tokenizer: ", config_path,
                 ": chat_template entries must be {\"name\": ..., \"template\": ...}; fix the file");
      if (entry["name"] == "default") t.chat_template_ = entry["template"].get<std::string>();
    }
  } else if (it != config.end() && !it->is_null()) {
    KILN_FAIL("tokenizer: ", config_path,
              ": chat_template must be a string or a list of {name, template}; "
              "fix tokenizer_config.json");
  }
}

void TokenizerFiles::add_bos_eos(const Tokenizer& t, std::vector<int64_t>& ids) {
  if (t.add_bos_token_ && t.bos_id_ && (ids.empty() || ids.front() != *t.bos_id_)) ids.insert(ids.begin(), *t.bos_id_);
  if (t.add_eos_token_ && t.eos_id_ && (ids.empty() || ids.back() != *t.eos_id_)) ids.push_back(*t.eos_id_);
}

// ---- loading ----

std::optional<TiktokenOptions> known_tiktoken_encoding(std::string_view name) {
  // The patterns and special tokens of OpenAI's tiktoken encodings (public facts of the format).
  static const char* kCl100k =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
      R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const char* kO200k =
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
      R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
      R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  TiktokenOptions o;
  if (name == "cl100k_base") {
    o.pattern = kCl100k;
    o.special_tokens = {{"<|endoftext|>", 100257},
                        {"<|fim_prefix|>", 100258},
                        {"<|fim_middle|>", 100259},
                        {"<|fim_suffix|>", 100260},
                        {"<|endofprompt|>", 100276}};
    return o;
  }
  if (name == "o200k_base") {
    o.pattern = kO200k;
    o.special_tokens = {{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}};
    return o;
  }
  if (name == "o200k_harmony") {  // gpt-oss
    o.pattern = kO200k;
    o.special_tokens = {{"<|startoftext|>", 199998}, {"<|endoftext|>", 199999}, {"<|return|>", 200002},
                        {"<|constrain|>", 200003},   {"<|channel|>", 200005},   {"<|start|>", 200006},
                        {"<|end|>", 200007},         {"<|message|>", 200008},   {"<|call|>", 200012},
                        {"<|endofprompt|>", 200018}};
    for (int64_t id : {200000, 200001, 200004, 200009, 200010, 200011})
      o.special_tokens.emplace_back("<|reserved_" + std::to_string(id) + "|>", id);
    for (int64_t id = 200013; id < 201088; ++id)
      if (id != 200018) o.special_tokens.emplace_back("<|reserved_" + std::to_string(id) + "|>", id);
    return o;
  }
  return std::nullopt;
}

std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, const std::optional<TiktokenOptions>& options) {
  TiktokenOptions o;
  if (options) {
    o = *options;
  } else {
    std::string stem = base_name(path);
    if (ends_with(stem, ".tiktoken")) stem.resize(stem.size() - 9);
    std::optional<TiktokenOptions> known = known_tiktoken_encoding(stem);
    KILN_CHECK(known.has_value(), "tokenizer: ", path, " is not a known tiktoken encoding (name=", stem,
               "); name the file cl100k_base.tiktoken, o200k_base.tiktoken or o200k_harmony.tiktoken, or pass "
               "TiktokenOptions with its pattern and special tokens");
    o = *known;
  }
  std::unique_ptr<Tokenizer> t = load_tiktoken_file(path, o);
  TokenizerFiles::apply(*t, parent_dir(path));
  return t;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  std::string file = path;
  if (is_directory(path)) {
    file = path + "/tokenizer.json";
    if (!is_file(file)) {
      const std::vector<std::string> ranks = tiktoken_files(path);
      KILN_CHECK(!ranks.empty(), "tokenizer: ", path,
                 " holds neither tokenizer.json nor a *.tiktoken file; give a model directory with its tokenizer");
      KILN_CHECK(ranks.size() == 1, "tokenizer: ", path, " holds ", ranks.size(),
                 " *.tiktoken files and no tokenizer.json; give the path of the one to use");
      return load_tiktoken(path + "/" + ranks[0]);
    }
  } else if (ends_with(path, ".tiktoken")) {
    return load_tiktoken(path);
  }
  KILN_CHECK(is_file(file), "tokenizer: cannot open ", file,
             "; give a model directory (tokenizer.json or *.tiktoken) or the path of tokenizer.json");
  std::unique_ptr<Tokenizer> t = load_tokenizer_json(file);
  TokenizerFiles::apply(*t, parent_dir(file));
  return t;
}

bool has_tokenizer_files(const std::string& dir) {
  return is_directory(dir) && (is_file(dir + "/tokenizer.json") || !tiktoken_files(dir).empty());
}

std::string tokenizer_dir(const Tokenizer& tokenizer) {
  if (is_directory(tokenizer.name())) return tokenizer.name();
  return is_file(tokenizer.name()) ? parent_dir(tokenizer.name()) : "";
}

void copy_tokenizer_files(const std::string& from_dir, const std::string& to_dir) {
  KILN_CHECK(is_directory(from_dir), "tokenizer: cannot copy tokenizer files from ", from_dir,
             ": not a directory; give the model directory");
  if (!is_directory(to_dir)) {
    KILN_CHECK(::mkdir(to_dir.c_str(), 0755) == 0 || is_directory(to_dir), "tokenizer: cannot create ", to_dir,
               "; check the path and permissions");
  }
  for (const std::string& name : list_dir(from_dir)) {
    const bool wanted = name == "tokenizer.json" || name == "tokenizer_config.json" ||
                        name == "generation_config.json" || name == "chat_template.jinja" ||
                        ends_with(name, ".tiktoken");
    if (!wanted || !is_file(from_dir + "/" + name)) continue;
    const std::string text = read_file(from_dir + "/" + name, "a tokenizer file");
    const std::string dest = to_dir + "/" + name, tmp = dest + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary);
      out << text;
      KILN_CHECK(out.good(), "tokenizer: cannot write ", tmp, "; check the disk space and permissions");
    }
    KILN_CHECK(std::rename(tmp.c_str(), dest.c_str()) == 0, "tokenizer: cannot rename ", tmp, " to ", dest,
               "; check the permissions");
  }
}

// ---- byte tokenizer ----

namespace {

std::string show_byte(unsigned char c) {
  if (c >= 32 && c < 127) return std::string("'") + char(c) + "'";
  char buf[8];
  std::snprintf(buf, sizeof buf, "\\x%02X", unsigned(c));
  return buf;
}

}  // namespace

ByteTokenizer::ByteTokenizer(int64_t vocab_size) : vocab_size_(vocab_size) {
  KILN_CHECK(vocab_size >= 11 && vocab_size <= 256,
             "ByteTokenizer: vocab_size outside [11, 256] (vocab_size=", vocab_size,
             "); byte ids need room for pad (0) and eos ('\\n' = 10) and stop at 255");
  eos_id_ = '\n';
  eos_token_ = "\n";
  stop_ids_ = {'\n'};
  pad_id_ = 0;
  name_ = "byte(" + std::to_string(vocab_size) + ")";
}

std::vector<int64_t> ByteTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    KILN_CHECK(c != 0, "ByteTokenizer: text holds '\\0', the pad id (position=", i, "); remove it from the text");
    KILN_CHECK(int64_t(c) < vocab_size_, "ByteTokenizer: character outside the vocabulary (char=", show_byte(c),
               ", byte=", int(c), ", position=", i, ", vocab_size=", vocab_size_,
               "); use ASCII text or a larger vocab_size");
    ids[i] = c;
  }
  return ids;
}

std::optional<int64_t> ByteTokenizer::token_to_id(std::string_view token) const {
  if (token.size() != 1 || static_cast<unsigned char>(token[0]) >= vocab_size_) return std::nullopt;
  return static_cast<unsigned char>(token[0]);
}

std::string ByteTokenizer::id_to_token(int64_t id) const {
  return id >= 0 && id < vocab_size_ ? std::string(1, char(static_cast<unsigned char>(id))) : std::string();
}

void ByteTokenizer::append_bytes(int64_t id, bool skip_special_tokens, std::string& out) const {
  if (id < 0 || id >= vocab_size_) {
    out += "\xEF\xBF\xBD";
    return;
  }
  if (skip_special_tokens && is_special(id)) return;
  out += char(static_cast<unsigned char>(id));
}

std::unique_ptr<Tokenizer> make_byte_tokenizer(int64_t vocab_size) {
  return std::make_unique<ByteTokenizer>(vocab_size);
}

// ---- streaming ----

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamDecoder::push(int64_t id) {
  tokenizer_.append_bytes(id, skip_special_tokens_, pending_);
  std::string out;
  const size_t used = unicode::append_complete(pending_, out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = unicode::to_valid_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace kiln::text
