// The built-in rewards (exact match, PCRE2 regex format, math answers, weighted sums), the spec's
// validation and make_reward. Math answers compare as exact rationals (__int128) so that 0.5,
// 0.50, 1/2 and \frac{1}{2} are one answer without any floating-point tolerance.
#include "trainer/rewards.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>
#include <set>

#include "core/error.h"
#include "trainer/reward_worker.h"

namespace kiln::trainer {

// ---- stats ----

RewardStats& RewardStats::operator+=(const RewardStats& o) {
  num_requests += o.num_requests;
  num_failures += o.num_failures;
  num_timeouts += o.num_timeouts;
  num_restarts += o.num_restarts;
  num_retries += o.num_retries;
  num_garbage_lines += o.num_garbage_lines;
  num_protocol_violations += o.num_protocol_violations;
  num_answered += o.num_answered;
  total_seconds += o.total_seconds;
  return *this;
}

RewardStats RewardStats::operator-(const RewardStats& b) const {
  RewardStats d = *this;
  d.num_requests -= b.num_requests;
  d.num_failures -= b.num_failures;
  d.num_timeouts -= b.num_timeouts;
  d.num_restarts -= b.num_restarts;
  d.num_retries -= b.num_retries;
  d.num_garbage_lines -= b.num_garbage_lines;
  d.num_protocol_violations -= b.num_protocol_violations;
  d.num_answered -= b.num_answered;
  d.total_seconds -= b.total_seconds;
  return d;
}

// ---- names ----

namespace {

struct TypeName {
  RewardType type;
  const char* name;
};
constexpr TypeName kTypeNames[] = {{RewardType::kExactMatch, "exact_match"},
                                   {RewardType::kRegexFormat, "regex_format"},
                                   {RewardType::kMath, "math"},
                                   {RewardType::kWorker, "worker"},
                                   {RewardType::kSum, "sum"}};

}  // namespace

RewardType parse_reward_type(const std::string& name) {
  for (const TypeName& t : kTypeNames)
    if (name == t.name) return t.type;
  KILN_FAIL("reward: unknown type (type=", name, "); use exact_match, regex_format, math, worker or sum");
}

const char* reward_type_name(RewardType type) {
  for (const TypeName& t : kTypeNames)
    if (type == t.type) return t.name;
  return "unknown";
}

std::vector<std::string> reward_type_names() {
  std::vector<std::string> out;
  for (const TypeName& t : kTypeNames) out.push_back(t.name);
  return out;
}

OnFailure parse_on_failure(const std::string& name) {
  if (name == "zero") return OnFailure::kZero;
  if (name == "stop") return OnFailure::kStop;
  KILN_FAIL("reward: unknown on_failure (on_failure=", name,
            "); use zero (score 0, count it, go on) or stop (raise an error)");
}

const char* on_failure_name(OnFailure policy) { return policy == OnFailure::kZero ? "zero" : "stop"; }

// ---- text helpers ----

namespace {

// The demo's trim set (trainer::final_answer): no '\n', which ends the answer instead.
bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string trim(const std::string& s, bool (*drop)(char)) {
  size_t lo = 0, hi = s.size();
  while (lo < hi && drop(s[lo])) ++lo;
  while (hi > lo && drop(s[hi - 1])) --hi;
  return s.substr(lo, hi - lo);
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size()))
    s.replace(pos, from.size(), to);
}

// Removes a LaTeX command where no letter follows it, so \left goes but \leftarrow stays.
void remove_command(std::string& s, const std::string& cmd) {
  for (size_t pos = s.find(cmd); pos != std::string::npos; pos = s.find(cmd, pos)) {
    const size_t end = pos + cmd.size();
    if (end < s.size() && is_alpha(s[end])) {
      ++pos;
      continue;
    }
    s.erase(pos, cmd.size());
  }
}

// The index just past the '}' that closes the '{' at s[open], or npos when it never closes.
size_t close_brace(const std::string& s, size_t open) {
  int depth = 0;
  for (size_t i = open; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == '{' || s[i + 1] == '}')) {
      ++i;  // \{ and \} are literal braces
      continue;
    }
    if (s[i] == '{') ++depth;
    if (s[i] == '}' && --depth == 0) return i + 1;
  }
  return std::string::npos;
}

}  // namespace

