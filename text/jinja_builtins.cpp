// Jinja builtins: operators, lookups, str/dict/list methods, filters, tests and globals, each following
// what jinja2 3.1 in transformers' ImmutableSandboxedEnvironment does (Python semantics underneath).
#include "text/jinja_builtins.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <unordered_set>

#include "text/jinja_unicode.h"

namespace kiln::text::jinja {
namespace {

[[noreturn]] void fail_undefined(const Value& v) {
  fail(v.undefined_hint().empty() ? "an undefined value was used" : v.undefined_hint());
}

void check_defined(const Value& v) {
  if (v.is_undefined()) fail_undefined(v);
}

// Binds positional and keyword arguments to named parameters, as a Python signature would.
class Args {
 public:
  Args(const CallArgs& call, std::string what, std::vector<std::string> names, bool varargs = false)
      : what_(std::move(what)), names_(std::move(names)), values_(names_.size()), set_(names_.size(), false) {
    size_t n = call.positional.size();
    if (n > names_.size() && !varargs) {
      fail(what_ + " takes at most " + std::to_string(names_.size()) + " argument(s) (" + std::to_string(n) +
           " given)");
    }
    for (size_t i = 0; i < n; ++i) {
      if (i < names_.size()) {
        values_[i] = call.positional[i];
        set_[i] = true;
      } else {
        extra_.push_back(call.positional[i]);
      }
    }
    for (const auto& [key, value] : call.keyword) {
      auto it = std::find(names_.begin(), names_.end(), key);
      if (it == names_.end()) fail(what_ + " got an unexpected keyword argument '" + key + "'");
      size_t i = it - names_.begin();
      if (set_[i]) fail(what_ + " got multiple values for argument '" + key + "'");
      values_[i] = value;
      set_[i] = true;
    }
  }
  bool has(size_t i) const { return set_[i]; }
  Value get(size_t i, Value fallback = Value()) const { return set_[i] ? values_[i] : fallback; }
  Value required(size_t i) const {
    if (!set_[i]) fail(what_ + " is missing its argument '" + names_[i] + "'");
    return values_[i];
  }
  const ValueList& extra() const { return extra_; }
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::vector<std::string> names_;
  ValueList values_;
  std::vector<bool> set_;
  ValueList extra_;
};

const std::string& str_arg(const Value& v, const std::string& what) {
  if (!v.is_string()) fail(what + " must be a str, not " + type_name(v));
  return v.as_string();
}

int64_t int_arg(const Value& v, const std::string& what) {
  if (!v.is(Kind::kInt) && !v.is(Kind::kBool)) fail(what + " must be an int, not " + type_name(v));
  return v.as_int();
}

bool is_none_or_missing(const Value& v) { return v.is_none() || v.is_undefined(); }

Value generator(std::string label, ValueList items) {
  IteratorData it;
  it.type = IteratorData::Type::kGenerator;
  it.python_type = "generator";
  it.label = std::move(label);
  it.items = std::move(items);
  return Value::iterator(std::move(it));
}

Value dict_view(IteratorData::Type type, const char* python_type, ValueList items) {
  IteratorData it;
  it.type = type;
  it.python_type = python_type;
  it.items = std::move(items);
  return Value::iterator(std::move(it));
}

// ---- str helpers (code points, Python's whitespace) ----

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<char32_t> cps = unicode::code_points(s);
  bool whitespace = is_none_or_missing(chars);
  std::vector<char32_t> set;
  if (!whitespace) set = unicode::code_points(str_arg(chars, "strip argument"));
  auto strip = [&](char32_t c) {
    return whitespace ? unicode::is_space(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip(cps[b])) ++b;
  if (right)
    while (e > b && strip(cps[e - 1])) --e;
  return unicode::encode(cps, b, e);
}

ValueList py_split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  ValueList out;
  if (is_none_or_missing(sep)) {
    std::vector<char32_t> cps = unicode::code_points(s);
    if (!from_right) {
      size_t i = 0;
      while (true) {
        while (i < cps.size() && unicode::is_space(cps[i])) ++i;
        if (i >= cps.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
          out.push_back(Value::string(unicode::encode(cps, i, cps.size())));
          break;
        }
        size_t j = i;
        while (j < cps.size() && !unicode::is_space(cps[j])) ++j;
        out.push_back(Value::string(unicode::encode(cps, i, j)));
        i = j;
      }
    } else {
      size_t e = cps.size();
      while (true) {
        while (e > 0 && unicode::is_space(cps[e - 1])) --e;
        if (e == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
          out.push_back(Value::string(unicode::encode(cps, 0, e)));
          break;
        }
        size_t b = e;
        while (b > 0 && !unicode::is_space(cps[b - 1])) --b;
        out.push_back(Value::string(unicode::encode(cps, b, e)));
        e = b;
      }
      std::reverse(out.begin(), out.end());
    }
    return out;
  }
  const std::string& d = str_arg(sep, "separator");
  if (d.empty()) fail("empty separator");
  if (!from_right) {
    size_t start = 0;
    while (true) {
      size_t p = s.find(d, start);
      if (p == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit)) {
        out.push_back(Value::string(s.substr(start)));
        break;
      }
      out.push_back(Value::string(s.substr(start, p - start)));
      start = p + d.size();
    }
  } else {
    size_t end = s.size();
    while (true) {
      size_t p = end >= d.size() ? s.rfind(d, end - d.size()) : std::string::npos;
      if (p == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit)) {
        out.push_back(Value::string(s.substr(0, end)));
        break;
      }
      out.push_back(Value::string(s.substr(p + d.size(), end - p - d.size())));
      end = p;
    }
    std::reverse(out.begin(), out.end());
  }
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement before every character and at the end.
    std::vector<char32_t> cps = unicode::code_points(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (i < cps.size()) unicode::append(out, cps[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t p = s.find(old, start);
    if (p == std::string::npos) break;
    out.append(s, start, p - start);
    out += repl;
    start = p + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

// Python's slice.indices(): clamps start/stop for a sequence of `length` and the step's direction.
void slice_indices(int64_t length, const Value& start, const Value& stop, const Value& step, int64_t* b, int64_t* e,
                   int64_t* st) {
  auto index = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (is_none_or_missing(v)) return std::nullopt;
    if (!v.is(Kind::kInt) && !v.is(Kind::kBool))
      fail(std::string("slice ") + what + " must be an integer or None, not " + type_name(v));
    return v.as_int();
  };
  auto s = index(step, "step");
  *st = s.value_or(1);
  if (*st == 0) fail("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t x = *v;
    if (x < 0) {
      x += length;
      if (x < 0) x = *st < 0 ? -1 : 0;
    } else if (x >= length) {
      x = *st < 0 ? length - 1 : length;
    }
    return x;
  };
  *b = clamp(index(start, "start"), *st < 0 ? length - 1 : 0);
  *e = clamp(index(stop, "stop"), *st < 0 ? -1 : length);
}

template <typename T>
std::vector<T> slice_vector(const std::vector<T>& items, const Value& start, const Value& stop, const Value& step) {
  int64_t b, e, st;
  slice_indices(static_cast<int64_t>(items.size()), start, stop, step, &b, &e, &st);
  std::vector<T> out;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) out.push_back(items[i]);
  return out;
}

// Python str.find/rfind/count/startswith/endswith take code-point [start, end) bounds.
std::string bounded(const std::string& s, const Args& a, size_t first, int64_t* offset) {
  *offset = 0;
  if (!a.has(first) && !a.has(first + 1)) return s;
  std::vector<char32_t> cps = unicode::code_points(s);
  int64_t b, e, st;
  slice_indices(static_cast<int64_t>(cps.size()), a.get(first), a.get(first + 1), Value(), &b, &e, &st);
  *offset = b;
  return b < e ? unicode::encode(cps, b, e) : std::string();
}

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) || c == 0x85 || c == 0x2028 ||
         c == 0x2029;
}

ValueList py_splitlines(const std::string& s, bool keepends) {
  ValueList out;
  std::vector<char32_t> cps = unicode::code_points(s);
  size_t start = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (!is_line_break(cps[i])) continue;
    size_t end = i;
    if (cps[i] == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    out.push_back(Value::string(unicode::encode(cps, start, keepends ? i + 1 : end)));
    start = i + 1;
  }
  if (start < cps.size()) out.push_back(Value::string(unicode::encode(cps, start, cps.size())));
  return out;
}

