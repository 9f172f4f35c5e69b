// The Jinja lexer: newlines normalised as jinja2 does, tags found, whitespace control applied,
// and the tags' contents cut into names, numbers, strings (escapes decoded) and operators.
#include "text/jinja_lexer.h"

#include <cstdlib>

#include "text/jinja_unicode.h"

namespace kiln::text::jinja {
namespace {

bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class Lexer {
 public:
  explicit Lexer(const std::string& source) {
    // jinja2 normalises every newline to "\n" and, without keep_trailing_newline, drops one at the end.
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    const size_t n = src_.size();
    while (i_ < n) {
      size_t p = find_tag(i_);
      if (p == std::string::npos) {
        emit(Tok::kText, src_.substr(i_), i_);
        break;
      }
      char kind = src_[p + 1];
      size_t q = p + 2;
      char sign = 0;
      if (q < n && (src_[q] == '-' || src_[q] == '+')) sign = src_[q++];
      std::string text = src_.substr(i_, p - i_);
      strip_before_tag(text, sign, kind != '{');
      if (!text.empty()) emit(Tok::kText, text, i_);
      if (kind == '#') {
        lex_comment(p, q);
      } else if (kind == '%' && lex_raw(p, q)) {
        // lex_raw emitted the raw text
      } else {
        emit(kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, kind == '{' ? "{{" : "{%", p);
        i_ = q;
        lex_tag(kind, p);
      }
    }
    emit(Tok::kEof, "", n);
    return std::move(tokens_);
  }

 private:
  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
  size_t i_ = 0;
  bool line_starting_ = true;  // the last thing consumed ended a line (jinja2's lstrip_blocks rule)

  Pos pos_at(size_t offset) const {
    size_t line = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset) - line_starts_.begin();
    size_t start = line_starts_[line - 1];
    return Pos{static_cast<int>(line),
               static_cast<int>(unicode::length(std::string_view(src_).substr(start, offset - start))) + 1};
  }

  [[noreturn]] void error(size_t offset, const std::string& message) const {
    throw TemplateError(message, pos_at(offset));
  }

