// Tasks and rewards of the GRPO demo: tokenizer, arithmetic generator, JSONL loading and split,
// the training-prompt stream and the rewards. Randomness comes from our own splitmix64 so that a
// seed gives the same problems and orders with every standard library.
#include "trainer/tasks.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/error.h"

namespace kiln::trainer {
namespace {

// Distinct salts keep the generator, the split and the stream independent under one seed.
constexpr uint64_t kSaltProblems = 0x61726974686d6574ull;
constexpr uint64_t kSaltSplit = 0x73706c6974000000ull;
constexpr uint64_t kSaltStream = 0x73747265616d0000ull;

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t s = a;
  uint64_t h = splitmix64(s) ^ b;
  return splitmix64(h);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  // Uniform in [0, n), n >= 1; rejection keeps it unbiased.
  uint64_t below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    for (;;) {
      const uint64_t x = splitmix64(state_);
      if (x >= threshold) return x % n;
    }
  }
  int64_t between(int64_t lo, int64_t hi) { return lo + int64_t(below(uint64_t(hi - lo + 1))); }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }

 private:
  uint64_t state_;
};

// How a byte reads in an error message: 'c' when printable, else \xNN.
std::string show_byte(unsigned char c) {
  if (c >= 32 && c < 127) return std::string("'") + char(c) + "'";
  char buf[8];
  std::snprintf(buf, sizeof buf, "\\x%02X", unsigned(c));
  return buf;
}

struct Level {
  const char* ops;
  int64_t lo, hi;  // operand range
};

Level level_of(int difficulty) {
  switch (difficulty) {
    case 1: return {"+", 0, 9};
    case 2: return {"+", 10, 99};
    case 3: return {"+-", 10, 99};
    case 4: return {"+-*", 0, 99};
    default:
      KILN_FAIL("arithmetic_problems: unknown difficulty (difficulty=", difficulty,
                "); use 1 (single-digit +), 2 (two-digit +), 3 (two-digit + and -) or 4 (+, - and * "
                "with operands up to two digits)");
  }
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r'; }

// Integral numbers print without a fraction ("46", not "46.0"); others as JSON writes them.
std::string number_text(const nlohmann::json& j) {
  if (j.is_number_float()) {
    const double v = j.get<double>();
    if (std::isfinite(v) && v == std::trunc(v) && std::fabs(v) < 9.0e18) return std::to_string(int64_t(v));
  }
  return j.dump();
}

}  // namespace

// ---- tokenizer ----

CharTokenizer::CharTokenizer(int64_t vocab_size) : vocab_size_(vocab_size) {
  KILN_CHECK(vocab_size >= 11 && vocab_size <= 256, "CharTokenizer: vocab_size outside [11, 256] (vocab_size=",
             vocab_size, "); byte ids need room for pad (0) and eos ('\\n' = 10) and stop at 255");
}

std::vector<int64_t> CharTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    KILN_CHECK(c != 0, "CharTokenizer: text holds '\\0', the pad id (position=", i, "); remove it from the text");
    KILN_CHECK(int64_t(c) < vocab_size_, "CharTokenizer: character outside the vocabulary (char=", show_byte(c),
               ", byte=", int(c), ", position=", i, ", vocab_size=", vocab_size_,
               "); use ASCII text or a larger vocab_size");
    ids[i] = c;
  }
  return ids;
}

std::string CharTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    KILN_CHECK(ids[i] >= 0 && ids[i] < vocab_size_, "CharTokenizer: id outside the vocabulary (id=", ids[i],
               ", position=", i, ", vocab_size=", vocab_size_, "); decode ids the model of this vocabulary made");
    text[i] = char(static_cast<unsigned char>(ids[i]));
  }
  return text;
}

std::string CharTokenizer::decode_sample(const std::vector<int64_t>& ids) const {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] >= 0 && ids[i] < vocab_size_) text[i] = char(static_cast<unsigned char>(ids[i]));
  return text;
}

