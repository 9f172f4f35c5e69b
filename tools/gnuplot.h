// Running gnuplot for the commands that draw PNGs (plot, mismatch): the script, its check, and the
// temporary files removed after.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"

namespace kiln::tools {

// Runs gnuplot on `script`, then removes it and `temp_files`. `who` names the command in errors.
inline void run_gnuplot(const std::string& script, const std::vector<std::string>& temp_files, const char* who) {
  const int rc = std::system(("gnuplot '" + script + "' 2>&1").c_str());
  KILN_CHECK(rc == 0, who, ": gnuplot failed (exit ", rc, ") on ", script, "; is gnuplot installed (apt gnuplot-nox)?");
  std::remove(script.c_str());
  for (const auto& f : temp_files) std::remove(f.c_str());
}

}  // namespace kiln::tools
