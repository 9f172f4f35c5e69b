// The byte-level BPE tokenizer and its two loaders: HF tokenizer.json (added tokens, normalizer,
// pre-tokenizer, BPE model, post-processor, decoder, read as HF tokenizers reads them) and tiktoken
// rank files (a pattern and special tokens from TiktokenOptions).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "text/bpe.h"
#include "text/tokenizer_internal.h"
#include "text/tokenizer_pipeline.h"
#include "text/unicode.h"

namespace kiln::text {
namespace {

using nlohmann::json;

// The GPT-2 pre-tokenizer pattern that ByteLevel uses when use_regex is set.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class BpeTokenizer final : public Tokenizer {
 public:
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override;
  int64_t vocab_size() const override { return int64_t(present_.size()); }
  std::optional<int64_t> token_to_id(std::string_view token) const override {
    auto it = token_ids_.find(std::string(token));
    if (it == token_ids_.end()) return std::nullopt;
    return it->second;
  }
  std::string id_to_token(int64_t id) const override {
    return id >= 0 && id < vocab_size() ? tokens_[size_t(id)] : std::string();
  }
  bool is_special(int64_t id) const override { return id >= 0 && id < vocab_size() && special_[size_t(id)]; }

  // The tables, filled by the loaders below.
  std::unique_ptr<BpeModel> model_;
  std::vector<std::string> tokens_;  // id -> vocab string (added tokens: their content)
  std::vector<std::string> bytes_;   // id -> what decode writes for it
  std::vector<bool> present_, special_;
  std::unordered_map<std::string, int64_t> token_ids_;  // vocab strings and added contents
  std::deque<AddedToken> added_;                        // the matchers point here
  AddedTokenMatcher raw_matcher_, normalized_matcher_;  // added tokens with normalized false / true
  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  struct Wrap {  // one post-processor step on a single sequence: before + ids + after
    std::vector<int64_t> before, after;
  };
  std::vector<Wrap> post_;

  void set_name(std::string name) { name_ = std::move(name); }
  void resize(size_t n) {
    tokens_.resize(n);
    bytes_.resize(n);
    present_.resize(n);
    special_.resize(n);
  }

 protected:
  void append_bytes(int64_t id, bool skip_special_tokens, std::string& out) const override {
    if (id < 0 || id >= vocab_size() || !present_[size_t(id)]) {
      out += "\xEF\xBF\xBD";
      return;
    }
    if (skip_special_tokens && special_[size_t(id)]) return;
    out += bytes_[size_t(id)];
  }