  void emit(Tok type, std::string value, size_t offset, Value number = Value()) {
    tokens_.push_back(Token{type, std::move(value), pos_at(offset), std::move(number)});
  }

  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    }
    return std::string::npos;
  }

  size_t skip_space(size_t k) const {
    while (k < src_.size()) {
      size_t next = k;
      if (!unicode::is_space(unicode::decode(src_, next))) break;
      k = next;
    }
    return k;
  }

  // `{%-` strips all whitespace before the tag; otherwise lstrip_blocks removes the spaces and tabs
  // between the start of the line and a block or comment tag (not a `{{`) unless it is `{%+`.
  void strip_before_tag(std::string& text, char sign, bool block_or_comment) const {
    if (sign == '-') {
      size_t keep = 0;
      for (size_t k = 0; k < text.size();) {
        if (!unicode::is_space(unicode::decode(text, k))) keep = k;
      }
      text.resize(keep);
    } else if (sign != '+' && block_or_comment) {
      size_t l = text.rfind('\n');
      l = (l == std::string::npos) ? 0 : l + 1;
      if (l > 0 || line_starting_) {
        bool blank = true;
        for (size_t k = l; k < text.size() && blank;) blank = unicode::is_space(unicode::decode(text, k));
        if (blank) text.resize(l);
      }
    }
  }

  // After `-%}` all whitespace goes; after a plain `%}` or `#}` (trim_blocks) one newline; `+%}` keeps it.
  void finish_tag(size_t after, char sign, bool block) {
    if (sign == '-') {
      after = skip_space(after);
    } else if (block && sign != '+' && after < src_.size() && src_[after] == '\n') {
      ++after;
    }
    line_starting_ = after > 0 && src_[after - 1] == '\n';
    i_ = after;
  }

  void lex_comment(size_t p, size_t q) {
    size_t e = src_.find("#}", q);
    if (e == std::string::npos) error(p, "missing end of comment tag '#}'");
    char sign = (e > q && (src_[e - 1] == '-' || src_[e - 1] == '+')) ? src_[e - 1] : 0;
    finish_tag(e + 2, sign, true);
  }

  // `{% raw %}...{% endraw %}`: the text between is output as is.
  bool lex_raw(size_t p, size_t q) {
    size_t k = skip_space(q);
    if (src_.compare(k, 3, "raw") != 0 || (k + 3 < src_.size() && is_name_char(src_[k + 3]))) return false;
    k = skip_space(k + 3);
    char sign = 0;
    if (k < src_.size() && (src_[k] == '-' || src_[k] == '+')) sign = src_[k++];
    if (src_.compare(k, 2, "%}") != 0) error(k, "expected '%}' after 'raw'");
    finish_tag(k + 2, sign, true);
    for (size_t s = find_tag(i_); s != std::string::npos; s = find_tag(s + 1)) {
      if (src_[s + 1] != '%') continue;
      size_t m = s + 2;
      char open_sign = 0;
      if (m < src_.size() && (src_[m] == '-' || src_[m] == '+')) open_sign = src_[m++];
      m = skip_space(m);
      if (src_.compare(m, 6, "endraw") != 0) continue;
      m = skip_space(m + 6);
      char close_sign = 0;
      if (m < src_.size() && (src_[m] == '-' || src_[m] == '+')) close_sign = src_[m++];
      if (src_.compare(m, 2, "%}") != 0) continue;
      std::string text = src_.substr(i_, s - i_);
      strip_before_tag(text, open_sign, true);
      if (!text.empty()) emit(Tok::kText, text, i_);
      finish_tag(m + 2, close_sign, true);
      return true;
    }
    error(p, "missing '{% endraw %}'");
  }

  void lex_tag(char kind, size_t tag_start) {
    std::vector<char> brackets;
    const size_t n = src_.size();
    while (true) {
      i_ = skip_space(i_);
      if (i_ >= n)
        error(tag_start, kind == '{' ? "missing '}}' at the end of this tag" : "missing '%}' at the end of this tag");
      if (brackets.empty()) {
        // End markers count only outside brackets, so `{{ {'a': {'b': 1}} }}` works as in jinja2.
        size_t k = i_;
        char sign = 0;
        if (src_[k] == '-' || (kind == '%' && src_[k] == '+')) sign = src_[k++];
        const char* end = kind == '{' ? "}}" : "%}";
        if (src_.compare(k, 2, end) == 0) {
          emit(kind == '{' ? Tok::kVarEnd : Tok::kBlockEnd, end, i_);
          finish_tag(k + 2, sign, kind == '%');
          return;
        }
      }
      lex_token(brackets);
    }
  }

  void lex_token(std::vector<char>& brackets) {
    const size_t n = src_.size();
    const size_t start = i_;
    char c = src_[i_];
    if (is_name_start(c)) {
      while (i_ < n && is_name_char(src_[i_])) ++i_;
      emit(Tok::kName, src_.substr(start, i_ - start), start);
      return;
    }
    if (is_digit(c)) {
      lex_number();
      return;
    }
    if (c == '\'' || c == '"') {
      std::string raw;
      size_t k = i_ + 1;
      while (k < n && src_[k] != c) {
        if (src_[k] == '\\' && k + 1 < n) raw += src_[k++];
        raw += src_[k++];
      }
      if (k >= n) error(start, "unterminated string literal");
      i_ = k + 1;
      emit(Tok::kString, unescape(raw, start), start);
      return;
    }
    static const char* kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* op : kTwo) {
      if (src_.compare(i_, 2, op) == 0) {
        i_ += 2;
        emit(Tok::kOp, op, start);
        return;
      }
    }
    static const std::string kOne = "+-*/%~[](){}<>=.:|,;";
    if (kOne.find(c) == std::string::npos) {
      size_t k = i_;
      std::string ch;
      unicode::append(ch, unicode::decode(src_, k));
      error(start, "unexpected character '" + ch + "'");
    }
    if (c == '(' || c == '[' || c == '{') {
      brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    } else if (c == ')' || c == ']' || c == '}') {
      if (brackets.empty()) error(start, std::string("unexpected '") + c + "'");
      if (brackets.back() != c) error(start, std::string("unexpected '") + c + "', expected '" + brackets.back() + "'");
      brackets.pop_back();
    }
    ++i_;
    emit(Tok::kOp, std::string(1, c), start);
  }

  void lex_number() {
    const size_t n = src_.size();
    const size_t start = i_;
    std::string digits;
    auto take_digits = [&]() {
      while (i_ < n && (is_digit(src_[i_]) || (src_[i_] == '_' && i_ + 1 < n && is_digit(src_[i_ + 1])))) {
        if (src_[i_] != '_') digits += src_[i_];
        ++i_;
      }
    };
    take_digits();
    // A float may not follow a '.', so `x.0.1` is two subscripts, as in jinja2.
    bool after_dot = start > 0 && src_[start - 1] == '.';
    bool is_float = false;
    if (!after_dot && i_ + 1 < n && src_[i_] == '.' && is_digit(src_[i_ + 1])) {
      digits += src_[i_++];
      take_digits();
      is_float = true;
    }
    if (!after_dot && i_ < n && (src_[i_] == 'e' || src_[i_] == 'E')) {
      size_t k = i_ + 1;
      if (k < n && (src_[k] == '+' || src_[k] == '-')) ++k;
      if (k < n && is_digit(src_[k])) {
        digits += 'e';
        if (src_[i_ + 1] == '-' || src_[i_ + 1] == '+') digits += src_[i_ + 1];
        i_ = k;
        take_digits();
        is_float = true;
      }
    }
    if (is_float) {
      emit(Tok::kFloat, digits, start, Value::real(std::strtod(digits.c_str(), nullptr)));
      return;
    }
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(digits.c_str(), &end, 10);
    if (errno == ERANGE) error(start, "integer literal " + digits + " does not fit in 64 bits");
    emit(Tok::kInt, digits, start, Value::integer(v));
  }

  // Python's unicode-escape decoding, which jinja2 applies to string literals.
  std::string unescape(const std::string& raw, size_t at) const {
    std::string out;
    for (size_t k = 0; k < raw.size(); ++k) {
      if (raw[k] != '\\' || k + 1 >= raw.size()) {
        out += raw[k];
        continue;
      }
      char d = raw[++k];
      auto hex = [&](int count) {
        char32_t cp = 0;
        for (int h = 0; h < count; ++h) {
          int v = k + 1 < raw.size() ? hex_value(raw[k + 1]) : -1;
          if (v < 0) error(at, std::string("truncated \\") + d + " escape in string literal");
          cp = cp * 16 + v;
          ++k;
        }
        if (cp >= 0x110000) error(at, "illegal Unicode character in string literal");
        unicode::append(out, cp);
      };
      switch (d) {
        case '\n':
          break;
        case '\\':
        case '\'':
        case '"':
          out += d;
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          hex(2);
          break;
        case 'u':
          hex(4);
          break;
        case 'U':
          hex(8);
          break;
        case 'N':
          error(at, "unsupported \\N{...} escape in string literal");
        default:
          if (d >= '0' && d <= '7') {
            char32_t cp = d - '0';
            for (int o = 0; o < 2 && k + 1 < raw.size() && raw[k + 1] >= '0' && raw[k + 1] <= '7'; ++o)
              cp = cp * 8 + (raw[++k] - '0');
            unicode::append(out, cp);
          } else {
            out += '\\';
            out += d;
          }
      }
    }
    return out;
  }
};

}  // namespace

std::vector<Token> lex_template(const std::string& source) {
  Lexer lexer(source);
  return lexer.run();
}

std::string describe(const Token& t) {
  switch (t.type) {
    case Tok::kText:
      return "template text";
    case Tok::kVarBegin:
      return "'{{'";
    case Tok::kVarEnd:
      return "'}}'";
    case Tok::kBlockBegin:
      return "'{%'";
    case Tok::kBlockEnd:
      return "'%}'";
    case Tok::kEof:
      return "end of template";
    case Tok::kString:
      return "string literal";
    case Tok::kInt:
    case Tok::kFloat:
      return "number " + t.value;
    default:
      return "'" + t.value + "'";
  }
}

}  // namespace kiln::text::jinja