// ---- math answers ----

namespace {

// The content of the last \boxed / \fbox; nullopt when there is none, "" when the last one is cut
// off (a truncated response), so an earlier, superseded answer is never scored instead.
std::optional<std::string> last_boxed(const std::string& text) {
  size_t pos = std::string::npos, len = 0;
  for (const char* marker : {"\\boxed", "\\fbox"}) {
    const size_t p = text.rfind(marker);
    if (p != std::string::npos && (pos == std::string::npos || p > pos)) {
      pos = p;
      len = std::char_traits<char>::length(marker);
    }
  }
  if (pos == std::string::npos) return std::nullopt;
  size_t i = pos + len;
  while (i < text.size() && is_space(text[i])) ++i;
  if (i < text.size() && text[i] == '{') {
    const size_t end = close_brace(text, i);
    if (end == std::string::npos) return std::string();
    return text.substr(i + 1, end - i - 2);
  }
  if (i == pos + len) return std::string();  // "\boxedx": not a box
  size_t end = i;  // "\boxed 5": one token, up to a space or '$'
  while (end < text.size() && !is_space(text[end]) && text[end] != '$') ++end;
  return text.substr(i, end - i);
}

// The last number in the text: digits with optional thousands commas, a decimal part and a
// "/denominator"; a '-' right before counts when no digit precedes it ("5-3" gives "3").
std::string last_number(const std::string& text) {
  std::string last;
  size_t i = 0;
  while (i < text.size()) {
    const bool starts = is_digit(text[i]) || (text[i] == '.' && i + 1 < text.size() && is_digit(text[i + 1]));
    if (!starts || (i > 0 && (is_digit(text[i - 1]) || text[i - 1] == '.'))) {
      ++i;
      continue;
    }
    size_t begin = i;
    if (begin > 0 && text[begin - 1] == '-' && (begin < 2 || !is_digit(text[begin - 2]))) --begin;
    size_t end = i;
    while (end < text.size() && (is_digit(text[end]) || text[end] == ',' || text[end] == '.' || text[end] == '/'))
      ++end;
    std::string token = text.substr(begin, end - begin);
    while (!token.empty() && (token.back() == ',' || token.back() == '.' || token.back() == '/')) token.pop_back();
    last = token;
    i = end;
  }
  return last;
}

using Int = __int128;
constexpr int kMaxDigits = 18;  // per decimal, so that a/b stays below 1e36 < 2^127

Int gcd(Int a, Int b) {
  if (a < 0) a = -a;
  while (b != 0) {
    const Int t = a % b;
    a = b;
    b = t;
  }
  return a;
}

struct Rational {
  Int num = 0, den = 1;  // den > 0, reduced
};

Rational reduced(Int num, Int den) {
  if (den < 0) num = -num, den = -den;
  const Int g = gcd(num, den);
  if (g > 1) num /= g, den /= g;
  return {num, den};
}

std::string int_text(Int v) {
  if (v == 0) return "0";
  const bool neg = v < 0;
  std::string s;
  for (; v != 0; v /= 10) s += char('0' + int(neg ? -(v % 10) : v % 10));
  if (neg) s += '-';
  return {s.rbegin(), s.rend()};
}

// A signed decimal: "12", "-1,000", "0.50", ".5", "+3."; thousands commas only in groups of three.
std::optional<Rational> parse_decimal(const std::string& s) {
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) neg = s[i++] == '-';
  std::string int_digits, frac_digits;
  const size_t int_begin = i;
  while (i < s.size() && (is_digit(s[i]) || s[i] == ',')) ++i;
  const std::string int_part = s.substr(int_begin, i - int_begin);
  if (int_part.find(',') != std::string::npos) {
    // 1,000 and 12,345,678 but not 1,00 or ,100.
    const size_t first = int_part.find(',');
    if (first == 0 || first > 3) return std::nullopt;
    for (size_t g = first; g < int_part.size(); g += 4) {
      if (int_part[g] != ',' || g + 4 > int_part.size()) return std::nullopt;
      for (size_t k = g + 1; k < g + 4; ++k)
        if (!is_digit(int_part[k])) return std::nullopt;
    }
  }
  for (char c : int_part)
    if (c != ',') int_digits += c;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && is_digit(s[i])) frac_digits += s[i++];
  }
  if (i != s.size() || (int_digits.empty() && frac_digits.empty())) return std::nullopt;
  while (!frac_digits.empty() && frac_digits.back() == '0') frac_digits.pop_back();
  size_t lead = 0;
  while (lead < int_digits.size() && int_digits[lead] == '0') ++lead;
  if (int(int_digits.size() - lead + frac_digits.size()) > kMaxDigits) return std::nullopt;
  Int num = 0, den = 1;
  for (char c : int_digits) num = num * 10 + (c - '0');
  for (char c : frac_digits) num = num * 10 + (c - '0'), den *= 10;
  return reduced(neg ? -num : num, den);
}

