// The Jinja evaluator: runs a parsed template against a context with jinja2's scoping (a fresh scope per
// loop iteration, macros closing over the scope they were defined in, namespaces as the way out of a loop).
#pragma once
#include <string>
#include <unordered_map>

#include "text/jinja_parser.h"

namespace kiln::text::jinja {

// Fails (TemplateError with the position) on filters and tests the renderer does not have, so an
// unsupported template is refused when it is loaded rather than halfway through a render.
void check_supported(const Body& body);

// Renders `body`. `context` holds the render variables (messages, tools, ...), which shadow the globals.
std::string render(const Body& body, const std::unordered_map<std::string, Value>& context);

}  // namespace kiln::text::jinja
