// Tasks and rewards of the GRPO demo: tokenizer round trip and errors, the arithmetic generator
// (determinism, levels, answers checked by evaluating the prompt here), JSONL loading and its
// errors, the train/test split, the resumable training stream, and the rewards on hand cases.
#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <map>
#include <set>

#include "tests/test_util.h"
#include "trainer/tasks.h"

namespace kiln {
namespace {

using test::error_of;
using test::throws_with;
using trainer::CharTokenizer;
using trainer::DataStream;
using trainer::Problem;

std::vector<std::string> prompts(const std::vector<Problem>& ps) {
  std::vector<std::string> out;
  for (const auto& p : ps) out.push_back(p.prompt);
  return out;
}

std::set<std::string> prompt_set(const std::vector<Problem>& ps) {
  std::set<std::string> out;
  for (const auto& p : ps) out.insert(p.prompt);
  return out;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// ---- tokenizer ----

TEST(TokenizerTest, RoundTripsEveryPrintableAsciiChar) {
  CharTokenizer tok;
  std::string text;
  for (int c = 32; c < 127; ++c) text += char(c);
  text += "\n\t";
  const std::vector<int64_t> ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(ids[i], int64_t(static_cast<unsigned char>(text[i])));
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(tok.decode({}), "");
}

TEST(TokenizerTest, PadIsZeroAndEosIsNewline) {
  CharTokenizer tok;
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.eos_id(), 10);
  EXPECT_EQ(tok.encode("46\n"), (std::vector<int64_t>{'4', '6', tok.eos_id()}));
  EXPECT_EQ(tok.decode({tok.pad_id()}), std::string(1, '\0'));
}

TEST(TokenizerTest, EncodeRejectsBytesOutsideVocabNamingCharAndPosition) {
  CharTokenizer tok;
  EXPECT_TRUE(throws_with([&] { tok.encode("12+\xC8="); }, {"char=\\xC8", "byte=200", "position=3", "vocab_size=128"}));
  CharTokenizer small(64);
  EXPECT_TRUE(throws_with([&] { small.encode("12a"); }, {"char='a'", "position=2", "vocab_size=64"}));
  EXPECT_TRUE(throws_with([&] { tok.encode(std::string("1\0", 2)); }, {"pad", "position=1"}));
}

TEST(TokenizerTest, DecodeRejectsIdsOutsideVocab) {
  CharTokenizer tok;
  EXPECT_TRUE(throws_with([&] { tok.decode({'4', 128}); }, {"id=128", "position=1", "vocab_size=128"}));
  EXPECT_TRUE(throws_with([&] { tok.decode({-1}); }, {"id=-1", "position=0"}));
  EXPECT_EQ(tok.decode({127}), "\x7F");
}

TEST(TokenizerTest, SamplesWithIdsOutsideVocabDecodeToWrongAnswers) {
  // A model vocabulary larger than the tokenizer's (muse-small: 65536) can sample such ids.
  CharTokenizer tok(128);
  const std::string text = tok.decode_sample({'4', 28341, '2', -1, '\n'});
  EXPECT_EQ(text, std::string("4\0" "2\0\n", 5));
  EXPECT_EQ(trainer::exact_match_reward(text, "42"), 0.0);
  EXPECT_EQ(trainer::exact_match_reward(tok.decode_sample({'4', '2', '\n'}), "42"), 1.0);
}

TEST(TokenizerTest, RejectsVocabSizeWithoutRoomForEos) {
  EXPECT_TRUE(throws_with([] { CharTokenizer t(10); }, {"vocab_size=10"}));
  EXPECT_TRUE(throws_with([] { CharTokenizer t(257); }, {"vocab_size=257"}));
}

// ---- arithmetic problems ----

struct Parsed {
  int64_t a = 0, b = 0;
  char op = '?';
  size_t a_digits = 0, b_digits = 0;
};

// Reads "<a><op><b>=" independently of the generator; fails the test on anything else.
Parsed parse_prompt(const std::string& s) {
  Parsed p;
  size_t i = 0;
  while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) p.a = p.a * 10 + (s[i++] - '0');
  p.a_digits = i;
  EXPECT_LT(i, s.size()) << s;
  if (i < s.size()) p.op = s[i++];
  const size_t b_start = i;
  while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) p.b = p.b * 10 + (s[i++] - '0');
  p.b_digits = i - b_start;
  EXPECT_EQ(s.substr(i), "=") << s;
  EXPECT_GT(p.a_digits, 0u) << s;
  EXPECT_GT(p.b_digits, 0u) << s;
  return p;
}