std::optional<Rational> divide(const std::optional<Rational>& a, const std::optional<Rational>& b) {
  if (!a || !b || b->num == 0) return std::nullopt;
  return reduced(a->num * b->den, a->den * b->num);
}

// A decimal, a/b of decimals, or \frac{a}{b} of decimals, optionally signed in front.
std::optional<Rational> parse_number(const std::string& s) {
  if (s.empty()) return std::nullopt;
  if (s[0] == '-' || s[0] == '+') {
    if (s.size() > 1 && s[1] == '\\') {  // -\frac{1}{2}
      std::optional<Rational> r = parse_number(s.substr(1));
      if (r && s[0] == '-') r->num = -r->num;
      return r;
    }
  }
  if (s.rfind("\\frac{", 0) == 0) {
    const size_t a_end = close_brace(s, 5);
    if (a_end == std::string::npos || a_end >= s.size() || s[a_end] != '{') return std::nullopt;
    const size_t b_end = close_brace(s, a_end);
    if (b_end != s.size()) return std::nullopt;
    return divide(parse_decimal(s.substr(6, a_end - 7)), parse_decimal(s.substr(a_end + 1, b_end - a_end - 2)));
  }
  const size_t slash = s.find('/');
  if (slash != std::string::npos) return divide(parse_decimal(s.substr(0, slash)), parse_decimal(s.substr(slash + 1)));
  return parse_decimal(s);
}

std::string brace_arguments(const std::string& s);

// One argument of a LaTeX command, braced: a brace group (its inside fixed too), a command name
// (\pi) or one character.
size_t braced_argument(const std::string& s, size_t i, std::string* out) {
  if (i >= s.size()) return std::string::npos;
  if (s[i] == '{') {
    const size_t end = close_brace(s, i);
    if (end == std::string::npos) return std::string::npos;
    *out += "{" + brace_arguments(s.substr(i + 1, end - i - 2)) + "}";
    return end;
  }
  size_t end = i + 1;
  if (s[i] == '\\')
    while (end < s.size() && is_alpha(s[end])) ++end;
  *out += "{" + s.substr(i, end - i) + "}";
  return end;
}

// \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2} (what models and datasets write for the same thing).
std::string brace_arguments(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const bool frac = s.compare(i, 5, "\\frac") == 0 && !(i + 5 < s.size() && is_alpha(s[i + 5]));
    const bool sqrt = s.compare(i, 5, "\\sqrt") == 0 && !(i + 5 < s.size() && is_alpha(s[i + 5]));
    if (!frac && !sqrt) {
      out += s[i++];
      continue;
    }
    out += s.substr(i, 5);
    i += 5;
    if (sqrt && i < s.size() && s[i] == '[') {  // \sqrt[3]{x}: keep the index as it is
      const size_t close = s.find(']', i);
      if (close == std::string::npos) continue;
      out += s.substr(i, close + 1 - i);
      i = close + 1;
    }
    for (int arg = 0; arg < (frac ? 2 : 1); ++arg) {
      const size_t next = braced_argument(s, i, &out);
      if (next == std::string::npos) break;
      i = next;
    }
  }
  return out;
}

