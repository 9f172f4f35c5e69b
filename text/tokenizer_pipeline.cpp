// PCRE2 regexes in HF's split semantics, added-token matching, normalizers and the non-streaming
// split behaviours of the pre-tokenizer.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/tokenizer_pipeline.h"

#include <pcre2.h>

#include <algorithm>

#include "core/error.h"
#include "text/unicode.h"

namespace kiln::text {
namespace {

// White_Space as class members (what Oniguruma and Rust mean by \s).
constexpr const char* kSpaceMembers =
    "\\t-\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
constexpr const char* kHexMembers = "0-9A-Fa-f";

// Per-thread match buffers: a match data block and a JIT stack larger than the 32 KiB default, so
// long whitespace runs against lookaheads cannot exhaust it.
struct MatchState {
  pcre2_match_data* data;
  pcre2_match_context* context;
  pcre2_jit_stack* stack;
  MatchState() {
    data = pcre2_match_data_create(32, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    if (stack) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchState() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    if (stack) pcre2_jit_stack_free(stack);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

size_t char_length(std::string_view s, size_t i) {
  if (i >= s.size()) return 1;
  const unsigned char c = static_cast<unsigned char>(s[i]);
  return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

}  // namespace

std::string rewrite_pattern(const std::string& p, Regex::Dialect dialect) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      if (n == 'Q') {  // \Q...\E is literal text
        size_t end = p.find("\\E", i + 2);
        end = end == std::string::npos ? p.size() : end + 2;
        out.append(p, i, end - i);
        i = end - 1;
        continue;
      }
      const bool space = n == 's' || n == 'S';
      const bool hex = dialect == Regex::Dialect::kOniguruma && (n == 'h' || n == 'H');
      if (space || hex) {
        const char* members = space ? kSpaceMembers : kHexMembers;
        const bool negated = n == 'S' || n == 'H';
        if (!in_class) {
          out += negated ? "[^" : "[";
          out += members;
          out += ']';
          ++i;
          continue;
        }
        if (!negated) {
          out += members;
          ++i;
          continue;
        }
        // A negated class inside a class cannot be spelled out; PCRE2's own \S differs from
        // White_Space only at U+180E.
      }
      out += c;
      out += n;
      ++i;
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
        size_t end = p.find(":]", i + 2);
        end = end == std::string::npos ? p.size() : end + 2;
        out.append(p, i, end - i);
        i = end - 1;
        continue;
      }
      if (c == ']') in_class = false;
      out += c;
      continue;
    }
    out += c;
    if (c == '[') {
      in_class = true;
      // A ']' first in the class (after an optional '^') is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
    }
  }
  return out;
}

Regex::Regex(const std::string& pattern, Dialect dialect, const std::string& where) : where_(where) {
  uint32_t options = PCRE2_UTF;
  std::string compiled = pattern;
  if (dialect == Dialect::kLiteral) {
    options |= PCRE2_LITERAL;
  } else {
    options |= PCRE2_UCP;
    compiled = rewrite_pattern(pattern, dialect);
    options |= dialect == Dialect::kOniguruma ? PCRE2_MULTILINE : PCRE2_DOLLAR_ENDONLY;
  }
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(), options, &error, &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    KILN_FAIL("tokenizer: ", where, ": the regex does not compile (error=", reinterpret_cast<const char*>(message),
              ", offset=", offset, ", pattern=", compiled, "); PCRE2 must accept it, with Unicode properties");
  }
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::next_match(std::string_view s, size_t& from, size_t& last_match_end, size_t& begin, size_t& end) const {
  MatchState& st = match_state();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  while (from <= s.size()) {
    // The text is valid UTF-8 (encode repairs it first), so PCRE2 need not check it again.
    const int rc = jit_ ? pcre2_jit_match(code, subject, s.size(), from, 0, st.data, st.context)
                        : pcre2_match(code, subject, s.size(), from, PCRE2_NO_UTF_CHECK, st.data, st.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      KILN_FAIL("tokenizer: ", where_, ": regex matching failed (error=", reinterpret_cast<const char*>(message),
                ", offset=", from, ", text_bytes=", s.size(), "); split the text into smaller pieces");
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    begin = ov[0];
    end = ov[1];
    if (begin == end && last_match_end == end) {  // no empty match right after the previous one
      from += char_length(s, from);
      continue;
    }
    from = end;
    last_match_end = end;
    return true;
  }
  return false;
}

// ---- added tokens ----

void AddedTokenMatcher::add(std::string_view pattern, const AddedToken* token) {
  if (pattern.empty()) return;
  int32_t node = 0;
  for (char ch : pattern) {
    const auto c = static_cast<unsigned char>(ch);
    int32_t child = -1;
    for (const auto& [k, v] : nodes_[size_t(node)].next)
      if (k == c) child = v;
    if (child < 0) {
      child = int32_t(nodes_.size());
      nodes_[size_t(node)].next.emplace_back(c, child);
      nodes_.emplace_back();
    }
    node = child;
  }
  nodes_[size_t(node)].token = token;
  first_byte_[static_cast<unsigned char>(pattern[0])] = true;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& out) const {
  const size_t n = text.size();
  size_t start_offset = 0, pos = 0;
  while (pos < n) {
    // The leftmost start with a match, and there the longest match.
    size_t match_begin = n, match_end = 0;
    const AddedToken* token = nullptr;
    for (size_t i = pos; i < n && !token; ++i) {
      if (!first_byte_[static_cast<unsigned char>(text[i])]) continue;
      int32_t node = 0;
      for (size_t j = i; j < n; ++j) {
        const auto c = static_cast<unsigned char>(text[j]);
        int32_t child = -1;
        for (const auto& [k, v] : nodes_[size_t(node)].next)
          if (k == c) {
            child = v;
            break;
          }
        if (child < 0) break;
        node = child;
        if (nodes_[size_t(node)].token) token = nodes_[size_t(node)].token, match_begin = i, match_end = j + 1;
      }
    }
    if (!token) break;
    pos = match_end;  // the search goes on after the match as found, whatever happens to it
    size_t start = match_begin, stop = match_end;
    if (token->single_word) {
      size_t k = start;
      const bool word_before = start > 0 && unicode::is_word_char(unicode::prev_code_point(text, k));
      k = stop;
      const bool word_after = stop < n && unicode::is_word_char(unicode::next_code_point(text, k));
      if (word_before || word_after) continue;
    }
    if (token->lstrip) {
      size_t s = start;
      while (s > 0) {
        size_t k = s;
        if (!unicode::is_white_space(unicode::prev_code_point(text, k))) break;
        s = k;
      }
      start = std::max(s, start_offset);  // spaces an earlier match took stay with it
    }
    if (token->rstrip) {
      while (stop < n) {
        size_t k = stop;
        if (!unicode::is_white_space(unicode::next_code_point(text, k))) break;
        stop = k;
      }
    }
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, token->id});
    start_offset = stop;
  }
  if (start_offset < n) out.push_back({start_offset, n, -1});
}

