// Built-in rewards: the arithmetic demo's exact-match and format rules reproduced bit for bit on
// thousands of strings, regex format on long and odd inputs, the math answer tables, weighted sums
// and their components, and spec validation errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <tuple>

#include "tests/test_util.h"
#include "trainer/rewards.h"

namespace kiln::trainer {
namespace {

using test::throws_with;

// The demo's rules, written out again from trainer/tasks.h (this binary does not link tasks.cpp):
// the answer is the text up to the first '\n', trimmed of spaces, tabs and '\r'; it must equal
// the label as a string. The format is an optional '-', one or more digits, then '\n' and nothing more.
std::string demo_final_answer(const std::string& completion) {
  std::string s = completion.substr(0, completion.find('\n'));
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r'; };
  while (!s.empty() && blank(s.back())) s.pop_back();
  size_t lo = 0;
  while (lo < s.size() && blank(s[lo])) ++lo;
  return s.substr(lo);
}
double demo_exact(const std::string& completion, const std::string& label) {
  return demo_final_answer(completion) == label ? 1.0 : 0.0;
}
double demo_format(const std::string& completion) {
  if (completion.empty() || completion.back() != '\n') return 0.0;
  const std::string body = completion.substr(0, completion.size() - 1);
  const size_t start = !body.empty() && body[0] == '-' ? 1 : 0;
  if (start >= body.size()) return 0.0;
  for (size_t i = start; i < body.size(); ++i)
    if (body[i] < '0' || body[i] > '9') return 0.0;
  return 1.0;
}

RewardRequest request(int64_t id, const std::string& response, const std::string& label = "") {
  RewardRequest r;
  r.id = id;
  r.response = response;
  r.label = label;
  return r;
}

RewardSpec spec_of(RewardType type) {
  RewardSpec s;
  s.type = type;
  return s;
}

double score_one(Reward& reward, const std::string& response, const std::string& label = "") {
  const std::vector<RewardResult> out = reward.score({request(0, response, label)});
  EXPECT_EQ(out.size(), 1u);
  EXPECT_FALSE(out[0].failed) << out[0].error;
  return out[0].reward;
}

// Demo-like samples: labels with prefixes and suffixes the rules treat differently, and noise.
std::vector<RewardRequest> demo_samples() {
  const std::vector<std::string> labels = {"46", "-3", "0", "046", "120", "7"};
  const std::vector<std::string> prefixes = {"", "", "", " ", "\t", "-", "\r", "+", "0", "\n"};
  const std::vector<std::string> suffixes = {"\n", "\n", "", " \n", "\r\n", "\n\n", "\n12", "5", " ", "\t\t\n", "x\n"};
  const std::string alphabet = "0123456789- \t\r\nx";
  std::mt19937 rng(17);
  std::vector<RewardRequest> out;
  for (int i = 0; i < 6000; ++i) {
    const std::string& label = labels[rng() % labels.size()];
    std::string response;
    if (i % 3 == 2) {
      for (size_t n = rng() % 8; n > 0; --n) response += alphabet[rng() % alphabet.size()];
    } else {
      const std::string& body = i % 3 == 0 ? label : labels[rng() % labels.size()];
      response = prefixes[rng() % prefixes.size()] + body + suffixes[rng() % suffixes.size()];
    }
    out.push_back(request(i, response, label));
  }
  for (const char* s : {"", "\n", "-\n", "-", "--1\n", "12", "12\n", "-0\n", " 12\n", "12 \n"})
    out.push_back(request(int64_t(out.size()), s, "12"));
  return out;
}

// ---- the demo ----

TEST(DemoRewardTest, ExactMatchAndFormatGiveTheDemoNumbers) {
  const std::vector<RewardRequest> samples = demo_samples();
  RewardSpec exact_spec = spec_of(RewardType::kExactMatch);  // the default stops are the demo's {"\n"}
  RewardSpec format_spec = spec_of(RewardType::kRegexFormat);
  format_spec.regex_format.pattern = "-?[0-9]+\\n";
  const std::vector<RewardResult> exact = make_reward(exact_spec)->score(samples);
  const std::vector<RewardResult> format = make_reward(format_spec)->score(samples);
  ASSERT_EQ(exact.size(), samples.size());
  ASSERT_EQ(format.size(), samples.size());
  int num_exact = 0, num_format = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const RewardRequest& s = samples[i];
    EXPECT_EQ(exact[i].reward, demo_exact(s.response, s.label))
        << "response=\"" << s.response << "\" label=" << s.label;
    EXPECT_EQ(format[i].reward, demo_format(s.response)) << "response=\"" << s.response << "\"";
    num_exact += exact[i].reward == 1.0;
    num_format += format[i].reward == 1.0;
  }
  // Both outcomes occur often, so the comparison above means something.
  EXPECT_GT(num_exact, 200) << num_exact;
  EXPECT_LT(num_exact, int(samples.size()) - 200) << num_exact;
  EXPECT_GT(num_format, 200) << num_format;
  EXPECT_LT(num_format, int(samples.size()) - 200) << num_format;
}

TEST(DemoRewardTest, ArithmeticSpecSumsBitForBitWithComponents) {
  const std::vector<RewardRequest> samples = demo_samples();
  for (const auto& [correct, format] : std::vector<std::pair<double, double>>{{1.0, 0.2}, {1.0, 0.0}, {0.7, 0.3}}) {
    const std::vector<RewardResult> out = make_reward(arithmetic_reward_spec(correct, format))->score(samples);
    ASSERT_EQ(out.size(), samples.size());
    for (size_t i = 0; i < samples.size(); ++i) {
      const double e = demo_exact(samples[i].response, samples[i].label), f = demo_format(samples[i].response);
      ASSERT_EQ(out[i].reward, correct * e + format * f) << "response=\"" << samples[i].response << "\"";
      ASSERT_EQ(out[i].components.size(), 2u);
      EXPECT_EQ(out[i].components[0], std::make_pair(std::string("correct"), e));
      EXPECT_EQ(out[i].components[1], std::make_pair(std::string("format"), f));
      EXPECT_FALSE(out[i].failed);
    }
  }
}

// ---- exact match ----

TEST(ExactMatchTest, StopsAndNormalisation) {
  RewardSpec spec = spec_of(RewardType::kExactMatch);
  spec.exact_match.stops = {"</answer>", "\n"};
  auto stops = make_reward(spec);
  EXPECT_EQ(score_one(*stops, " 42 </answer> more", "42"), 1.0);
  EXPECT_EQ(score_one(*stops, "42\n</answer>", "42"), 1.0);
  EXPECT_EQ(score_one(*stops, "4 2", "42"), 0.0);

  spec.exact_match.stops = {};  // the whole response
  auto whole = make_reward(spec);
  EXPECT_EQ(score_one(*whole, "42\n", "42"), 0.0);  // '\n' is not in the trim set
  EXPECT_EQ(score_one(*whole, " 42\t", "42"), 1.0);

  spec.exact_match.normalize_whitespace = true;
  spec.exact_match.ignore_case = true;
  auto loose = make_reward(spec);
  EXPECT_EQ(score_one(*loose, "  New\n\t YORK \n", "new york"), 1.0);
  EXPECT_EQ(score_one(*loose, "New  York", " NEW YORK\n"), 1.0);
  EXPECT_EQ(score_one(*loose, "NewYork", "new york"), 0.0);
  EXPECT_EQ(score_one(*loose, "", ""), 1.0);
}

// ---- regex format ----

TEST(RegexFormatTest, MatchesTheWholeResponse) {
  RewardSpec spec = spec_of(RewardType::kRegexFormat);
  spec.regex_format.pattern = "\\d+";
  auto digits = make_reward(spec);
  EXPECT_EQ(score_one(*digits, "123"), 1.0);
  EXPECT_EQ(score_one(*digits, "123\n"), 0.0);  // unlike $, the end anchor does not skip a final newline
  EXPECT_EQ(score_one(*digits, "a123"), 0.0);
  EXPECT_EQ(score_one(*digits, ""), 0.0);

  spec.regex_format.pattern = "(?s)<think>.*</think>\\s*\\\\boxed\\{.+\\}";
  auto think = make_reward(spec);
  EXPECT_EQ(score_one(*think, "<think>\nfirst\nthen</think>\n\\boxed{3}"), 1.0);
  EXPECT_EQ(score_one(*think, "<think>x</think> 3"), 0.0);
  EXPECT_EQ(score_one(*think, "<think>x</think>\\boxed{3} trailing"), 0.0);

  spec.regex_format.pattern = "a|ab";  // the end anchor makes it backtrack into the longer branch
  EXPECT_EQ(score_one(*make_reward(spec), "ab"), 1.0);
}

TEST(RegexFormatTest, LongAndInvalidUtf8ResponsesScoreWithoutCrashing) {
  RewardSpec spec = spec_of(RewardType::kRegexFormat);
  spec.regex_format.pattern = "-?[0-9]+\\n";
  auto demo = make_reward(spec);
  // libstdc++'s std::regex recurses per character and dies on ~100k characters.
  EXPECT_EQ(score_one(*demo, std::string(1000000, '7') + "\n"), 1.0);
  EXPECT_EQ(score_one(*demo, std::string(1000000, '7') + "x\n"), 0.0);
  EXPECT_EQ(score_one(*demo, "\xff" "12\n"), 0.0);  // invalid UTF-8 never matches, and is no failure
  EXPECT_EQ(score_one(*demo, "12\n\xc3"), 0.0);
  spec.regex_format.pattern = "(?s)(.|\\n)*";  // a group per character: PCRE2 keeps its backtracking on the heap
  auto slow = make_reward(spec);
  const std::vector<RewardResult> out = slow->score({request(0, std::string(100, 'a') + "\xc3\xa9"),
                                                     request(1, "\xc3\x28"), request(2, std::string(200000, 'a'))});
  EXPECT_EQ(out[0].reward, 1.0);
  EXPECT_EQ(out[1].reward, 0.0);
  EXPECT_FALSE(out[1].failed);
  // 200k backtracking points: a match, or (past PCRE2's heap limit) a failed result; never a crash.
  EXPECT_TRUE(out[2].reward == 1.0 || (out[2].failed && out[2].error.find("matching failed") != std::string::npos))
      << out[2].error;
}

TEST(RegexFormatTest, BadPatternsAreRejectedByValidate) {
  RewardSpec spec = spec_of(RewardType::kRegexFormat);
  EXPECT_TRUE(throws_with([&] { spec.validate(); }, {"reward.pattern: missing"}));
  spec.regex_format.pattern = "([0-9]+";
  EXPECT_TRUE(throws_with([&] { make_reward(spec); }, {"reward.pattern: does not compile", "([0-9]+", "offset="}));
}

// ---- math ----

TEST(MathRewardTest, ExtractsTheFinalAnswer) {
  const std::vector<std::tuple<std::string, bool, std::string>> cases = {
      {"so \\boxed{\\frac{1}{2}}.", false, "\\frac{1}{2}"},
      {"\\boxed{\\sqrt{2}}", false, "\\sqrt{2}"},
      {"\\boxed{ {a}{b} }", false, "{a}{b}"},
      {"first \\boxed{1}, finally \\boxed{2}", false, "2"},
      {"\\boxed{1} then cut off \\boxed{12", false, ""},
      {"$\\boxed 5$", false, "5"},
      {"\\fbox{7}", false, "7"},
      {"work\n#### 1,000", false, "1,000"},
      {"#### 3 \n#### 72\nthanks", false, "72"},
      {"no answer here", false, ""},
      {"no answer here", true, ""},
      {"5-3=2.", false, ""},
      {"5-3=2.", true, "2"},
      {"so x = -3.5, done", true, "-3.5"},
      {"about 1,234,567 people", true, "1,234,567"},
      {"half is 1/2", true, "1/2"},
      {"\\boxed{4} beats 99", true, "4"},
  };
  for (const auto& [text, fallback, expected] : cases)
    EXPECT_EQ(extract_math_answer(text, fallback), expected) << "text=" << text << " fallback=" << fallback;
}

TEST(MathRewardTest, NormalisesAnswers) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\\frac{1}{2}", "1/2"},  {"0.5", "1/2"},       {"0.50", "1/2"},         {".5", "1/2"},
      {"1/2", "1/2"},           {"2/4", "1/2"},       {"\\dfrac{1}{2}", "1/2"}, {"\\tfrac12", "1/2"},
      {"\\frac12", "1/2"},      {"-\\frac{3}{4}", "-3/4"}, {"\\frac{-3}{4}", "-3/4"}, {"-0.75", "-3/4"},
      {"1,000", "1000"},        {"1{,}000", "1000"},  {"12,345,678.50", "24691357/2"},
      {"$1000$", "1000"},       {"\\$5", "5"},        {"+5", "5"},             {"5.", "5"},
      {"2.0", "2"},             {"007", "7"},         {"-0", "0"},             {"{5}", "5"},
      {"50\\%", "50"},          {"50%", "50"},        {"90^\\circ", "90"},     {"90^{\\circ}", "90"},
      {"10\\text{ cm}", "10"},  {"\\text{(B)}", "(B)"}, {"x = 5", "5"},        {"\\left( 1, 2 \\right)", "(1,2)"},
      {"\\sqrt2", "\\sqrt{2}"}, {"\\sqrt{2}", "\\sqrt{2}"}, {"\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"},
      {"\\leftarrow", "\\leftarrow"}, {"1,00", "1,00"}, {"3/0", "3/0"},       {"\\!1\\,000", "1000"},
      {"0.333333333333333333333", "0.333333333333333333333"},  // past 18 digits: compared as text
  };
  for (const auto& [answer, expected] : cases)
    EXPECT_EQ(normalize_math_answer(answer), expected) << "answer=" << answer;
}

