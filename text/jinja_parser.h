// Jinja source -> AST: a lexer that applies whitespace control exactly as transformers configures jinja2
// (trim_blocks, lstrip_blocks, `-`/`+` markers, one trailing newline dropped) and a recursive-descent parser
// with jinja2's operator precedence for the subset chat templates use.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_value.h"

namespace kiln::text::jinja {

enum class ExprKind {
  kLiteral,
  kName,
  kList,
  kTuple,
  kDict,
  kAttr,
  kItem,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kNot,
  kNeg,
  kPos,
  kBinary,
  kCompare,
  kAnd,
  kOr,
  kCond
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
struct Keyword {
  std::string name;
  ExprPtr value;
};

// One node type for every expression; `args` holds the operands, by kind:
//   kAttr [object]                      kItem [object, key]          kSlice [object, start, stop, step]
//   kCall [callee, arg...]              kFilter/kTest [operand, arg...] (operand null in filter blocks)
//   kNot/kNeg/kPos [operand]            kBinary/kAnd/kOr [left, right]
//   kCompare [first, operand...]        kCond [then, condition, else]   kList/kTuple [item...]
//   kDict [key0, value0, key1, ...]     absent slice parts and a missing `else` are null.
struct Expr {
  ExprKind kind;
  Pos pos;
  Value literal;     // kLiteral
  std::string name;  // kName, kAttr, kFilter, kTest; the operator of kBinary
  std::vector<ExprPtr> args;
  std::vector<Keyword> kwargs;   // kCall, kFilter, kTest
  std::vector<std::string> ops;  // kCompare: one operator per operand after the first
  bool negated = false;          // kTest: `is not`
};

enum class StmtKind {
  kText,
  kPrint,
  kIf,
  kFor,
  kSet,
  kSetBlock,
  kMacro,
  kCallBlock,
  kFilterBlock,
  kBreak,
  kContinue,
  kScope
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

// What `set` and `for` assign to: one name, several (tuple unpacking), or `namespace.attribute`.
struct Target {
  std::vector<std::string> names;
  bool unpack = false;
  std::string attribute;  // non-empty: names[0].attribute
};

struct Param {
  std::string name;
  ExprPtr default_value;  // null: required (undefined when not passed, as in jinja2)
};

struct Branch {
  ExprPtr condition;
  Body body;
};

// One node type for every statement; the fields each kind uses:
//   kText text          kPrint expr          kIf branches, else_body
//   kFor target, expr (iterable), condition (`if` filter, may be null), body, else_body
//   kSet target, expr   kSetBlock target, body, expr (filter chain with a null operand, may be null)
//   kMacro name, params, body, uses_*     kCallBlock expr (the call), params (caller's), body
//   kFilterBlock expr (filter chain with a null operand), body
//   kScope assignments, body (`with`, and transformers' `generation` block)
struct Stmt {
  StmtKind kind;
  Pos pos;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;
  std::vector<Branch> branches;
  Body body;
  Body else_body;
  Target target;
  std::string name;
  std::vector<Param> params;
  std::vector<std::pair<Target, ExprPtr>> assignments;
  bool uses_varargs = false;
  bool uses_kwargs = false;
  bool uses_caller = false;
};

// Parses a whole template; throws TemplateError with the position of the offending token.
Body parse_template(const std::string& source);

}  // namespace kiln::text::jinja