 private:
  void encode_words(std::string_view piece, std::vector<int64_t>& ids) const {
    pre_tokenizer_.run(piece, [&](std::string_view word) { model_->encode_word(word, ids); });
  }
  void encode_normalized(std::string_view piece, std::vector<int64_t>& ids) const;
};

void BpeTokenizer::encode_normalized(std::string_view piece, std::vector<int64_t>& ids) const {
  std::string storage;
  const std::string_view text = normalizer_.apply(piece, storage);
  if (normalized_matcher_.empty()) return encode_words(text, ids);
  std::vector<Segment> segments;
  normalized_matcher_.split(text, segments);
  for (const Segment& s : segments) {
    if (s.id >= 0)
      ids.push_back(s.id);
    else
      encode_words(text.substr(s.begin, s.end - s.begin), ids);
  }
}

std::vector<int64_t> BpeTokenizer::encode(std::string_view input, bool add_special_tokens) const {
  std::string repaired;
  std::string_view text = input;
  if (!unicode::is_valid_utf8(input)) {
    repaired = unicode::to_valid_utf8(input);
    text = repaired;
  }
  std::vector<int64_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (raw_matcher_.empty()) {
    encode_normalized(text, ids);
  } else {
    std::vector<Segment> segments;
    raw_matcher_.split(text, segments);
    for (const Segment& s : segments) {
      if (s.id >= 0)
        ids.push_back(s.id);
      else
        encode_normalized(text.substr(s.begin, s.end - s.begin), ids);
    }
  }
  if (add_special_tokens) {
    for (const Wrap& w : post_) {
      ids.insert(ids.begin(), w.before.begin(), w.before.end());
      ids.insert(ids.end(), w.after.begin(), w.after.end());
    }
    TokenizerFiles::add_bos_eos(*this, ids);
  }
  return ids;
}

// ---- tokenizer.json ----

// Reads tokenizer.json with errors "tokenizer: <file>: <json path>: what; hint".
class JsonReader {
 public:
  explicit JsonReader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what, const std::string& hint) const {
    KILN_FAIL("tokenizer: ", file_, ": ", path, ": ", what, "; ", hint);
  }
  const json& at(const json& obj, const std::string& key, const std::string& path) const {
    if (!obj.is_object()) fail(path, "expected an object", "check the file against HF tokenizers' format");
    auto it = obj.find(key);
    if (it == obj.end()) fail(path + "." + key, "missing", "check the file against HF tokenizers' format");
    return *it;
  }
  std::string type(const json& obj, const std::string& path) const {
    const json& t = at(obj, "type", path);
    if (!t.is_string()) fail(path + ".type", "expected a string", "check the file against HF tokenizers' format");
    return t.get<std::string>();
  }
  bool flag(const json& obj, const std::string& key, bool fallback, const std::string& path) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) fail(path + "." + key, "expected true or false", "fix the value");
    return it->get<bool>();
  }
  std::string string(const json& obj, const std::string& key, const std::string& path) const {
    const json& v = at(obj, key, path);
    if (!v.is_string()) fail(path + "." + key, "expected a string", "fix the value");
    return v.get<std::string>();
  }
  [[noreturn]] void unsupported(const std::string& path, const std::string& kind, const std::string& type,
                                const std::string& supported) const {
    fail(path + ".type", kind + " '" + type + "' is unsupported",
         "kiln reads byte-level BPE tokenizers; supported " + kind + "s: " + supported);
  }
  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

std::string index_path(const std::string& path, const char* key, size_t i) {
  return path + "." + key + "[" + std::to_string(i) + "]";
}

void parse_normalizer(const JsonReader& r, const json& j, const std::string& path, Normalizer& out) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  using Kind = NormalizerStep::Kind;
  if (type == "Sequence") {
    const json& list = r.at(j, "normalizers", path);
    for (size_t i = 0; i < list.size(); ++i) parse_normalizer(r, list[i], index_path(path, "normalizers", i), out);
  } else if (type == "NFC") {
    out.add({Kind::kNFC, "", ""});
  } else if (type == "NFD") {
    out.add({Kind::kNFD, "", ""});
  } else if (type == "NFKC") {
    out.add({Kind::kNFKC, "", ""});
  } else if (type == "NFKD") {
    out.add({Kind::kNFKD, "", ""});
  } else if (type == "Lowercase") {
    out.add({Kind::kLowercase, "", ""});
  } else if (type == "Strip") {
    NormalizerStep s{Kind::kStrip, "", ""};
    s.left = r.flag(j, "strip_left", true, path);
    s.right = r.flag(j, "strip_right", true, path);
    out.add(s);
  } else if (type == "Prepend") {
    out.add({Kind::kPrepend, r.string(j, "prepend", path), ""});
  } else if (type == "Replace") {
    const json& pattern = r.at(j, "pattern", path);
    if (!pattern.contains("String") || !pattern["String"].is_string())
      r.fail(path + ".pattern", "only a String pattern is supported in Replace", "use {\"String\": \"...\"}");
    out.add({Kind::kReplace, pattern["String"].get<std::string>(), r.string(j, "content", path)});
  } else {
    r.unsupported(path, "normalizer", type, "Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Strip, Prepend, Replace");
  }
}

