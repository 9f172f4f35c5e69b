// Jinja builtins with jinja2's (and so Python's) semantics: operators, attribute and item lookup as the
// sandbox transformers uses does it, filters, tests, str/dict/list methods, and the global functions.
#pragma once
#include <string>

#include "text/jinja_value.h"

namespace kiln::text::jinja {

// `+ - * / // % ** ~`; undefined operands fail (except with `~`), as jinja2's Undefined does.
Value binary_op(const std::string& op, const Value& a, const Value& b);
Value negate(const Value& v);
Value unary_plus(const Value& v);
bool contains(const Value& container, const Value& item);  // Python `item in container`

// `obj.name`: methods first, then dict keys; `obj[key]`: keys and indices first, then methods. A miss is
// undefined (with jinja2's wording); any lookup on an undefined value fails.
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// What a for loop visits: list/tuple items, dict keys, str characters; undefined visits nothing.
ValueList iterate(const Value& v);
Value call_value(const Value& fn, const CallArgs& args);

bool is_filter(const std::string& name);
bool is_test(const std::string& name);
Value apply_filter(const std::string& name, const Value& v, const CallArgs& args);
bool apply_test(const std::string& name, const Value& v, const CallArgs& args);

// range, namespace, dict, joiner, and transformers' raise_exception and strftime_now; undefined otherwise.
Value global_function(const std::string& name);

}  // namespace kiln::text::jinja
