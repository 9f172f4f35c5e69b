// Datasets: the arithmetic generator (determinism, levels, labels checked by evaluating the prompt
// here), JSONL loading with keys, its errors and the skip policy, the train/test split, the
// resumable training stream, and prompt preparation (length filter, chats).
#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <map>
#include <set>

#include "tests/test_util.h"
#include "text/tokenizer.h"
#include "trainer/dataset.h"
#include "trainer/tasks.h"

namespace kiln {
namespace {

using test::error_of;
using test::throws_with;
using trainer::DataStream;
using trainer::Example;

std::vector<std::string> prompts(const std::vector<Example>& ps) {
  std::vector<std::string> out;
  for (const auto& p : ps) out.push_back(p.prompt);
  return out;
}

std::set<std::string> prompt_set(const std::vector<Example>& ps) {
  std::set<std::string> out;
  for (const auto& p : ps) out.insert(p.prompt);
  return out;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
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

TEST(ArithmeticTest, SameSeedGivesSameExamples) {
  for (int level = 1; level <= 4; ++level) {
    const auto a = trainer::arithmetic_problems(57, level, 7);
    const auto b = trainer::arithmetic_problems(57, level, 7);
    const auto c = trainer::arithmetic_problems(57, level, 8);
    EXPECT_EQ(prompts(a), prompts(b)) << "level " << level;
    EXPECT_NE(prompts(a), prompts(c)) << "level " << level;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].label, b[i].label);
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
    text::ByteTokenizer tok(128);
    for (const Example& p : problems) {
      const Parsed q = parse_prompt(p.prompt);
      seen_ops.insert(q.op);
      EXPECT_TRUE(w.ops.count(q.op)) << "level " << w.level << ": " << p.prompt;
      EXPECT_GE(q.a, w.lo) << p.prompt;
      EXPECT_LE(q.a, w.hi) << p.prompt;
      EXPECT_GE(q.b, w.lo) << p.prompt;
      EXPECT_LE(q.b, w.hi) << p.prompt;
      EXPECT_EQ(q.a_digits, std::to_string(q.a).size()) << "no leading zeros: " << p.prompt;
      EXPECT_EQ(p.label, std::to_string(evaluate(q))) << p.prompt;
      negative |= p.label[0] == '-';
      EXPECT_NO_THROW(tok.encode(p.prompt + p.label + "\n"));
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
  for (const Example& p : problems) {
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

trainer::JsonlOptions options(const std::string& label_key = "label") {
  trainer::JsonlOptions o;
  o.keys.label = label_key;
  return o;
}

TEST(JsonlTest, ReadsPromptsLabelsSourcesAndMetadataSkippingBlankLines) {
  test::TempDir dir;
  write_file(dir / "d.jsonl",
             "{\"prompt\": \"12+34=\", \"label\": \"46\", \"data_source\": \"add\"}\n"
             "\n"
             "   \n"
             "{\"prompt\": \"5-8=\", \"label\": -3, \"source\": \"extra keys are ignored\"}\r\n"
             "{\"prompt\": \"2*23=\", \"label\": 46.0, \"metadata\": {\"level\": 2}}\n"
             "{\"prompt\": \"5/2=\", \"label\": 2.5}\n"
             "{\"prompt\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"hi\"}],"
             " \"label\": [\"a\", 1]}\n"
             "{\"prompt\": \"zero pad\", \"label\": \"046\"}");  // no final newline
  trainer::LoadReport report;
  trainer::JsonlOptions o = options();
  o.data_source = "default";
  const auto d = trainer::load_jsonl(dir / "d.jsonl", o, &report);
  ASSERT_EQ(d.size(), 6u);
  EXPECT_EQ(report.lines, 6);
  EXPECT_EQ(report.loaded, 6);
  EXPECT_EQ(report.skipped, 0);
  EXPECT_EQ(d[0].label, "46");
  EXPECT_EQ(d[0].data_source, "add");
  EXPECT_EQ(d[0].origin, dir / "d.jsonl:1");
  EXPECT_EQ(d[1].label, "-3");
  EXPECT_EQ(d[1].data_source, "default");
  EXPECT_EQ(d[1].origin, dir / "d.jsonl:4");
  EXPECT_EQ(d[2].label, "46");
  EXPECT_EQ(d[2].metadata, "{\"level\":2}");
  EXPECT_EQ(d[1].metadata, "{}");
  EXPECT_EQ(d[3].label, "2.5");
  EXPECT_TRUE(d[4].prompt.empty());
  EXPECT_EQ(d[4].messages, "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"hi\"}]");
  EXPECT_EQ(d[4].label, "[\"a\",1]");
  EXPECT_EQ(d[5].label, "046");
}

TEST(JsonlTest, KeysMayBeDottedPathsAndRenamed) {
  test::TempDir dir;
  write_file(dir / "v.jsonl",
             "{\"question\": \"q1\", \"reward_model\": {\"ground_truth\": \"7\"}, \"src\": \"gsm8k\","
             " \"extra_info\": {\"index\": 3}}\n");
  trainer::JsonlOptions o;
  o.keys = {"question", "reward_model.ground_truth", "src", "extra_info"};
  const auto d = trainer::load_jsonl(dir / "v.jsonl", o);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].prompt, "q1");
  EXPECT_EQ(d[0].label, "7");
  EXPECT_EQ(d[0].data_source, "gsm8k");
  EXPECT_EQ(d[0].metadata, "{\"index\":3}");
  o.keys.label = "reward_model.missing";
  EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(dir / "v.jsonl", o); },
                          {"v.jsonl:1", "missing key \"reward_model.missing\""}));
  o.require_label = false;
  EXPECT_EQ(trainer::load_jsonl(dir / "v.jsonl", o)[0].label, "");
}