SplitBehavior parse_behavior(const JsonReader& r, const json& j, const std::string& path) {
  const std::string b = r.string(j, "behavior", path);
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  r.fail(path + ".behavior", "unknown split behavior '" + b + "'",
         "use Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous");
}

std::shared_ptr<const Regex> gpt2_regex() {
  static const auto regex = std::make_shared<const Regex>(kGpt2Pattern, Regex::Dialect::kOniguruma, "ByteLevel");
  return regex;
}

// Flattens Sequence; `byte_level` is set once a ByteLevel step has been read (it must be last).
void parse_pre_tokenizer(const JsonReader& r, const json& j, const std::string& path, PreTokenizer& out,
                         bool& byte_level) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  if (type == "Sequence") {
    const json& list = r.at(j, "pretokenizers", path);
    for (size_t i = 0; i < list.size(); ++i)
      parse_pre_tokenizer(r, list[i], index_path(path, "pretokenizers", i), out, byte_level);
    return;
  }
  if (byte_level)
    r.fail(path, "a pre-tokenizer after ByteLevel",
           "kiln's BPE works on raw bytes, so ByteLevel must be the last pre-tokenizer");
  if (type == "Split") {
    PreTokenizerStep s;
    s.kind = PreTokenizerStep::Kind::kSplit;
    const json& pattern = r.at(j, "pattern", path);
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
      s.regex = std::make_shared<const Regex>(pattern["Regex"].get<std::string>(), Regex::Dialect::kOniguruma,
                                              r.file() + ": " + path + ".pattern");
    } else if (pattern.contains("String") && pattern["String"].is_string()) {
      s.regex = std::make_shared<const Regex>(pattern["String"].get<std::string>(), Regex::Dialect::kLiteral,
                                              r.file() + ": " + path + ".pattern");
    } else {
      r.fail(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}", "fix the pattern");
    }
    s.behavior = parse_behavior(r, j, path);
    s.invert = r.flag(j, "invert", false, path);
    out.add(s);
  } else if (type == "ByteLevel") {
    PreTokenizerStep s;
    s.kind = PreTokenizerStep::Kind::kByteLevel;
    s.add_prefix_space = r.flag(j, "add_prefix_space", true, path);
    if (r.flag(j, "use_regex", true, path)) s.regex = gpt2_regex();
    out.add(s);
    byte_level = true;
  } else {
    r.unsupported(path, "pre-tokenizer", type, "Sequence, Split, ByteLevel");
  }
}

void parse_decoder(const JsonReader& r, const json& j, const std::string& path) {
  if (j.is_null())
    r.fail(path, "no decoder", "byte-level BPE needs the ByteLevel decoder; add {\"type\": \"ByteLevel\"}");
  const std::string type = r.type(j, path);
  if (type == "Sequence") {
    const json& list = r.at(j, "decoders", path);
    if (list.empty()) r.fail(path, "an empty decoder Sequence", "use the ByteLevel decoder");
    for (size_t i = 0; i < list.size(); ++i) parse_decoder(r, list[i], index_path(path, "decoders", i));
  } else if (type != "ByteLevel") {
    r.unsupported(path, "decoder", type, "ByteLevel (alone or in a Sequence)");
  }
}

