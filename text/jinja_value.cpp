// Jinja runtime values: construction, Python truthiness/equality/ordering, str()/repr() and json.dumps.
#include "text/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "text/jinja_unicode.h"

namespace kiln::text::jinja {

void fail(const std::string& message) { throw TemplateError(message); }

namespace {
const std::string kEmpty;
}

Value Value::undefined(std::string hint) {
  Value v;
  if (!hint.empty()) v.ptr_ = std::make_shared<std::string>(std::move(hint));
  return v;
}
Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.b_ = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.i_ = i;
  return v;
}
Value Value::real(double d) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.f_ = d;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.ptr_ = std::make_shared<std::string>(std::move(s));
  return v;
}
Value Value::markup(std::string s) {
  Value v = string(std::move(s));
  v.b_ = true;
  return v;
}
Value Value::list(ValueList items) {
  Value v;
  v.kind_ = Kind::kList;
  v.ptr_ = std::make_shared<ValueList>(std::move(items));
  return v;
}
Value Value::tuple(ValueList items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::kTuple;
  return v;
}
Value Value::dict(Dict d) {
  Value v;
  v.kind_ = Kind::kDict;
  v.ptr_ = std::make_shared<Dict>(std::move(d));
  return v;
}
Value Value::make_namespace(Dict attrs, bool is_loop) {
  Value v;
  v.kind_ = Kind::kNamespace;
  v.ptr_ = std::make_shared<NamespaceData>(NamespaceData{std::move(attrs), is_loop});
  return v;
}
Value Value::callable(std::string name, Function fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.ptr_ = std::make_shared<CallableData>(CallableData{std::move(name), std::move(fn)});
  return v;
}

Value Value::iterator(IteratorData data) {
  Value v;
  v.kind_ = Kind::kIterator;
  v.ptr_ = std::make_shared<IteratorData>(std::move(data));
  return v;
}

const std::string& Value::as_string() const { return *static_cast<const std::string*>(ptr_.get()); }
const ValueList& Value::items() const { return *static_cast<const ValueList*>(ptr_.get()); }
const Dict& Value::as_dict() const { return *static_cast<const Dict*>(ptr_.get()); }
NamespaceData& Value::as_namespace() const { return *static_cast<NamespaceData*>(ptr_.get()); }
const CallableData& Value::as_callable() const { return *static_cast<const CallableData*>(ptr_.get()); }
IteratorData& Value::as_iterator() const { return *static_cast<IteratorData*>(ptr_.get()); }
const std::string& Value::undefined_hint() const {
  return ptr_ ? *static_cast<const std::string*>(ptr_.get()) : kEmpty;
}

const Value* Dict::find(const Value& key) const {
  for (const auto& item : items_)
    if (equals(item.first, key)) return &item.second;
  return nullptr;
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& item : items_)
    if (item.first.is_string() && item.first.as_string() == key) return &item.second;
  return nullptr;
}

void Dict::set(Value key, Value value) {
  for (auto& item : items_) {
    if (equals(item.first, key)) {
      item.second = std::move(value);
      return;
    }
  }
  items_.emplace_back(std::move(key), std::move(value));
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.as_bool();
    case Kind::kInt:
      return v.as_int() != 0;
    case Kind::kFloat:
      return v.as_float() != 0.0;
    case Kind::kString:
      return !v.as_string().empty();
    case Kind::kList:
    case Kind::kTuple:
      return !v.items().empty();
    case Kind::kDict:
      return !v.as_dict().empty();
    case Kind::kNamespace:
    case Kind::kCallable:
      return true;
    case Kind::kIterator:
      return v.as_iterator().one_shot() || !v.as_iterator().items.empty();
  }
  return false;
}

std::string format_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  // Shortest round-trip digits, then Python's layout: positional when -4 < exponent < 16.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exponent = std::stoi(sci.substr(e + 1));
  int decpt = exponent + 1;  // the decimal point sits after `decpt` digits
  int n = static_cast<int>(digits.size());
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(-decpt, '0') + digits;
    } else if (decpt < n) {
      out = digits.substr(0, decpt) + "." + digits.substr(decpt);
    } else {
      out = digits + std::string(decpt - n, '0') + ".0";
    }
  } else {
    out = digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    int x = decpt - 1;
    char ebuf[16];
    std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", x < 0 ? '-' : '+', x < 0 ? -x : x);
    out += ebuf;
  }
  return sign + out;
}

namespace {

std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    char32_t c = unicode::decode(s, i);
    char buf[16];
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c >= unicode::kRawByte) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c - unicode::kRawByte));
      out += buf;
    } else if (unicode::is_printable(c)) {
      unicode::append(out, c);
    } else {
      if (c < 0x100) {
        std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      } else if (c < 0x10000) {
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      } else {
        std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
      }
      out += buf;
    }
  }
  out += quote;
  return out;
}

std::string join_repr(const ValueList& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    out += repr(items[i]);
  }
  return out;
}

