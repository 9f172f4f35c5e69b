// Reading a JSON file with errors that name it: kept apart from files.h so that only the code that
// parses JSON (and links nlohmann_json) sees the json types.
#pragma once
#include <nlohmann/json.hpp>

#include <string>

namespace kiln {

// Parses `path`. Errors start with `what` and name the file: "<what>: cannot open <path>; <hint>"
// (the hint says what should be there) or "<what>: <path> is not valid JSON: <parser message>".
nlohmann::json read_json_file(const std::string& path, const std::string& what, const std::string& hint);

}  // namespace kiln