int64_t evaluate(const Parsed& p) {
  switch (p.op) {
    case '+': return p.a + p.b;
    case '-': return p.a - p.b;
    case '*': return p.a * p.b;
  }
  ADD_FAILURE() << "unexpected operator " << p.op;
  return 0;
}

TEST(ArithmeticTest, SameSeedGivesSameProblems) {
  for (int level = 1; level <= 4; ++level) {
    const auto a = trainer::arithmetic_problems(57, level, 7);
    const auto b = trainer::arithmetic_problems(57, level, 7);
    const auto c = trainer::arithmetic_problems(57, level, 8);
    EXPECT_EQ(prompts(a), prompts(b)) << "level " << level;
    EXPECT_NE(prompts(a), prompts(c)) << "level " << level;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].answer, b[i].answer);
  }
  // The generator is ours (splitmix64), so these hold with every standard library.
  const auto golden = trainer::arithmetic_problems(3, 4, 42);
  EXPECT_EQ(prompts(golden), (std::vector<std::string>{"2-46=", "41-25=", "78-93="}));
}

TEST(ArithmeticTest, LevelsUseTheirOperatorsOperandSizesAndCorrectAnswers) {
  struct Want {
    int level;
    std::set<char> ops;
    int64_t lo, hi;
  };
  for (const Want& w : {Want{1, {'+'}, 0, 9}, Want{2, {'+'}, 10, 99}, Want{3, {'+', '-'}, 10, 99},
                        Want{4, {'+', '-', '*'}, 0, 99}}) {
    const auto problems = trainer::arithmetic_problems(w.level == 1 ? 100 : 1111, w.level, 3);
    std::set<char> seen_ops;
    bool negative = false;
    CharTokenizer tok;
    for (const Problem& p : problems) {
      const Parsed q = parse_prompt(p.prompt);
      seen_ops.insert(q.op);
      EXPECT_TRUE(w.ops.count(q.op)) << "level " << w.level << ": " << p.prompt;
      EXPECT_GE(q.a, w.lo) << p.prompt;
      EXPECT_LE(q.a, w.hi) << p.prompt;
      EXPECT_GE(q.b, w.lo) << p.prompt;
      EXPECT_LE(q.b, w.hi) << p.prompt;
      EXPECT_EQ(q.a_digits, std::to_string(q.a).size()) << "no leading zeros: " << p.prompt;
      EXPECT_EQ(p.answer, std::to_string(evaluate(q))) << p.prompt;
      negative |= p.answer[0] == '-';
      EXPECT_NO_THROW(tok.encode(p.prompt + p.answer + "\n"));
    }
    EXPECT_EQ(seen_ops, w.ops) << "level " << w.level;
    EXPECT_EQ(negative, w.level >= 3) << "level " << w.level;
    EXPECT_EQ(prompt_set(problems).size(), problems.size())
        << "problems are distinct";
  }
}

TEST(ArithmeticTest, Level1HoldsEveryPairExactlyOnce) {
  const auto problems = trainer::arithmetic_problems(100, 1, 11);
  std::set<std::pair<int64_t, int64_t>> pairs;
  for (const Problem& p : problems) {
    const Parsed q = parse_prompt(p.prompt);
    pairs.insert({q.a, q.b});
  }
  EXPECT_EQ(pairs.size(), 100u);
  EXPECT_TRUE(throws_with([] { trainer::arithmetic_problems(101, 1, 11); }, {"count=101", "100 distinct"}));
  EXPECT_TRUE(trainer::arithmetic_problems(0, 2, 11).empty());
  EXPECT_TRUE(throws_with([] { trainer::arithmetic_problems(-1, 2, 11); }, {"count=-1"}));
}

