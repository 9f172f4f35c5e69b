// Tokenizer unit tests without references: the byte tokenizer (CharTokenizer's cases), UTF-8
// repair, StreamDecoder, BPE merging (scan against heap), tiktoken rank files, the config files,
// copy_tokenizer_files, regex rewriting and the errors for bad files.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <random>

#include "tests/test_util.h"
#include "text/bpe.h"
#include "text/tokenizer.h"
#include "text/tokenizer_pipeline.h"
#include "text/unicode.h"

namespace kiln::text {
namespace {

using test::throws_with;

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// ---- byte tokenizer (the cases of trainer::CharTokenizer) ----

TEST(ByteTokenizerTest, RoundTripsEveryPrintableAsciiChar) {
  ByteTokenizer tok;
  std::string text;
  for (int c = 32; c < 127; ++c) text += char(c);
  text += "\n\t";
  const std::vector<int64_t> ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(ids[i], int64_t(static_cast<unsigned char>(text[i])));
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(tok.decode({}), "");
  EXPECT_EQ(tok.encode(text, true), ids);  // no bos, no post-processor
}

TEST(ByteTokenizerTest, PadIsZeroAndEosIsNewline) {
  const std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  EXPECT_EQ(tok->pad_id(), 0);
  EXPECT_EQ(tok->eos_id(), 10);
  EXPECT_EQ(tok->eos_token(), "\n");
  EXPECT_EQ(tok->stop_ids(), std::vector<int64_t>{10});
  EXPECT_FALSE(tok->bos_id().has_value());
  EXPECT_EQ(tok->chat_template(), "");
  EXPECT_EQ(tok->vocab_size(), 128);
  EXPECT_EQ(tok->encode("46\n"), (std::vector<int64_t>{'4', '6', 10}));
  EXPECT_EQ(tok->decode({0}), std::string(1, '\0'));
  EXPECT_EQ(tok->decode({'4', 0, '2'}, true), "42");  // pad is the special id
  EXPECT_TRUE(tok->is_special(0));
  EXPECT_FALSE(tok->is_special(10));
  EXPECT_EQ(tok->token_to_id("a"), 'a');
  EXPECT_FALSE(tok->token_to_id("ab").has_value());
  EXPECT_EQ(tok->id_to_token('a'), "a");
  EXPECT_EQ(tok->id_to_token(128), "");
}

TEST(ByteTokenizerTest, EncodeRejectsBytesOutsideVocabNamingCharAndPosition) {
  ByteTokenizer tok;
  EXPECT_TRUE(throws_with([&] { tok.encode("12+\xC8="); }, {"char=\\xC8", "byte=200", "position=3", "vocab_size=128"}));
  ByteTokenizer small(64);
  EXPECT_TRUE(throws_with([&] { small.encode("12a"); }, {"char='a'", "position=2", "vocab_size=64"}));
  EXPECT_TRUE(throws_with([&] { tok.encode(std::string("1\0", 2)); }, {"pad", "position=1"}));
}

TEST(ByteTokenizerTest, IdsOutsideVocabDecodeToReplacementCharacter) {
  // CharTokenizer::decode threw here; the Tokenizer interface writes U+FFFD instead, so model
  // samples with ids beyond the byte vocabulary (muse-small: 65536) decode to wrong answers.
  ByteTokenizer tok(128);
  EXPECT_EQ(tok.decode({'4', 28341, '2', -1, '\n'}),
            "4\xEF\xBF\xBD"
            "2\xEF\xBF\xBD\n");
  EXPECT_EQ(tok.decode({127}), "\x7F");
}

TEST(ByteTokenizerTest, RejectsVocabSizeWithoutRoomForEos) {
  EXPECT_TRUE(throws_with([] { ByteTokenizer t(10); }, {"vocab_size=10"}));
  EXPECT_TRUE(throws_with([] { ByteTokenizer t(257); }, {"vocab_size=257"}));
}

TEST(ByteTokenizerTest, FullByteVocabularyRoundTripsUtf8) {
  ByteTokenizer tok(256);
  const std::string text = "héllo 😀";
  EXPECT_EQ(tok.encode(text).size(), text.size());
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
  EXPECT_EQ(tok.decode({0xF0, 0x9F}), "\xEF\xBF\xBD");  // an unfinished character: one U+FFFD
}

// ---- UTF-8 repair: maximal invalid subsequences -> U+FFFD (Unicode 3.9, WHATWG, Rust) ----

TEST(Utf8Test, InvalidSequencesBecomeOneReplacementPerMaximalSubpart) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(unicode::to_valid_utf8("a\xFF"
                                   "b"),
            "a" + r + "b");
  EXPECT_EQ(unicode::to_valid_utf8("\xF0\x9F\x98"), r);                  // truncated 4-byte: one
  EXPECT_EQ(unicode::to_valid_utf8("\xE0\x80\x80"), r + r + r);          // E0 needs A0..BF next
  EXPECT_EQ(unicode::to_valid_utf8("\xED\xA0\x80"), r + r + r);          // a surrogate
  EXPECT_EQ(unicode::to_valid_utf8("\xC0\xAF"), r + r);                  // overlong
  EXPECT_EQ(unicode::to_valid_utf8("\xF4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
  EXPECT_EQ(unicode::to_valid_utf8("\xE2\x82"
                                   "x"),
            r + "x");
  EXPECT_EQ(unicode::to_valid_utf8("ok \xF0\x9F\x98\x80"), "ok \xF0\x9F\x98\x80");
  EXPECT_TRUE(unicode::is_valid_utf8("ok \xF0\x9F\x98\x80 é"));
  EXPECT_FALSE(unicode::is_valid_utf8("\xC3"));
  std::string out;
  EXPECT_EQ(unicode::append_complete("ab\xF0\x9F", out), 2u);  // the unfinished emoji waits
  EXPECT_EQ(out, "ab");
}

TEST(Utf8Test, ByteLevelAlphabetIsABijection) {
  std::string all;
  for (int b = 0; b < 256; ++b) all += char(b);
  const std::string chars = unicode::byte_level_encode(all);
  std::string back;
  ASSERT_TRUE(unicode::byte_level_decode(chars, back));
  EXPECT_EQ(back, all);
  EXPECT_EQ(unicode::byte_level_char(' '), "\xC4\xA0");   // 'Ġ'
  EXPECT_EQ(unicode::byte_level_char('\n'), "\xC4\x8A");  // 'Ċ'
  EXPECT_EQ(unicode::byte_level_char('a'), "a");
  EXPECT_FALSE(unicode::byte_level_decode("\xE2\x82\xAC", back));  // '€' is not in the alphabet
}

// ---- streaming ----

TEST(StreamDecoderTest, NeverSplitsACharacterAndEqualsDecode) {
  ByteTokenizer tok(256);
  const std::string text = "a👩‍👩‍👧‍👦b é";
  const std::vector<int64_t> ids = tok.encode(text);
  StreamDecoder stream(tok);
  std::string joined;
  for (int64_t id : ids) {
    const std::string piece = stream.push(id);
    EXPECT_TRUE(unicode::is_valid_utf8(piece));
    joined += piece;
  }
  joined += stream.flush();
  EXPECT_EQ(joined, text);
  // The emoji's four bytes come out together, on the fourth.
  StreamDecoder s2(tok);
  EXPECT_EQ(s2.push(0xF0), "");
  EXPECT_EQ(s2.push(0x9F), "");
  EXPECT_EQ(s2.push(0x98), "");
  EXPECT_EQ(s2.push(0x80), "\xF0\x9F\x98\x80");
  // An unfinished tail flushes as U+FFFD, like decode; an invalid byte comes out at once.
  EXPECT_EQ(s2.push(0xE4), "");
  EXPECT_EQ(s2.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(s2.push(0xFF), "\xEF\xBF\xBD");
  EXPECT_EQ(s2.push(0xE4), "");
  EXPECT_EQ(s2.push('x'), "\xEF\xBF\xBDx");
  EXPECT_EQ(tok.decode({0xE4, 'x'}), "\xEF\xBF\xBDx");
}

TEST(StreamDecoderTest, SkipsSpecialTokensWhenAsked) {
  ByteTokenizer tok;
  StreamDecoder stream(tok, true);
  EXPECT_EQ(stream.push('a'), "a");
  EXPECT_EQ(stream.push(0), "");
  EXPECT_EQ(stream.push(999), "\xEF\xBF\xBD");
}

// ---- BPE merging: the heap and the scan agree ----

TEST(BpeMergeTest, HeapAndScanGiveTheSameSymbols) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int alphabet = 2 + int(rng() % 5), num_symbols = 1 + int(rng() % 200);
    // Random merge table over a small id space; merged ids get fresh numbers.
    PairRanks pairs;
    std::vector<std::array<int32_t, 3>> table;
    int32_t next_id = alphabet;
    for (int k = 0; k < 60; ++k) {
      const int32_t a = int32_t(rng() % uint64_t(next_id)), b = int32_t(rng() % uint64_t(next_id));
      pairs.insert(a, b, BpeMerge{int32_t(rng() % 1000), next_id++});
    }
    std::vector<BpeSymbol> s1;
    for (int i = 0; i < num_symbols; ++i) s1.push_back({int32_t(rng() % uint64_t(alphabet)), uint32_t(i), 1});
    std::vector<BpeSymbol> s2 = s1;
    auto pair = [&](const BpeSymbol& a, const BpeSymbol& b) { return pairs.find(a.id, b.id); };
    merge_symbols_scan(s1, pair);
    merge_symbols_heap(s2, pair);
    ASSERT_EQ(s1.size(), s2.size()) << "trial " << trial;
    for (size_t i = 0; i < s1.size(); ++i) {
      EXPECT_EQ(s1[i].id, s2[i].id) << "trial " << trial << " symbol " << i;
      EXPECT_EQ(s1[i].start, s2[i].start);
      EXPECT_EQ(s1[i].length, s2[i].length);
    }
  }
}

TEST(BpeMergeTest, LowestRankFirstLeftmostOnTies) {
  // ids: a=0 b=1 c=2; merges: (b, c) rank 0 -> 3, (a, b) rank 1 -> 4, (a, 3) rank 2 -> 5.
  PairRanks pairs;
  pairs.insert(1, 2, {0, 3});
  pairs.insert(0, 1, {1, 4});
  pairs.insert(0, 3, {2, 5});
  auto pair = [&](const BpeSymbol& a, const BpeSymbol& b) { return pairs.find(a.id, b.id); };
  std::vector<BpeSymbol> abc = {{0, 0, 1}, {1, 1, 1}, {2, 2, 1}};
  merge_symbols(abc, pair);
  ASSERT_EQ(abc.size(), 1u);
  EXPECT_EQ(abc[0].id, 5);
  std::vector<BpeSymbol> abab = {{0, 0, 1}, {1, 1, 1}, {0, 2, 1}, {1, 3, 1}};
  merge_symbols(abab, pair);
  ASSERT_EQ(abab.size(), 2u);
  EXPECT_EQ(abab[0].id, 4);
  EXPECT_EQ(abab[1].id, 4);
}

// ---- tiktoken ----

std::string b64(const std::string& bytes) {
  static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : bytes) {
    acc = (acc << 8) | c;
    bits += 8;
    while (bits >= 6) out += abc[(acc >> (bits -= 6)) & 63];
  }
  if (bits > 0) out += abc[(acc << (6 - bits)) & 63];
  while (out.size() % 4) out += '=';
  return out;
}

// Every byte (rank = byte value) and ab=256, abc=257, cd=258, " x"=259.
std::string tiny_ranks() {
  std::string text;
  for (int b = 0; b < 256; ++b) text += b64(std::string(1, char(b))) + " " + std::to_string(b) + "\n";
  text += b64("ab") + " 256\n" + b64("abc") + " 257\n" + b64("cd") + " 258\n" + b64(" x") + " 259\n";
  return text;
}

TEST(TiktokenTest, TinyRankFileMergesByRankOfTheMergedBytes) {
  test::TempDir dir;
  write_file(dir / "tiny.tiktoken", tiny_ranks());
  TiktokenOptions options;
  options.pattern = R"( ?\S+|\s+)";
  options.special_tokens = {{"<|end|>", 300}};
  const auto tok = load_tiktoken(dir / "tiny.tiktoken", options);
  EXPECT_EQ(tok->vocab_size(), 301);
  // a b c d: ab (256) first, then abc (257); abcd is no token.
  EXPECT_EQ(tok->encode("abcd"), (std::vector<int64_t>{257, 'd'}));
  EXPECT_EQ(tok->encode("abc"), (std::vector<int64_t>{257}));  // the whole piece is a token
  EXPECT_EQ(tok->encode("bcd"), (std::vector<int64_t>{'b', 258}));
  EXPECT_EQ(tok->encode("cd xab<|end|>"), (std::vector<int64_t>{258, 259, 256, 300}));
  EXPECT_EQ(tok->decode({258, 259, 256, 300}), "cd xab<|end|>");
  EXPECT_EQ(tok->decode({258, 300}, true), "cd");
  EXPECT_TRUE(tok->is_special(300));
  EXPECT_EQ(tok->token_to_id("<|end|>"), 300);
  EXPECT_EQ(tok->id_to_token(259), "\xC4\xA0x");  // byte-level name: "Ġx"
  EXPECT_EQ(tok->token_to_id("\xC4\xA0x"), 259);
  EXPECT_EQ(tok->decode({0xE4, 0xBD}), "\xEF\xBF\xBD");
  EXPECT_EQ(tok->name(), dir / "tiny.tiktoken");
}

TEST(TiktokenTest, KnownEncodingsAndFileNames) {
  ASSERT_TRUE(known_tiktoken_encoding("cl100k_base").has_value());
  ASSERT_TRUE(known_tiktoken_encoding("o200k_base").has_value());
  ASSERT_TRUE(known_tiktoken_encoding("o200k_harmony").has_value());
  EXPECT_FALSE(known_tiktoken_encoding("p50k_base").has_value());
  EXPECT_EQ(known_tiktoken_encoding("cl100k_base")->special_tokens.front(),
            (std::pair<std::string, int64_t>{"<|endoftext|>", 100257}));
  test::TempDir dir;
  // Named after a known encoding: its pattern and specials apply (cl100k: <|endoftext|> = 100257).
  write_file(dir / "cl100k_base.tiktoken", tiny_ranks());
  const auto tok = load_tokenizer(dir.path());
  EXPECT_EQ(tok->token_to_id("<|endoftext|>"), 100257);
  EXPECT_EQ(tok->encode("ab<|endoftext|>"), (std::vector<int64_t>{256, 100257}));
  EXPECT_EQ(tok->encode("'s"), (std::vector<int64_t>{'\'', 's'}));
  // Another name needs options.
  write_file(dir / "mine.tiktoken", tiny_ranks());
  EXPECT_TRUE(throws_with([&] { load_tiktoken(dir / "mine.tiktoken"); }, {"mine.tiktoken", "known tiktoken"}));
  EXPECT_TRUE(throws_with([&] { load_tokenizer(dir.path()); }, {"2 *.tiktoken files"}));
}

TEST(TiktokenTest, BadRankFilesNameTheLine) {
  test::TempDir dir;
  TiktokenOptions options;
  options.pattern = R"(\S+|\s+)";
  write_file(dir / "bad.tiktoken", b64("a") + " 0\nnot-base64!! 1\n");
  EXPECT_TRUE(throws_with([&] { load_tiktoken(dir / "bad.tiktoken", options); }, {"bad.tiktoken:2", "base64"}));
  write_file(dir / "dup.tiktoken", b64("a") + " 0\n" + b64("b") + " 0\n");
  EXPECT_TRUE(throws_with([&] { load_tiktoken(dir / "dup.tiktoken", options); }, {"dup.tiktoken:2", "rank 0"}));
  write_file(dir / "short.tiktoken", b64("a") + " 0\n");
  EXPECT_TRUE(throws_with([&] { load_tiktoken(dir / "short.tiktoken", options); }, {"single byte 0"}));
}

// ---- tokenizer.json: a small hand-written one ----

using nlohmann::json;

json tiny_model(const std::string& type = "BPE") {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[unicode::byte_level_char(uint8_t(b))] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"l", "l"},          {"ll", "o"},          {"he", "llo"},        {"\xC4\xA0", "w"},
      {"o", "r"}, {"\xC4\xA0w", "or"}, {"\xC4\xA0wor", "l"}, {"\xC4\xA0worl", "d"}};
  json list = json::array();
  int64_t next = 256;
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    list.push_back(a + " " + b);  // the legacy "a b" form
  }
  return {{"type", type}, {"vocab", vocab}, {"merges", list}, {"ignore_merges", false}};
}

