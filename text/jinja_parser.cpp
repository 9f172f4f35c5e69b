// The Jinja recursive-descent parser: the lexer's tokens (jinja_lexer.h) into the AST of jinja_parser.h,
// with jinja2's operator precedence.
#include "text/jinja_parser.h"

#include <algorithm>

#include "text/jinja_lexer.h"

namespace kiln::text::jinja {
namespace {

ExprPtr make_expr(ExprKind kind, Pos pos) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->pos = pos;
  return e;
}

StmtPtr make_stmt(StmtKind kind, Pos pos) {
  auto s = std::make_unique<Stmt>();
  s->kind = kind;
  s->pos = pos;
  return s;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Body parse() { return subparse({}); }

 private:
  std::vector<Token> toks_;
  size_t p_ = 0;
  int loop_depth_ = 0;
  std::vector<Stmt*> macros_;  // enclosing macros, to note their use of varargs/kwargs/caller

  const Token& cur() const { return toks_[p_]; }
  const Token& peek() const { return toks_[std::min(p_ + 1, toks_.size() - 1)]; }
  bool is_op(const char* op) const { return cur().type == Tok::kOp && cur().value == op; }
  bool is_name(const char* name) const { return cur().type == Tok::kName && cur().value == name; }

  [[noreturn]] void error(const Token& t, const std::string& message) const { throw TemplateError(message, t.pos); }

  void expect_op(const char* op) {
    if (!is_op(op)) error(cur(), std::string("expected '") + op + "', got " + describe(cur()));
    ++p_;
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) error(cur(), "expected a name, got " + describe(cur()));
    return toks_[p_++].value;
  }
  void expect_block_end() {
    if (cur().type != Tok::kBlockEnd) error(cur(), "expected '%}', got " + describe(cur()));
    ++p_;
  }
  // Consumes `{% <end> %}` after subparse stopped at it.
  void close_block() {
    ++p_;
    expect_block_end();
  }