void parse_post_processor(const JsonReader& r, const json& j, const std::string& path, BpeTokenizer& t) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  if (type == "Sequence") {
    const json& list = r.at(j, "processors", path);
    for (size_t i = 0; i < list.size(); ++i) parse_post_processor(r, list[i], index_path(path, "processors", i), t);
  } else if (type == "ByteLevel") {
    // Adds no ids (it trims offsets, which kiln does not report).
  } else if (type == "TemplateProcessing") {
    const json& single = r.at(j, "single", path);
    const json& specials = r.at(j, "special_tokens", path);
    BpeTokenizer::Wrap wrap;
    bool seen_a = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string item = index_path(path, "single", i);
      if (single[i].contains("Sequence")) {
        const std::string which = r.string(single[i]["Sequence"], "id", item + ".Sequence");
        if (which != "A" || seen_a)
          r.fail(item, "a single-sequence template must hold sequence A once", "fix the template");
        seen_a = true;
      } else if (single[i].contains("SpecialToken")) {
        const std::string name = r.string(single[i]["SpecialToken"], "id", item + ".SpecialToken");
        const json& entry = r.at(specials, name, path + ".special_tokens");
        const json& ids = r.at(entry, "ids", path + ".special_tokens." + name);
        for (const json& id : ids) (seen_a ? wrap.after : wrap.before).push_back(id.get<int64_t>());
      } else {
        r.fail(item, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}", "fix the template");
      }
    }
    if (!seen_a) r.fail(path + ".single", "the template lacks sequence A", "add {\"Sequence\": {\"id\": \"A\"}}");
    t.post_.push_back(std::move(wrap));
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    // {"cls": [token, id], "sep": [token, id]}: [cls] A [sep].
    const json& cls = r.at(j, "cls", path);
    const json& sep = r.at(j, "sep", path);
    if (!cls.is_array() || cls.size() != 2 || !sep.is_array() || sep.size() != 2)
      r.fail(path, "cls and sep must be [token, id]", "fix the processor");
    t.post_.push_back({{cls[1].get<int64_t>()}, {sep[1].get<int64_t>()}});
  } else {
    r.unsupported(path, "post-processor", type,
                  "Sequence, ByteLevel, TemplateProcessing, RobertaProcessing, "
                  "BertProcessing");
  }
}

// Fills the model and the per-id tables from model.vocab, model.merges and the options HF's BPE
// reads; returns the number of vocab entries (where HF starts numbering new added tokens).
size_t parse_model(const JsonReader& r, const json& m, BpeTokenizer& t,
                   std::unordered_map<std::string, int64_t>& vocab) {
  const std::string path = "model";
  if (!m.is_object()) r.fail(path, "expected an object", "check the file against HF tokenizers' format");
  const std::string type = m.contains("type") ? r.type(m, path) : std::string("BPE");
  if (type != "BPE") r.unsupported(path, "model", type, "BPE");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0)
    r.fail(path + ".dropout", "BPE dropout is unsupported", "set it to null for deterministic tokenization");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(key) && !m[key].is_null() && !m[key].get<std::string>().empty())
      r.fail(path + "." + key, "a non-empty value is unsupported", "byte-level BPE models use null here");
  }
  if (r.flag(m, "byte_fallback", false, path))
    r.fail(path + ".byte_fallback", "byte_fallback is unsupported", "byte-level BPE models use false here");
  const bool ignore_merges = r.flag(m, "ignore_merges", false, path);
  const bool fuse_unk = r.flag(m, "fuse_unk", false, path);

  const json& vocab_json = r.at(m, "vocab", path);
  if (!vocab_json.is_object()) r.fail(path + ".vocab", "expected an object token -> id", "fix the vocabulary");
  int64_t max_id = -1;
  vocab.reserve(vocab_json.size());
  for (auto it = vocab_json.begin(); it != vocab_json.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0)
      r.fail(path + ".vocab." + it.key(), "expected an id >= 0", "fix the vocabulary");
    const int64_t id = it.value().get<int64_t>();
    vocab[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  // Ids index tables: a sparse id would allocate for tokens that do not exist (a real vocabulary
  // numbers its tokens 0..n-1).
  if (max_id >= 2 * int64_t(vocab_json.size()) + 1024)
    r.fail(path + ".vocab", "ids are sparse: the largest is " + std::to_string(max_id) + " for " +
                                std::to_string(vocab_json.size()) + " tokens",
           "number the tokens from 0 without large gaps");
  t.resize(size_t(max_id + 1));
  std::vector<std::string> model_bytes(size_t(max_id + 1));
  for (const auto& [token, id] : vocab) {
    t.tokens_[size_t(id)] = token;
    t.present_[size_t(id)] = true;
    // A token with a character outside the byte alphabet can only come from decode (HF then
    // writes its UTF-8 as it is); no byte-level word reaches it.
    if (!unicode::byte_level_decode(token, model_bytes[size_t(id)])) model_bytes[size_t(id)].clear();
  }

  int32_t unk_id = -1;
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto it = vocab.find(m["unk_token"].get<std::string>());
    if (it != vocab.end()) unk_id = int32_t(it->second);
  }

  const json& merges_json = r.at(m, "merges", path);
  if (!merges_json.is_array()) r.fail(path + ".merges", "expected a list", "fix the merges");
  std::vector<std::array<int32_t, 3>> merges;
  merges.reserve(merges_json.size());
  std::string a, b;
  for (size_t i = 0; i < merges_json.size(); ++i) {
    const json& e = merges_json[i];
    if (e.is_string()) {  // legacy "a b"
      const std::string& s = e.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        r.fail(index_path(path, "merges", i), "expected \"a b\" (two tokens, one space), got '" + s + "'",
               "fix the merge");
      a.assign(s, 0, space);
      b.assign(s, space + 1, std::string::npos);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      r.fail(index_path(path, "merges", i), "expected \"a b\" or [\"a\", \"b\"]", "fix the merge");
    }
    int64_t ids[3];
    const std::string merged = a + b;
    const std::string* parts[3] = {&a, &b, &merged};
    for (int k = 0; k < 3; ++k) {
      auto it = vocab.find(*parts[k]);
      if (it == vocab.end())
        r.fail(index_path(path, "merges", i), "names a token missing from model.vocab (token='" + *parts[k] + "')",
               "every merge part and their concatenation must be in the vocabulary");
      ids[k] = it->second;
    }
    merges.push_back({int32_t(ids[0]), int32_t(ids[1]), int32_t(ids[2])});
  }
  t.model_ = BpeModel::with_merges(std::move(model_bytes), merges, ignore_merges, unk_id, fuse_unk);
  return vocab.size();
}

