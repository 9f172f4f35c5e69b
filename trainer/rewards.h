// The Reward interface, the spec a recipe's `reward:` block parses into, and the built-in rewards:
// exact match, regex format (PCRE2), math answers (\boxed{}, ####, exact rationals) and weighted
// sums. External scorers run as reward workers (trainer/reward_worker.h). Pure C++; no torch headers.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/yaml_fwd.h"

namespace kiln::trainer {

// One sample to score.
struct RewardRequest {
  int64_t id = 0;           // unique within a call
  std::string prompt;       // the rendered prompt text
  std::string response;     // the sampled response text (decoded)
  std::string label;        // the dataset's label/ground truth as text ("" if none)
  std::string data_source;  // the dataset's data_source ("" if none)
  std::string metadata;     // a JSON object as text ("{}" or "" if none), passed through from the dataset line
  bool truncated = false;   // the response hit max_tokens without a stop token
};

struct RewardResult {
  double reward = 0;
  // Optional named parts, e.g. {"format", 1}. A sum lists each part's unweighted value under the
  // part's name, and a part's own components as "<part>/<component>".
  std::vector<std::pair<std::string, double>> components;
  // The scorer could not score it (worker error/timeout/garbage). A failed worker scores 0; a sum
  // with a failed part is failed too and adds its other parts as usual.
  bool failed = false;
  std::string error;  // why, when failed ("<part>: ..." in a sum)
};

// Counters since the reward was made; the trainer logs the difference between two steps
// (`after - before`). Built-ins count requests and failures; workers fill in the rest.
struct RewardStats {
  int64_t num_requests = 0;       // samples scored
  int64_t num_failures = 0;       // results with failed = true
  int64_t num_timeouts = 0;       // worker attempts that ran past timeout_s (each attempt counts)
  int64_t num_restarts = 0;       // worker processes started to replace one that died, hung or misbehaved
  int64_t num_retries = 0;        // requests sent again after their worker died or hung
  int64_t num_garbage_lines = 0;  // worker stdout lines that named no request in flight on it
  int64_t num_protocol_violations = 0;  // answers to an id never sent to that worker, or a second answer
  int64_t num_answered = 0;       // worker answers received (with a reward or an error)
  double total_seconds = 0;       // sum over answered worker requests of (answer time - send time)