// ---- problems ----

std::vector<Problem> arithmetic_problems(int64_t count, int difficulty, uint64_t seed) {
  const Level level = level_of(difficulty);
  const int64_t num_ops = int64_t(std::char_traits<char>::length(level.ops));
  const int64_t span = level.hi - level.lo + 1;
  const int64_t distinct = num_ops * span * span;
  KILN_CHECK(count >= 0 && count <= distinct, "arithmetic_problems: count outside [0, ", distinct,
             "] (count=", count, ", difficulty=", difficulty, "); level ", difficulty, " has ", distinct,
             " distinct problems: ask for fewer, a higher difficulty, or repeat them in epochs");
  Rng rng(mix(seed, kSaltProblems));
  std::unordered_set<std::string> seen;
  std::vector<Problem> out;
  out.reserve(size_t(count));
  while (int64_t(out.size()) < count) {
    const char op = level.ops[rng.below(uint64_t(num_ops))];
    const int64_t a = rng.between(level.lo, level.hi);
    const int64_t b = rng.between(level.lo, level.hi);
    std::string prompt = std::to_string(a) + op + std::to_string(b) + "=";
    if (!seen.insert(prompt).second) continue;
    const int64_t result = op == '+' ? a + b : op == '-' ? a - b : a * b;
    out.push_back({std::move(prompt), std::to_string(result)});
  }
  return out;
}

// ---- datasets ----

Dataset split(std::vector<Problem> problems, double test_fraction, uint64_t seed) {
  KILN_CHECK(std::isfinite(test_fraction) && test_fraction >= 0.0 && test_fraction < 1.0,
             "split: test_fraction outside [0, 1) (test_fraction=", test_fraction,
             "); give the fraction of prompts held out for evaluation");
  // Group by prompt, in first-seen order, so duplicates cannot straddle train and test.
  std::unordered_map<std::string, size_t> group_of;
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < problems.size(); ++i) {
    auto [it, fresh] = group_of.emplace(problems[i].prompt, groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  Rng(mix(seed, kSaltSplit)).shuffle(groups);
  const size_t num_groups = groups.size();
  size_t num_test = size_t(std::llround(test_fraction * double(num_groups)));
  if (num_groups > 0) num_test = std::min(num_test, num_groups - 1);
  Dataset d;
  for (size_t g = 0; g < num_groups; ++g) {
    auto& side = g < num_test ? d.test : d.train;
    for (size_t i : groups[g]) side.push_back(std::move(problems[i]));
  }
  return d;
}

Dataset load_jsonl(const std::string& path, double test_fraction, uint64_t seed) {
  std::ifstream in(path);
  KILN_CHECK(in.good(), "load_jsonl: cannot open file (path=", path, "); check the path");
  std::vector<Problem> problems;
  std::string line;
  for (int64_t num = 1; std::getline(in, line); ++num) {
    if (std::all_of(line.begin(), line.end(), [](char c) { return is_space(c) || c == '\f' || c == '\v'; })) continue;
    const std::string where = str_cat(path, ":", num);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      // nlohmann's own "line 1, column N" prefix would contradict our file line; keep its reason.
      const std::string what = e.what();
      const size_t colon = what.find(": ", what.find("column"));
      KILN_FAIL("load_jsonl: ", where, ": bad JSON at column ", e.byte, " (",
                colon == std::string::npos ? what : what.substr(colon + 2), "); write one JSON object per line");
    }
    KILN_CHECK(j.is_object(), "load_jsonl: ", where, ": expected a JSON object, got ", j.type_name(),
               "; write {\"prompt\": ..., \"answer\": ...} on each line");
    for (const char* key : {"prompt", "answer"}) {
      KILN_CHECK(j.contains(key), "load_jsonl: ", where, ": missing key \"", key,
                 "\"; every line needs \"prompt\" and \"answer\"");
    }
    const nlohmann::json& p = j["prompt"];
    const nlohmann::json& a = j["answer"];
    KILN_CHECK(p.is_string(), "load_jsonl: ", where, ": \"prompt\" has the wrong type (type=", p.type_name(),
               "); make it a string");
    KILN_CHECK(a.is_string() || a.is_number(), "load_jsonl: ", where, ": \"answer\" has the wrong type (type=",
               a.type_name(), "); make it a string or a number");
    Problem prob{p.get<std::string>(), a.is_string() ? a.get<std::string>() : number_text(a)};
    KILN_CHECK(!prob.prompt.empty(), "load_jsonl: ", where, ": \"prompt\" is empty; give the question text");
    KILN_CHECK(!prob.answer.empty() && final_answer(prob.answer) == prob.answer, "load_jsonl: ", where,
               ": \"answer\" can never match (answer=", a.dump(),
               "); final answers are non-empty, trimmed of spaces and end at the first newline");
    problems.push_back(std::move(prob));
  }
  KILN_CHECK(!in.bad(), "load_jsonl: read error (path=", path, "); check the file");
  KILN_CHECK(!problems.empty(), "load_jsonl: no problems in file (path=", path,
             "); write one {\"prompt\": ..., \"answer\": ...} object per line");
  return split(std::move(problems), test_fraction, seed);
}