TEST(JsonlTest, EveryErrorNamesFileLineAndKeyOrIsSkippedAndCounted) {
  test::TempDir dir;
  const std::string good = "{\"prompt\": \"1+1=\", \"label\": \"2\"}\n\n";  // lines 1-2; the bad line is 3
  struct Case {
    std::string line;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"{\"prompt\": \"1+2=\", \"label\": ", {"bad JSON"}},
      {"{\"prompt\": \"1+2=\", \"label\": 2e99999}", {"bad JSON", "number overflow"}},  // found by fuzz_jsonl
      {"[1, 2]", {"expected a JSON object", "array"}},
      {"{\"label\": \"3\"}", {"missing key \"prompt\""}},
      {"{\"prompt\": \"1+2=\"}", {"missing key \"label\""}},
      {"{\"prompt\": 12, \"label\": \"3\"}", {"\"prompt\" must be a string or a non-empty list of chat messages"}},
      {"{\"prompt\": [], \"label\": \"3\"}", {"\"prompt\" must be a string or a non-empty list"}},
      {"{\"prompt\": [{\"content\": \"x\"}], \"label\": \"3\"}", {"\"prompt\"[0] has no string \"role\""}},
      {"{\"prompt\": [\"x\"], \"label\": \"3\"}", {"\"prompt\"[0] is a string"}},
      {"{\"prompt\": [{\"role\": \"user\", \"content\": 5}], \"label\": \"3\"}", {"\"prompt\"[0].content is a number"}},
      {"{\"prompt\": \"\", \"label\": \"3\"}", {"\"prompt\" is empty"}},
      {"{\"prompt\": \"1+2=\", \"label\": \"3\", \"data_source\": 4}", {"\"data_source\" must be a string"}},
      {"{\"prompt\": \"1+2=\", \"label\": \"3\", \"metadata\": [1]}", {"\"metadata\" must be a JSON object"}},
  };
  for (const Case& c : cases) {
    const std::string path = dir / "bad.jsonl";
    write_file(path, good + c.line + "\n" + good);
    std::vector<std::string> parts = c.parts;
    parts.push_back("load_jsonl: " + path + ":3:");
    parts.push_back("bad_lines: skip");
    EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(path, options()); }, parts)) << c.line;
    trainer::JsonlOptions skip = options();
    skip.bad_lines = trainer::BadLines::kSkip;
    trainer::LoadReport report;
    EXPECT_EQ(trainer::load_jsonl(path, skip, &report).size(), 2u) << c.line;
    EXPECT_EQ(report.skipped, 1) << c.line;
    ASSERT_EQ(report.examples.size(), 1u);
    EXPECT_NE(report.examples[0].find(path + ":3: "), std::string::npos) << report.examples[0];
  }
  EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(dir / "missing.jsonl", options()); },
                          {"cannot open", "missing.jsonl"}));
  write_file(dir / "empty.jsonl", "\n  \n");
  EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(dir / "empty.jsonl", options()); }, {"no usable lines", "empty.jsonl"}));
  write_file(dir / "allbad.jsonl", "x\ny\n");
  trainer::JsonlOptions skip = options();
  skip.bad_lines = trainer::BadLines::kSkip;
  EXPECT_TRUE(throws_with([&] { trainer::load_jsonl(dir / "allbad.jsonl", skip); }, {"no usable lines", "2 skipped"}));
}

TEST(JsonlTest, SplitsLikeSplit) {
  test::TempDir dir;
  const auto problems = trainer::arithmetic_problems(37, 2, 5);
  std::string text;
  for (const Example& p : problems) text += "{\"prompt\": \"" + p.prompt + "\", \"answer\": " + p.label + "}\n";
  write_file(dir / "a.jsonl", text);
  const trainer::Dataset a = trainer::split(trainer::load_jsonl(dir / "a.jsonl", options("answer")), 0.25, 9);
  const trainer::Dataset b = trainer::split(problems, 0.25, 9);
  EXPECT_EQ(prompts(a.train), prompts(b.train));
  EXPECT_EQ(prompts(a.test), prompts(b.test));
}

