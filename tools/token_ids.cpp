// Token-id parsing for the kiln subcommands.
#include "tools/token_ids.h"

#include <sstream>

#include "core/error.h"

namespace kiln::tools {

std::vector<int64_t> parse_ids(const std::string& text, const std::string& command, const std::string& where) {
  std::string s = text;
  for (char& c : s)
    if (c == ',') c = ' ';
  std::istringstream in(s);
  std::vector<int64_t> ids;
  std::string tok;
  while (in >> tok) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    KILN_CHECK(used == tok.size(), command, ": ", where, ": '", tok, "' is not a token id; expected integers");
    ids.push_back(v);
  }
  return ids;
}

}  // namespace kiln::tools