std::string pad(const std::string& s, int64_t width, bool left_align, char fill = ' ') {
  int64_t n = static_cast<int64_t>(unicode::length(s));
  if (n >= width) return s;
  std::string padding(width - n, fill);
  return left_align ? s + padding : padding + s;
}

// Python's printf-style `str % args`.
std::string percent_format(const std::string& fmt, const Value& args) {
  ValueList list;
  const Dict* mapping = nullptr;
  if (args.is(Kind::kTuple)) {
    list = args.items();
  } else {
    if (args.is(Kind::kDict)) mapping = &args.as_dict();
    list.push_back(args);
  }
  // Python skips the "not all arguments converted" check when the argument has __getitem__ (a list, dict or
  // jinja2's Undefined) and is not a tuple or str.
  bool mapping_like = args.is(Kind::kList) || args.is(Kind::kDict) || args.is_undefined();
  size_t next = 0;
  bool used_mapping = false;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) fail("incomplete format");
    Value arg;
    bool named = false;
    if (fmt[i] == '(') {
      size_t close = fmt.find(')', i);
      if (close == std::string::npos) fail("incomplete format key");
      if (!mapping) fail("format requires a mapping");
      const Value* found = mapping->find(std::string_view(fmt).substr(i + 1, close - i - 1));
      if (!found) fail("KeyError: '" + fmt.substr(i + 1, close - i - 1) + "'");
      arg = *found;
      named = used_mapping = true;
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string("-+ #0").find(fmt[i]) != std::string::npos) flags += fmt[i++];
    std::string width, precision;
    while (i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i]))) width += fmt[i++];
    bool has_precision = false;
    if (i < fmt.size() && fmt[i] == '.') {
      has_precision = true;
      ++i;
      while (i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i]))) precision += fmt[i++];
    }
    while (i < fmt.size() && (fmt[i] == 'l' || fmt[i] == 'h' || fmt[i] == 'L')) ++i;
    if (i >= fmt.size()) fail("incomplete format");
    char type = fmt[i];
    if (type == '%') {
      out += '%';
      continue;
    }
    if (!named) {
      if (next >= list.size()) fail("not enough arguments for format string");
      arg = list[next++];
    }
    // Found by fuzz_chat_template: a width past int64 threw out of std::stoll. Real templates use
    // a few digits; the formatting buffer holds 512 bytes.
    if (width.size() > 3 || precision.size() > 3)
      fail("unsupported construct: a format width or precision above 999 ('%" + width + "." + precision + "')");
    int64_t w = width.empty() ? 0 : std::stoll(width);
    bool left = flags.find('-') != std::string::npos;
    std::string spec = "%" + flags + width + (has_precision ? "." + (precision.empty() ? "0" : precision) : "");
    char buf[512];
    switch (type) {
      case 's':
      case 'r':
      case 'a': {
        std::string text = type == 's' ? to_str(arg) : repr(arg);
        if (has_precision) {
          std::vector<char32_t> cps = unicode::code_points(text);
          size_t keep = std::min<size_t>(cps.size(), precision.empty() ? 0 : std::stoul(precision));
          text = unicode::encode(cps, 0, keep);
        }
        out += pad(text, w, left);
        break;
      }
      case 'd':
      case 'i':
      case 'u':
      case 'x':
      case 'X':
      case 'o': {
        if (!arg.is_number())
          fail(std::string("%") + type + " format: a real number is required, not " + type_name(arg));
        long long v = arg.is(Kind::kFloat) ? static_cast<long long>(std::trunc(arg.as_float())) : arg.as_int();
        char conv = (type == 'i' || type == 'u') ? 'd' : type;
        std::snprintf(buf, sizeof(buf), (spec + "ll" + conv).c_str(), v);
        out += buf;
        break;
      }
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G':
        if (!arg.is_number()) fail(std::string("must be real number, not ") + type_name(arg));
        std::snprintf(buf, sizeof(buf), (spec + type).c_str(), arg.as_float());
        out += buf;
        break;
      case 'c': {
        std::string ch;
        if (arg.is_string() && unicode::length(arg.as_string()) == 1) {
          ch = arg.as_string();
        } else if (arg.is(Kind::kInt)) {
          unicode::append(ch, static_cast<char32_t>(arg.as_int()));
        } else {
          fail("%c requires int or char");
        }
        out += pad(ch, w, left);
        break;
      }
      default:
        fail(std::string("unsupported format character '") + type + "'");
    }
  }
  if (!used_mapping && !mapping_like && next < list.size())
    fail("not all arguments converted during string formatting");
  return out;
}

// Python's str.format for plain fields: "{}", "{0}", "{name}", with !r / !s; no format specs.
std::string brace_format(const std::string& fmt, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      fail("Single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    size_t close = fmt.find('}', i);
    if (close == std::string::npos) fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    i = close;
    char conversion = 's';
    size_t bang = field.find('!');
    if (field.find(':') != std::string::npos) fail("unsupported construct: format specs in str.format");
    if (bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 's';
      field = field.substr(0, bang);
    }
    Value v;
    if (field.empty()) {
      if (auto_index >= args.positional.size()) fail("Replacement index out of range for positional args tuple");
      v = args.positional[auto_index++];
    } else if (std::all_of(field.begin(), field.end(), [](char d) { return std::isdigit((unsigned char)d); })) {
      size_t k = std::stoul(field);
      if (k >= args.positional.size()) fail("Replacement index out of range for positional args tuple");
      v = args.positional[k];
    } else {
      if (field.find_first_of(".[") != std::string::npos)
        fail("unsupported construct: attribute or index lookups in str.format fields");
      bool found = false;
      for (const auto& [k, val] : args.keyword) {
        if (k == field) {
          v = val;
          found = true;
        }
      }
      if (!found) fail("KeyError: '" + field + "'");
    }
    out += conversion == 'r' ? repr(v) : to_str(v);
  }
  return out;
}

// Python float(str): optional sign, digits with single underscores, inf/nan; surrounding whitespace.
bool parse_python_float(const std::string& text, double* out) {
  std::string s = py_strip(text, Value(), true, true);
  std::string cleaned;
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) cleaned += s[i++];
  std::string rest = unicode::lower(s.substr(i));
  if (rest == "inf" || rest == "infinity" || rest == "nan") {
    *out = std::strtod((cleaned + rest).c_str(), nullptr);
    return true;
  }
  bool digits = false, dot = false, exp = false;
  for (; i < s.size(); ++i) {
    char c = s[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digits = true;
      cleaned += c;
    } else if (c == '_' && i > 0 && std::isdigit((unsigned char)s[i - 1]) && i + 1 < s.size() &&
               std::isdigit((unsigned char)s[i + 1])) {
      continue;
    } else if (c == '.' && !dot && !exp) {
      dot = true;
      cleaned += c;
    } else if ((c == 'e' || c == 'E') && digits && !exp) {
      exp = true;
      cleaned += c;
      if (i + 1 < s.size() && (s[i + 1] == '+' || s[i + 1] == '-')) cleaned += s[++i];
      if (i + 1 >= s.size()) return false;
    } else {
      return false;
    }
  }
  if (!digits) return false;
  *out = std::strtod(cleaned.c_str(), nullptr);
  return true;
}

bool parse_python_int(const std::string& text, int64_t base, int64_t* out) {
  std::string s = py_strip(text, Value(), true, true);
  size_t i = 0;
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  if (i >= s.size()) return false;
  std::string digits;
  for (; i < s.size(); ++i) {
    char c = s[i];
    if (c == '_' && !digits.empty() && i + 1 < s.size() && s[i + 1] != '_') continue;
    int d = std::isdigit((unsigned char)c) ? c - '0' : std::isalpha((unsigned char)c) ? std::tolower(c) - 'a' + 10 : 99;
    if (d >= base) return false;
    digits += c;
  }
  if (digits.empty()) return false;
  errno = 0;
  long long v = std::strtoll(digits.c_str(), nullptr, static_cast<int>(base));
  if (errno == ERANGE) fail("integer '" + text + "' does not fit in 64 bits");
  *out = negative ? -v : v;
  return true;
}

// ---- methods ----

