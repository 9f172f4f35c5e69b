// The Jinja evaluator: statements write into a string, expressions produce Values; errors raised without a
// position pick up the position of the innermost node they pass through.
#include "text/jinja_eval.h"

#include <algorithm>
#include <memory>

#include "text/jinja_builtins.h"

namespace kiln::text::jinja {
namespace {

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
};
using ScopePtr = std::shared_ptr<Scope>;

ScopePtr child_of(const ScopePtr& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

enum class Flow { kNormal, kBreak, kContinue };

// Deep enough for recursive macros over nested tool schemas, shallow enough to stop runaway recursion.
constexpr int kMaxCallDepth = 200;

class Evaluator {
 public:
  explicit Evaluator(const std::unordered_map<std::string, Value>& context) : context_(context) {}

  std::string run(const Body& body) {
    std::string out;
    exec_body(body, std::make_shared<Scope>(), out);
    return out;
  }

 private:
  const std::unordered_map<std::string, Value>& context_;
  int depth_ = 0;
  // The scopes macros were defined in, alive until the render ends. A macro holds its scope
  // weakly: that scope holds the macro, and a strong reference would make a cycle that leaks.
  std::vector<ScopePtr> macro_homes_;

  Flow exec_body(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const auto& stmt : body) {
      Flow flow = exec(*stmt, scope, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s, const ScopePtr& scope, std::string& out) {
    try {
      return exec_inner(s, scope, out);
    } catch (TemplateError& e) {
      if (e.pos.line == 0) e.pos = s.pos;
      throw;
    }
  }

  Flow exec_inner(const Stmt& s, const ScopePtr& scope, std::string& out) {
    switch (s.kind) {
      case StmtKind::kText:
        out += s.text;
        return Flow::kNormal;
      case StmtKind::kPrint:
        out += to_str(eval(*s.expr, scope));
        return Flow::kNormal;
      case StmtKind::kIf:
        for (const Branch& b : s.branches)
          if (truthy(eval(*b.condition, scope))) return exec_body(b.body, scope, out);
        return exec_body(s.else_body, scope, out);
      case StmtKind::kFor:
        exec_for(s, scope, out);
        return Flow::kNormal;
      case StmtKind::kSet:
        assign(s.target, eval(*s.expr, scope), scope);
        return Flow::kNormal;
      case StmtKind::kSetBlock: {
        std::string captured;
        exec_body(s.body, child_of(scope), captured);
        Value v = Value::string(std::move(captured));
        if (s.expr) v = eval_filter(*s.expr, scope, &v);
        assign(s.target, v, scope);
        return Flow::kNormal;
      }
      case StmtKind::kMacro:
        scope->vars[s.name] = make_macro(s, scope, "macro '" + s.name + "'");
        return Flow::kNormal;
      case StmtKind::kCallBlock: {
        const Expr& call = *s.expr;
        Value fn = eval(*call.args[0], scope);
        CallArgs args = eval_args(call, 1, scope);
        args.keyword.emplace_back("caller", make_macro(s, scope, "caller"));
        out += to_str(call_value(fn, args));
        return Flow::kNormal;
      }
      case StmtKind::kFilterBlock: {
        std::string captured;
        exec_body(s.body, child_of(scope), captured);
        Value v = Value::string(std::move(captured));
        out += to_str(eval_filter(*s.expr, scope, &v));
        return Flow::kNormal;
      }
      case StmtKind::kScope: {
        ScopePtr inner = child_of(scope);
        std::vector<Value> values;
        for (const auto& [target, expr] : s.assignments) values.push_back(eval(*expr, scope));
        for (size_t i = 0; i < values.size(); ++i) assign(s.assignments[i].first, values[i], inner);
        return exec_body(s.body, inner, out);
      }
      case StmtKind::kBreak:
        return Flow::kBreak;
      case StmtKind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    ValueList items = iterate(eval(*s.expr, scope));
    if (s.condition) {
      // The `if` filter sees the loop variables but not `loop`; loop.index counts only kept items.
      ValueList kept;
      for (const Value& item : items) {
        ScopePtr probe = child_of(scope);
        assign(s.target, item, probe);
        if (truthy(eval(*s.condition, probe))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec_body(s.else_body, child_of(scope), out);
      return;
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      ScopePtr inner = child_of(scope);  // jinja2 starts every iteration from the enclosing scope
      assign(s.target, items[i], inner);
      Dict loop;
      loop.append(Value::string("index"), Value::integer(i + 1));
      loop.append(Value::string("index0"), Value::integer(i));
      loop.append(Value::string("revindex"), Value::integer(n - i));
      loop.append(Value::string("revindex0"), Value::integer(n - i - 1));
      loop.append(Value::string("first"), Value::boolean(i == 0));
      loop.append(Value::string("last"), Value::boolean(i == n - 1));
      loop.append(Value::string("length"), Value::integer(n));
      loop.append(Value::string("depth"), Value::integer(1));
      loop.append(Value::string("depth0"), Value::integer(0));
      loop.append(Value::string("previtem"), i > 0 ? items[i - 1] : Value::undefined("there is no previous item"));
      loop.append(Value::string("nextitem"), i + 1 < n ? items[i + 1] : Value::undefined("there is no next item"));
      loop.append(Value::string("cycle"), Value::callable("loop.cycle", [i](const CallArgs& call) {
                    if (call.positional.empty()) fail("no items for cycling given");
                    return call.positional[i % call.positional.size()];
                  }));
      inner->vars["loop"] = Value::make_namespace(std::move(loop), true);
      if (exec_body(s.body, inner, out) == Flow::kBreak) break;
    }
  }

  void assign(const Target& t, const Value& v, const ScopePtr& scope) {
    if (!t.attribute.empty()) {
      Value ns = lookup(t.names[0], scope);
      if (!ns.is(Kind::kNamespace) || ns.as_namespace().is_loop)
        fail("cannot assign attribute on non-namespace object '" + t.names[0] + "'");
      ns.as_namespace().attrs.set(t.attribute, v);
      return;
    }
    if (!t.unpack) {
      scope->vars[t.names[0]] = v;
      return;
    }
    if (!v.is_sequence() && !v.is_string() && !v.is(Kind::kDict) && !v.is(Kind::kIterator))
      fail("cannot unpack non-iterable " + type_name(v) + " object");
    ValueList parts = iterate(v);
    if (parts.size() > t.names.size())
      fail("too many values to unpack (expected " + std::to_string(t.names.size()) + ")");
    if (parts.size() < t.names.size()) {
      fail("not enough values to unpack (expected " + std::to_string(t.names.size()) + ", got " +
           std::to_string(parts.size()) + ")");
    }
    for (size_t i = 0; i < parts.size(); ++i) scope->vars[t.names[i]] = parts[i];
  }

  Value lookup(const std::string& name, const ScopePtr& scope) const {
    for (const Scope* s = scope.get(); s; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    auto it = context_.find(name);
    if (it != context_.end()) return it->second;
    return global_function(name);
  }

  // A macro (or a call block's `caller`): its body runs in a new scope under the one it was defined in.
  Value make_macro(const Stmt& s, const ScopePtr& defined_in, std::string label) {
    macro_homes_.push_back(defined_in);
    std::weak_ptr<Scope> home = defined_in;
    return Value::callable(label, [this, &s, home, label](const CallArgs& call) {
      if (depth_ >= kMaxCallDepth) fail(label + " recursed deeper than " + std::to_string(kMaxCallDepth) + " calls");
      ScopePtr scope = child_of(home.lock());
      const size_t num_params = s.params.size();
      ValueList extra;
      for (size_t i = 0; i < call.positional.size(); ++i) {
        if (i < num_params) {
          scope->vars[s.params[i].name] = call.positional[i];
        } else {
          extra.push_back(call.positional[i]);
        }
      }
      if (!extra.empty() && !s.uses_varargs) {
        fail(label + " takes not more than " + std::to_string(num_params) + " argument(s)");
      }
      Dict kwargs;
      bool has_caller = false;
      for (const auto& [key, value] : call.keyword) {
        const std::string& name = key;  // a structured binding cannot be captured before C++20 (clang)
        auto param = std::find_if(s.params.begin(), s.params.end(), [&](const Param& p) { return p.name == name; });
        if (param != s.params.end()) {
          if (scope->vars.count(key)) fail(label + " got multiple values for argument '" + key + "'");
          scope->vars[key] = value;
        } else if (key == "caller" && s.kind == StmtKind::kMacro) {
          scope->vars["caller"] = value;
          has_caller = true;
        } else if (s.uses_kwargs) {
          kwargs.set(key, value);
        } else {
          fail(label + " takes no keyword argument '" + key + "'");
        }
      }
      for (const Param& p : s.params) {
        if (scope->vars.count(p.name)) continue;
        scope->vars[p.name] = p.default_value ? eval(*p.default_value, scope)
                                              : Value::undefined("parameter '" + p.name + "' was not provided");
      }
      if (s.uses_varargs) scope->vars["varargs"] = Value::tuple(std::move(extra));
      if (s.uses_kwargs) scope->vars["kwargs"] = Value::dict(std::move(kwargs));
      if (!has_caller && s.uses_caller && s.kind == StmtKind::kMacro)
        scope->vars["caller"] = Value::undefined("No caller defined");
      std::string out;
      ++depth_;
      struct Leave {
        int& depth;
        ~Leave() { --depth; }
      } leave{depth_};
      exec_body(s.body, scope, out);
      return Value::string(std::move(out));
    });
  }

  CallArgs eval_args(const Expr& e, size_t first, const ScopePtr& scope) {
    CallArgs args;
    for (size_t i = first; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i], scope));
    for (const Keyword& k : e.kwargs) args.keyword.emplace_back(k.name, eval(*k.value, scope));
    return args;
  }

  // A filter chain; a null operand at its bottom stands for `input` (block set and filter blocks).
  Value eval_filter(const Expr& e, const ScopePtr& scope, const Value* input) {
    try {
      Value operand;
      if (!e.args[0]) {
        operand = *input;
      } else if (input && e.args[0]->kind == ExprKind::kFilter) {
        operand = eval_filter(*e.args[0], scope, input);
      } else {
        operand = eval(*e.args[0], scope);
      }
      return apply_filter(e.name, operand, eval_args(e, 1, scope));
    } catch (TemplateError& err) {
      if (err.pos.line == 0) err.pos = e.pos;
      throw;
    }
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      return eval_inner(e, scope);
    } catch (TemplateError& err) {
      if (err.pos.line == 0) err.pos = e.pos;
      throw;
    }
  }

  Value eval_inner(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case ExprKind::kLiteral:
        return e.literal;
      case ExprKind::kName:
        return lookup(e.name, scope);
      case ExprKind::kList:
      case ExprKind::kTuple: {
        ValueList items;
        for (const auto& item : e.args) items.push_back(eval(*item, scope));
        return e.kind == ExprKind::kList ? Value::list(std::move(items)) : Value::tuple(std::move(items));
      }
      case ExprKind::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value key = eval(*e.args[i], scope);
          if (key.is(Kind::kList) || key.is(Kind::kDict) || key.is(Kind::kNamespace))
            fail("unhashable type: '" + type_name(key) + "'");
          d.set(std::move(key), eval(*e.args[i + 1], scope));
        }
        return Value::dict(std::move(d));
      }
      case ExprKind::kAttr:
        return get_attr(eval(*e.args[0], scope), e.name);
      case ExprKind::kItem: {
        Value obj = eval(*e.args[0], scope);
        return get_item(obj, eval(*e.args[1], scope));
      }
      case ExprKind::kSlice: {
        Value obj = eval(*e.args[0], scope);
        auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i], scope) : Value::none(); };
        return slice(obj, part(1), part(2), part(3));
      }
      case ExprKind::kCall: {
        Value fn = eval(*e.args[0], scope);
        return call_value(fn, eval_args(e, 1, scope));
      }
      case ExprKind::kFilter:
        return eval_filter(e, scope, nullptr);
      case ExprKind::kTest: {
        Value operand = eval(*e.args[0], scope);
        return Value::boolean(apply_test(e.name, operand, eval_args(e, 1, scope)) != e.negated);
      }
      case ExprKind::kNot:
        return Value::boolean(!truthy(eval(*e.args[0], scope)));
      case ExprKind::kNeg:
        return negate(eval(*e.args[0], scope));
      case ExprKind::kPos:
        return unary_plus(eval(*e.args[0], scope));
      case ExprKind::kBinary: {
        Value left = eval(*e.args[0], scope);
        return binary_op(e.name, left, eval(*e.args[1], scope));
      }
      case ExprKind::kCompare: {
        Value left = eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], scope);
          if (!compare_op(e.ops[i], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::kAnd: {
        Value left = eval(*e.args[0], scope);
        return truthy(left) ? eval(*e.args[1], scope) : left;
      }
      case ExprKind::kOr: {
        Value left = eval(*e.args[0], scope);
        return truthy(left) ? left : eval(*e.args[1], scope);
      }
      case ExprKind::kCond:
        if (truthy(eval(*e.args[1], scope))) return eval(*e.args[0], scope);
        if (e.args[2]) return eval(*e.args[2], scope);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.pos.line) +
                                " evaluated to false and no else section was defined.");
    }
    return Value();
  }

  static bool compare_op(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "in") return contains(b, a);
    if (op == "not in") return !contains(b, a);
    int c = compare(a, b, op.c_str());
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }
};