// ---- prompt format ----

TEST(PromptTest, TextPromptsAreTokenizedAndLongOnesDroppedAndCounted) {
  auto tok = text::make_byte_tokenizer(128);
  std::vector<Example> ex = trainer::arithmetic_problems(19, 2, 3);
  ex[4].prompt = "1234567+1=";  // 10 tokens
  trainer::PromptFormat f;
  f.max_prompt_tokens = 9;
  const trainer::PrepareReport r = trainer::prepare_prompts(ex, *tok, f);
  EXPECT_EQ(r.kept, 18);
  EXPECT_EQ(r.too_long, 1);
  EXPECT_EQ(r.max_tokens, 6);
  ASSERT_EQ(ex.size(), 18u);
  for (const Example& e : ex) {
    EXPECT_EQ(e.prompt_text, e.prompt);
    EXPECT_EQ(e.prompt_ids, tok->encode(e.prompt));
  }
  f.max_prompt_tokens = -1;
  EXPECT_TRUE(throws_with([&] { trainer::prepare_prompts(ex, *tok, f); }, {"max_prompt_tokens must be >= 0"}));
  f = trainer::PromptFormat{};
  f.template_kwargs = "[1]";
  EXPECT_TRUE(throws_with([&] { f.validate(); }, {"template_kwargs must be a JSON object"}));
}

TEST(PromptTest, ChatsNeedATemplateAndSystemPromptsAreAdded) {
  auto tok = text::make_byte_tokenizer(128);
  Example chat;
  chat.messages = "[{\"role\": \"user\", \"content\": \"hi\"}]";
  chat.origin = "chats.jsonl:7";
  std::vector<Example> ex = {chat};
  EXPECT_TRUE(throws_with([&] { trainer::prepare_prompts(ex, *tok, {}); }, {"has no chat template"}));
  trainer::PromptFormat never;
  never.chat = trainer::ChatMode::kNever;
  EXPECT_TRUE(throws_with([&] { trainer::prepare_prompts(ex, *tok, never); }, {"chats.jsonl:7", "prompt.chat is never"}));
  trainer::PromptFormat sys;
  sys.system_prompt = "Be brief.";
  EXPECT_EQ(trainer::chat_messages(chat, sys),
            "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"hi\"}]");
  Example text_prompt;
  text_prompt.prompt = "2+2=";
  EXPECT_EQ(trainer::chat_messages(text_prompt, {}), "[{\"role\":\"user\",\"content\":\"2+2=\"}]");
  Example has_system = chat;
  has_system.messages = "[{\"role\": \"system\", \"content\": \"mine\"}, {\"role\": \"user\", \"content\": \"hi\"}]";
  EXPECT_EQ(trainer::chat_messages(has_system, sys),
            "[{\"role\":\"system\",\"content\":\"mine\"},{\"role\":\"user\",\"content\":\"hi\"}]");
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
  for (const Example& p : a.test) {
    EXPECT_FALSE(train.count(p.prompt)) << p.prompt;
    all.insert(p.prompt);
  }
  EXPECT_EQ(all.size(), problems.size());
}

TEST(SplitTest, DuplicatePromptsStayOnOneSide) {
  std::vector<Example> problems;
  for (int rep = 0; rep < 3; ++rep) {
    for (const Example& p : trainer::arithmetic_problems(19, 1, 6)) problems.push_back(p);
  }
  const trainer::Dataset d = trainer::split(problems, 0.5, 3);
  EXPECT_EQ(d.test.size(), 3u * 10u);  // round(0.5 * 19) = 10 distinct prompts, 3 copies each
  EXPECT_EQ(d.train.size(), 3u * 9u);
  const std::set<std::string> train = prompt_set(d.train);
  for (const Example& p : d.test) EXPECT_FALSE(train.count(p.prompt)) << p.prompt;
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

TEST(DataStreamTest, EachEpochVisitsEveryExampleOnce) {
  const auto problems = trainer::arithmetic_problems(19, 2, 8);
  DataStream stream(problems, 12);
  std::vector<std::string> seen;
  while (seen.size() < 5 * 19) {
    for (const Example& p : stream.next(7)) seen.push_back(p.prompt);  // batches span epochs
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

TEST(DataStreamTest, RejectsEmptyExamplesAndNegativeBatch) {
  EXPECT_TRUE(throws_with([] { DataStream s({}, 1); }, {"DataStream: no examples"}));
  DataStream s(trainer::arithmetic_problems(3, 1, 1), 1);
  EXPECT_TRUE(throws_with([&] { s.next(-1); }, {"n=-1"}));
  EXPECT_TRUE(s.next(0).empty());
}

}  // namespace
}  // namespace kiln