const std::unordered_set<std::string>& str_methods() {
  static const std::unordered_set<std::string> names = {
      "strip",        "lstrip",    "rstrip",     "split",   "rsplit",  "splitlines", "startswith",
      "endswith",     "replace",   "upper",      "lower",   "title",   "capitalize", "casefold",
      "find",         "rfind",     "index",      "rindex",  "count",   "join",       "format",
      "isdigit",      "isalpha",   "isalnum",    "isspace", "isupper", "islower",    "removeprefix",
      "removesuffix", "partition", "rpartition", "zfill",   "center",  "ljust",      "rjust"};
  return names;
}
const std::unordered_set<std::string>& str_unsupported() {
  static const std::unordered_set<std::string> names = {"encode",    "expandtabs",   "format_map", "isascii",
                                                        "isdecimal", "isidentifier", "isnumeric",  "isprintable",
                                                        "istitle",   "maketrans",    "swapcase",   "translate"};
  return names;
}

Value bound_method(const Value& receiver, const std::string& name);

Value unsafe(const std::string& name, const Value& obj) {
  return Value::undefined("access to attribute '" + name + "' of '" + type_name(obj) + "' object is unsafe.");
}

// str methods that search the string or test its characters.
std::optional<Value> str_search_method(const std::string& s, const std::string& name, const CallArgs& call,
                                       const std::string& what) {
  if (name == "startswith" || name == "endswith") {
    Args a(call, what, {"prefix", "start", "end"});
    int64_t offset;
    std::string t = bounded(s, a, 1, &offset);
    Value prefix = a.required(0);
    ValueList options = prefix.is(Kind::kTuple) ? prefix.items() : ValueList{prefix};
    for (const Value& o : options) {
      const std::string& p = str_arg(o, what + " argument");
      bool hit = name == "startswith" ? t.compare(0, p.size(), p) == 0
                                      : t.size() >= p.size() && t.compare(t.size() - p.size(), p.size(), p) == 0;
      if (hit && t.size() >= p.size()) return Value::boolean(true);
    }
    return Value::boolean(false);
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    Args a(call, what, {"sub", "start", "end"});
    const std::string& sub = str_arg(a.required(0), what + " argument");
    int64_t offset;
    std::string t = bounded(s, a, 1, &offset);
    bool reverse = name[0] == 'r';
    size_t p = reverse ? t.rfind(sub) : t.find(sub);
    if (p == std::string::npos) {
      if (name == "index" || name == "rindex") fail("substring not found");
      return Value::integer(-1);
    }
    return Value::integer(offset + static_cast<int64_t>(unicode::code_point_index(t, p)));
  }
  if (name == "count") {
    Args a(call, what, {"sub", "start", "end"});
    const std::string& sub = str_arg(a.required(0), what + " argument");
    int64_t offset;
    std::string t = bounded(s, a, 1, &offset);
    if (sub.empty()) return Value::integer(static_cast<int64_t>(unicode::length(t)) + 1);
    int64_t n = 0;
    for (size_t p = t.find(sub); p != std::string::npos; p = t.find(sub, p + sub.size())) ++n;
    return Value::integer(n);
  }
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace") {
    Args a(call, what, {});
    std::vector<char32_t> cps = unicode::code_points(s);
    bool ok = !cps.empty();
    for (char32_t c : cps) {
      bool digit = unicode::is_digit(c), alpha = unicode::is_alpha(c);
      if (name == "isdigit") ok = ok && digit;
      if (name == "isalpha") ok = ok && alpha;
      if (name == "isalnum") ok = ok && (digit || alpha);
      if (name == "isspace") ok = ok && unicode::is_space(c);
    }
    return Value::boolean(ok);
  }
  if (name == "isupper" || name == "islower") {
    Args a(call, what, {});
    bool cased = false, ok = true;
    for (char32_t c : unicode::code_points(s)) {
      if (unicode::is_upper(c)) cased = true, ok = ok && name == "isupper";
      if (unicode::is_lower(c)) cased = true, ok = ok && name == "islower";
    }
    return Value::boolean(cased && ok);
  }
  return std::nullopt;
}