  Body subparse(const std::vector<std::string>& end_tags) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::kEof) {
        if (end_tags.empty()) return body;
        std::string expected;
        for (const auto& tag : end_tags) expected += (expected.empty() ? "'" : " or '") + tag + "'";
        error(t, "unexpected end of template; expected " + expected);
      }
      if (t.type == Tok::kText) {
        auto s = make_stmt(StmtKind::kText, t.pos);
        s->text = t.value;
        body.push_back(std::move(s));
        ++p_;
      } else if (t.type == Tok::kVarBegin) {
        auto s = make_stmt(StmtKind::kPrint, t.pos);
        ++p_;
        s->expr = parse_tuple(true, false);
        if (cur().type != Tok::kVarEnd) error(cur(), "expected '}}', got " + describe(cur()));
        ++p_;
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        ++p_;
        if (cur().type != Tok::kName) error(cur(), "expected a tag name after '{%', got " + describe(cur()));
        if (std::find(end_tags.begin(), end_tags.end(), cur().value) != end_tags.end()) return body;
        body.push_back(parse_statement());
      } else {
        error(t, "unexpected " + describe(t));
      }
    }
  }

  StmtPtr parse_statement() {
    const Token& kw = cur();
    const std::string& k = kw.value;
    if (k == "if") return parse_if();
    if (k == "for") return parse_for();
    if (k == "set") return parse_set();
    if (k == "macro") return parse_macro();
    if (k == "call") return parse_call_block();
    if (k == "filter") return parse_filter_block();
    if (k == "with" || k == "generation") return parse_scope();
    if (k == "break" || k == "continue") {
      if (loop_depth_ == 0) error(kw, "'" + k + "' outside of a for loop");
      auto s = make_stmt(k == "break" ? StmtKind::kBreak : StmtKind::kContinue, kw.pos);
      ++p_;
      expect_block_end();
      return s;
    }
    static const char* kEnds[] = {"elif",    "else",      "endif",   "endfor",        "endset", "endmacro",
                                  "endcall", "endfilter", "endwith", "endgeneration", "endraw"};
    for (const char* end : kEnds)
      if (k == end) error(kw, "unexpected '" + k + "' (no open block it could close)");
    static const char* kJinja[] = {"include",    "import", "from",      "extends",  "block",         "do",
                                   "autoescape", "trans",  "pluralize", "endblock", "endautoescape", "endtrans"};
    for (const char* tag : kJinja)
      if (k == tag) error(kw, "unsupported tag '" + k + "'");
    error(kw, "unknown tag '" + k + "'");
  }

  StmtPtr parse_if() {
    auto s = make_stmt(StmtKind::kIf, cur().pos);
    ++p_;
    while (true) {
      Branch branch;
      branch.condition = parse_tuple(false, false);
      expect_block_end();
      branch.body = subparse({"elif", "else", "endif"});
      s->branches.push_back(std::move(branch));
      std::string tag = cur().value;
      ++p_;
      if (tag == "elif") continue;
      if (tag == "else") {
        expect_block_end();
        s->else_body = subparse({"endif"});
        ++p_;
      }
      expect_block_end();
      return s;
    }
  }

  StmtPtr parse_for() {
    auto s = make_stmt(StmtKind::kFor, cur().pos);
    ++p_;
    s->target = parse_target(false);
    if (!is_name("in")) error(cur(), "expected 'in' in for loop, got " + describe(cur()));
    ++p_;
    s->expr = parse_tuple(false, false, "recursive");
    if (is_name("if")) {
      ++p_;
      s->condition = parse_expression(true);
    }
    if (is_name("recursive")) error(cur(), "unsupported construct: recursive for loops");
    expect_block_end();
    ++loop_depth_;
    s->body = subparse({"endfor", "else"});
    --loop_depth_;
    if (is_name("else")) {
      ++p_;
      expect_block_end();
      s->else_body = subparse({"endfor"});
    }
    close_block();
    return s;
  }

  StmtPtr parse_set() {
    Pos pos = cur().pos;
    ++p_;
    Target target = parse_target(true);
    if (is_op("=")) {
      ++p_;
      auto s = make_stmt(StmtKind::kSet, pos);
      s->target = std::move(target);
      s->expr = parse_tuple(true, false);
      expect_block_end();
      return s;
    }
    auto s = make_stmt(StmtKind::kSetBlock, pos);
    if (!target.attribute.empty() || target.unpack) error(cur(), "a block set assigns to one plain name");
    s->target = std::move(target);
    if (is_op("|")) s->expr = parse_filter(nullptr, false);
    expect_block_end();
    s->body = subparse({"endset"});
    close_block();
    return s;
  }

  std::vector<Param> parse_signature() {
    std::vector<Param> params;
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      Param param;
      param.name = expect_name();
      if (is_op("=")) {
        ++p_;
        param.default_value = parse_expression(true);
      } else if (!params.empty() && params.back().default_value) {
        error(cur(), "non-default argument follows default argument");
      }
      params.push_back(std::move(param));
    }
    ++p_;
    return params;
  }

  // Macro and caller bodies are separate functions: no loop to break out of, their own varargs/kwargs.
  Body parse_function_body(Stmt* s, const char* end_tag) {
    int saved_depth = loop_depth_;
    loop_depth_ = 0;
    macros_.push_back(s);
    Body body = subparse({end_tag});
    macros_.pop_back();
    loop_depth_ = saved_depth;
    return body;
  }

  StmtPtr parse_macro() {
    auto s = make_stmt(StmtKind::kMacro, cur().pos);
    ++p_;
    s->name = expect_name();
    s->params = parse_signature();
    expect_block_end();
    s->body = parse_function_body(s.get(), "endmacro");
    close_block();
    return s;
  }

  StmtPtr parse_call_block() {
    auto s = make_stmt(StmtKind::kCallBlock, cur().pos);
    ++p_;
    if (is_op("(")) s->params = parse_signature();
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::kCall) error(cur(), "expected a macro call after 'call'");
    expect_block_end();
    s->body = parse_function_body(s.get(), "endcall");
    close_block();
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = make_stmt(StmtKind::kFilterBlock, cur().pos);
    ++p_;
    s->expr = parse_filter(nullptr, true);
    expect_block_end();
    s->body = subparse({"endfilter"});
    close_block();
    return s;
  }

  StmtPtr parse_scope() {
    bool is_with = cur().value == "with";
    auto s = make_stmt(StmtKind::kScope, cur().pos);
    ++p_;
    while (is_with && cur().type != Tok::kBlockEnd) {
      if (!s->assignments.empty()) expect_op(",");
      Target target = parse_target(false);
      expect_op("=");
      s->assignments.emplace_back(std::move(target), parse_expression(true));
    }
    expect_block_end();
    s->body = subparse({is_with ? "endwith" : "endgeneration"});
    close_block();
    return s;
  }

  Target parse_target(bool with_namespace) {
    Target target;
    if (with_namespace && cur().type == Tok::kName && peek().type == Tok::kOp && peek().value == ".") {
      target.names.push_back(toks_[p_].value);
      p_ += 2;
      target.attribute = expect_name();
      return target;
    }
    bool parens = is_op("(");
    if (parens) ++p_;
    while (true) {
      const Token& t = cur();
      std::string name = expect_name();
      static const char* kConstants[] = {"true", "false", "none", "True", "False", "None"};
      for (const char* c : kConstants)
        if (name == c) error(t, "can't assign to '" + name + "'");
      target.names.push_back(name);
      if (!is_op(",")) break;
      ++p_;
      target.unpack = true;
      if (cur().type != Tok::kName) break;  // trailing comma
    }
    if (parens) expect_op(")");
    return target;
  }

  // ---- expressions, in jinja2's precedence order ----

  bool is_tuple_end(const char* extra_end) const {
    if (cur().type == Tok::kVarEnd || cur().type == Tok::kBlockEnd || is_op(")")) return true;
    return extra_end && is_name(extra_end);
  }

  ExprPtr parse_tuple(bool with_condexpr, bool explicit_parens, const char* extra_end = nullptr) {
    Pos pos = cur().pos;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) error(cur(), "expected an expression, got " + describe(cur()));
    }
    auto e = make_expr(ExprKind::kTuple, pos);
    e->args = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      auto e = make_expr(ExprKind::kCond, cur().pos);
      ++p_;
      ExprPtr condition = parse_or();
      ExprPtr otherwise;
      if (is_name("else")) {
        ++p_;
        otherwise = parse_condexpr();
      }
      e->args.push_back(std::move(expr));
      e->args.push_back(std::move(condition));
      e->args.push_back(std::move(otherwise));
      expr = std::move(e);
    }
    return expr;
  }

  ExprPtr binary(ExprKind kind, Pos pos, ExprPtr left, ExprPtr right, std::string op = "") {
    auto e = make_expr(kind, pos);
    e->name = std::move(op);
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      Pos pos = cur().pos;
      ++p_;
      left = binary(ExprKind::kOr, pos, std::move(left), parse_and());
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      Pos pos = cur().pos;
      ++p_;
      left = binary(ExprKind::kAnd, pos, std::move(left), parse_not());
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      auto e = make_expr(ExprKind::kNot, cur().pos);
      ++p_;
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr first = parse_math1();
    Pos pos = cur().pos;  // the first operator: where a failed comparison is reported
    std::vector<std::string> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      static const char* kOps[] = {"==", "!=", "<", ">", "<=", ">="};
      std::string op;
      for (const char* o : kOps)
        if (is_op(o)) op = o;
      if (!op.empty()) {
        ++p_;
      } else if (is_name("in")) {
        op = "in";
        ++p_;
      } else if (is_name("not") && peek().type == Tok::kName && peek().value == "in") {
        op = "not in";
        p_ += 2;
      } else {
        break;
      }
      ops.push_back(op);
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = make_expr(ExprKind::kCompare, pos);
    e->args.push_back(std::move(first));
    for (auto& operand : operands) e->args.push_back(std::move(operand));
    e->ops = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      Token op = cur();
      ++p_;
      left = binary(ExprKind::kBinary, op.pos, std::move(left), parse_concat(), op.value);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      Pos pos = cur().pos;
      ++p_;
      left = binary(ExprKind::kBinary, pos, std::move(left), parse_math2(), "~");
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      Token op = cur();
      ++p_;
      left = binary(ExprKind::kBinary, op.pos, std::move(left), parse_pow(), op.value);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      Pos pos = cur().pos;
      ++p_;
      left = binary(ExprKind::kBinary, pos, std::move(left), parse_unary(true), "**");
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      node = make_expr(is_op("-") ? ExprKind::kNeg : ExprKind::kPos, cur().pos);
      ++p_;
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    if (t.type == Tok::kName) {
      ++p_;
      if (t.value == "true" || t.value == "True" || t.value == "false" || t.value == "False") {
        auto e = make_expr(ExprKind::kLiteral, t.pos);
        e->literal = Value::boolean(t.value[0] == 't' || t.value[0] == 'T');
        return e;
      }
      if (t.value == "none" || t.value == "None") {
        auto e = make_expr(ExprKind::kLiteral, t.pos);
        e->literal = Value::none();
        return e;
      }
      if (!macros_.empty()) {
        if (t.value == "varargs") macros_.back()->uses_varargs = true;
        if (t.value == "kwargs") macros_.back()->uses_kwargs = true;
        if (t.value == "caller") macros_.back()->uses_caller = true;
      }
      auto e = make_expr(ExprKind::kName, t.pos);
      e->name = t.value;
      return e;
    }
    if (t.type == Tok::kString) {
      auto e = make_expr(ExprKind::kLiteral, t.pos);
      std::string s;
      while (cur().type == Tok::kString) s += toks_[p_++].value;  // "a" "b" is "ab", as in Python
      e->literal = Value::string(std::move(s));
      return e;
    }
    if (t.type == Tok::kInt || t.type == Tok::kFloat) {
      auto e = make_expr(ExprKind::kLiteral, t.pos);
      e->literal = t.number;
      ++p_;
      return e;
    }
    if (is_op("(")) {
      ++p_;
      ExprPtr e;
      if (is_op(")")) {
        e = make_expr(ExprKind::kTuple, t.pos);
      } else {
        e = parse_tuple(true, true);
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      auto e = make_expr(ExprKind::kList, t.pos);
      ++p_;
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      ++p_;
      return e;
    }
    if (is_op("{")) {
      auto e = make_expr(ExprKind::kDict, t.pos);
      ++p_;
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      ++p_;
      return e;
    }
    error(t, "unexpected " + describe(t) + " in an expression");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter(std::move(node), false);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    Token t = cur();
    ++p_;
    if (t.value == ".") {
      const Token& attr = cur();
      if (attr.type == Tok::kName) {
        auto e = make_expr(ExprKind::kAttr, attr.pos);
        e->name = attr.value;
        e->args.push_back(std::move(node));
        ++p_;
        return e;
      }
      if (attr.type == Tok::kInt) {
        auto e = make_expr(ExprKind::kItem, attr.pos);
        auto key = make_expr(ExprKind::kLiteral, attr.pos);
        key->literal = attr.number;
        e->args.push_back(std::move(node));
        e->args.push_back(std::move(key));
        ++p_;
        return e;
      }
      error(attr, "expected an attribute name after '.', got " + describe(attr));
    }
    std::vector<ExprPtr> keys;
    ExprPtr slice;
    while (!is_op("]")) {
      if (!keys.empty() || slice) expect_op(",");
      if (is_op("]")) break;
      ExprPtr start;
      if (!is_op(":")) {
        start = parse_expression(true);
        if (!is_op(":")) {
          keys.push_back(std::move(start));
          continue;
        }
      }
      if (!keys.empty() || slice) error(cur(), "unsupported construct: slices inside a tuple subscript");
      slice = make_expr(ExprKind::kSlice, t.pos);
      slice->args.push_back(std::move(node));
      slice->args.push_back(std::move(start));
      ++p_;  // ':'
      slice->args.push_back(is_op(":") || is_op("]") || is_op(",") ? nullptr : parse_expression(true));
      ExprPtr step;
      if (is_op(":")) {
        ++p_;
        if (!is_op("]") && !is_op(",")) step = parse_expression(true);
      }
      slice->args.push_back(std::move(step));
    }
    ++p_;
    if (slice) {
      if (!keys.empty()) error(t, "unsupported construct: slices inside a tuple subscript");
      return slice;
    }
    if (keys.empty()) error(t, "expected a subscript inside '[]'");
    auto e = make_expr(ExprKind::kItem, t.pos);
    e->args.push_back(std::move(node));
    if (keys.size() == 1) {
      e->args.push_back(std::move(keys[0]));
    } else {
      auto tuple = make_expr(ExprKind::kTuple, t.pos);
      tuple->args = std::move(keys);
      e->args.push_back(std::move(tuple));
    }
    return e;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) error(cur(), "unsupported construct: *args and **kwargs in calls");
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().value == "=") {
        std::string name = cur().value;
        p_ += 2;
        e.kwargs.push_back(Keyword{name, parse_expression(true)});
      } else {
        if (!e.kwargs.empty()) error(cur(), "positional argument follows keyword argument");
        e.args.push_back(parse_expression(true));
      }
    }
    ++p_;
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make_expr(ExprKind::kCall, node->pos);
    e->args.push_back(std::move(node));
    parse_call_args(*e);
    return e;
  }

  std::string parse_dotted_name(Pos* pos) {
    *pos = cur().pos;
    std::string name = expect_name();
    while (is_op(".")) {
      ++p_;
      name += "." + expect_name();
    }
    return name;
  }

  ExprPtr parse_filter(ExprPtr node, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) ++p_;
      start_inline = false;
      Pos pos;
      std::string name = parse_dotted_name(&pos);
      auto e = make_expr(ExprKind::kFilter, pos);
      e->name = std::move(name);
      e->args.push_back(std::move(node));
      if (is_op("(")) parse_call_args(*e);
      node = std::move(e);
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    ++p_;  // 'is'
    bool negated = false;
    if (is_name("not")) {
      ++p_;
      negated = true;
    }
    Pos pos;
    std::string name = parse_dotted_name(&pos);
    auto e = make_expr(ExprKind::kTest, pos);
    e->name = std::move(name);
    e->negated = negated;
    e->args.push_back(std::move(node));
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((cur().type == Tok::kName || cur().type == Tok::kString || cur().type == Tok::kInt ||
                cur().type == Tok::kFloat || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      // jinja2 takes one argument without parentheses: `x is divisibleby 3`, `x is sameas none`.
      if (is_name("is")) error(cur(), "you cannot chain multiple tests with 'is'");
      e->args.push_back(parse_postfix(parse_primary()));
    }
    return e;
  }
};

}  // namespace

Body parse_template(const std::string& source) {
  Parser parser(lex_template(source));
  return parser.parse();
}

}  // namespace kiln::text::jinja
