// The Jinja lexer's tokens: template text and the `{{ }}`/`{% %}` tags' names, literals and
// operators, with whitespace control as transformers configures jinja2 (trim_blocks, lstrip_blocks).
#pragma once
#include <string>
#include <vector>

#include "text/jinja_value.h"

namespace kiln::text::jinja {

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string value;  // text, name, decoded string, operator
  Pos pos;
  Value number;  // kInt, kFloat
};

// The tokens of a template's source, ending with kEof; throws TemplateError at a bad token.
std::vector<Token> lex_template(const std::string& source);

// How an error message names a token: "'{{'", "string literal", "'('".
std::string describe(const Token& t);

}  // namespace kiln::text::jinja