// str methods that return a changed copy of the string, or its parts.
std::optional<Value> str_edit_method(const std::string& s, const std::string& name, const CallArgs& call,
                                     const std::string& what) {
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    Args a(call, what, {"chars"});
    return Value::string(py_strip(s, a.get(0), name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    Args a(call, what, {"sep", "maxsplit"});
    return Value::list(py_split(s, a.get(0), int_arg(a.get(1, Value::integer(-1)), "maxsplit"), name == "rsplit"));
  }
  if (name == "splitlines") {
    Args a(call, what, {"keepends"});
    return Value::list(py_splitlines(s, truthy(a.get(0))));
  }
  if (name == "replace") {
    Args a(call, what, {"old", "new", "count"});
    return Value::string(py_replace(s, str_arg(a.required(0), what + " old"), str_arg(a.required(1), what + " new"),
                                    int_arg(a.get(2, Value::integer(-1)), "count")));
  }
  if (name == "upper" || name == "lower" || name == "casefold" || name == "title" || name == "capitalize") {
    Args a(call, what, {});
    if (name == "upper") return Value::string(unicode::upper(s));
    if (name == "title") return Value::string(unicode::title(s));
    if (name == "capitalize") return Value::string(unicode::capitalize(s));
    return Value::string(unicode::lower(s));
  }
  if (name == "join") {
    Args a(call, what, {"iterable"});
    std::string out;
    bool first = true;
    for (const Value& item : iterate(a.required(0))) {
      if (!item.is_string()) fail("sequence item: expected str instance, " + type_name(item) + " found");
      if (!first) out += s;
      first = false;
      out += item.as_string();
    }
    return Value::string(out);
  }
  if (name == "format") return Value::string(brace_format(s, call));
  if (name == "removeprefix" || name == "removesuffix") {
    Args a(call, what, {"affix"});
    const std::string& p = str_arg(a.required(0), what + " argument");
    if (name == "removeprefix" && s.compare(0, p.size(), p) == 0) return Value::string(s.substr(p.size()));
    if (name == "removesuffix" && !p.empty() && s.size() >= p.size() &&
        s.compare(s.size() - p.size(), p.size(), p) == 0)
      return Value::string(s.substr(0, s.size() - p.size()));
    return Value::string(s);
  }
  if (name == "partition" || name == "rpartition") {
    Args a(call, what, {"sep"});
    const std::string& sep = str_arg(a.required(0), what + " argument");
    if (sep.empty()) fail("empty separator");
    size_t p = name == "partition" ? s.find(sep) : s.rfind(sep);
    if (p == std::string::npos) {
      return name == "partition" ? Value::tuple({Value::string(s), Value::string(""), Value::string("")})
                                 : Value::tuple({Value::string(""), Value::string(""), Value::string(s)});
    }
    return Value::tuple({Value::string(s.substr(0, p)), Value::string(sep), Value::string(s.substr(p + sep.size()))});
  }
  if (name == "zfill") {
    Args a(call, what, {"width"});
    int64_t width = int_arg(a.required(0), "width");
    int64_t n = static_cast<int64_t>(unicode::length(s));
    if (n >= width) return Value::string(s);
    size_t sign = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
    return Value::string(s.substr(0, sign) + std::string(width - n, '0') + s.substr(sign));
  }
  if (name == "center" || name == "ljust" || name == "rjust") {
    Args a(call, what, {"width", "fillchar"});
    int64_t width = int_arg(a.required(0), "width");
    std::string fill = a.has(1) ? str_arg(a.get(1), "fillchar") : " ";
    int64_t n = static_cast<int64_t>(unicode::length(s));
    if (n >= width) return Value::string(s);
    int64_t margin = width - n;
    int64_t left = name == "ljust" ? 0 : name == "rjust" ? margin : margin / 2 + (margin & width & 1);
    std::string out;
    for (int64_t k = 0; k < left; ++k) out += fill;
    out += s;
    for (int64_t k = left; k < margin; ++k) out += fill;
    return Value::string(out);
  }
  return std::nullopt;
}

Value call_str_method(const std::string& s, const std::string& name, const CallArgs& call) {
  const std::string what = "str." + name + "()";
  if (std::optional<Value> out = str_search_method(s, name, call, what)) return *out;
  if (std::optional<Value> out = str_edit_method(s, name, call, what)) return *out;
  fail("unsupported construct: str method '" + name + "'");
}

Value call_method(const Value& receiver, const std::string& name, const CallArgs& call) {
  if (receiver.is_string()) return call_str_method(receiver.as_string(), name, call);
  const std::string what = type_name(receiver) + "." + name + "()";
  if (receiver.is(Kind::kDict)) {
    const Dict& d = receiver.as_dict();
    if (name == "items" || name == "keys" || name == "values") {
      Args a(call, what, {});
      ValueList out;
      for (const auto& [k, v] : d.items())
        out.push_back(name == "items" ? Value::tuple({k, v}) : name == "keys" ? k : v);
      if (name == "items") return dict_view(IteratorData::Type::kDictItems, "dict_items", std::move(out));
      if (name == "keys") return dict_view(IteratorData::Type::kDictKeys, "dict_keys", std::move(out));
      return dict_view(IteratorData::Type::kDictValues, "dict_values", std::move(out));
    }
    if (name == "get") {
      Args a(call, what, {"key", "default"});
      const Value* found = d.find(a.required(0));
      return found ? *found : a.get(1, Value::none());
    }
    if (name == "copy") return receiver;
  }
  if (receiver.is_sequence()) {
    const ValueList& items = receiver.items();
    if (name == "index") {
      Args a(call, what, {"value"});
      for (size_t i = 0; i < items.size(); ++i)
        if (equals(items[i], a.required(0))) return Value::integer(static_cast<int64_t>(i));
      fail(repr(a.required(0)) + " is not in " + type_name(receiver));
    }
    if (name == "count") {
      Args a(call, what, {"value"});
      int64_t n = 0;
      for (const Value& item : items) n += equals(item, a.required(0)) ? 1 : 0;
      return Value::integer(n);
    }
    if (name == "copy") return receiver;
  }
  fail("unsupported construct: method '" + name + "' of " + type_name(receiver));
}

Value bound_method(const Value& receiver, const std::string& name) {
  return Value::callable("built-in method " + name + " of " + type_name(receiver) + " object",
                         [receiver, name](const CallArgs& call) { return call_method(receiver, name, call); });
}

// The attribute part of jinja2's lookup: methods (and namespace attributes), never dict keys.
std::optional<Value> python_attr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Kind::kString:
      if (str_methods().count(name)) return bound_method(obj, name);
      if (str_unsupported().count(name)) return Value::undefined("unsupported construct: str method '" + name + "'");
      return std::nullopt;
    case Kind::kDict:
      if (name == "items" || name == "keys" || name == "values" || name == "get" || name == "copy")
        return bound_method(obj, name);
      if (name == "pop" || name == "popitem" || name == "setdefault" || name == "update" || name == "clear")
        return unsafe(name, obj);
      return std::nullopt;
    case Kind::kList:
    case Kind::kTuple:
      if (name == "index" || name == "count" || (name == "copy" && obj.is(Kind::kList))) return bound_method(obj, name);
      if (obj.is(Kind::kList) && (name == "append" || name == "extend" || name == "insert" || name == "pop" ||
                                  name == "remove" || name == "reverse" || name == "sort" || name == "clear"))
        return unsafe(name, obj);
      return std::nullopt;
    case Kind::kNamespace: {
      const Value* found = obj.as_namespace().attrs.find(name);
      if (found) return *found;
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

std::string object_name(const Value& obj) { return obj.is_none() ? "'None'" : "'" + type_name(obj) + " object'"; }

// jinja2's make_attrgetter: "a.b.0" looks up each part with getitem semantics.
Value attr_path(const Value& item, const Value& attribute) {
  if (attribute.is(Kind::kInt)) return get_item(item, attribute);
  const std::string& path = str_arg(attribute, "attribute");
  Value v = item;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric =
        !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit((unsigned char)c); });
    int64_t index = 0;
    if (numeric && std::from_chars(part.data(), part.data() + part.size(), index).ec != std::errc()) {
      // Python's int has no bound, but no list here is that long and no key that large: found by
      // fuzz_chat_template (std::stoll threw out_of_range past the renderer).
      v = Value::undefined(object_name(v) + " has no element " + part);
    } else {
      v = get_item(v, numeric ? Value::integer(index) : Value::string(part));
    }
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value sort_key(const Value& item, const Value& attribute, bool case_sensitive) {
  Value v = is_none_or_missing(attribute) ? item : attr_path(item, attribute);
  if (!case_sensitive && v.is_string()) return Value::string(unicode::lower(v.as_string()));
  return v;
}

int64_t length_of(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return 0;
    case Kind::kString:
      return static_cast<int64_t>(unicode::length(v.as_string()));
    case Kind::kList:
    case Kind::kTuple:
      return static_cast<int64_t>(v.items().size());
    case Kind::kDict:
      return static_cast<int64_t>(v.as_dict().size());
    case Kind::kIterator:
      if (!v.as_iterator().one_shot()) return static_cast<int64_t>(v.as_iterator().items.size());
      fail("object of type '" + type_name(v) + "' has no len()");
    default:
      fail("object of type '" + type_name(v) + "' has no len()");
  }
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// The arguments of Markup % args, escaped as Markup.__mod__ does.
Value escape_args(const Value& args) {
  auto escape_one = [](const Value& v) {
    return v.is_string() && !v.is_markup() ? Value::string(html_escape(v.as_string())) : v;
  };
  if (args.is(Kind::kTuple)) {
    ValueList items;
    for (const Value& v : args.items()) items.push_back(escape_one(v));
    return Value::tuple(std::move(items));
  }
  return escape_one(args);
}

Value py_round(const Value& v, int64_t precision, const std::string& method) {
  if (method != "common" && method != "floor" && method != "ceil") fail("method must be common, ceil or floor");
  if (!v.is_number()) fail("type " + type_name(v) + " doesn't define __round__ method");
  if (method == "common") {
    if (!v.is(Kind::kFloat) && precision >= 0) return Value::integer(v.as_int());
    double x = v.as_float();
    if (std::isnan(x) || std::isinf(x)) return v;
    double r;
    if (precision >= 0) {
      // printf rounds the exact binary value half-to-even, as Python's round(x, n) does.
      if (precision > 300) return v;
      std::vector<char> buf(400 + static_cast<size_t>(precision));
      std::snprintf(buf.data(), buf.size(), "%.*f", static_cast<int>(precision), x);
      r = std::strtod(buf.data(), nullptr);
    } else {
      double p = std::pow(10.0, static_cast<double>(-precision));
      r = std::nearbyint(x / p) * p;
    }
    if (!v.is(Kind::kFloat)) return Value::integer(static_cast<int64_t>(r));
    return Value::real(r);
  }
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = v.as_float() * scale;
  return Value::real((method == "floor" ? std::floor(x) : std::ceil(x)) / scale);
}

// jinja2's title filter: words start after '-', whitespace or an opening bracket.
std::string jinja_title(const std::string& s) {
  std::string out;
  bool at_start = true;
  for (size_t i = 0; i < s.size();) {
    size_t start = i;
    char32_t c = unicode::decode(s, i);
    bool delimiter = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || unicode::is_space(c);
    std::string one = s.substr(start, i - start);
    if (delimiter) {
      out += one;
      at_start = true;
    } else {
      out += at_start ? unicode::upper(one) : unicode::lower(one);
      at_start = false;
    }
  }
  return out;
}

std::string jinja_indent(const Value& value, const Value& width, bool first, bool blank) {
  // jinja2 appends "\n" to the value with +=, which only a str survives.
  if (!value.is_string()) {
    check_defined(value);
    fail("unsupported operand type(s) for +=: '" + type_name(value) + "' and 'str'");
  }
  const std::string& text = value.as_string();
  std::string indention = width.is_string() ? width.as_string() : std::string(int_arg(width, "width"), ' ');
  ValueList lines = py_splitlines(text + "\n", false);
  std::string out;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" + indention : "") + lines[i].as_string();
  } else {
    out = lines.empty() ? "" : lines[0].as_string();
    for (size_t i = 1; i < lines.size(); ++i) {
      const std::string& line = lines[i].as_string();
      out += "\n" + (line.empty() ? line : indention + line);
    }
  }
  return first ? indention + out : out;
}