TEST(MathRewardTest, ScoresResponsesAgainstLabels) {
  const std::vector<std::tuple<std::string, std::string, bool, double>> cases = {
      {"so \\boxed{\\frac{1}{2}}", "0.5", false, 1},
      {"#### 1,000", "1000", false, 1},
      {"\\boxed{\\sqrt{2}}", "\\sqrt{2}", false, 1},
      {"\\boxed{\\sqrt{2}}", "\\sqrt2", false, 1},
      {"\\boxed{0.50}", "1/2", false, 1},
      {"\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", false, 1},
      {"\\boxed{x + 1}", "x+1", false, 1},
      {"\\boxed{72}", "Natalia sold 48/2 = 24 clips.\n#### 72", false, 1},
      {"\\boxed{72}", "\\boxed{72}", false, 1},
      {"no answer", "3", false, 0},
      {"no answer", "3", true, 0},
      {"\\boxed{3}", "", false, 0},
      {"\\boxed{2}", "3", false, 0},
      {"\\boxed{1}, then \\boxed{2}", "1", false, 0},
      {"\\boxed{12", "12", false, 0},
      {"the answer is 42.", "42", false, 0},
      {"the answer is 42.", "42", true, 1},
      {"\\boxed{}", "", false, 0},
  };
  RewardSpec strict = spec_of(RewardType::kMath), loose = spec_of(RewardType::kMath);
  loose.math.last_number_fallback = true;
  auto strict_reward = make_reward(strict), loose_reward = make_reward(loose);
  for (const auto& [response, label, fallback, expected] : cases) {
    EXPECT_EQ(math_reward(response, label, fallback), expected) << "response=" << response << " label=" << label;
    EXPECT_EQ(score_one(fallback ? *loose_reward : *strict_reward, response, label), expected) << response;
  }
}

