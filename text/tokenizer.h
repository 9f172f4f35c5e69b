// Tokenizers: the abstract Tokenizer, byte-level BPE from HF tokenizer.json or tiktoken rank files
// (exact against HF tokenizers), the muse-tiny byte tokenizer, a streaming UTF-8-safe decoder, and
// the list of files a checkpoint carries for its tokenizer. Pure C++ (no torch).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::text {

class StreamDecoder;
struct TokenizerFiles;

// Text <-> token ids. Implementations are immutable after loading; encode and decode may be called
// from several threads at once.
//
// Text in: UTF-8. Invalid UTF-8 is replaced before encoding, each maximal invalid subsequence by
// one U+FFFD (what a JS or Python caller of HF tokenizers would send after decoding the bytes with
// TextDecoder or bytes.decode(errors="replace")). The byte tokenizer is the exception: it encodes
// the bytes as they are. Text out: always valid UTF-8 (invalid byte runs become U+FFFD, as HF's
// decode does).
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Text -> ids. Added/special tokens occurring in the text are matched first (as HF does), the
  // rest is normalised, pre-tokenised and BPE'd. add_special_tokens applies the post-processor
  // (tokenizer.json TemplateProcessing) and tokenizer_config's add_bos_token/add_eos_token.
  virtual std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = false) const = 0;
  // Ids -> text. Ids outside the vocabulary decode to U+FFFD; skip_special_tokens drops special tokens.
  // The default concatenates append_bytes and replaces invalid UTF-8; a subclass overrides this or
  // append_bytes (the default of each calls the other).
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;
  // One id's bytes as decode concatenates them: possibly part of a UTF-8 character (an API's
  // per-token "bytes").
  std::string token_bytes(int64_t id, bool skip_special_tokens = false) const;
  virtual int64_t vocab_size() const = 0;                                        // 1 + the largest id
  virtual std::optional<int64_t> token_to_id(std::string_view token) const = 0;  // specials included
  virtual std::string id_to_token(int64_t id) const = 0;                         // raw vocab string ("" if none)
  virtual bool is_special(int64_t id) const = 0;

  // From tokenizer_config.json / generation_config.json (or the byte tokenizer's fixed choices).
  std::optional<int64_t> bos_id() const { return bos_id_; }
  std::string bos_token() const { return bos_token_; }
  std::optional<int64_t> eos_id() const { return eos_id_; }
  std::string eos_token() const { return eos_token_; }
  // eos, then generation_config eos_token_id (int or list), deduplicated.
  const std::vector<int64_t>& stop_ids() const { return stop_ids_; }
  int64_t pad_id() const { return pad_id_; }  // pad_token, else eos, else 0
  // tokenizer_config "chat_template" (a string, or the "default" entry of a list of {name,
  // template}), else a chat_template.jinja file beside it; "" if none.
  const std::string& chat_template() const { return chat_template_; }
  const std::string& name() const { return name_; }  // e.g. the source path

 protected:
  friend class StreamDecoder;
  friend struct TokenizerFiles;  // fills the fields below from the config files
  // Appends the bytes of one id as decode concatenates them (possibly a partial UTF-8 character);
  // ids outside the vocabulary append U+FFFD, skipped special tokens nothing.
  virtual void append_bytes(int64_t id, bool skip_special_tokens, std::string& out) const;

  std::optional<int64_t> bos_id_, eos_id_;
  std::string bos_token_, eos_token_;
  std::vector<int64_t> stop_ids_;
  int64_t pad_id_ = 0;
  std::string chat_template_, name_;
  bool add_bos_token_ = false, add_eos_token_ = false;  // tokenizer_config.json
};

// A model directory (tokenizer.json + optional tokenizer_config.json, generation_config.json,
// chat_template.jinja; or a *.tiktoken rank file, see load_tiktoken) or a path to tokenizer.json
// or *.tiktoken. Supported tokenizer.json: BPE models with a ByteLevel pre-tokenizer and decoder
// (Qwen2/3, Llama 3, gpt-oss, GPT-2 style); anything else fails with an error naming the file,
// the JSON path and the type.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

// What a tiktoken rank file ("<base64 token> <rank>" per line; the rank is the id) leaves out.
struct TiktokenOptions {
  std::string pattern;  // pre-tokenizer regex (PCRE2 syntax, matched with Unicode properties)
  std::vector<std::pair<std::string, int64_t>> special_tokens;  // content, id
};
// The known encodings: "cl100k_base", "o200k_base" and "o200k_harmony" (o200k_base plus the
// gpt-oss specials 199998..200018). nullopt for other names.
std::optional<TiktokenOptions> known_tiktoken_encoding(std::string_view name);
// A tiktoken rank file. options nullopt: the known encoding named by the file's stem
// (cl100k_base.tiktoken -> cl100k_base). A tokenizer_config.json/generation_config.json beside the
// file supplies bos/eos/pad/chat template as for tokenizer.json.
std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path,
                                         const std::optional<TiktokenOptions>& options = std::nullopt);

// The muse-tiny byte tokenizer: id = byte value for bytes below vocab_size (in [11, 256]); pad 0
// (the only special id), eos '\n' (stop_ids {10}), no bos, no chat template. encode rejects '\0'
// and bytes >= vocab_size with an error naming the byte and its position.
class ByteTokenizer : public Tokenizer {
 public:
  explicit ByteTokenizer(int64_t vocab_size = 128);
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = false) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<int64_t> token_to_id(std::string_view token) const override;
  std::string id_to_token(int64_t id) const override;
  bool is_special(int64_t id) const override { return id == 0; }

 protected:
  void append_bytes(int64_t id, bool skip_special_tokens, std::string& out) const override;

 private:
  int64_t vocab_size_;
};
std::unique_ptr<Tokenizer> make_byte_tokenizer(int64_t vocab_size = 128);

// Streaming output: push ids one at a time, get back only text that is complete UTF-8 (never a
// split character); flush() returns the rest (an unfinished tail as U+FFFD, like decode). The
// concatenated outputs equal decode() of all the ids pushed. Holds a reference to the tokenizer.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  std::string push(int64_t id);
  std::string flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;  // bytes of an unfinished UTF-8 character
};

// Whether `dir` holds a tokenizer load_tokenizer can read (tokenizer.json or a *.tiktoken file).
bool has_tokenizer_files(const std::string& dir);
// The folder a loaded tokenizer's files are in, or "" for one with no files (the byte tokenizer).
std::string tokenizer_dir(const Tokenizer& tokenizer);

// The files a kiln checkpoint carries for its tokenizer: copies tokenizer.json,
// tokenizer_config.json, generation_config.json, chat_template.jinja and *.tiktoken that exist in
// `from_dir` into `to_dir` (created if missing).
void copy_tokenizer_files(const std::string& from_dir, const std::string& to_dir);

}  // namespace kiln::text