// Shared by select/reject/selectattr/rejectattr: keeps items whose test result equals `keep`.
Value select_items(const Value& v, const CallArgs& call, bool with_attribute, bool keep, const std::string& what) {
  size_t first = with_attribute ? 1 : 0;
  if (with_attribute && call.positional.empty()) fail(what + " needs an attribute name");
  Value attribute = with_attribute ? call.positional[0] : Value();
  bool has_test = call.positional.size() > first;
  std::string test = has_test ? str_arg(call.positional[first], what + " test name") : "";
  if (has_test && !is_test(test)) fail("unsupported test '" + test + "'");
  ValueList test_args(call.positional.begin() + std::min(call.positional.size(), first + 1), call.positional.end());
  CallArgs test_call{test_args, call.keyword};
  ValueList out;
  if (truthy(v)) {  // jinja2 yields nothing for a false value (none, "", []) instead of failing
    for (const Value& item : iterate(v)) {
      Value subject = with_attribute ? attr_path(item, attribute) : item;
      bool result = has_test ? apply_test(test, subject, test_call) : truthy(subject);
      if (result == keep) out.push_back(item);
    }
  }
  return generator("select_or_reject", std::move(out));
}

const std::unordered_set<std::string>& filter_names() {
  static const std::unordered_set<std::string> names = {
      "abs",        "attr",    "batch",   "capitalize", "center",      "count",  "d",          "default", "dictsort",
      "e",          "escape",  "first",   "float",      "forceescape", "format", "indent",     "int",     "items",
      "join",       "last",    "length",  "list",       "lower",       "map",    "max",        "min",     "reject",
      "rejectattr", "replace", "reverse", "round",      "safe",        "select", "selectattr", "sort",    "string",
      "sum",        "title",   "tojson",  "trim",       "unique",      "upper",  "wordcount"};
  return names;
}

const std::unordered_set<std::string>& test_names() {
  static const std::unordered_set<std::string> names = {
      "boolean",  "callable", "defined",  "divisibleby", "eq",          "equalto", "escaped", "even",
      "false",    "filter",   "float",    "ge",          "greaterthan", "gt",      "in",      "integer",
      "iterable", "le",       "lessthan", "lower",       "lt",          "mapping", "ne",      "none",
      "number",   "odd",      "sameas",   "sequence",    "string",      "test",    "true",    "undefined",
      "upper",    "==",       "!=",       "<",           "<=",          ">",       ">="};
  return names;
}

}  // namespace

// ---- operators ----

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value::string(to_str(a) + to_str(b));
  check_defined(a);
  if (op == "%" && a.is_markup()) return Value::markup(percent_format(a.as_string(), escape_args(b)));
  if (op == "%" && a.is_string()) return Value::string(percent_format(a.as_string(), b));
  check_defined(b);
  auto unsupported = [&]() {
    if (op == "+" && a.is_string()) fail("can only concatenate str (not \"" + type_name(b) + "\") to str");
    fail("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  if (op == "+" && a.is_string() && b.is_string() && (a.is_markup() || b.is_markup())) {
    // Markup + str escapes the str (transformers renders without autoescape, but |safe still makes Markup).
    return Value::markup((a.is_markup() ? a.as_string() : html_escape(a.as_string())) +
                         (b.is_markup() ? b.as_string() : html_escape(b.as_string())));
  }
  if (a.is_number() && b.is_number()) {
    bool floats = a.is(Kind::kFloat) || b.is(Kind::kFloat);
    if (op == "/") {
      if (b.as_float() == 0) fail("division by zero");
      return Value::real(a.as_float() / b.as_float());
    }
    if (op == "**") {
      if (!floats && b.as_int() >= 0) {
        int64_t result = 1, base = a.as_int();
        for (int64_t k = 0; k < b.as_int(); ++k) {
          if (__builtin_mul_overflow(result, base, &result)) fail("integer overflow in '**' (kiln uses 64 bits)");
          if (result == 0 || result == 1) break;
        }
        return Value::integer(result);
      }
      if (a.as_float() == 0 && b.as_float() < 0) fail("0.0 cannot be raised to a negative power");
      if (a.as_float() < 0 && b.as_float() != std::floor(b.as_float()))
        fail("unsupported construct: '**' with a complex result");
      return Value::real(std::pow(a.as_float(), b.as_float()));
    }
    if (floats) {
      double x = a.as_float(), y = b.as_float();
      if (op == "+") return Value::real(x + y);
      if (op == "-") return Value::real(x - y);
      if (op == "*") return Value::real(x * y);
      if (y == 0) fail(op == "//" ? "float floor division by zero" : "float modulo");
      // Python's float divmod: the remainder takes the divisor's sign and the quotient is rounded from
      // (x - remainder) / y, so 1 // 0.1 is 9.0, not floor(1 / 0.1) = 10.0.
      double m = std::fmod(x, y);
      double div = (x - m) / y;
      if (m != 0) {
        if ((y < 0) != (m < 0)) {
          m += y;
          div -= 1.0;
        }
      } else {
        m = std::copysign(0.0, y);
      }
      if (op == "%") return Value::real(m);
      if (div == 0) return Value::real(std::copysign(0.0, x / y));
      double floordiv = std::floor(div);
      if (div - floordiv > 0.5) floordiv += 1.0;
      return Value::real(floordiv);
    }
    int64_t x = a.as_int(), y = b.as_int(), r = 0;
    bool overflow = false;
    if (op == "+")
      overflow = __builtin_add_overflow(x, y, &r);
    else if (op == "-")
      overflow = __builtin_sub_overflow(x, y, &r);
    else if (op == "*")
      overflow = __builtin_mul_overflow(x, y, &r);
    else {
      if (y == 0) fail(op == "//" ? "integer division by zero" : "integer modulo by zero");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        --q;
        m += y;
      }
      r = op == "//" ? q : m;
    }
    if (overflow) fail("integer overflow in '" + op + "' (kiln uses 64 bits)");
    return Value::integer(r);
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) return Value::string(a.as_string() + b.as_string());
    if (a.kind() == b.kind() && a.is_sequence()) {
      ValueList out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return a.is(Kind::kList) ? Value::list(std::move(out)) : Value::tuple(std::move(out));
    }
  }
  if (op == "*") {
    const Value& seq = a.is(Kind::kInt) || a.is(Kind::kBool) ? b : a;
    const Value& count = &seq == &a ? b : a;
    if ((count.is(Kind::kInt) || count.is(Kind::kBool)) && (seq.is_string() || seq.is_sequence())) {
      int64_t n = std::max<int64_t>(0, count.as_int());
      if (seq.is_string()) {
        std::string out;
        for (int64_t k = 0; k < n; ++k) out += seq.as_string();
        return seq.is_markup() ? Value::markup(out) : Value::string(out);
      }
      ValueList out;
      for (int64_t k = 0; k < n; ++k) out.insert(out.end(), seq.items().begin(), seq.items().end());
      return seq.is(Kind::kList) ? Value::list(std::move(out)) : Value::tuple(std::move(out));
    }
  }
  unsupported();
  return Value();
}

Value negate(const Value& v) {
  check_defined(v);
  if (v.is(Kind::kFloat)) return Value::real(-v.as_float());
  if (v.is(Kind::kInt) || v.is(Kind::kBool)) {
    if (v.as_int() == INT64_MIN) fail("integer overflow in unary '-'");
    return Value::integer(-v.as_int());
  }
  fail("bad operand type for unary -: '" + type_name(v) + "'");
}

Value unary_plus(const Value& v) {
  check_defined(v);
  if (v.is(Kind::kFloat)) return v;
  if (v.is(Kind::kInt) || v.is(Kind::kBool)) return Value::integer(v.as_int());
  fail("bad operand type for unary +: '" + type_name(v) + "'");
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kUndefined:
      return false;  // jinja2's Undefined iterates as empty
    case Kind::kString:
      if (!item.is_string()) fail("'in <string>' requires string as left operand, not " + type_name(item));
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Kind::kList:
    case Kind::kTuple:
      for (const Value& v : container.items())
        if (equals(v, item)) return true;
      return false;
    case Kind::kDict:
      if (item.is(Kind::kList) || item.is(Kind::kDict) || item.is(Kind::kNamespace))
        fail("unhashable type: '" + type_name(item) + "'");
      return container.as_dict().find(item) != nullptr;
    case Kind::kIterator:
      for (const Value& v : iterate(container))
        if (equals(v, item)) return true;
      return false;
    default:
      fail("argument of type '" + type_name(container) + "' is not iterable");
  }
}

// ---- lookups ----

Value get_attr(const Value& obj, const std::string& name) {
  check_defined(obj);
  if (std::optional<Value> attr = python_attr(obj, name)) return *attr;
  if (obj.is(Kind::kDict)) {
    if (const Value* found = obj.as_dict().find(name)) return *found;
  }
  if (obj.is(Kind::kNamespace) && obj.as_namespace().is_loop && name == "changed")
    return Value::undefined("unsupported construct: loop.changed");
  return Value::undefined(object_name(obj) + " has no attribute '" + name + "'");
}