// The vocabulary has 265 entries (256 bytes, 9 merges); added tokens continue from there.
constexpr int64_t kBos = 265, kEos = 266;

json tiny_tokenizer(int64_t bos = kBos, int64_t eos = kEos) {
  return {{"version", "1.0"},
          {"added_tokens", json::array({{{"id", bos}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
                                        {{"id", eos}, {"content", "</s>"}, {"special", true}, {"normalized", false}}})},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                    {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
            {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {kBos}}, {"tokens", {"<s>"}}}}}}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", tiny_model()}};
}

int64_t id_of(const Tokenizer& t, const std::string& token) {
  const std::optional<int64_t> id = t.token_to_id(token);
  EXPECT_TRUE(id.has_value()) << token;
  return id.value_or(-1);
}

TEST(TokenizerJsonTest, EncodesDecodesAndAddsTheTemplateTokens) {
  test::TempDir dir;
  write_file(dir / "tokenizer.json", tiny_tokenizer().dump());
  const auto tok = load_tokenizer(dir / "tokenizer.json");
  const int64_t hello = id_of(*tok, "hello"), world = id_of(*tok, "\xC4\xA0world");
  EXPECT_EQ(tok->encode("hello world"), (std::vector<int64_t>{hello, world}));
  EXPECT_EQ(tok->encode("hello world", true), (std::vector<int64_t>{kBos, hello, world}));
  EXPECT_EQ(tok->encode("<s>hello</s>"), (std::vector<int64_t>{kBos, hello, kEos}));
  EXPECT_EQ(tok->decode({kBos, hello, world, kEos}), "<s>hello world</s>");
  EXPECT_EQ(tok->decode({kBos, hello, world, kEos}, true), "hello world");
  EXPECT_EQ(tok->decode({hello, 5000, -3}), "hello\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tok->vocab_size(), 267);
  EXPECT_TRUE(tok->is_special(kEos));
  EXPECT_FALSE(tok->is_special(hello));
  EXPECT_EQ(tok->id_to_token(world), "\xC4\xA0world");
  EXPECT_EQ(tok->id_to_token(kEos), "</s>");
  EXPECT_EQ(tok->id_to_token(267), "");
  EXPECT_EQ(tok->name(), dir / "tokenizer.json");
  // No config files: no bos/eos, pad 0, no template.
  EXPECT_FALSE(tok->eos_id().has_value());
  EXPECT_EQ(tok->pad_id(), 0);
  EXPECT_TRUE(tok->stop_ids().empty());
  // Invalid UTF-8 is repaired first: the same ids as the U+FFFD text.
  EXPECT_EQ(tok->encode("he\xFFllo"), tok->encode("he\xEF\xBF\xBDllo"));
}

TEST(TokenizerJsonTest, AddedTokensTakeHfsIdsNotTheFilesIds) {
  // HF reads added tokens through add_tokens: an unknown content gets the next id after the
  // vocabulary's entries (a warning there); kiln does the same so its ids are HF's.
  test::TempDir dir;
  write_file(dir / "tokenizer.json", tiny_tokenizer(300, 301).dump());
  const auto tok = load_tokenizer(dir.path());
  EXPECT_EQ(tok->token_to_id("<s>"), kBos);
  EXPECT_EQ(tok->token_to_id("</s>"), kEos);
  EXPECT_EQ(tok->encode("</s>"), std::vector<int64_t>{kEos});
}

TEST(TokenizerJsonTest, ConfigFilesGiveBosEosPadStopIdsAndChatTemplate) {
  test::TempDir dir;
  write_file(dir / "tokenizer.json", tiny_tokenizer().dump());
  write_file(dir / "tokenizer_config.json",
             json{{"bos_token", "<s>"},
                  {"eos_token", {{"content", "</s>"}, {"lstrip", false}}},
                  {"pad_token", nullptr},
                  {"chat_template",
                   json::array({{{"name", "tool_use"}, {"template", "U"}}, {{"name", "default"}, {"template", "T"}}})}}
                 .dump());
  write_file(dir / "generation_config.json", json{{"eos_token_id", {kEos, 104, kEos}}, {"bos_token_id", 7}}.dump());
  auto tok = load_tokenizer(dir.path());
  EXPECT_EQ(tok->bos_id(), kBos);  // tokenizer_config names it; generation_config's id stands in only without
  EXPECT_EQ(tok->bos_token(), "<s>");
  EXPECT_EQ(tok->eos_id(), kEos);
  EXPECT_EQ(tok->eos_token(), "</s>");
  EXPECT_EQ(tok->stop_ids(), (std::vector<int64_t>{kEos, 104}));
  EXPECT_EQ(tok->pad_id(), kEos);  // no pad_token: eos
  EXPECT_EQ(tok->chat_template(), "T");
  // chat_template.jinja wins over tokenizer_config's entry (transformers does the same).
  write_file(dir / "chat_template.jinja", "{{ messages }}");
  tok = load_tokenizer(dir.path());
  EXPECT_EQ(tok->chat_template(), "{{ messages }}");
  // add_bos_token without a template post-processor: bos once, never twice.
  json t = tiny_tokenizer();
  t["post_processor"] = nullptr;
  write_file(dir / "tokenizer.json", t.dump());
  write_file(dir / "tokenizer_config.json", json{{"bos_token", "<s>"},
                                                 {"eos_token", "</s>"},
                                                 {"pad_token", "h"},
                                                 {"add_bos_token", true},
                                                 {"add_eos_token", true},
                                                 {"chat_template", "C"}}
                                                .dump());
  tok = load_tokenizer(dir.path());
  const int64_t hello = id_of(*tok, "hello");
  EXPECT_EQ(tok->encode("hello", true), (std::vector<int64_t>{kBos, hello, kEos}));
  EXPECT_EQ(tok->encode("<s>hello</s>", true), (std::vector<int64_t>{kBos, hello, kEos}));
  EXPECT_EQ(tok->encode("hello"), (std::vector<int64_t>{hello}));
  EXPECT_EQ(tok->pad_id(), 'h');
  // Only generation_config.json: its ids give bos and eos.
  write_file(dir / "tokenizer_config.json", "{}");
  tok = load_tokenizer(dir.path());
  EXPECT_EQ(tok->bos_id(), 7);
  EXPECT_EQ(tok->eos_id(), kEos);
  EXPECT_EQ(tok->eos_token(), "</s>");
  // A named token that the vocabulary lacks is an error naming the file and key.
  write_file(dir / "tokenizer_config.json", json{{"eos_token", "<|nope|>"}}.dump());
  EXPECT_TRUE(throws_with([&] { load_tokenizer(dir.path()); }, {"tokenizer_config.json", "eos_token", "<|nope|>"}));
}

TEST(TokenizerJsonTest, ErrorsNameTheFileThePathAndTheType) {
  test::TempDir dir;
  EXPECT_TRUE(throws_with([&] { load_tokenizer(dir / "missing"); }, {"cannot open", "missing"}));
  EXPECT_TRUE(throws_with([&] { load_tokenizer(dir.path()); }, {"neither tokenizer.json nor a *.tiktoken"}));
  write_file(dir / "tokenizer.json", "{\"model\": [1, 2,");
  EXPECT_TRUE(throws_with([&] { load_tokenizer(dir.path()); }, {dir / "tokenizer.json", "not valid JSON"}));

  auto expect_error = [&](const json& t, const std::vector<std::string>& parts) {
    write_file(dir / "tokenizer.json", t.dump());
    std::vector<std::string> all = parts;
    all.push_back(dir / "tokenizer.json");
    EXPECT_TRUE(throws_with([&] { load_tokenizer(dir.path()); }, all));
  };
  json t = tiny_tokenizer();
  t["model"] = tiny_model("WordPiece");
  expect_error(t, {"model.type", "model 'WordPiece' is unsupported"});
  t = tiny_tokenizer();
  t["model"]["merges"].push_back("h zz");
  expect_error(t, {"model.merges[9]", "token='zz'"});
  t = tiny_tokenizer();
  t["model"]["merges"].push_back("h e x");
  expect_error(t, {"model.merges[9]", "two tokens"});
  t = tiny_tokenizer();
  t["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Metaspace"}}, t["pre_tokenizer"]})}};
  expect_error(t, {"pre_tokenizer.pretokenizers[0].type", "'Metaspace'"});
  t = tiny_tokenizer();
  t["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Isolated"}, {"invert", false}};
  expect_error(t, {"pre_tokenizer", "no ByteLevel pre-tokenizer"});
  t = tiny_tokenizer();
  t["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}, {"invert", false}};
  expect_error(t, {"pre_tokenizer.pattern", "does not compile"});
  t = tiny_tokenizer();
  t["model"]["vocab"]["far"] = 10000000;  // found by fuzz_tokenizer: a 10M-entry table for one token
  expect_error(t, {"model.vocab", "ids are sparse: the largest is 10000000"});
  t = tiny_tokenizer();
  t["normalizer"] = {{"type", "BertNormalizer"}};
  expect_error(t, {"normalizer.type", "'BertNormalizer'"});
  t = tiny_tokenizer();
  t["decoder"] = {{"type", "WordPiece"}};
  expect_error(t, {"decoder.type", "'WordPiece'"});
  t = tiny_tokenizer();
  t["post_processor"] = {{"type", "Mystery"}};
  expect_error(t, {"post_processor.type", "'Mystery'"});
  t = tiny_tokenizer();
  t["model"]["byte_fallback"] = true;
  expect_error(t, {"model.byte_fallback"});
  t = tiny_tokenizer();
  t["truncation"] = {{"max_length", 512}};
  expect_error(t, {"truncation"});
}