  double mean_seconds() const { return num_answered > 0 ? total_seconds / double(num_answered) : 0.0; }
  RewardStats& operator+=(const RewardStats& other);
  RewardStats operator-(const RewardStats& before) const;
};

class Reward {
 public:
  virtual ~Reward() = default;
  // Scores a batch (one result per request, same order). Thread-compatible; called from one thread.
  virtual std::vector<RewardResult> score(const std::vector<RewardRequest>& requests) = 0;
  // Starts what scoring runs (worker processes) and checks that it stays up: throws kiln::Error
  // naming the command when it cannot start. The trainer calls it before the first step, so that a
  // mistyped command is an error then and not a run of zero rewards; score() starts what is not running.
  virtual void start() {}
  // Counters since construction; rewards that keep none report zeros.
  virtual RewardStats stats() const { return {}; }
};

// Recipes name types and policies as strings; they become these enums at the YAML boundary.
enum class RewardType { kExactMatch, kRegexFormat, kMath, kWorker, kSum };
enum class OnFailure { kZero, kStop };

// "exact_match", "regex_format", "math", "worker", "sum"; errors list the names.
RewardType parse_reward_type(const std::string& name);
const char* reward_type_name(RewardType type);
std::vector<std::string> reward_type_names();  // every type's name, in declaration order
// "zero" or "stop".
OnFailure parse_on_failure(const std::string& name);
const char* on_failure_name(OnFailure policy);

// type: exact_match. Reward 1 when the response's answer equals the label, else 0.
struct ExactMatchSpec {
  // The answer is the response up to the earliest occurrence of any of these strings (all of it
  // when none occurs; the whole response when the list is empty), trimmed of spaces, tabs and '\r'
  // at both ends. The default {"\n"} is the arithmetic demo's rule (trainer::final_answer). The
  // label is compared as it is, unless an option below normalises both sides.
  std::vector<std::string> stops = {"\n"};
  bool normalize_whitespace = false;  // trim all whitespace and collapse each inner run to one space
  bool ignore_case = false;           // compare ASCII letters case-insensitively
  void validate(const std::string& path) const;  // no empty stop string
};

// type: regex_format. Reward 1 when the pattern matches the whole response, else 0.
struct RegexFormatSpec {
  // A PCRE2 pattern (Perl syntax; UTF-8), anchored at both ends of the response. '.' stops at
  // newlines unless the pattern starts with (?s); a response that is not valid UTF-8 never
  // matches. "-?[0-9]+\n" is the demo's format rule (trainer::format_reward). PCRE2 rather than
  // std::regex: libstdc++'s regex recurses once per character and overflows the stack on
  // responses of ~100k characters.
  std::string pattern;
  void validate(const std::string& path) const;  // non-empty and compiles
};

// type: math. Reward 1 when the response's final answer equals the label's, else 0.
// The answer is the content of the last \boxed{...} (balanced braces; a last \boxed that is cut
// off gives no answer), else the rest of the line after the last "####", else (when
// last_number_fallback) the response's last number. The label goes through the same extraction
// but falls back to the whole label. Both are normalised: $, spaces, \left/\right, \! \, \; \:,
// \displaystyle, ^\circ, % and \% go; \dfrac and \tfrac become \frac; \frac12 becomes \frac{1}{2}
// and \sqrt2 \sqrt{2}; \text{..} and \mbox{..} unwrap (a trailing one after a value is a unit and
// goes); "x=" in front, a leading '+' and trailing '.' go. When both sides then read as numbers
// (integers, 1,000-style thousands, decimals, a/b, \frac{a}{b}, signed) they compare as exact
// rationals, so 0.5 == 0.50 == 1/2 == \frac{1}{2}; otherwise as the normalised strings.
struct MathSpec {
  bool last_number_fallback = false;  // without \boxed{} or ####, score the response's last number
};

// type: worker. An external scorer: a pool of persistent processes speaking JSONL on stdin/stdout
// (protocol in trainer/reward_worker.h and recipes/reward_worker_example.py).
struct WorkerSpec {
  std::vector<std::string> command;  // argv; command[0] is looked up on PATH; in a recipe, a relative
                                     // path is taken from the cwd, else beside the recipe
  int num_workers = 1;               // processes in the pool, started on first use
  int max_in_flight = 4;             // requests written to one worker before its answers come back
  double timeout_s = 60;             // per request, from when it is sent; a worker past it is killed
  int max_retries = 1;               // re-sends of a request whose worker died or hung (alone, to a fresh worker)
  int max_restarts = 8;              // worker restarts allowed per score() call; past it the rest fail
  int max_garbage_lines = 3;         // stdout lines naming no request in flight a worker may write per call
  OnFailure on_failure = OnFailure::kStop;  // zero: score 0, count it, go on; stop: throw kiln::Error
  double shutdown_grace_s = 2;       // after stdin is closed, how long workers get to exit before SIGKILL
  double start_check_s = 1;          // a new pool's workers must stay up this long, or the run stops (0: no wait)
  // A GRPO step in which more than this fraction of the samples fail stops the run, whatever
  // on_failure says (batch_rewards.cpp): 0 stops at the first failure, 1 never.
  double max_failure_fraction = 0.5;
  void validate(const std::string& path) const;  // a command, counts and times in range
};

// The keys a reward worker and an environment share (trainer/rewards_yaml.cpp): command (required)
// and the pool's limits. The caller reads its own keys and finishes the section.
void read_yaml(yaml::MapReader& m, WorkerSpec& w);
void write_yaml(YAML::Emitter& e, const WorkerSpec& w);

// A reward. `type` picks which of the option blocks below applies; the others are ignored.
struct RewardSpec {
  RewardType type = RewardType::kExactMatch;
  std::string name;     // the name in a parent sum's components; "" means the type's name
  double weight = 1.0;  // the weight in a parent sum (a top-level reward's weight is not applied)
  ExactMatchSpec exact_match;
  RegexFormatSpec regex_format;
  MathSpec math;
  WorkerSpec worker;
  std::vector<RewardSpec> parts;  // type sum: reward = sum of part.weight * part's reward, in order

  std::string display_name() const;  // name, or the type's name when name is ""
  // The failure budget of a step scored by this reward: the worker's max_failure_fraction; for a
  // sum, the smallest of its workers' (a sample fails when any part does); without a worker, the
  // default (built-ins do not fail; a Reward given in code may).
  double max_failure_fraction() const;
  // Checks this spec and its parts (names unique within a sum, finite weights, patterns that
  // compile, worker limits in range). Errors name the reward's path, e.g. "reward.parts[1]".
  void validate(const std::string& path = "reward") const;
};

// A recipe's reward: section (trainer/rewards_yaml.cpp, docs/CONFIG.md): the type's keys (a sum's
// parts each a reward of their own), finished at every level, then validate(), a bad value named
// at the file and line of its section.
void read_yaml(yaml::MapReader& m, RewardSpec& spec);
void write_yaml(YAML::Emitter& e, const RewardSpec& spec);

// Validates `spec` and builds the reward. Workers start on the first score() call.
std::unique_ptr<Reward> make_reward(const RewardSpec& spec);

// The arithmetic demo's reward (trainer::reward with RewardConfig{correct, format}) as a spec:
// a sum of exact_match (stops {"\n"}) named "correct" and regex_format "-?[0-9]+\n" named
// "format". Gives the same numbers bit for bit.
RewardSpec arithmetic_reward_spec(double correct, double format);

// The math reward's pieces, exposed for tests and for tools that show what was compared.
// extract_math_answer: the final answer as described at MathSpec, or "" when there is none.
std::string extract_math_answer(const std::string& text, bool last_number_fallback);
// normalize_math_answer: the normalised text; numbers are printed as a reduced fraction "p/q"
// (or "p" when q == 1), so two answers are equal exactly when their normalised texts are.
std::string normalize_math_answer(const std::string& answer);
// 1 when the response's answer equals the label's, else 0.
double math_reward(const std::string& response, const std::string& label, bool last_number_fallback);

}  // namespace kiln::trainer