Value get_item(const Value& obj, const Value& key) {
  check_defined(obj);
  switch (obj.kind()) {
    case Kind::kDict:
      if (const Value* found = obj.as_dict().find(key)) return *found;
      break;
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kString:
    case Kind::kIterator:
      if ((key.is(Kind::kInt) || key.is(Kind::kBool)) &&
          (!obj.is(Kind::kIterator) || obj.as_iterator().type == IteratorData::Type::kRange)) {
        int64_t i = key.as_int();
        const ValueList& items = obj.is(Kind::kIterator) ? obj.as_iterator().items : ValueList();
        if (obj.is(Kind::kIterator)) {
          int64_t n = static_cast<int64_t>(items.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return items[i];
        } else if (obj.is_string()) {
          std::vector<char32_t> cps = unicode::code_points(obj.as_string());
          int64_t n = static_cast<int64_t>(cps.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return Value::string(unicode::encode(cps, i, i + 1));
        } else {
          int64_t n = static_cast<int64_t>(obj.items().size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return obj.items()[i];
        }
        return Value::undefined(object_name(obj) + " has no element " + std::to_string(key.as_int()));
      }
      break;
    default:
      break;
  }
  if (key.is_string()) {
    if (std::optional<Value> attr = python_attr(obj, key.as_string())) return *attr;
    return Value::undefined(object_name(obj) + " has no attribute '" + key.as_string() + "'");
  }
  return Value::undefined(object_name(obj) + " has no element " + repr(key));
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  check_defined(obj);
  if (obj.is_string()) {
    return Value::string(unicode::encode(slice_vector(unicode::code_points(obj.as_string()), start, stop, step)));
  }
  if (obj.is(Kind::kIterator) && obj.as_iterator().type == IteratorData::Type::kRange) {
    return Value::list(slice_vector(obj.as_iterator().items, start, stop, step));
  }
  if (obj.is_sequence()) {
    ValueList out = slice_vector(obj.items(), start, stop, step);
    return obj.is(Kind::kList) ? Value::list(std::move(out)) : Value::tuple(std::move(out));
  }
  // jinja2 compiles slices to plain Python subscripts (not its forgiving getitem), so this is a TypeError.
  if (obj.is(Kind::kDict)) fail("unhashable type: 'slice'");
  fail("'" + type_name(obj) + "' object is not subscriptable");
}

ValueList iterate(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return {};
    case Kind::kList:
    case Kind::kTuple:
      return v.items();
    case Kind::kDict: {
      ValueList keys;
      for (const auto& item : v.as_dict().items()) keys.push_back(item.first);
      return keys;
    }
    case Kind::kIterator: {
      IteratorData& it = v.as_iterator();
      if (!it.one_shot()) return it.items;
      if (it.consumed) return {};
      it.consumed = true;
      return it.items;
    }
    case Kind::kString: {
      ValueList chars;
      const std::string& s = v.as_string();
      for (size_t i = 0; i < s.size();) {
        size_t start = i;
        unicode::decode(s, i);
        chars.push_back(Value::string(s.substr(start, i - start)));
      }
      return chars;
    }
    default:
      fail("'" + type_name(v) + "' object is not iterable");
  }
}

Value call_value(const Value& fn, const CallArgs& args) {
  if (fn.is(Kind::kCallable)) return fn.as_callable().fn(args);
  check_defined(fn);
  fail("'" + type_name(fn) + "' object is not callable");
}

// ---- filters ----

bool is_filter(const std::string& name) { return filter_names().count(name) > 0; }
bool is_test(const std::string& name) { return test_names().count(name) > 0; }

namespace {

// Filters on text: escaping, JSON, case, trimming, replacing, joining, formatting, layout.
std::optional<Value> text_filter(const std::string& name, const Value& v, const CallArgs& call,
                                 const std::string& what) {
  if (name == "safe") {
    Args a(call, what, {});
    return v.is_markup() ? v : Value::markup(to_str(v));
  }
  if (name == "tojson") {
    Args a(call, what, {"ensure_ascii", "indent", "separators", "sort_keys"});
    JsonOptions o;
    o.ensure_ascii = truthy(a.get(0));
    Value indent = a.get(1, Value::none());
    if (indent.is_string()) {
      o.indent = indent.as_string();
    } else if (!indent.is_none()) {
      o.indent = std::string(std::max<int64_t>(0, int_arg(indent, "indent")), ' ');
    }
    Value separators = a.get(2, Value::none());
    if (!separators.is_none()) {
      if (!separators.is_sequence() || separators.items().size() != 2) fail("separators must be a pair of strings");
      o.separators = std::make_pair(str_arg(separators.items()[0], "item separator"),
                                    str_arg(separators.items()[1], "key separator"));
    }
    o.sort_keys = truthy(a.get(3));
    return Value::string(to_json(v, o));
  }
  if (name == "trim") {
    Args a(call, what, {"chars"});
    std::string out = py_strip(to_str(v), a.get(0), true, true);
    return v.is_markup() ? Value::markup(out) : Value::string(out);
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
    Args a(call, what, {});
    std::string s = to_str(v);
    auto keep = [&](std::string out) { return v.is_markup() ? Value::markup(out) : Value::string(out); };
    if (name == "upper") return keep(unicode::upper(s));
    if (name == "lower") return keep(unicode::lower(s));
    if (name == "capitalize") return keep(unicode::capitalize(s));
    return Value::string(jinja_title(s));
  }
  if (name == "string") {
    Args a(call, what, {});
    return v.is_markup() ? v : Value::string(to_str(v));
  }
  if (name == "replace") {
    Args a(call, what, {"old", "new", "count"});
    Value count = a.get(2, Value::none());
    return Value::string(py_replace(to_str(v), to_str(a.required(0)), to_str(a.required(1)),
                                    count.is_none() ? -1 : int_arg(count, "count")));
  }
  if (name == "join") {
    Args a(call, what, {"d", "attribute"});
    std::string sep = to_str(a.get(0, Value::string("")));
    std::string out;
    bool first = true;
    for (const Value& item : iterate(v)) {
      if (!first) out += sep;
      first = false;
      out += to_str(a.has(1) && !a.get(1).is_none() ? attr_path(item, a.get(1)) : item);
    }
    return Value::string(out);
  }
  if (name == "indent") {
    Args a(call, what, {"width", "first", "blank"});
    return Value::string(jinja_indent(v, a.get(0, Value::integer(4)), truthy(a.get(1)), truthy(a.get(2))));
  }
  if (name == "center") {
    Args a(call, what, {"width"});
    CallArgs inner{{a.get(0, Value::integer(80))}, {}};
    return call_str_method(to_str(v), "center", inner);
  }
  if (name == "escape" || name == "e" || name == "forceescape") {
    Args a(call, what, {});
    if (v.is_markup() && name != "forceescape") return v;
    return Value::markup(html_escape(to_str(v)));
  }
  if (name == "format") {
    if (!call.positional.empty() && !call.keyword.empty())
      fail("can't handle positional and keyword arguments at the same time");
    if (!call.keyword.empty()) {
      Dict d;
      for (const auto& [k, val] : call.keyword) d.set(k, val);
      return Value::string(percent_format(to_str(v), Value::dict(std::move(d))));
    }
    return Value::string(percent_format(to_str(v), Value::tuple(call.positional)));
  }
  if (name == "wordcount") {
    Args a(call, what, {});
    int64_t words = 0;
    bool in_word = false;
    for (char32_t c : unicode::code_points(to_str(v))) {
      bool word = unicode::is_alpha(c) || unicode::is_digit(c) || c == '_' ||
                  (c >= 0x80 && !unicode::is_space(c) && unicode::is_printable(c));
      if (word && !in_word) ++words;
      in_word = word;
    }
    return Value::integer(words);
  }
  return std::nullopt;
}

// Filters that walk a sequence: its ends, its reverse, a dict's items, mapping, selecting, batching.
std::optional<Value> sequence_filter(const std::string& name, const Value& v, const CallArgs& call,
                                     const std::string& what) {
  if (name == "first") {
    Args a(call, what, {});
    ValueList items = iterate(v);
    return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
  }
  if (name == "last") {
    Args a(call, what, {});
    if (v.is(Kind::kIterator) && v.as_iterator().one_shot()) fail("'" + type_name(v) + "' object is not reversible");
    ValueList items = iterate(v);
    return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
  }
  if (name == "list") {
    Args a(call, what, {});
    return Value::list(iterate(v));
  }
  if (name == "reverse") {
    // jinja2 returns reversed(value): an iterator, except for strings, and a list for what cannot be reversed.
    Args a(call, what, {});
    if (v.is_string()) return slice(v, Value(), Value(), Value::integer(-1));
    if (v.is_none() || v.is_number() || v.is(Kind::kNamespace) || v.is(Kind::kCallable))
      fail("argument must be iterable");
    bool to_list = v.is(Kind::kIterator) && v.as_iterator().one_shot();
    ValueList items = iterate(v);
    std::reverse(items.begin(), items.end());
    if (to_list) return Value::list(std::move(items));
    IteratorData it;
    it.type = IteratorData::Type::kReverse;
    it.python_type = v.is(Kind::kList)   ? "list_reverseiterator"
                     : v.is(Kind::kDict) ? "dict_reversekeyiterator"
                     : v.is(Kind::kIterator) && v.as_iterator().type == IteratorData::Type::kRange ? "range_iterator"
                     : v.is(Kind::kIterator) ? "dict_reverseitemiterator"
                                             : "reversed";
    it.items = std::move(items);
    return Value::iterator(std::move(it));
  }
  if (name == "items") {
    Args a(call, what, {});
    if (v.is_undefined()) return generator("do_items", {});
    if (!v.is(Kind::kDict)) fail("Can only get item pairs from a mapping.");
    ValueList out;
    for (const auto& [k, val] : v.as_dict().items()) out.push_back(Value::tuple({k, val}));
    return generator("do_items", std::move(out));
  }
  if (name == "map") {
    bool by_attribute = call.positional.empty();
    ValueList out;
    if (!truthy(v)) {  // as select: a false value maps to nothing
      if (by_attribute) Args(call, what, {"attribute", "default"});
    } else if (by_attribute) {
      Args a(call, what, {"attribute", "default"});
      Value attribute = a.required(0);
      for (const Value& item : iterate(v)) {
        Value x = attr_path(item, attribute);
        out.push_back(x.is_undefined() && a.has(1) ? a.get(1) : x);
      }
    } else {
      std::string filter = str_arg(call.positional[0], "map filter name");
      if (!is_filter(filter)) fail("unsupported filter '" + filter + "'");
      CallArgs inner{ValueList(call.positional.begin() + 1, call.positional.end()), call.keyword};
      for (const Value& item : iterate(v)) out.push_back(apply_filter(filter, item, inner));
    }
    return generator("sync_do_map", std::move(out));
  }
  if (name == "select" || name == "reject") return select_items(v, call, false, name == "select", what);
  if (name == "selectattr" || name == "rejectattr") return select_items(v, call, true, name == "selectattr", what);
  if (name == "batch") {
    Args a(call, what, {"linecount", "fill_with"});
    int64_t n = int_arg(a.required(0), "linecount");
    if (n <= 0) fail("batch size must be positive");
    ValueList out, current;
    for (const Value& item : iterate(v)) {
      current.push_back(item);
      if (static_cast<int64_t>(current.size()) == n) {
        out.push_back(Value::list(std::move(current)));
        current.clear();
      }
    }
    if (!current.empty()) {
      if (a.has(1) && !a.get(1).is_none())
        while (static_cast<int64_t>(current.size()) < n) current.push_back(a.get(1));
      out.push_back(Value::list(std::move(current)));
    }
    return generator("do_batch", std::move(out));
  }
  return std::nullopt;
}

// Filters that order or compare the items of a sequence: sorting, dedup, min/max, sum.
std::optional<Value> ordering_filter(const std::string& name, const Value& v, const CallArgs& call,
                                     const std::string& what) {
  if (name == "dictsort") {
    Args a(call, what, {"case_sensitive", "by", "reverse"});
    if (!v.is(Kind::kDict)) fail("dictsort needs a mapping, not " + type_name(v));
    bool case_sensitive = truthy(a.get(0));
    std::string by = a.has(1) ? str_arg(a.get(1), "by") : "key";
    if (by != "key" && by != "value") fail("You can only sort by either 'key' or 'value'");
    bool reverse = truthy(a.get(2));
    std::vector<Dict::Item> items = v.as_dict().items();
    std::stable_sort(items.begin(), items.end(), [&](const Dict::Item& x, const Dict::Item& y) {
      const Value& p = by == "key" ? x.first : x.second;
      const Value& q = by == "key" ? y.first : y.second;
      int c = compare(sort_key(p, Value(), case_sensitive), sort_key(q, Value(), case_sensitive), "<");
      return reverse ? c > 0 : c < 0;
    });
    ValueList out;
    for (auto& item : items) out.push_back(Value::tuple({item.first, item.second}));
    return Value::list(std::move(out));
  }
  if (name == "sort") {
    Args a(call, what, {"reverse", "case_sensitive", "attribute"});
    bool reverse = truthy(a.get(0)), case_sensitive = truthy(a.get(1));
    ValueList items = iterate(v);
    std::vector<std::pair<Value, Value>> keyed;
    for (const Value& item : items) keyed.emplace_back(sort_key(item, a.get(2), case_sensitive), item);
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
      int c = compare(x.first, y.first, "<");
      return reverse ? c > 0 : c < 0;
    });
    ValueList out;
    for (auto& k : keyed) out.push_back(k.second);
    return Value::list(std::move(out));
  }
  if (name == "unique") {
    Args a(call, what, {"case_sensitive", "attribute"});
    ValueList seen, out;
    for (const Value& item : iterate(v)) {
      Value key = sort_key(item, a.get(1), truthy(a.get(0)));
      if (key.is(Kind::kList) || key.is(Kind::kDict) || key.is(Kind::kNamespace))
        fail("unhashable type: '" + type_name(key) + "'");  // jinja2 keeps the seen keys in a set
      bool dup = std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); });
      if (!dup) {
        seen.push_back(key);
        out.push_back(item);
      }
    }
    return generator("sync_do_unique", std::move(out));
  }
  if (name == "min" || name == "max") {
    Args a(call, what, {"case_sensitive", "attribute"});
    ValueList items = iterate(v);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    size_t best = 0;
    for (size_t i = 1; i < items.size(); ++i) {
      int c = compare(sort_key(items[i], a.get(1), truthy(a.get(0))), sort_key(items[best], a.get(1), truthy(a.get(0))),
                      "<");
      if (name == "min" ? c < 0 : c > 0) best = i;
    }
    return items[best];
  }
  if (name == "sum") {
    Args a(call, what, {"attribute", "start"});
    Value total = a.get(1, Value::integer(0));
    for (const Value& item : iterate(v))
      total = binary_op("+", total, a.has(0) && !a.get(0).is_none() ? attr_path(item, a.get(0)) : item);
    return total;
  }
  return std::nullopt;
}