TEST(ArithmeticTest, RejectsUnknownDifficultyNamingTheLevels) {
  for (int bad : {0, 5, -1}) {
    EXPECT_TRUE(throws_with([&] { trainer::arithmetic_problems(4, bad, 1); },
                            {"difficulty=" + std::to_string(bad), "1 (", "2 (", "3 (", "4 ("}));
  }
}

// ---- JSONL ----

TEST(JsonlTest, ReadsStringAndNumberAnswersSkippingBlankLines) {
  test::TempDir dir;
  write_file(dir / "d.jsonl",
             "{\"prompt\": \"12+34=\", \"answer\": \"46\"}\n"
             "\n"
             "   \n"
             "{\"prompt\": \"5-8=\", \"answer\": -3, \"source\": \"extra keys are ignored\"}\r\n"
             "{\"prompt\": \"2*23=\", \"answer\": 46.0}\n"
             "{\"prompt\": \"5/2=\", \"answer\": 2.5}\n"
             "{\"prompt\": \"zero pad\", \"answer\": \"046\"}");  // no final newline
  const trainer::Dataset d = trainer::load_jsonl(dir / "d.jsonl", 0.0, 1);
  EXPECT_TRUE(d.test.empty());
  std::map<std::string, std::string> got;
  for (const Problem& p : d.train) got[p.prompt] = p.answer;
  EXPECT_EQ(got, (std::map<std::string, std::string>{
                     {"12+34=", "46"}, {"5-8=", "-3"}, {"2*23=", "46"}, {"5/2=", "2.5"}, {"zero pad", "046"}}));
}

TEST(JsonlTest, EveryErrorNamesFileAndLine) {
  test::TempDir dir;
  const std::string good = "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n\n";  // lines 1-2; the bad line is 3
  struct Case {
    std::string line;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"{\"prompt\": \"1+2=\", \"answer\": ", {"bad JSON"}},
      {"[1, 2]", {"expected a JSON object", "array"}},
      {"{\"answer\": \"3\"}", {"missing key \"prompt\""}},
      {"{\"prompt\": \"1+2=\"}", {"missing key \"answer\""}},
      {"{\"prompt\": 12, \"answer\": \"3\"}", {"\"prompt\" has the wrong type", "type=number"}},
      {"{\"prompt\": \"1+2=\", \"answer\": true}", {"\"answer\" has the wrong type", "type=boolean"}},
      {"{\"prompt\": \"1+2=\", \"answer\": [3]}", {"\"answer\" has the wrong type", "type=array"}},
      {"{\"prompt\": \"1+2=\", \"answer\": null}", {"\"answer\" has the wrong type", "type=null"}},
      {"{\"prompt\": \"\", \"answer\": \"3\"}", {"\"prompt\" is empty"}},
      {"{\"prompt\": \"1+2=\", \"answer\": \" 3\"}", {"can never match"}},
      {"{\"prompt\": \"1+2=\", \"answer\": \"3\\n\"}", {"can never match"}},
  };
  for (const Case& c : cases) {
    const std::string path = dir / "bad.jsonl";
    write_file(path, good + c.line + "\n" + good);
    std::vector<std::string> parts = c.parts;
    parts.push_back("load_jsonl: " + path + ":3:");
    EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(path, 0.1, 1); }, parts)) << c.line;
  }
  EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(dir / "missing.jsonl", 0.1, 1); },
                          {"cannot open", "missing.jsonl"}));
  write_file(dir / "empty.jsonl", "\n  \n");
  EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(dir / "empty.jsonl", 0.1, 1); }, {"no problems", "empty.jsonl"}));
  write_file(dir / "ok.jsonl", good);
  EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(dir / "ok.jsonl", 1.0, 1); }, {"test_fraction=1"}));
}

TEST(JsonlTest, SplitsLikeSplit) {
  test::TempDir dir;
  const auto problems = trainer::arithmetic_problems(37, 2, 5);
  std::string text;
  for (const Problem& p : problems) text += "{\"prompt\": \"" + p.prompt + "\", \"answer\": " + p.answer + "}\n";
  write_file(dir / "a.jsonl", text);
  const trainer::Dataset a = trainer::load_jsonl(dir / "a.jsonl", 0.25, 9);
  const trainer::Dataset b = trainer::split(problems, 0.25, 9);
  EXPECT_EQ(prompts(a.train), prompts(b.train));
  EXPECT_EQ(prompts(a.test), prompts(b.test));
}

