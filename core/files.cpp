// File-system helpers (see files.h) and reading JSON files (json_file.h).
#include "core/files.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/json_file.h"

namespace kiln {

void remove_tree(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return;  // nothing there
  const int rc = nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
                      16, FTW_DEPTH | FTW_PHYS);
  KILN_CHECK(rc == 0, "files: cannot remove ", path, " (", std::strerror(errno), ")");
}

void write_text_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    KILN_CHECK(f.good(), "files: cannot write ", tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KILN_CHECK(!ec, "files: cannot rename ", tmp, " to ", path, " (", ec.message(), ")");
}

void check_input_file(const std::string& path, const std::string& what, const std::string& hint) {
  struct stat st;
  KILN_CHECK(stat(path.c_str(), &st) == 0, what, ": cannot open ", path, " (", std::strerror(errno), "); ", hint);
  KILN_CHECK(!S_ISDIR(st.st_mode), what, ": ", path, " is a directory; ", hint);
}

void check_distinct_output(const std::string& out, const std::vector<std::string>& inputs, const std::string& what) {
  namespace fs = std::filesystem;
  auto canonical = [](const std::string& p) {
    std::error_code ec;
    fs::path c = fs::weakly_canonical(fs::absolute(p), ec);
    return (ec ? fs::absolute(p).lexically_normal() : c).string();
  };
  const std::string o = canonical(out);
  for (const auto& in : inputs) {
    const std::string i = canonical(in);
    KILN_CHECK(o != i, what, ": the output ", out, " would overwrite the input ", in,
               "; write to another directory");
  }
}

nlohmann::json read_json_file(const std::string& path, const std::string& what, const std::string& hint) {
  check_input_file(path, what, hint);
  std::ifstream in(path);
  KILN_CHECK(in.good(), what, ": cannot open ", path, "; ", hint);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    KILN_FAIL(what, ": ", path, " is not valid JSON: ", e.what());
  }
}

}  // namespace kiln