// HF's AddedVocabulary::add_tokens as run when a tokenizer.json is read: an added token takes the
// id its content already has (earlier added tokens, then the model vocab), else the next free one
// from the vocab's size; the ids written in the file are not used.
void parse_added_tokens(const JsonReader& r, const json& list, size_t vocab_entries,
                        const std::unordered_map<std::string, int64_t>& vocab, BpeTokenizer& t) {
  if (list.is_null()) return;
  if (!list.is_array()) r.fail("added_tokens", "expected a list", "fix the file");
  std::unordered_map<std::string, int64_t> added_ids;
  std::unordered_map<int64_t, AddedToken> by_id;
  std::unordered_set<std::string> special_set;
  int64_t next_id = int64_t(vocab_entries);
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    AddedToken tok;
    tok.content = r.string(list[i], "content", path);
    tok.single_word = r.flag(list[i], "single_word", false, path);
    tok.lstrip = r.flag(list[i], "lstrip", false, path);
    tok.rstrip = r.flag(list[i], "rstrip", false, path);
    tok.normalized = r.flag(list[i], "normalized", true, path);
    tok.special = r.flag(list[i], "special", false, path);
    if (tok.content.empty()) continue;
    auto known = added_ids.find(tok.content);
    if (known != added_ids.end()) {
      tok.id = known->second;
    } else {
      auto in_vocab = vocab.find(tok.content);
      tok.id = in_vocab != vocab.end() ? in_vocab->second : next_id++;
    }
    added_ids[tok.content] = tok.id;
    if (tok.special) special_set.insert(tok.content);
    by_id[tok.id] = tok;
  }
  int64_t max_id = t.vocab_size() - 1;
  for (const auto& [id, tok] : by_id) max_id = std::max(max_id, id);
  t.resize(size_t(max_id + 1));
  for (auto& [id, tok] : by_id) {
    t.added_.push_back(tok);
    const AddedToken* p = &t.added_.back();
    // A normalized token matches its normalized form, and decodes from it.
    std::string form = tok.content;
    if (tok.normalized && !t.normalizer_.empty()) {
      std::string storage;
      form = std::string(t.normalizer_.apply(tok.content, storage));
    }
    if (tok.normalized)
      t.normalized_matcher_.add(form, p);
    else
      t.raw_matcher_.add(form, p);
    t.tokens_[size_t(id)] = tok.content;
    t.present_[size_t(id)] = true;
    std::string bytes;
    if (!unicode::byte_level_decode(form, bytes)) bytes = form;
    t.bytes_[size_t(id)] = std::move(bytes);
    t.special_[size_t(id)] = special_set.count(form) > 0;  // HF checks the decoded form
  }
  for (const auto& [content, id] : added_ids) t.token_ids_[content] = id;
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path) {
  const std::string text = read_file(path, "a HF tokenizer.json");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    KILN_FAIL("tokenizer: ", path, " is not valid JSON: ", e.what(), "; give a HF tokenizer.json");
  }
  const JsonReader r(path);
  if (!j.is_object()) r.fail("(top level)", "expected an object", "give a HF tokenizer.json");
  for (const char* key : {"truncation", "padding"}) {
    if (j.contains(key) && !j[key].is_null())
      r.fail(key, "is set", "kiln's encode neither truncates nor pads; set it to null in the file");
  }
  auto t = std::make_unique<BpeTokenizer>();
  std::unordered_map<std::string, int64_t> vocab;
  const size_t vocab_entries = parse_model(r, r.at(j, "model", "(top level)"), *t, vocab);
  for (size_t id = 0; id < t->bytes_.size(); ++id) {
    if (!t->present_[id]) continue;
    // The ByteLevel decoder: a token whose characters are all in the byte alphabet stands for
    // those bytes; any other token for its own UTF-8.
    if (!unicode::byte_level_decode(t->tokens_[id], t->bytes_[id])) t->bytes_[id] = t->tokens_[id];
  }
  t->token_ids_ = std::move(vocab);
  if (j.contains("normalizer")) parse_normalizer(r, j["normalizer"], "normalizer", t->normalizer_);
  bool byte_level = false;
  if (j.contains("pre_tokenizer"))
    parse_pre_tokenizer(r, j["pre_tokenizer"], "pre_tokenizer", t->pre_tokenizer_, byte_level);
  if (!byte_level)
    r.fail("pre_tokenizer", "no ByteLevel pre-tokenizer",
           "kiln reads byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, gpt-oss style)");
  parse_decoder(r, j.contains("decoder") ? j["decoder"] : json(), "decoder");
  if (j.contains("added_tokens")) parse_added_tokens(r, j["added_tokens"], vocab_entries, t->token_ids_, *t);
  if (j.contains("post_processor")) parse_post_processor(r, j["post_processor"], "post_processor", *t);
  t->set_name(path);
  return t;
}