// ---- split ----

TEST(SplitTest, SizesDeterminismAndDisjointness) {
  const auto problems = trainer::arithmetic_problems(111, 3, 2);
  const trainer::Dataset a = trainer::split(problems, 0.2, 4);
  EXPECT_EQ(a.test.size(), 22u);  // round(0.2 * 111)
  EXPECT_EQ(a.train.size(), 89u);
  const trainer::Dataset b = trainer::split(problems, 0.2, 4);
  EXPECT_EQ(prompts(a.train), prompts(b.train));
  EXPECT_EQ(prompts(a.test), prompts(b.test));
  const trainer::Dataset c = trainer::split(problems, 0.2, 5);
  EXPECT_NE(prompts(a.test), prompts(c.test));

  const std::set<std::string> train = prompt_set(a.train);
  std::set<std::string> all(train);
  for (const Problem& p : a.test) {
    EXPECT_FALSE(train.count(p.prompt)) << p.prompt;
    all.insert(p.prompt);
  }
  EXPECT_EQ(all.size(), problems.size());
}

TEST(SplitTest, DuplicatePromptsStayOnOneSide) {
  std::vector<Problem> problems;
  for (int rep = 0; rep < 3; ++rep) {
    for (const Problem& p : trainer::arithmetic_problems(19, 1, 6)) problems.push_back(p);
  }
  const trainer::Dataset d = trainer::split(problems, 0.5, 3);
  EXPECT_EQ(d.test.size(), 3u * 10u);  // round(0.5 * 19) = 10 distinct prompts, 3 copies each
  EXPECT_EQ(d.train.size(), 3u * 9u);
  const std::set<std::string> train = prompt_set(d.train);
  for (const Problem& p : d.test) EXPECT_FALSE(train.count(p.prompt)) << p.prompt;
}

