// Tasks and rewards of the GRPO demo: the byte-level tokenizer, arithmetic problems, JSONL datasets
// with a deterministic train/test split, a resumable stream of training prompts, and the
// exact-match and format rewards. Pure C++; no torch.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::trainer {

// Byte-level tokenizer: token id = byte value, for bytes below vocab_size (128 covers ASCII).
// Id 0 ('\0') is the pad id and '\n' (10) the end-of-answer (eos) id, so a completion is the answer
// text followed by '\n' and the rollout stops on eos_id(). encode rejects '\0' so a pad never
// appears inside real text; decode maps every id in [0, vocab_size) to its byte, pad included.
class CharTokenizer {
 public:
  explicit CharTokenizer(int64_t vocab_size = 128);  // in [11, 256]: must hold pad and eos
  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  // For model samples: an id the tokenizer lacks (a model vocabulary larger than its 256 bytes)
  // becomes the pad byte, which no answer holds, so such a sample scores as wrong.
  std::string decode_sample(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const { return vocab_size_; }
  int64_t eos_id() const { return '\n'; }
  int64_t pad_id() const { return 0; }

 private:
  int64_t vocab_size_;
};

struct Problem {
  std::string prompt;  // e.g. "12+34="
  std::string answer;  // e.g. "46"; the model should answer "46\n"
};

// `count` distinct problems "<a><op><b>=" with the integer result as answer. Difficulty:
// 1 = a+b, a and b in [0, 9] (100 distinct); 2 = a+b, a and b in [10, 99] (8100);
// 3 = a+b or a-b, a and b in [10, 99], results may be negative (16200);
// 4 = a+b, a-b or a*b, a and b in [0, 99] (30000).
// The same (count, difficulty, seed) gives the same problems in the same order on every platform.
std::vector<Problem> arithmetic_problems(int64_t count, int difficulty, uint64_t seed);

struct Dataset {
  std::vector<Problem> train, test;
};

// Shuffles by seed and puts round(test_fraction * D) of the D distinct prompts (clamped so train
// keeps at least one when D > 0) in test, the rest in train. All copies of a prompt land on the
// same side, so no test prompt is ever trained on. test_fraction in [0, 1).
Dataset split(std::vector<Problem> problems, double test_fraction, uint64_t seed);

// Reads one JSON object per line: {"prompt": "12+34=", "answer": "46"}; answer may also be a number
// (46 and 46.0 both become "46"). Blank lines are skipped and other keys ignored. Errors name
// file:line. Then split(problems, test_fraction, seed).
Dataset load_jsonl(const std::string& path, double test_fraction, uint64_t seed);

// Training prompts in epochs: each epoch visits every problem once, in an order shuffled by
// (seed, epoch). position() counts problems handed out since the start; a run that saves it and
// later seek()s to it over the same problems and seed gets the identical sequence from there.
class DataStream {
 public:
  DataStream(std::vector<Problem> problems, uint64_t seed);
  std::vector<Problem> next(int64_t n);  // the next n problems; a batch may span two epochs
  uint64_t position() const { return position_; }
  void seek(uint64_t position) { position_ = position; }
  uint64_t epoch() const { return position_ / problems_.size(); }
  int64_t size() const { return int64_t(problems_.size()); }

 private:
  const std::vector<int64_t>& order(uint64_t epoch);

  std::vector<Problem> problems_;
  uint64_t seed_;
  uint64_t position_ = 0;
  uint64_t cached_epoch_ = UINT64_MAX;
  std::vector<int64_t> cached_order_;
};

// The completion's answer: its text up to the first '\n' (all of it when there is none), with
// spaces, tabs and '\r' trimmed from both ends.
std::string final_answer(const std::string& completion);

// 1 when final_answer(completion) == answer as strings ("046" is not "46"), else 0.
double exact_match_reward(const std::string& completion, const std::string& answer);

// 1 when the completion is exactly an optional '-', one or more digits and the eos '\n', else 0
// (a truncated "12" or a padded " 12\n" scores 0).
double format_reward(const std::string& completion);

struct RewardConfig {
  double correct = 1.0;  // weight of exact_match_reward
  double format = 0.0;   // weight of format_reward
  void validate() const;
};

// correct * exact_match_reward + format * format_reward.
double reward(const std::string& completion, const std::string& answer, const RewardConfig& config);

}  // namespace kiln::trainer