// ---- added-token matching (HF's rules, by hand) ----

TEST(AddedTokenTest, LeftmostLongestWithStripAndSingleWord) {
  AddedToken a{"<a", 1}, ab{"<ab>", 2}, strip{"<m>", 3}, word{"<sw>", 4};
  strip.lstrip = strip.rstrip = true;
  word.single_word = true;
  AddedTokenMatcher m;
  for (const AddedToken* t : {&a, &ab, &strip, &word}) m.add(t->content, t);
  auto segments = [&](const std::string& text) {
    std::vector<Segment> out;
    m.split(text, out);
    std::vector<std::pair<std::string, int64_t>> r;
    for (const Segment& s : out) r.emplace_back(text.substr(s.begin, s.end - s.begin), s.id);
    return r;
  };
  using V = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(segments("x<ab>y<a"), (V{{"x", -1}, {"<ab>", 2}, {"y", -1}, {"<a", 1}}));
  EXPECT_EQ(segments("a \u3000<m>\t b"), (V{{"a", -1}, {" \u3000<m>\t ", 3}, {"b", -1}}));
  EXPECT_EQ(segments("a<sw>b"), (V{{"a<sw>b", -1}}));
  EXPECT_EQ(segments("é<sw>"), (V{{"é<sw>", -1}}));
  EXPECT_EQ(segments("a <sw>."), (V{{"a ", -1}, {"<sw>", 4}, {".", -1}}));
  EXPECT_EQ(segments(""), V{});
}