TEST(SplitTest, EdgeCasesAndBadFractions) {
  const auto problems = trainer::arithmetic_problems(19, 2, 1);
  EXPECT_EQ(trainer::split(problems, 0.0, 1).train.size(), 19u);
  EXPECT_EQ(trainer::split(problems, 0.99, 1).train.size(), 1u);  // train keeps one
  EXPECT_EQ(trainer::split({problems[0]}, 0.9, 1).train.size(), 1u);
  EXPECT_TRUE(trainer::split({}, 0.5, 1).train.empty());
  for (double bad : {1.0, -0.1, std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_TRUE(throws_with([&] { trainer::split(problems, bad, 1); }, {"split:", "test_fraction="})) << bad;
  }
}

// ---- training stream ----

TEST(DataStreamTest, EachEpochVisitsEveryProblemOnce) {
  const auto problems = trainer::arithmetic_problems(19, 2, 8);
  DataStream stream(problems, 12);
  std::vector<std::string> seen;
  while (seen.size() < 5 * 19) {
    for (const Problem& p : stream.next(7)) seen.push_back(p.prompt);  // batches span epochs
  }
  const std::set<std::string> all = prompt_set(problems);
  std::vector<std::vector<std::string>> epochs;
  for (size_t e = 0; e < 5; ++e) {
    epochs.emplace_back(seen.begin() + e * 19, seen.begin() + (e + 1) * 19);
    EXPECT_EQ(std::set<std::string>(epochs[e].begin(), epochs[e].end()), all) << "epoch " << e;
  }
  EXPECT_NE(epochs[0], epochs[1]) << "each epoch has its own order";
  EXPECT_NE(epochs[0], prompts(problems)) << "the first epoch is shuffled too";
  EXPECT_EQ(stream.position(), seen.size());
  EXPECT_EQ(stream.epoch(), seen.size() / 19);
}

TEST(DataStreamTest, SeekToSavedPositionResumesTheSameSequence) {
  const auto problems = trainer::arithmetic_problems(23, 3, 4);
  DataStream run(problems, 99);
  std::vector<std::vector<std::string>> batches;
  std::vector<uint64_t> positions;
  for (int i = 0; i < 12; ++i) {
    positions.push_back(run.position());
    batches.push_back(prompts(run.next(5)));
  }
  for (int resume_at : {0, 3, 4, 9}) {  // 4 * 5 = 20 is mid-epoch; batch 4 spans epochs 0 and 1
    DataStream resumed(problems, 99);
    resumed.seek(positions[resume_at]);
    for (int i = resume_at; i < 12; ++i) EXPECT_EQ(prompts(resumed.next(5)), batches[i]) << resume_at << " " << i;
  }
  DataStream other_seed(problems, 100);
  EXPECT_NE(prompts(other_seed.next(23)), batches[0]) << "seed matters";
}

TEST(DataStreamTest, RejectsEmptyProblemsAndNegativeBatch) {
  EXPECT_TRUE(throws_with([] { DataStream s({}, 1); }, {"DataStream: no problems"}));
  DataStream s(trainer::arithmetic_problems(3, 1, 1), 1);
  EXPECT_TRUE(throws_with([&] { s.next(-1); }, {"n=-1"}));
  EXPECT_TRUE(s.next(0).empty());
}

// ---- rewards ----

TEST(RewardTest, ExactMatchOnHandCases) {
  EXPECT_EQ(trainer::exact_match_reward("46\n", "46"), 1.0);
  EXPECT_EQ(trainer::exact_match_reward("46", "46"), 1.0);  // truncated, but the answer is right
  EXPECT_EQ(trainer::exact_match_reward(" 46 \n", "46"), 1.0);
  EXPECT_EQ(trainer::exact_match_reward("46\n99", "46"), 1.0);  // only up to the first eos counts
  EXPECT_EQ(trainer::exact_match_reward("046\n", "46"), 0.0);
  EXPECT_EQ(trainer::exact_match_reward("4 6\n", "46"), 0.0);
  EXPECT_EQ(trainer::exact_match_reward("", "46"), 0.0);
  EXPECT_EQ(trainer::exact_match_reward("\n46", "46"), 0.0);
  EXPECT_EQ(trainer::exact_match_reward("-12\n", "-12"), 1.0);
  EXPECT_EQ(trainer::exact_match_reward("12\n", "-12"), 0.0);
  EXPECT_EQ(trainer::final_answer(" \t-7\r\n8"), "-7");
}

TEST(RewardTest, FormatOnHandCases) {
  EXPECT_EQ(trainer::format_reward("46\n"), 1.0);
  EXPECT_EQ(trainer::format_reward("-12\n"), 1.0);
  EXPECT_EQ(trainer::format_reward("0\n"), 1.0);
  EXPECT_EQ(trainer::format_reward("12"), 0.0);  // not terminated
  EXPECT_EQ(trainer::format_reward(""), 0.0);
  EXPECT_EQ(trainer::format_reward("\n"), 0.0);
  EXPECT_EQ(trainer::format_reward("-\n"), 0.0);
  EXPECT_EQ(trainer::format_reward("4 6\n"), 0.0);
  EXPECT_EQ(trainer::format_reward(" 46\n"), 0.0);
  EXPECT_EQ(trainer::format_reward("46\n\n"), 0.0);
  EXPECT_EQ(trainer::format_reward("1-2\n"), 0.0);
  EXPECT_EQ(trainer::format_reward("+3\n"), 0.0);
}

TEST(RewardTest, WeightedSum) {
  trainer::RewardConfig cfg;
  EXPECT_EQ(trainer::reward("46\n", "46", cfg), 1.0);
  EXPECT_EQ(trainer::reward("47\n", "46", cfg), 0.0);
  cfg.correct = 2.0;
  cfg.format = 0.25;
  EXPECT_EQ(trainer::reward("46\n", "46", cfg), 2.25);
  EXPECT_EQ(trainer::reward("47\n", "46", cfg), 0.25);
  EXPECT_EQ(trainer::reward(" 46\n", "46", cfg), 2.0);
  EXPECT_EQ(trainer::reward("x", "46", cfg), 0.0);
  cfg.format = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(throws_with([&] { trainer::reward("46\n", "46", cfg); }, {"RewardConfig", "format=inf"}));
}

}  // namespace
}  // namespace kiln
