// Optimizer state in a file on a fast disk: one preallocated file under a directory, read and
// written with pread/pwrite at byte offsets. Errors name the directory, the offset and the cause.
#pragma once
#include <cstdint>
#include <string>

namespace kiln::optimizers {

class NvmeFile {
 public:
  // Creates (or truncates) `dir`/`name` and reserves `bytes` (read back as zeros). Throws if `dir`
  // is missing or not writable, or if the disk lacks the space (names free and needed bytes).
  NvmeFile(const std::string& dir, const std::string& name, uint64_t bytes);
  ~NvmeFile();
  NvmeFile(const NvmeFile&) = delete;
  NvmeFile& operator=(const NvmeFile&) = delete;

  void read(uint64_t offset, void* dst, uint64_t bytes) const;
  void write(uint64_t offset, const void* src, uint64_t bytes);
  // A read-only mapping of the whole file (for writing checkpoints without a second copy).
  const void* map() const;
  uint64_t size() const { return bytes_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t bytes_ = 0;
  mutable void* map_ = nullptr;
};

}  // namespace kiln::optimizers
