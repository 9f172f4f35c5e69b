// Internal to kiln_text: the loaders behind load_tokenizer, and the reader of the config files
// (tokenizer_config.json, generation_config.json, chat_template.jinja) that fill a Tokenizer's
// bos/eos/pad/stop ids and chat template.
#pragma once
#include <memory>
#include <string>

#include "text/tokenizer.h"

namespace kiln::text {

// A tokenizer.json file alone (no config files read).
std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path);
// A tiktoken rank file alone.
std::unique_ptr<Tokenizer> load_tiktoken_file(const std::string& path, const TiktokenOptions& options);

// Reads the config files in `dir` (each optional) into `tokenizer`.
struct TokenizerFiles {
  static void apply(Tokenizer& tokenizer, const std::string& dir);
  // The add_bos_token/add_eos_token rule, applied after the post-processor: prepends bos (appends
  // eos) when the config asks for it and the ids do not already start (end) with it.
  static void add_bos_eos(const Tokenizer& tokenizer, std::vector<int64_t>& ids);
};

// Reads a whole file; errors name the file and what it should hold.
std::string read_file(const std::string& path, const std::string& what);

}  // namespace kiln::text
