// RL datasets: examples (a text or chat prompt, a label, a data_source and free metadata for the
// reward) read from JSONL files with configurable keys, the train/test split, the resumable prompt
// stream, and the prompt format that renders chats and tokenizes once, dropping over-long prompts.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/yaml_fwd.h"

namespace kiln::text {
class Tokenizer;
}

namespace kiln::trainer {

struct Example {
  std::string prompt;       // a plain-text prompt, or "" when `messages` holds a chat
  std::string messages;     // a JSON array of chat messages ({"role", "content", ...}) as text, or ""
  std::string label;        // the ground truth as text (a number 46.0 becomes "46"); "" if none
  std::string data_source;  // e.g. "gsm8k": evaluation reports per data_source
  std::string metadata;     // a JSON object as text, passed through to the reward ("{}" if none)
  std::string origin;       // where it came from, for messages: "file:line" or "arithmetic#17"
  // Filled by prepare_prompts: the rendered prompt and its ids.
  std::string prompt_text;
  std::vector<int64_t> prompt_ids;
  // Filled by add_demonstrations (trainer/sft.h), else empty: the answer the warm start imitates,
  // as ids, and per id whether it is trained (0: an environment's observation).
  std::vector<int64_t> answer_ids;
  std::vector<uint8_t> answer_trained;
};

// Where a JSONL line keeps each field. A key may be a dotted path into nested objects
// ("reward_model.ground_truth"). Empty label/data_source/metadata keys mean "not in the file".
struct DataKeys {
  std::string prompt = "prompt";  // a string, or a list of {"role", "content"} messages
  std::string label = "label";    // a string or a number (anything else is stored as JSON text)
  std::string data_source = "data_source";
  std::string metadata = "metadata";  // an object; absent -> "{}"
};

enum class BadLines { kError, kSkip };

struct JsonlOptions {
  DataKeys keys;
  BadLines bad_lines = BadLines::kError;  // kSkip: a malformed line is skipped and counted
  std::string data_source;                // the data_source of lines that carry none
  bool require_label = true;              // a line without a label is malformed
};

// The JSONL keys of a recipe's data: section (trainer/dataset_yaml.cpp, docs/CONFIG.md):
// data_source, bad_lines (error | skip) and the keys: mapping, which is finished here. The data:
// section also holds the recipe's task and paths, so the caller finishes it.
void read_yaml(yaml::MapReader& m, JsonlOptions& options);
void write_yaml(YAML::Emitter& e, const JsonlOptions& options);

struct LoadReport {
  int64_t lines = 0;                 // non-blank lines read
  int64_t loaded = 0;
  int64_t skipped = 0;               // malformed lines skipped (BadLines::kSkip)
  std::vector<std::string> examples; // the first few skip reasons, "file:line: why"
};

// Reads one JSON object per line. A malformed line (bad JSON, a missing or mistyped key) is an
// error naming file:line and the key, or with BadLines::kSkip is skipped and counted in `report`.
// Blank lines are ignored. An empty result is an error.
std::vector<Example> load_jsonl(const std::string& path, const JsonlOptions& options,
                                LoadReport* report = nullptr);

// Shuffles by seed and puts round(test_fraction * D) of the D distinct prompts (clamped so train
// keeps at least one when D > 0) in test, the rest in train. All copies of a prompt land on the
// same side, so no test prompt is ever trained on. test_fraction in [0, 1).
struct Dataset {
  std::vector<Example> train, test;
};
Dataset split(std::vector<Example> examples, double test_fraction, uint64_t seed);

// Training prompts in epochs: each epoch visits every example once, in an order shuffled by
// (seed, epoch). position() counts examples handed out since the start; a run that saves it and
// later seek()s to it over the same examples and seed gets the identical sequence from there.
class DataStream {
 public:
  DataStream(std::vector<Example> examples, uint64_t seed);
  std::vector<Example> next(int64_t n);  // the next n examples; a batch may span two epochs
  uint64_t position() const { return position_; }
  void seek(uint64_t position) { position_ = position; }
  uint64_t epoch() const { return position_ / examples_.size(); }
  int64_t size() const { return int64_t(examples_.size()); }
  const std::vector<Example>& examples() const { return examples_; }

 private:
  const std::vector<int64_t>& order(uint64_t epoch);

  std::vector<Example> examples_;
  uint64_t seed_;
  uint64_t position_ = 0;
  uint64_t cached_epoch_ = UINT64_MAX;
  std::vector<int64_t> cached_order_;
};

// How prompts become token ids.
enum class ChatMode {
  kAuto,    // chats go through the tokenizer's chat template; text prompts are used as they are
  kAlways,  // a text prompt becomes one user message first (plus system_prompt)
  kNever,   // no template: a chat is an error
};

struct PromptFormat {
  ChatMode chat = ChatMode::kAuto;
  std::string system_prompt;        // prepended as a system message to chats that have none
  bool add_generation_prompt = true;
  std::string template_kwargs = "{}";  // a JSON object of extra template variables
                                       // (e.g. {"enable_thinking": false})
  std::optional<int64_t> max_prompt_tokens;  // longer prompts are dropped and counted; unset (the
                                             // recipe's 0): no limit
  void validate() const;
};

// A recipe's prompt: section (trainer/dataset_yaml.cpp, docs/CONFIG.md): chat (auto | always |
// never), system, add_generation_prompt, max_prompt_tokens and template_kwargs (a mapping of
// template variables), finished, then validate(), a bad value named at its file and line.
void read_yaml(yaml::MapReader& m, PromptFormat& format);
void write_yaml(YAML::Emitter& e, const PromptFormat& format);

struct PrepareReport {
  int64_t kept = 0, too_long = 0;
  int64_t max_tokens = 0;           // longest kept prompt
  double mean_tokens = 0;
};

// Renders and tokenizes every example (prompt_text, prompt_ids) and removes those longer than
// max_prompt_tokens. Plain prompts are encoded with the tokenizer's special-token rule (BOS);
// rendered chats are encoded as they are (the template writes its own BOS), as transformers does.
PrepareReport prepare_prompts(std::vector<Example>& examples, const text::Tokenizer& tokenizer,
                              const PromptFormat& format);

// The chat for a prompt under `format`: the example's messages (or its text as one user message),
// with the system prompt added when the chat has none. A JSON array as text.
std::string chat_messages(const Example& example, const PromptFormat& format);

}  // namespace kiln::trainer