// Unwraps \text{..}-like commands; a trailing one after a value is a unit ("5\text{ cm}") and goes.
std::string strip_text_commands(std::string s) {
  static const char* const kCommands[] = {"\\text", "\\textbf", "\\textrm", "\\mbox", "\\mathrm", "\\mathbf"};
  for (const char* cmd : kCommands) {
    const std::string open = std::string(cmd) + "{";
    const size_t pos = s.rfind(open);
    if (pos != std::string::npos && pos > 0 && close_brace(s, pos + open.size() - 1) == s.size() &&
        !trim(s.substr(0, pos), is_space).empty())
      s.erase(pos);
  }
  for (const char* cmd : kCommands) {
    const std::string open = std::string(cmd) + "{";
    for (size_t pos = s.find(open); pos != std::string::npos; pos = s.find(open, pos)) {
      const size_t brace = pos + open.size() - 1;
      const size_t end = close_brace(s, brace);
      if (end == std::string::npos) break;
      s = s.substr(0, pos) + s.substr(brace + 1, end - brace - 2) + s.substr(end);
    }
  }
  return s;
}

}  // namespace

std::string extract_math_answer(const std::string& text, bool last_number_fallback) {
  if (std::optional<std::string> boxed = last_boxed(text)) return trim(*boxed, is_space);
  const size_t hashes = text.rfind("####");
  if (hashes != std::string::npos) {
    const size_t begin = hashes + 4;
    const size_t end = std::min(text.find('\n', begin), text.size());
    return trim(text.substr(begin, end - begin), is_space);
  }
  return last_number_fallback ? last_number(text) : std::string();
}

std::string normalize_math_answer(const std::string& answer) {
  std::string s = trim(answer, is_space);
  for (const char* cmd : {"\\left", "\\right", "\\displaystyle"}) remove_command(s, cmd);
  replace_all(s, "\\dfrac", "\\frac");
  replace_all(s, "\\tfrac", "\\frac");
  for (const char* gone : {"\\!", "\\,", "\\;", "\\:", "\\ ", "^{\\circ}", "^\\circ", "\\%", "%", "\\$", "$"})
    replace_all(s, gone, "");
  replace_all(s, "{,}", ",");
  s = strip_text_commands(s);
  std::string packed;
  for (char c : s)
    if (!is_space(c)) packed += c;
  s = brace_arguments(packed);
  if (s.size() > 2 && is_alpha(s[0]) && s[1] == '=') s.erase(0, 2);  // "x=5"
  for (bool changed = true; changed;) {
    changed = false;
    if (!s.empty() && s.back() == '.') s.pop_back(), changed = true;
    if (!s.empty() && s[0] == '+') s.erase(0, 1), changed = true;
    if (s.size() >= 2 && s[0] == '{' && close_brace(s, 0) == s.size()) s = s.substr(1, s.size() - 2), changed = true;
  }
  if (std::optional<Rational> r = parse_number(s))
    return r->den == 1 ? int_text(r->num) : int_text(r->num) + "/" + int_text(r->den);
  return s;
}

double math_reward(const std::string& response, const std::string& label, bool last_number_fallback) {
  const std::string answer = extract_math_answer(response, last_number_fallback);
  // A label is usually the bare answer; a worked solution ending in \boxed{} or #### also works.
  const bool marked = last_boxed(label) || label.find("####") != std::string::npos;
  const std::string truth = marked ? extract_math_answer(label, false) : trim(label, is_space);
  if (answer.empty() || truth.empty()) return 0.0;
  const std::string a = normalize_math_answer(answer), t = normalize_math_answer(truth);
  return !a.empty() && a == t ? 1.0 : 0.0;
}

// ---- spec ----

void ExactMatchSpec::validate(const std::string& path) const {
  for (size_t i = 0; i < stops.size(); ++i)
    KILN_CHECK(!stops[i].empty(), path, ".stops[", i, "]: empty stop string (stops has ", stops.size(),
               " entries); remove it (an empty list means the whole response is the answer)");
}