// ---- sums, stats, specs ----

TEST(SumRewardTest, WeightsPartsAndNamesComponents) {
  RewardSpec correct = spec_of(RewardType::kMath);
  correct.name = "correct";
  RewardSpec boxed = spec_of(RewardType::kRegexFormat);
  boxed.name = "format";
  boxed.weight = 0.1;
  boxed.regex_format.pattern = "(?s).*\\\\boxed\\{.*\\}.*";
  RewardSpec inner = spec_of(RewardType::kSum);
  inner.name = "inner";
  inner.weight = 2.0;
  inner.parts = {correct, boxed};
  RewardSpec outer = spec_of(RewardType::kSum);
  RewardSpec exact = spec_of(RewardType::kExactMatch);  // unnamed: named after its type
  exact.weight = -1.0;
  outer.parts = {inner, exact};
  auto reward = make_reward(outer);
  const std::vector<RewardResult> out =
      reward->score({request(0, "\\boxed{4}", "4"), request(1, "\\boxed{5}", "4"), request(2, "4", "4")});
  ASSERT_EQ(out.size(), 3u);
  using C = std::vector<std::pair<std::string, double>>;
  EXPECT_EQ(out[0].reward, 2.0 * (1.0 + 0.1) - 0.0);
  EXPECT_EQ(out[0].components,
            (C{{"inner", 1.0 + 0.1}, {"inner/correct", 1}, {"inner/format", 1}, {"exact_match", 0}}));
  EXPECT_EQ(out[1].reward, 2.0 * 0.1);
  EXPECT_EQ(out[2].reward, 2.0 * 0.0 - 1.0);  // "4" has no \boxed: math finds no answer
  EXPECT_EQ(out[2].components, (C{{"inner", 0}, {"inner/correct", 0}, {"inner/format", 0}, {"exact_match", 1}}));
  EXPECT_EQ(reward->stats().num_requests, 3);
  EXPECT_EQ(reward->stats().num_failures, 0);
}