// ---- regexes ----

TEST(RegexTest, WhiteSpaceClassesFollowOnigurumaNotPcre2) {
  const std::string rewritten = rewrite_pattern(R"([^\s\p{L}]+|\s+(?!\S)|\h)", Regex::Dialect::kOniguruma);
  EXPECT_EQ(rewritten.find("\\s"), std::string::npos) << rewritten;
  EXPECT_EQ(rewritten.find("\\h"), std::string::npos) << rewritten;
  Regex space(R"(\s+)", Regex::Dialect::kOniguruma, "test");
  std::vector<std::string> matches;
  const std::string text = "a\u3000\u180E b\u0085c";  // U+180E is not White_Space
  space.for_each_piece(text, [&](size_t b, size_t e, bool m) {
    if (m) matches.push_back(text.substr(b, e - b));
  });
  EXPECT_EQ(matches, (std::vector<std::string>{"\u3000", " ", "\u0085"}));
  // Oniguruma's ^ and $ are line anchors; Rust's $ is the end of the text.
  Regex onig("x$", Regex::Dialect::kOniguruma, "test"), rust("x$", Regex::Dialect::kRust, "test");
  int onig_matches = 0, rust_matches = 0;
  onig.for_each_piece("x\nx\n", [&](size_t, size_t, bool m) { onig_matches += m; });
  rust.for_each_piece("x\nx\n", [&](size_t, size_t, bool m) { rust_matches += m; });
  EXPECT_EQ(onig_matches, 2);
  EXPECT_EQ(rust_matches, 0);
}