namespace {

struct Pcre2CodeFree {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
using Pcre2Code = std::unique_ptr<pcre2_code, Pcre2CodeFree>;
struct Pcre2MatchDataFree {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
using Pcre2MatchData = std::unique_ptr<pcre2_match_data, Pcre2MatchDataFree>;

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

Pcre2Code compile_pattern(const std::string& pattern, const std::string& path) {
  // Not PCRE2_MATCH_INVALID_UTF: it restarts an anchored match after an invalid byte, so "\xff12\n"
  // would fully match "-?[0-9]+\n". A response that is not valid UTF-8 fails the UTF check instead.
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF, &error,
                                   &offset, nullptr);
  KILN_CHECK(code != nullptr, path, ".pattern: does not compile (pattern=", pattern, ", offset=", offset,
             ", error=", pcre2_message(error), "); write a PCRE2 (Perl-syntax) pattern");
  return Pcre2Code(code);
}

}  // namespace

void RegexFormatSpec::validate(const std::string& path) const {
  KILN_CHECK(!pattern.empty(), path, ".pattern: missing (pattern=\"\"); give the PCRE2 pattern a well-formatted ",
             "response matches in full, e.g. '-?[0-9]+\\n'");
  compile_pattern(pattern, path);
}

void WorkerSpec::validate(const std::string& path) const {
  KILN_CHECK(!command.empty() && !command[0].empty(), path, ".command: missing (command has ", command.size(),
             " entries); give the worker's argv, e.g. [python3, recipes/reward_worker_example.py]");
  KILN_CHECK(num_workers >= 1 && num_workers <= 1024, path, ".num_workers: outside [1, 1024] (num_workers=",
             num_workers, "); give the pool size");
  KILN_CHECK(max_in_flight >= 1, path, ".max_in_flight: below 1 (max_in_flight=", max_in_flight,
             "); allow at least one request per worker");
  KILN_CHECK(std::isfinite(timeout_s) && timeout_s > 0, path, ".timeout_s: not a positive number (timeout_s=",
             timeout_s, "); give seconds per request, e.g. 60");
  KILN_CHECK(max_retries >= 0, path, ".max_retries: negative (max_retries=", max_retries, "); use 0 or more");
  KILN_CHECK(max_restarts >= 0, path, ".max_restarts: negative (max_restarts=", max_restarts, "); use 0 or more");
  KILN_CHECK(max_garbage_lines >= 0, path, ".max_garbage_lines: negative (max_garbage_lines=", max_garbage_lines,
             "); use 0 or more");
  KILN_CHECK(std::isfinite(shutdown_grace_s) && shutdown_grace_s >= 0, path,
             ".shutdown_grace_s: not a number >= 0 (shutdown_grace_s=", shutdown_grace_s, "); give seconds, e.g. 2");
  KILN_CHECK(std::isfinite(start_check_s) && start_check_s >= 0 && start_check_s <= 600, path,
             ".start_check_s: outside [0, 600] (start_check_s=", start_check_s,
             "); give the seconds a new worker must stay up, e.g. 1");
  KILN_CHECK(max_failure_fraction >= 0 && max_failure_fraction <= 1, path,
             ".max_failure_fraction: outside [0, 1] (max_failure_fraction=", max_failure_fraction,
             "); give the fraction of a step's samples that may fail, e.g. 0.5 (1: never stop)");
}

std::string RewardSpec::display_name() const { return name.empty() ? reward_type_name(type) : name; }

namespace {
// The smallest max_failure_fraction among the workers of `spec` (itself or its parts), if any.
std::optional<double> least_worker_fraction(const RewardSpec& spec) {
  if (spec.type == RewardType::kWorker) return spec.worker.max_failure_fraction;
  std::optional<double> least;
  for (const RewardSpec& p : spec.parts)
    if (const std::optional<double> f = least_worker_fraction(p); f && (!least || *f < *least)) least = f;
  return least;
}
}  // namespace

double RewardSpec::max_failure_fraction() const {
  return least_worker_fraction(*this).value_or(WorkerSpec().max_failure_fraction);
}

void RewardSpec::validate(const std::string& path) const {
  KILN_CHECK(name.find('/') == std::string::npos, path, ".name: holds '/' (name=", name,
             "); '/' joins a part's name to its components, so pick a name without it");
  KILN_CHECK(std::isfinite(weight), path, ".weight: not finite (weight=", weight, "); use a finite weight");
  switch (type) {
    case RewardType::kExactMatch: exact_match.validate(path); break;
    case RewardType::kRegexFormat: regex_format.validate(path); break;
    case RewardType::kMath: break;
    case RewardType::kWorker: worker.validate(path); break;
    case RewardType::kSum: {
      KILN_CHECK(!parts.empty(), path, ".parts: empty (type=sum); list the rewards to add, each with a weight");
      std::set<std::string> names;
      for (size_t i = 0; i < parts.size(); ++i) {
        const std::string part_path = str_cat(path, ".parts[", i, "]");
        parts[i].validate(part_path);
        KILN_CHECK(names.insert(parts[i].display_name()).second, part_path, ": name used twice in one sum (name=",
                   parts[i].display_name(), "); give each part its own name");
      }
      break;
    }
  }
}

// ---- rewards ----

namespace {

// Scores one request at a time and counts requests and failures.
class PerSampleReward : public Reward {
 public:
  std::vector<RewardResult> score(const std::vector<RewardRequest>& requests) override {
    std::vector<RewardResult> out;
    out.reserve(requests.size());
    for (const RewardRequest& r : requests) {
      out.push_back(score_one(r));
      stats_.num_failures += out.back().failed ? 1 : 0;
    }
    stats_.num_requests += int64_t(requests.size());
    return out;
  }
  RewardStats stats() const override { return stats_; }

