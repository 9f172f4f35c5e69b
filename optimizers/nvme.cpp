// NvmeFile: preallocation with posix_fallocate (so "disk full" shows up at start, not mid-step),
// full-length pread/pwrite loops, and a lazy read-only mmap.
#include "optimizers/nvme.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace kiln::optimizers {

NvmeFile::NvmeFile(const std::string& dir, const std::string& name, uint64_t bytes)
    : path_(dir + "/" + name), bytes_(bytes) {
  struct stat st {};
  KILN_CHECK(!dir.empty() && ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "optimizer: nvme_dir '", dir,
             "' does not exist or is not a directory; create it on the NVMe disk (optim.nvme_dir)");
  KILN_CHECK(::access(dir.c_str(), W_OK) == 0, "optimizer: nvme_dir '", dir, "' is not writable (",
             std::strerror(errno), "); pick a directory this user can write");
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KILN_CHECK(fd_ >= 0, "optimizer: nvme_dir '", dir, "' is not writable: cannot create ", path_, " (",
             std::strerror(errno), ")");
  if (bytes_ == 0) return;
  const int rc = ::posix_fallocate(fd_, 0, off_t(bytes_));
  if (rc != 0) {
    struct statvfs vfs {};
    const uint64_t free_bytes = ::statvfs(dir.c_str(), &vfs) == 0 ? uint64_t(vfs.f_bavail) * vfs.f_frsize : 0;
    ::close(fd_);
    fd_ = -1;
    ::unlink(path_.c_str());
    KILN_FAIL("optimizer: cannot reserve ", bytes_, " bytes for the optimizer state in ", path_, " (",
              std::strerror(rc), "); the disk has ", free_bytes,
              " bytes free; free space, pick another optim.nvme_dir, or keep the state in memory");
  }
}

NvmeFile::~NvmeFile() {
  if (map_) ::munmap(map_, bytes_);
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(path_.c_str());  // live state only; checkpoints hold the durable copy
  }
}

void NvmeFile::read(uint64_t offset, void* dst, uint64_t bytes) const {
  KILN_CHECK(offset + bytes <= bytes_, "optimizer: read of ", bytes, " bytes at offset ", offset, " is past the end of ",
             path_, " (", bytes_, " bytes)");
  auto* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, bytes, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    KILN_CHECK(n > 0, "optimizer: read failed in ", path_, " at offset ", offset, " (",
               n == 0 ? "unexpected end of file" : std::strerror(errno), ")");
    p += n, offset += uint64_t(n), bytes -= uint64_t(n);
  }
}

void NvmeFile::write(uint64_t offset, const void* src, uint64_t bytes) {
  KILN_CHECK(offset + bytes <= bytes_, "optimizer: write of ", bytes, " bytes at offset ", offset,
             " is past the end of ", path_, " (", bytes_, " bytes)");
  auto* p = static_cast<const char*>(src);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd_, p, bytes, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    KILN_CHECK(n > 0, "optimizer: write failed in ", path_, " at offset ", offset, " (", std::strerror(errno), ")");
    p += n, offset += uint64_t(n), bytes -= uint64_t(n);
  }
}

const void* NvmeFile::map() const {
  if (!map_ && bytes_ > 0) {
    void* m = ::mmap(nullptr, bytes_, PROT_READ, MAP_SHARED, fd_, 0);
    KILN_CHECK(m != MAP_FAILED, "optimizer: cannot map ", path_, " (", std::strerror(errno), ")");
    map_ = m;
  }
  return map_;
}

}  // namespace kiln::optimizers