// ---- normalizers ----

std::string_view Normalizer::apply(std::string_view text, std::string& storage) const {
  std::string_view cur = text;
  std::string next;
  for (const NormalizerStep& step : steps_) {
    bool changed = false;
    switch (step.kind) {
      case NormalizerStep::Kind::kNFC:
      case NormalizerStep::Kind::kNFD:
      case NormalizerStep::Kind::kNFKC:
      case NormalizerStep::Kind::kNFKD: {
        const auto form = step.kind == NormalizerStep::Kind::kNFC    ? unicode::NormalForm::kNFC
                          : step.kind == NormalizerStep::Kind::kNFD  ? unicode::NormalForm::kNFD
                          : step.kind == NormalizerStep::Kind::kNFKC ? unicode::NormalForm::kNFKC
                                                                     : unicode::NormalForm::kNFKD;
        changed = unicode::normalize(cur, form, next);
        break;
      }
      case NormalizerStep::Kind::kLowercase:
        next = unicode::lowercase(cur);
        changed = next != cur;
        break;
      case NormalizerStep::Kind::kStrip: {
        size_t b = 0, e = cur.size();
        while (step.left && b < e) {
          size_t k = b;
          if (!unicode::is_white_space(unicode::next_code_point(cur, k))) break;
          b = k;
        }
        while (step.right && e > b) {
          size_t k = e;
          if (!unicode::is_white_space(unicode::prev_code_point(cur, k))) break;
          e = k;
        }
        cur = cur.substr(b, e - b);  // a view of the same text: no copy
        break;
      }
      case NormalizerStep::Kind::kPrepend:
        if (!cur.empty()) {
          next.assign(step.a);
          next += cur;
          changed = true;
        }
        break;
      case NormalizerStep::Kind::kReplace: {
        if (step.a.empty() || cur.find(step.a) == std::string_view::npos) break;
        next.clear();
        size_t at = 0;
        for (size_t hit; (hit = cur.find(step.a, at)) != std::string_view::npos; at = hit + step.a.size()) {
          next.append(cur.data() + at, hit - at);
          next += step.b;
        }
        next.append(cur.data() + at, cur.size() - at);
        changed = true;
        break;
      }
    }
    if (changed) {
      storage.swap(next);
      cur = storage;
    }
  }
  return cur;
}

// ---- pre-tokenizer splits other than Isolated (HF NormalizedString::split) ----

void PreTokenizer::split_pieces(const PreTokenizerStep& step, std::string_view piece,
                                std::vector<std::pair<size_t, size_t>>& out) const {
  struct Part {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Part> parts;
  step.regex->for_each_piece(piece, [&](size_t b, size_t e, bool m) { parts.push_back({b, e, m != step.invert}); });
  // Each behaviour turns (range, is_match) into (range, remove).
  std::vector<Part> kept;  // is_match here means "remove"
  switch (step.behavior) {
    case SplitBehavior::kIsolated:
      for (const Part& p : parts) kept.push_back({p.begin, p.end, false});
      break;
    case SplitBehavior::kRemoved:
      kept = parts;
      break;
    case SplitBehavior::kContiguous: {
      bool previous = false;
      for (const Part& p : parts) {
        if (p.is_match == previous && !kept.empty())
          kept.back().end = p.end;
        else
          kept.push_back({p.begin, p.end, false});
        previous = p.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous = false;
      for (const Part& p : parts) {
        if (p.is_match && !previous && !kept.empty())
          kept.back().end = p.end;
        else
          kept.push_back({p.begin, p.end, false});
        previous = p.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !previous && !kept.empty())
          kept.back().begin = it->begin;
        else
          kept.push_back({it->begin, it->end, false});
        previous = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
  }
  for (const Part& p : kept)
    if (!p.is_match && p.end > p.begin) out.emplace_back(p.begin, p.end);
}

}  // namespace kiln::text