TEST(RewardStatsTest, CountsAndDifferences) {
  auto reward = make_reward(spec_of(RewardType::kExactMatch));
  reward->score({request(0, "a"), request(1, "b")});
  const RewardStats before = reward->stats();
  reward->score({request(0, "a"), request(1, "b"), request(2, "c")});
  EXPECT_EQ(before.num_requests, 2);
  EXPECT_EQ((reward->stats() - before).num_requests, 3);
  EXPECT_EQ(reward->score({}).size(), 0u);
  RewardStats s;
  s.num_answered = 4;
  s.total_seconds = 2.0;
  EXPECT_EQ(s.mean_seconds(), 0.5);
  EXPECT_EQ(RewardStats().mean_seconds(), 0.0);
}

TEST(RewardSpecTest, ParsesNamesAndRejectsBadSpecs) {
  EXPECT_EQ(parse_reward_type("math"), RewardType::kMath);
  EXPECT_EQ(parse_reward_type("regex_format"), RewardType::kRegexFormat);
  EXPECT_STREQ(reward_type_name(RewardType::kWorker), "worker");
  EXPECT_EQ(parse_on_failure("zero"), OnFailure::kZero);
  EXPECT_STREQ(on_failure_name(OnFailure::kStop), "stop");
  EXPECT_TRUE(throws_with([] { parse_reward_type("exact"); }, {"unknown type (type=exact)", "exact_match"}));
  EXPECT_TRUE(throws_with([] { parse_on_failure("ignore"); }, {"on_failure=ignore", "zero", "stop"}));

  RewardSpec sum = spec_of(RewardType::kSum);
  EXPECT_TRUE(throws_with([&] { make_reward(sum); }, {"reward.parts: empty"}));
  sum.parts = {spec_of(RewardType::kExactMatch), spec_of(RewardType::kExactMatch)};
  EXPECT_TRUE(throws_with([&] { sum.validate(); }, {"reward.parts[1]: name used twice", "name=exact_match"}));
  sum.parts[1].name = "a/b";
  EXPECT_TRUE(throws_with([&] { sum.validate(); }, {"reward.parts[1].name: holds '/'"}));
  sum.parts[1].name = "strict";
  sum.parts[1].weight = std::nan("");
  EXPECT_TRUE(throws_with([&] { sum.validate(); }, {"reward.parts[1].weight: not finite"}));
  sum.parts[1].weight = 1;
  sum.parts[1].exact_match.stops = {"\n", ""};
  EXPECT_TRUE(throws_with([&] { sum.validate(); }, {"reward.parts[1].stops[1]: empty stop string"}));
  sum.parts[1].exact_match.stops = {};
  sum.validate();

  RewardSpec worker = spec_of(RewardType::kWorker);
  EXPECT_TRUE(throws_with([&] { worker.validate(); }, {"reward.command: missing"}));
  worker.worker.command = {"python3", "w.py"};
  worker.validate();
  const std::vector<std::pair<std::function<void(WorkerSpec&)>, std::string>> bad = {
      {[](WorkerSpec& w) { w.num_workers = 0; }, "reward.num_workers: outside [1, 1024] (num_workers=0)"},
      {[](WorkerSpec& w) { w.max_in_flight = 0; }, "reward.max_in_flight: below 1"},
      {[](WorkerSpec& w) { w.timeout_s = 0; }, "reward.timeout_s: not a positive number"},
      {[](WorkerSpec& w) { w.timeout_s = INFINITY; }, "reward.timeout_s: not a positive number"},
      {[](WorkerSpec& w) { w.max_retries = -1; }, "reward.max_retries: negative"},
      {[](WorkerSpec& w) { w.max_restarts = -1; }, "reward.max_restarts: negative"},
      {[](WorkerSpec& w) { w.max_garbage_lines = -1; }, "reward.max_garbage_lines: negative"},
      {[](WorkerSpec& w) { w.shutdown_grace_s = -1; }, "reward.shutdown_grace_s: not a number >= 0"},
      {[](WorkerSpec& w) { w.start_check_s = 601; }, "reward.start_check_s: outside [0, 600]"},
      {[](WorkerSpec& w) { w.start_check_s = NAN; }, "reward.start_check_s: outside [0, 600]"},
      {[](WorkerSpec& w) { w.max_failure_fraction = -0.1; }, "reward.max_failure_fraction: outside [0, 1]"},
      {[](WorkerSpec& w) { w.max_failure_fraction = NAN; }, "reward.max_failure_fraction: outside [0, 1]"},
  };
  for (const auto& [breaks, message] : bad) {
    RewardSpec w = worker;
    breaks(w.worker);
    EXPECT_TRUE(throws_with([&] { make_reward(w); }, {message}));
  }
}

}  // namespace
}  // namespace kiln::trainer