// ---- tiktoken ----

namespace {

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t i = 0;
  for (; i < in.size() && in[i] != '='; ++i) {
    const int v = base64_value(in[i]);
    if (v < 0) return false;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += char((acc >> bits) & 0xFF);
    }
  }
  for (; i < in.size(); ++i)
    if (in[i] != '=') return false;
  return true;
}

}  // namespace

std::unique_ptr<Tokenizer> load_tiktoken_file(const std::string& path, const TiktokenOptions& options) {
  KILN_CHECK(!options.pattern.empty(), "tokenizer: no pre-tokenizer pattern for ", path,
             "; pass TiktokenOptions with a pattern, or name the file after a known encoding (cl100k_base, "
             "o200k_base, o200k_harmony)");
  const std::string text = read_file(path, "a tiktoken rank file (lines '<base64 token> <rank>')");
  std::vector<std::string> token_bytes;
  std::vector<bool> seen;
  std::string bytes;
  size_t line_no = 0, pos = 0;
  // Ranks index tables: one far beyond the number of tokens would allocate for nothing.
  const int64_t total_lines = int64_t(std::count(text.begin(), text.end(), '\n')) + 1;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    int64_t rank = -1;
    bool ok = space != std::string_view::npos && space + 1 < line.size() && base64_decode(line.substr(0, space), bytes);
    if (ok) {
      rank = 0;
      for (char c : line.substr(space + 1)) {
        if (c < '0' || c > '9' || rank > (int64_t(1) << 31)) {
          ok = false;
          break;
        }
        rank = rank * 10 + (c - '0');
      }
    }
    KILN_CHECK(ok && !bytes.empty(), "tokenizer: ", path, ":", line_no, ": expected '<base64 token> <rank>' (line='",
               std::string(line.substr(0, 80)), "'); give a tiktoken rank file");
    KILN_CHECK(rank < 2 * total_lines + 1024, "tokenizer: ", path, ":", line_no, ": rank ", rank, " is far beyond the ",
               total_lines, " lines of the file; ranks are token ids numbered from 0 without large gaps");
    if (size_t(rank) >= token_bytes.size()) {
      token_bytes.resize(size_t(rank) + 1);
      seen.resize(size_t(rank) + 1);
    }
    KILN_CHECK(!seen[size_t(rank)], "tokenizer: ", path, ":", line_no, ": rank ", rank,
               " appears twice; each rank is one token id");
    seen[size_t(rank)] = true;
    token_bytes[size_t(rank)] = bytes;
  }
  KILN_CHECK(!token_bytes.empty(), "tokenizer: ", path, " holds no ranks; give a tiktoken rank file");

  auto t = std::make_unique<BpeTokenizer>();
  int64_t max_id = int64_t(token_bytes.size()) - 1;
  for (const auto& [content, id] : options.special_tokens) max_id = std::max(max_id, id);
  t->resize(size_t(max_id + 1));
  for (size_t id = 0; id < token_bytes.size(); ++id) {
    if (!seen[id]) continue;
    // Byte-level names, so every token has a printable, valid UTF-8 name (HF's names for the same
    // vocabulary converted to tokenizer.json).
    t->tokens_[id] = unicode::byte_level_encode(token_bytes[id]);
    t->bytes_[id] = token_bytes[id];
    t->present_[id] = true;
    t->token_ids_.emplace(t->tokens_[id], int64_t(id));
  }
  for (const auto& [content, id] : options.special_tokens) {
    KILN_CHECK(id >= 0 && !content.empty(), "tokenizer: bad special token for ", path, " (content='", content,
               "', id=", id, "); give a non-empty content and an id >= 0");
    KILN_CHECK(!t->present_[size_t(id)] || t->tokens_[size_t(id)] == content, "tokenizer: special token '", content,
               "' takes id ", id, ", which ", path, " already gives to another token; pick a free id");
    AddedToken tok;
    tok.content = content;
    tok.id = id;
    tok.normalized = false;
    tok.special = true;
    t->added_.push_back(tok);
    t->raw_matcher_.add(content, &t->added_.back());
    t->tokens_[size_t(id)] = content;
    t->bytes_[size_t(id)] = content;
    t->present_[size_t(id)] = true;
    t->special_[size_t(id)] = true;
    t->token_ids_[content] = id;
  }
  t->model_ = BpeModel::with_token_ranks(std::move(token_bytes));
  PreTokenizerStep split;
  split.kind = PreTokenizerStep::Kind::kSplit;
  split.regex = std::make_shared<const Regex>(options.pattern, Regex::Dialect::kRust, path + ": pattern");
  t->pre_tokenizer_.add(split);
  t->set_name(path);
  return t;
}

}  // namespace kiln::text
