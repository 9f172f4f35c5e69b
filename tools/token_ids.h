// Token ids from command-line text, shared by the subcommands that take them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::tools {

// "1 2 3" or "1,2,3" -> ids. Errors read "<command>: <where>: 'x' is not a token id; ...".
std::vector<int64_t> parse_ids(const std::string& text, const std::string& command, const std::string& where);

}  // namespace kiln::tools