// jinja2 refuses an unknown filter or test when it compiles the template, except inside an `if` statement
// or an inline if-expression, where it fails only if reached ("soft" frames; loops, macros and blocks inside
// start hard again). Unknown names in soft places fail at render time instead, as there.
void check_expr(const Expr* e, bool soft) {
  if (!e) return;
  if (!soft && e->kind == ExprKind::kFilter && !is_filter(e->name))
    throw TemplateError("unsupported filter '" + e->name + "'", e->pos);
  if (!soft && e->kind == ExprKind::kTest && !is_test(e->name))
    throw TemplateError("unsupported test '" + e->name + "'", e->pos);
  soft = soft || e->kind == ExprKind::kCond;
  for (const auto& a : e->args) check_expr(a.get(), soft);
  for (const auto& k : e->kwargs) check_expr(k.value.get(), soft);
}

void check_body(const Body& body, bool soft) {
  for (const auto& s : body) {
    switch (s->kind) {
      case StmtKind::kIf:
        for (const auto& b : s->branches) {
          check_expr(b.condition.get(), true);
          check_body(b.body, true);
        }
        check_body(s->else_body, true);
        break;
      case StmtKind::kFor:
        check_expr(s->expr.get(), soft);
        check_expr(s->condition.get(), false);
        check_body(s->body, false);
        check_body(s->else_body, false);
        break;
      case StmtKind::kPrint:
      case StmtKind::kSet:
        check_expr(s->expr.get(), soft);
        break;
      case StmtKind::kCallBlock:
        check_expr(s->expr.get(), soft);
        check_body(s->body, false);
        break;
      case StmtKind::kSetBlock:
      case StmtKind::kFilterBlock:  // their filters belong to the block's own (hard) frame
        check_expr(s->expr.get(), false);
        check_body(s->body, false);
        break;
      case StmtKind::kMacro:
        for (const auto& p : s->params) check_expr(p.default_value.get(), false);
        check_body(s->body, false);
        break;
      case StmtKind::kScope:
        for (const auto& a : s->assignments) check_expr(a.second.get(), soft);
        check_body(s->body, false);
        break;
      default:
        break;
    }
  }
}

}  // namespace

void check_supported(const Body& body) { check_body(body, false); }

std::string render(const Body& body, const std::unordered_map<std::string, Value>& context) {
  return Evaluator(context).run(body);
}

}  // namespace kiln::text::jinja