 protected:
  virtual RewardResult score_one(const RewardRequest& request) = 0;

 private:
  RewardStats stats_;
};

std::string lower_ascii(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string collapse_space(const std::string& s) {
  std::string out;
  for (char c : trim(s, is_space)) {
    if (!is_space(c))
      out += c;
    else if (out.back() != ' ')
      out += ' ';
  }
  return out;
}

class ExactMatchReward final : public PerSampleReward {
 public:
  explicit ExactMatchReward(ExactMatchSpec spec) : spec_(std::move(spec)) {}

 private:
  RewardResult score_one(const RewardRequest& r) override {
    size_t end = spec_.stops.empty() ? r.response.size() : std::string::npos;
    for (const std::string& stop : spec_.stops) end = std::min(end, r.response.find(stop));
    std::string answer = trim(r.response.substr(0, std::min(end, r.response.size())), is_blank);
    std::string label = r.label;
    if (spec_.normalize_whitespace) answer = collapse_space(answer), label = collapse_space(label);
    if (spec_.ignore_case) answer = lower_ascii(answer), label = lower_ascii(label);
    RewardResult out;
    out.reward = answer == label ? 1.0 : 0.0;
    return out;
  }

  ExactMatchSpec spec_;
};

class RegexFormatReward final : public PerSampleReward {
 public:
  explicit RegexFormatReward(const RegexFormatSpec& spec)
      : pattern_(spec.pattern),
        code_(compile_pattern(spec.pattern, "regex_format")),
        match_(pcre2_match_data_create_from_pattern(code_.get(), nullptr)) {}

 private:
  RewardResult score_one(const RewardRequest& r) override {
    const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(r.response.data()), r.response.size(), 0,
                               PCRE2_ANCHORED | PCRE2_ENDANCHORED, match_.get(), nullptr);
    RewardResult out;
    const bool bad_utf8 = rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21;
    if (rc >= 0) {
      out.reward = 1.0;
    } else if (rc != PCRE2_ERROR_NOMATCH && !bad_utf8) {  // e.g. the heap or match limit on a pathological pattern
      out.failed = true;
      out.error = str_cat("regex_format: matching failed (pattern=", pattern_, ", response_size=", r.response.size(),
                          ", error=", pcre2_message(rc), "); simplify the pattern");
    }
    return out;
  }

  std::string pattern_;
  Pcre2Code code_;
  Pcre2MatchData match_;
};

class MathReward final : public PerSampleReward {
 public:
  explicit MathReward(MathSpec spec) : spec_(spec) {}

