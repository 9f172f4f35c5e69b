// Jinja runtime values with Python's semantics (truthiness, ==, <, str(), repr(), json.dumps) and the
// error type the lexer, parser and evaluator throw before the template name is attached.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::text::jinja {

// A place in the template source: 1-based line and column (columns count code points).
struct Pos {
  int line = 0;
  int col = 0;
};

// An error inside the engine. The innermost AST node that catches one without a position adds its own,
// so builtins can throw without knowing where they were called from.
class TemplateError : public std::runtime_error {
 public:
  explicit TemplateError(const std::string& message, Pos where = {}) : std::runtime_error(message), pos(where) {}
  Pos pos;
};
[[noreturn]] void fail(const std::string& message);

class Value;
class Dict;
struct CallArgs;
using ValueList = std::vector<Value>;
using Function = std::function<Value(const CallArgs&)>;

enum class Kind {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kList,
  kTuple,
  kDict,
  kNamespace,
  kCallable,
  kIterator
};

struct NamespaceData;
struct IteratorData;
struct CallableData {
  std::string name;  // for messages and repr: "range", "macro 'f'", "str.split"
  Function fn;
};

// A value: scalars inline, strings and containers shared and immutable (the sandbox transformers uses
// forbids mutating them), so copies are cheap.
class Value {
 public:
  Value() = default;  // undefined, with no hint
  static Value undefined(std::string hint);
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value real(double d);
  static Value string(std::string s);
  // jinja2's Markup (from `|safe` and `|escape`): a str whose `+` and `%` HTML-escape the other operand.
  static Value markup(std::string s);
  static Value list(ValueList items);
  static Value tuple(ValueList items);
  static Value dict(Dict d);
  static Value make_namespace(Dict attrs, bool is_loop = false);
  static Value callable(std::string name, Function fn);
  static Value iterator(IteratorData data);

  Kind kind() const { return kind_; }
  bool is(Kind k) const { return kind_ == k; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return kind_ == Kind::kString && b_; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_sequence() const { return kind_ == Kind::kList || kind_ == Kind::kTuple; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }  // bool is an int in Python
  double as_float() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(as_int()); }
  const std::string& as_string() const;
  const ValueList& items() const;  // list or tuple
  const Dict& as_dict() const;
  NamespaceData& as_namespace() const;
  const CallableData& as_callable() const;
  IteratorData& as_iterator() const;
  // Why this value is undefined, as jinja2 words it ("'x' is undefined"); "" when unknown.
  const std::string& undefined_hint() const;
  const void* identity() const { return ptr_.get(); }

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<void> ptr_;  // std::string, ValueList, Dict, NamespaceData, CallableData or IteratorData
};

// A Python dict: insertion-ordered (key, value) pairs. Lookups are linear: chat-template dicts are small.
class Dict {
 public:
  using Item = std::pair<Value, Value>;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(Value key, Value value);
  void set(const std::string& key, Value value) { set(Value::string(key), std::move(value)); }
  // For keys known to be new (JSON objects, keyword arguments): no duplicate check.
  void append(Value key, Value value) { items_.emplace_back(std::move(key), std::move(value)); }
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  const std::vector<Item>& items() const { return items_; }

 private:
  std::vector<Item> items_;
};

// namespace() objects and for-loop `loop` objects: attributes only; namespaces are the one mutable value.
struct NamespaceData {
  Dict attrs;
  bool is_loop = false;
};

// What Python returns where jinja2 hands back something other than a list: generators (map, select, unique,
// batch, the items filter), reverse iterators (the reverse filter), dict views (.items() .keys() .values())
// and range(). They differ from lists where templates can tell: a generator is always true, has no len(),
// can be iterated once and is not JSON; views and ranges have a len() but are not JSON either.
struct IteratorData {
  enum class Type { kGenerator, kReverse, kDictItems, kDictKeys, kDictValues, kRange };
  Type type = Type::kGenerator;
  std::string python_type;  // "generator", "list_reverseiterator", "dict_items", "range", ...
  std::string label;        // generators: the jinja2 function ("sync_do_map"); ranges: "range(0, 3)"
  ValueList items;
  bool consumed = false;  // generators and reverse iterators are exhausted by one pass
  bool one_shot() const { return type == Type::kGenerator || type == Type::kReverse; }
};

struct CallArgs {
  ValueList positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

bool truthy(const Value& v);
std::string to_str(const Value& v);           // Python str(): what {{ }} prints
std::string repr(const Value& v);             // Python repr(): how items print inside lists and dicts
std::string type_name(const Value& v);        // Python's type name, for messages: 'str', 'NoneType', ...
std::string format_float(double d);           // Python repr(float): shortest round trip, "1.0", "1e-05"
bool equals(const Value& a, const Value& b);  // Python ==
// Python ordering (<0, 0, >0) of numbers, strings, and lists/tuples of those; anything else fails
// like Python's TypeError, naming `op`.
int compare(const Value& a, const Value& b, const char* op);

// json.dumps(value, ensure_ascii, indent, separators, sort_keys): transformers' tojson filter.
struct JsonOptions {
  std::optional<std::string> indent;  // None: one line; otherwise the text of one indent level
  std::optional<std::pair<std::string, std::string>> separators;  // (item, key); default depends on indent
  bool sort_keys = false;
  bool ensure_ascii = false;
};
std::string to_json(const Value& v, const JsonOptions& options);

// JSON -> Value: objects keep their key order; integers beyond int64 are refused.
Value from_json(const nlohmann::ordered_json& j);

}  // namespace kiln::text::jinja