// ---- copy_tokenizer_files ----

TEST(CopyTokenizerFilesTest, CopiesOnlyTheTokenizerFiles) {
  test::TempDir from, to;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                           "o200k_base.tiktoken", "model.safetensors", "config.json"})
    write_file(from / name, std::string("contents of ") + name);
  copy_tokenizer_files(from.path(), to / "checkpoint");
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                           "o200k_base.tiktoken"}) {
    std::ifstream in(to / "checkpoint/" + name);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, std::string("contents of ") + name);
  }
  EXPECT_FALSE(std::ifstream(to / "checkpoint/model.safetensors").good());
  EXPECT_FALSE(std::ifstream(to / "checkpoint/config.json").good());
  EXPECT_TRUE(throws_with([&] { copy_tokenizer_files(from / "nope", to.path()); }, {"nope", "not a directory"}));
}

TEST(CopyTokenizerFilesTest, FindsTheFolderOfATokenizer) {
  test::TempDir json_dir, rank_dir, empty;
  write_file(json_dir / "tokenizer.json", "{}");
  write_file(rank_dir / "cl100k_base.tiktoken", "");
  write_file(empty / "config.json", "{}");
  EXPECT_TRUE(has_tokenizer_files(json_dir.path()));
  EXPECT_TRUE(has_tokenizer_files(rank_dir.path()));
  EXPECT_FALSE(has_tokenizer_files(empty.path()));
  EXPECT_FALSE(has_tokenizer_files(empty / "missing"));
  EXPECT_EQ(tokenizer_dir(ByteTokenizer()), "");  // no files behind it
  test::TempDir tiny;
  write_file(tiny / "tiny.tiktoken", tiny_ranks());
  TiktokenOptions o;
  o.pattern = R"( ?\S+|\s+)";
  EXPECT_EQ(tokenizer_dir(*load_tiktoken(tiny / "tiny.tiktoken", o)), tiny.path());
}

}  // namespace
}  // namespace kiln::text
