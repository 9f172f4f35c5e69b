// File-system helpers (see files.h).
#include "core/files.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace kiln {

void remove_tree(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return;  // nothing there
  const int rc = nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
                      16, FTW_DEPTH | FTW_PHYS);
  KILN_CHECK(rc == 0, "files: cannot remove ", path, " (", std::strerror(errno), ")");
}

}  // namespace kiln