// ---- training stream ----

DataStream::DataStream(std::vector<Problem> problems, uint64_t seed) : problems_(std::move(problems)), seed_(seed) {
  KILN_CHECK(!problems_.empty(), "DataStream: no problems; give at least one training problem");
}

const std::vector<int64_t>& DataStream::order(uint64_t epoch) {
  if (epoch != cached_epoch_) {
    cached_order_.resize(problems_.size());
    std::iota(cached_order_.begin(), cached_order_.end(), int64_t(0));
    Rng(mix(seed_ ^ kSaltStream, epoch)).shuffle(cached_order_);
    cached_epoch_ = epoch;
  }
  return cached_order_;
}

std::vector<Problem> DataStream::next(int64_t n) {
  KILN_CHECK(n >= 0, "DataStream: negative batch size (n=", n, "); ask for n >= 0 problems");
  std::vector<Problem> batch;
  batch.reserve(size_t(n));
  const uint64_t size = problems_.size();
  for (int64_t i = 0; i < n; ++i, ++position_) {
    batch.push_back(problems_[size_t(order(position_ / size)[size_t(position_ % size)])]);
  }
  return batch;
}

// ---- rewards ----

std::string final_answer(const std::string& completion) {
  const size_t end = std::min(completion.find('\n'), completion.size());
  size_t lo = 0, hi = end;
  while (lo < hi && is_space(completion[lo])) ++lo;
  while (hi > lo && is_space(completion[hi - 1])) --hi;
  return completion.substr(lo, hi - lo);
}

double exact_match_reward(const std::string& completion, const std::string& answer) {
  return final_answer(completion) == answer ? 1.0 : 0.0;
}

double format_reward(const std::string& completion) {
  const size_t n = completion.size();
  if (n < 2 || completion[n - 1] != '\n') return 0.0;
  const size_t start = completion[0] == '-' ? 1 : 0;
  if (start >= n - 1) return 0.0;
  for (size_t i = start; i + 1 < n; ++i) {
    if (completion[i] < '0' || completion[i] > '9') return 0.0;
  }
  return 1.0;
}

void RewardConfig::validate() const {
  KILN_CHECK(std::isfinite(correct) && std::isfinite(format), "RewardConfig: weight is not finite (correct=",
             correct, ", format=", format, "); use finite weights");
}

double reward(const std::string& completion, const std::string& answer, const RewardConfig& config) {
  config.validate();
  return config.correct * exact_match_reward(completion, answer) + config.format * format_reward(completion);
}

}  // namespace kiln::trainer
