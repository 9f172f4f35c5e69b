// The stages of a byte-level BPE tokenizer before the model: PCRE2 regexes in HF's split
// semantics, added-token matching (HF's AddedVocabulary rules), normalizers and pre-tokenizers.
// Internal to kiln_text; tokenizer_bpe.cpp builds them from tokenizer.json or tiktoken options.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::text {

// A compiled PCRE2 pattern (UTF, Unicode properties, JIT when available).
class Regex {
 public:
  // Whose syntax the pattern was written for: HF tokenizer.json patterns run on Oniguruma (Ruby
  // syntax: ^ and $ match at line ends, \h is a hex digit); tiktoken patterns on Rust regex ($ is
  // the end of the text). Both read \s as White_Space, which PCRE2's \s is not quite (U+180E), so
  // \s and \S are rewritten into explicit classes. kLiteral matches the pattern text itself.
  // `where` names the pattern in errors.
  enum class Dialect { kOniguruma, kRust, kLiteral };
  Regex(const std::string& pattern, Dialect dialect, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The next match in s at or after `from` as [begin, end), with Oniguruma's find_iter rule for
  // empty matches (none directly after the previous match); false when there is none.
  // `last_match_end` carries the iteration state: start with npos.
  bool next_match(std::string_view s, size_t& from, size_t& last_match_end, size_t& begin, size_t& end) const;

  // Splits s into maximal pieces, each a match or a gap between matches: fn(begin, end, is_match).
  template <typename Fn>
  void for_each_piece(std::string_view s, const Fn& fn) const {
    size_t from = 0, last = std::string_view::npos, prev = 0, b = 0, e = 0;
    while (next_match(s, from, last, b, e)) {
      if (b > prev) fn(prev, b, false);
      fn(b, e, true);
      prev = e;
    }
    if (prev < s.size()) fn(prev, s.size(), false);
  }

 private:
  void* code_ = nullptr;  // pcre2_code_8
  bool jit_ = false;
  std::string where_;
};

// The PCRE2 pattern for an Oniguruma or Rust one (exposed for tests).
std::string rewrite_pattern(const std::string& pattern, Regex::Dialect dialect);

// HF's AddedToken flags.
struct AddedToken {
  std::string content;
  int64_t id = -1;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// One piece of text after added-token matching: a token (id >= 0) or text to tokenize.
struct Segment {
  size_t begin, end;
  int64_t id;
};

// Finds added tokens in text as HF does: leftmost-longest matches of the contents (a trie here,
// Aho-Corasick there); a single_word token needs non-word characters (or the text's ends) around
// it, else the match is dropped and the search goes on after it; lstrip/rstrip widen a match over
// White_Space on that side.
class AddedTokenMatcher {
 public:
  void add(std::string_view pattern, const AddedToken* token);
  bool empty() const { return nodes_.size() <= 1; }
  // Appends the segments that cover `text` (empty ones left out).
  void split(std::string_view text, std::vector<Segment>& out) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;
    const AddedToken* token = nullptr;
  };
  std::vector<Node> nodes_{1};
  bool first_byte_[256] = {};
};

// Normalizers: NFC, NFD, NFKC, NFKD, Lowercase, Strip, Prepend, Replace (string pattern), in order.
struct NormalizerStep {
  enum class Kind { kNFC, kNFD, kNFKC, kNFKD, kLowercase, kStrip, kPrepend, kReplace } kind;
  std::string a, b;                  // Prepend: a; Replace: a -> b
  bool left = false, right = false;  // Strip
};

class Normalizer {
 public:
  void add(NormalizerStep step) { steps_.push_back(std::move(step)); }
  bool empty() const { return steps_.empty(); }
  // Normalises `text`; returns a view of `text` itself when nothing changes, else of `storage`.
  std::string_view apply(std::string_view text, std::string& storage) const;

 private:
  std::vector<NormalizerStep> steps_;
};

// Pre-tokenizers, flattened from Sequence: Split (regex or literal, five behaviours, invert) and
// ByteLevel, which must come last (the BPE model works on raw bytes, which is what ByteLevel's
// character mapping stands for).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  std::shared_ptr<const Regex> regex;  // Split; ByteLevel with use_regex (the GPT-2 pattern)
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
};

class PreTokenizer {
 public:
  void add(PreTokenizerStep step) { steps_.push_back(std::move(step)); }
  // Calls fn(word) for each non-empty word of `text`, in order.
  template <typename Fn>
  void run(std::string_view text, const Fn& fn) const {
    run_from(0, text, fn);
  }

 private:
  template <typename Fn>
  void run_from(size_t k, std::string_view piece, const Fn& fn) const;
  // The pieces of a non-isolating split (HF NormalizedString::split), as [begin, end) pairs.
  void split_pieces(const PreTokenizerStep& step, std::string_view piece,
                    std::vector<std::pair<size_t, size_t>>& out) const;
  std::vector<PreTokenizerStep> steps_;
};

template <typename Fn>
void PreTokenizer::run_from(size_t k, std::string_view piece, const Fn& fn) const {
  if (piece.empty()) return;
  if (k == steps_.size()) return fn(piece);
  const PreTokenizerStep& step = steps_[k];
  if (step.kind == PreTokenizerStep::Kind::kByteLevel) {
    std::string prefixed;
    if (step.add_prefix_space && piece[0] != ' ') {
      prefixed.reserve(piece.size() + 1);
      prefixed += ' ';
      prefixed += piece;
      piece = prefixed;
    }
    if (!step.regex) return run_from(k + 1, piece, fn);
    step.regex->for_each_piece(piece, [&](size_t b, size_t e, bool) { run_from(k + 1, piece.substr(b, e - b), fn); });
    return;
  }
  if (step.behavior == SplitBehavior::kIsolated) {  // every match and every gap is a piece
    step.regex->for_each_piece(piece, [&](size_t b, size_t e, bool) { run_from(k + 1, piece.substr(b, e - b), fn); });
    return;
  }
  std::vector<std::pair<size_t, size_t>> pieces;
  split_pieces(step, piece, pieces);
  for (const auto& [b, e] : pieces) run_from(k + 1, piece.substr(b, e - b), fn);
}

}  // namespace kiln::text
