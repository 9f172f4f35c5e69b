// Shared by the fuzz targets: the input as a file (the parsers under test read files) and the
// rule that a parser may only fail with kiln::Error. Anything else (a crash, a sanitizer report,
// another exception type) is a finding.
#pragma once
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kiln::fuzz {

// A per-process scratch folder (/dev/shm when there is one: no disk writes per input).
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    std::string base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string d = base + "/kiln-fuzz-" + std::to_string(getpid());
    ::mkdir(d.c_str(), 0700);
    return d;
  }();
  return dir;
}

// Writes the input to scratch_dir()/name and returns the path.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace kiln::fuzz