 private:
  RewardResult score_one(const RewardRequest& r) override {
    RewardResult out;
    out.reward = math_reward(r.response, r.label, spec_.last_number_fallback);
    return out;
  }

  MathSpec spec_;
};

// sum of weight * part reward, in part order; components list each part's unweighted value and
// its own components under "<part>/".
class SumReward final : public Reward {
 public:
  struct Part {
    std::string name;
    double weight;
    std::unique_ptr<Reward> reward;
  };
  explicit SumReward(std::vector<Part> parts) : parts_(std::move(parts)) {}

  std::vector<RewardResult> score(const std::vector<RewardRequest>& requests) override {
    std::vector<std::vector<RewardResult>> by_part;
    for (Part& p : parts_) {
      by_part.push_back(p.reward->score(requests));
      KILN_CHECK(by_part.back().size() == requests.size(), "reward: part returned the wrong number of results (part=",
                 p.name, ", results=", by_part.back().size(), ", requests=", requests.size(),
                 "); a Reward must return one result per request");
    }
    std::vector<RewardResult> out(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      RewardResult& r = out[i];
      for (size_t k = 0; k < parts_.size(); ++k) {
        const RewardResult& part = by_part[k][i];
        const double term = parts_[k].weight * part.reward;
        r.reward = k == 0 ? term : r.reward + term;  // first term as it is: bit-equal to a*x + b*y
        r.components.emplace_back(parts_[k].name, part.reward);
        for (const auto& [name, value] : part.components) r.components.emplace_back(parts_[k].name + "/" + name, value);
        if (part.failed) {
          r.error += str_cat(r.failed ? "; " : "", parts_[k].name, ": ", part.error);
          r.failed = true;
        }
      }
      stats_.num_failures += r.failed ? 1 : 0;
    }
    stats_.num_requests += int64_t(requests.size());
    return out;
  }

  void start() override {
    for (Part& p : parts_) p.reward->start();
  }

  RewardStats stats() const override {
    RewardStats s;
    for (const Part& p : parts_) s += p.reward->stats();
    s.num_requests = stats_.num_requests;  // samples, not part-samples
    s.num_failures = stats_.num_failures;
    return s;
  }

 private:
  std::vector<Part> parts_;
  RewardStats stats_;
};

std::unique_ptr<Reward> build(const RewardSpec& spec) {
  switch (spec.type) {
    case RewardType::kExactMatch: return std::make_unique<ExactMatchReward>(spec.exact_match);
    case RewardType::kRegexFormat: return std::make_unique<RegexFormatReward>(spec.regex_format);
    case RewardType::kMath: return std::make_unique<MathReward>(spec.math);
    case RewardType::kWorker: return std::make_unique<WorkerReward>(spec.worker);
    case RewardType::kSum: {
      std::vector<SumReward::Part> parts;
      for (const RewardSpec& p : spec.parts) parts.push_back({p.display_name(), p.weight, build(p)});
      return std::make_unique<SumReward>(std::move(parts));
    }
  }
  KILN_FAIL("reward: unknown type (type=", int(spec.type), "); use exact_match, regex_format, math, worker or sum");
}

}  // namespace

std::unique_ptr<Reward> make_reward(const RewardSpec& spec) {
  spec.validate();
  return build(spec);
}

RewardSpec arithmetic_reward_spec(double correct, double format) {
  RewardSpec exact;
  exact.type = RewardType::kExactMatch;
  exact.name = "correct";
  exact.weight = correct;
  exact.exact_match.stops = {"\n"};
  RewardSpec fmt;
  fmt.type = RewardType::kRegexFormat;
  fmt.name = "format";
  fmt.weight = format;
  fmt.regex_format.pattern = "-?[0-9]+\\n";
  RewardSpec sum;
  sum.type = RewardType::kSum;
  sum.parts = {exact, fmt};
  return sum;
}

}  // namespace kiln::trainer