// Filters on one value: a default, a length, numbers, an attribute.
std::optional<Value> value_filter(const std::string& name, const Value& v, const CallArgs& call,
                                  const std::string& what) {
  if (name == "default" || name == "d") {
    Args a(call, what, {"default_value", "boolean"});
    bool use_default = v.is_undefined() || (truthy(a.get(1)) && !truthy(v));
    return use_default ? a.get(0, Value::string("")) : v;
  }
  if (name == "length" || name == "count") {
    Args a(call, what, {});
    return Value::integer(length_of(v));
  }
  if (name == "int") {
    Args a(call, what, {"default", "base"});
    Value fallback = a.get(0, Value::integer(0));
    int64_t base = int_arg(a.get(1, Value::integer(10)), "base");
    if (v.is_string()) {
      int64_t i;
      double d;
      if (parse_python_int(v.as_string(), base, &i)) return Value::integer(i);
      if (parse_python_float(v.as_string(), &d) && std::isfinite(d)) return Value::integer(static_cast<int64_t>(d));
      return fallback;
    }
    check_defined(v);
    if (v.is(Kind::kFloat)) {
      if (std::isnan(v.as_float())) return fallback;
      if (std::isinf(v.as_float()) || std::fabs(v.as_float()) >= 9.2e18)
        fail("cannot convert float to a 64-bit integer");
      return Value::integer(static_cast<int64_t>(v.as_float()));
    }
    if (v.is_number()) return Value::integer(v.as_int());
    return fallback;
  }
  if (name == "float") {
    Args a(call, what, {"default"});
    Value fallback = a.get(0, Value::real(0.0));
    if (v.is_string()) {
      double d;
      return parse_python_float(v.as_string(), &d) ? Value::real(d) : fallback;
    }
    check_defined(v);
    return v.is_number() ? Value::real(v.as_float()) : fallback;
  }
  if (name == "abs") {
    Args a(call, what, {});
    if (v.is(Kind::kFloat)) return Value::real(std::fabs(v.as_float()));
    if (v.is(Kind::kInt) || v.is(Kind::kBool)) return Value::integer(v.as_int() < 0 ? -v.as_int() : v.as_int());
    check_defined(v);
    fail("bad operand type for abs(): '" + type_name(v) + "'");
  }
  if (name == "round") {
    Args a(call, what, {"precision", "method"});
    return py_round(v, int_arg(a.get(0, Value::integer(0)), "precision"),
                    a.has(1) ? str_arg(a.get(1), "method") : "common");
  }
  if (name == "attr") {
    Args a(call, what, {"name"});
    check_defined(v);
    const std::string& attr = str_arg(a.required(0), "attribute name");
    std::optional<Value> found = python_attr(v, attr);
    return found ? *found : Value::undefined(object_name(v) + " has no attribute '" + attr + "'");
  }
  return std::nullopt;
}

}  // namespace