std::string dict_repr(const Dict& d) {
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : d.items()) {
    if (!first) out += ", ";
    first = false;
    out += repr(k) + ": " + repr(v);
  }
  return out + "}";
}

}  // namespace

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return v.as_string();
    default:
      return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v.as_bool() ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v.as_int());
    case Kind::kFloat:
      return format_float(v.as_float());
    case Kind::kString:
      return v.is_markup() ? "Markup(" + repr_string(v.as_string()) + ")" : repr_string(v.as_string());
    case Kind::kList:
      return "[" + join_repr(v.items()) + "]";
    case Kind::kTuple:
      return "(" + join_repr(v.items()) + (v.items().size() == 1 ? ",)" : ")");
    case Kind::kDict:
      return dict_repr(v.as_dict());
    case Kind::kNamespace: {
      const NamespaceData& ns = v.as_namespace();
      if (ns.is_loop) {
        const Value* index = ns.attrs.find("index");
        const Value* length = ns.attrs.find("length");
        return "<LoopContext " + (index ? to_str(*index) : "?") + "/" + (length ? to_str(*length) : "?") + ">";
      }
      return "<Namespace " + dict_repr(ns.attrs) + ">";
    }
    case Kind::kCallable:
      return "<" + v.as_callable().name + ">";
    case Kind::kIterator: {
      // Python adds the object's address, which no renderer can reproduce.
      const IteratorData& it = v.as_iterator();
      switch (it.type) {
        case IteratorData::Type::kGenerator:
          return "<generator object " + it.label + ">";
        case IteratorData::Type::kReverse:
          return "<" + it.python_type + " object>";
        case IteratorData::Type::kRange:
          return it.label;
        default:
          return it.python_type + "([" + join_repr(it.items) + "])";
      }
    }
  }
  return "";
}

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return v.as_namespace().is_loop ? "LoopContext" : "Namespace";
    case Kind::kCallable:
      return "function";
    case Kind::kIterator:
      return v.as_iterator().python_type;
  }
  return "object";
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is(Kind::kFloat) || b.is(Kind::kFloat)) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.as_string() == b.as_string();
    case Kind::kList:
    case Kind::kTuple: {
      const ValueList& x = a.items();
      const ValueList& y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equals(x[i], y[i])) return false;
      return true;
    }
    case Kind::kDict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.items()) {
        const Value* other = y.find(k);
        if (!other || !equals(v, *other)) return false;
      }
      return true;
    }
    case Kind::kIterator:
      if (a.as_iterator().type == IteratorData::Type::kRange && b.as_iterator().type == IteratorData::Type::kRange) {
        return equals(Value::list(a.as_iterator().items), Value::list(b.as_iterator().items));
      }
      return a.identity() == b.identity();
    default:
      return a.identity() == b.identity();
  }
}

int compare(const Value& a, const Value& b, const char* op) {
  if (a.is_undefined()) fail(a.undefined_hint().empty() ? "undefined value in comparison" : a.undefined_hint());
  if (b.is_undefined()) fail(b.undefined_hint().empty() ? "undefined value in comparison" : b.undefined_hint());
  if (a.is_number() && b.is_number()) {
    if (a.is(Kind::kFloat) || b.is(Kind::kFloat)) {
      double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    // UTF-8 byte order is code point order, which is how Python orders str.
    int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.kind() == b.kind() && a.is_sequence()) {
    const ValueList& x = a.items();
    const ValueList& y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (!equals(x[i], y[i])) return compare(x[i], y[i], op);
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  fail(std::string("'") + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) +
       "'");
}

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    size_t start = i;
    char32_t c = unicode::decode(s, i);
    char buf[16];
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else if (ensure_ascii && c >= 0x80 && c < unicode::kRawByte) {
          if (c >= 0x10000) {
            char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                          static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          out.append(s, start, i - start);
        }
    }
  }
  out += '"';
}

std::string json_key(const Value& k) {
  switch (k.kind()) {
    case Kind::kString:
      return k.as_string();
    case Kind::kInt:
      return std::to_string(k.as_int());
    case Kind::kFloat:
      return format_float(k.as_float());
    case Kind::kBool:
      return k.as_bool() ? "true" : "false";
    case Kind::kNone:
      return "null";
    default:
      fail("keys must be str, int, float, bool or None, not " + type_name(k));
  }
}

void json_value(std::string& out, const Value& v, const JsonOptions& o, int depth) {
  const std::string item_sep = o.separators ? o.separators->first : (o.indent ? "," : ", ");
  const std::string key_sep = o.separators ? o.separators->second : ": ";
  auto newline = [&](int level) {
    out += '\n';
    for (int i = 0; i < level; ++i) out += *o.indent;
  };
  switch (v.kind()) {
    case Kind::kNone:
      out += "null";
      return;
    case Kind::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Kind::kInt:
      out += std::to_string(v.as_int());
      return;
    case Kind::kFloat: {
      double d = v.as_float();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity") : format_float(d);
      return;
    }
    case Kind::kString:
      json_string(out, v.as_string(), o.ensure_ascii);
      return;
    case Kind::kList:
    case Kind::kTuple: {
      const ValueList& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        if (o.indent) newline(depth + 1);
        json_value(out, items[i], o, depth + 1);
      }
      if (o.indent) newline(depth);
      out += ']';
      return;
    }
    case Kind::kDict: {
      std::vector<const Dict::Item*> items;
      for (const auto& item : v.as_dict().items()) items.push_back(&item);
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (o.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const Dict::Item* a, const Dict::Item* b) { return compare(a->first, b->first, "<") < 0; });
      }
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        if (o.indent) newline(depth + 1);
        json_string(out, json_key(items[i]->first), o.ensure_ascii);
        out += key_sep;
        json_value(out, items[i]->second, o, depth + 1);
      }
      if (o.indent) newline(depth);
      out += '}';
      return;
    }
    default:
      fail("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_value(out, v, options, 0);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) fail("integer " + std::to_string(u) + " does not fit in 64 bits");
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.append(Value::string(it.key()), from_json(it.value()));
      return Value::dict(std::move(d));
    }
    default:
      fail("unsupported JSON value (binary or discarded)");
  }
}

}  // namespace kiln::text::jinja