Value apply_filter(const std::string& name, const Value& v, const CallArgs& call) {
  const std::string what = "filter '" + name + "'";
  if (std::optional<Value> out = text_filter(name, v, call, what)) return *out;
  if (std::optional<Value> out = sequence_filter(name, v, call, what)) return *out;
  if (std::optional<Value> out = ordering_filter(name, v, call, what)) return *out;
  if (std::optional<Value> out = value_filter(name, v, call, what)) return *out;
  fail("unsupported filter '" + name + "'");
}

// ---- tests ----

bool apply_test(const std::string& name, const Value& v, const CallArgs& call) {
  const std::string what = "test '" + name + "'";
  auto one_arg = [&]() {
    Args a(call, what, {"other"});
    return a.required(0);
  };
  auto no_args = [&]() { Args a(call, what, {}); };
  if (name == "defined" || name == "undefined") {
    no_args();
    return v.is_undefined() == (name == "undefined");
  }
  if (name == "none") return no_args(), v.is_none();
  if (name == "boolean") return no_args(), v.is(Kind::kBool);
  if (name == "true") return no_args(), v.is(Kind::kBool) && v.as_bool();
  if (name == "false") return no_args(), v.is(Kind::kBool) && !v.as_bool();
  if (name == "integer") return no_args(), v.is(Kind::kInt);
  if (name == "float") return no_args(), v.is(Kind::kFloat);
  if (name == "number") return no_args(), v.is_number();
  if (name == "string") return no_args(), v.is_string();
  if (name == "mapping") return no_args(), v.is(Kind::kDict);
  if (name == "callable") return no_args(), v.is(Kind::kCallable);
  if (name == "escaped") return no_args(), false;
  // Undefined counts as iterable and as a sequence in jinja2 (it defines __iter__, __len__, __getitem__).
  if (name == "iterable" || name == "sequence") {
    no_args();
    if (v.is(Kind::kIterator)) return name == "iterable" || v.as_iterator().type == IteratorData::Type::kRange;
    return v.is_undefined() || v.is_string() || v.is_sequence() || v.is(Kind::kDict);
  }
  if (name == "odd" || name == "even") {
    no_args();
    return equals(binary_op("%", v, Value::integer(2)), Value::integer(name == "odd" ? 1 : 0));
  }
  if (name == "divisibleby") return !truthy(binary_op("%", v, one_arg()));
  if (name == "lower" || name == "upper") {
    no_args();
    CallArgs none;
    return truthy(call_str_method(to_str(v), name == "lower" ? "islower" : "isupper", none));
  }
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, one_arg());
  if (name == "ne" || name == "!=") return !equals(v, one_arg());
  if (name == "lt" || name == "lessthan" || name == "<") return compare(v, one_arg(), "<") < 0;
  if (name == "le" || name == "<=") return compare(v, one_arg(), "<=") <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, one_arg(), ">") > 0;
  if (name == "ge" || name == ">=") return compare(v, one_arg(), ">=") >= 0;
  if (name == "in") return contains(one_arg(), v);
  if (name == "sameas") {
    Value other = one_arg();
    if (v.kind() != other.kind()) return false;
    if (v.is_none() || v.is_undefined()) return true;
    if (v.is(Kind::kBool) || v.is(Kind::kInt)) return v.as_int() == other.as_int();
    if (v.is(Kind::kFloat)) return false;
    return v.identity() == other.identity();
  }
  if (name == "filter") return is_filter(to_str(one_arg()));
  if (name == "test") return is_test(to_str(one_arg()));
  fail("unsupported test '" + name + "'");
}

// ---- globals ----

Value global_function(const std::string& name) {
  if (name == "range") {
    return Value::callable("range", [](const CallArgs& call) {
      Args a(call, "range()", {"start", "stop", "step"});
      int64_t start = 0, stop, step = int_arg(a.get(2, Value::integer(1)), "range step");
      if (a.has(1)) {
        start = int_arg(a.required(0), "range start");
        stop = int_arg(a.get(1), "range stop");
      } else {
        stop = int_arg(a.required(0), "range stop");
      }
      if (step == 0) fail("range() arg 3 must not be zero");
      int64_t count = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                               : (start > stop ? (start - stop - step - 1) / -step : 0);
      if (count > 100000) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
      IteratorData it;
      it.type = IteratorData::Type::kRange;
      it.python_type = "range";
      it.label = "range(" + std::to_string(start) + ", " + std::to_string(stop) +
                 (step != 1 ? ", " + std::to_string(step) : "") + ")";
      for (int64_t k = 0; k < count; ++k) it.items.push_back(Value::integer(start + k * step));
      return Value::iterator(std::move(it));
    });
  }
  if (name == "namespace" || name == "dict") {
    bool is_namespace = name == "namespace";
    return Value::callable(name, [is_namespace](const CallArgs& call) {
      Dict attrs;
      if (call.positional.size() > 1) fail("expected at most 1 positional argument");
      if (!call.positional.empty()) {
        const Value& init = call.positional[0];
        if (init.is(Kind::kDict)) {
          for (const auto& [k, v] : init.as_dict().items()) attrs.set(k, v);
        } else {
          for (const Value& pair : iterate(init)) {
            if (!pair.is_sequence() || pair.items().size() != 2)
              fail("dictionary update sequence element is not a pair");
            attrs.set(pair.items()[0], pair.items()[1]);
          }
        }
      }
      for (const auto& [k, v] : call.keyword) attrs.set(k, v);
      return is_namespace ? Value::make_namespace(std::move(attrs)) : Value::dict(std::move(attrs));
    });
  }
  if (name == "raise_exception") {
    return Value::callable("raise_exception", [](const CallArgs& call) -> Value {
      Args a(call, "raise_exception()", {"message"});
      fail("raise_exception: " + to_str(a.required(0)));
    });
  }
  if (name == "strftime_now") {
    return Value::callable("strftime_now", [](const CallArgs& call) {
      Args a(call, "strftime_now()", {"format"});
      const std::string& format = str_arg(a.required(0), "strftime_now format");
      std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      std::vector<char> buf(256 + format.size() * 16);
      size_t n = format.empty() ? 0 : std::strftime(buf.data(), buf.size(), format.c_str(), &local);
      return Value::string(std::string(buf.data(), n));
    });
  }
  if (name == "joiner") {
    return Value::callable("joiner", [](const CallArgs& call) {
      Args a(call, "joiner()", {"sep"});
      std::string sep = a.has(0) ? to_str(a.get(0)) : ", ";
      auto used = std::make_shared<bool>(false);
      return Value::callable("joiner", [sep, used](const CallArgs&) {
        bool first = !*used;
        *used = true;
        return Value::string(first ? "" : sep);
      });
    });
  }
  if (name == "cycler" || name == "lipsum") return Value::undefined("unsupported construct: global '" + name + "'");
  return Value::undefined("'" + name + "' is undefined");
}

}  // namespace kiln::text::jinja
