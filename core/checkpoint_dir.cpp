// CheckpointDir: the write-then-swap protocol for checkpoint directories and its recovery after a
// kill (checkpoint_dir.h); fsync helpers and the crash-point test hook.
#include "core/checkpoint_dir.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/files.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

bool exists(const std::string& p) {
  struct stat st;
  return lstat(p.c_str(), &st) == 0;
}

// fsync of one file or folder; returns the errno of a failure, 0 on success. Some file systems
// (tmpfs, some FUSE mounts) cannot sync a folder; that loses nothing here and counts as success.
int fsync_errno(const char* p, bool directory) {
  const int fd = ::open(p, O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return errno;
  const int rc = ::fsync(fd), err = rc == 0 ? 0 : errno;
  ::close(fd);
  return directory && (err == EINVAL || err == ENOTSUP) ? 0 : err;
}

void fsync_path(const std::string& p, bool directory) {
  const int err = fsync_errno(p.c_str(), directory);
  KILN_CHECK(err == 0, "checkpoint: cannot sync ", p, " (", std::strerror(err), "); the disk may be full or failing");
}

thread_local std::string walk_failed;  // the path nftw's callback could not sync
thread_local int walk_errno = 0;

void rename_synced(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  KILN_CHECK(!ec, "checkpoint: cannot rename ", from, " to ", to, " (", ec.message(), ")");
  sync_parent(to);
}

std::mutex hook_mutex;
std::function<void(const char*)> crash_hook;

}  // namespace

void sync_tree(const std::string& path) {
  struct stat st;
  KILN_CHECK(lstat(path.c_str(), &st) == 0, "checkpoint: cannot sync ", path, ": it does not exist");
  if (!S_ISDIR(st.st_mode)) return fsync_path(path, false);
  walk_failed.clear();
  // No exception may cross nftw (C code): the callback stops the walk and says where.
  const int rc = nftw(path.c_str(), [](const char* p, const struct stat* s, int type, struct FTW*) {
    const bool dir = type == FTW_DP || type == FTW_D;
    if (!dir && !(type == FTW_F && S_ISREG(s->st_mode))) return 0;
    walk_errno = fsync_errno(p, dir);
    if (walk_errno != 0) walk_failed = p;
    return walk_errno != 0 ? 1 : 0;
  }, 16, FTW_DEPTH | FTW_PHYS);
  KILN_CHECK(walk_failed.empty(), "checkpoint: cannot sync ", walk_failed, " (", std::strerror(walk_errno),
             "); the disk may be full or failing");
  KILN_CHECK(rc == 0, "checkpoint: cannot walk ", path, " to sync it (", std::strerror(errno), ")");
}

void sync_parent(const std::string& path) {
  fs::path parent = fs::path(path).parent_path();
  fsync_path(parent.empty() ? "." : parent.string(), true);
}

void crash_point(const char* name) {
  {
    std::lock_guard<std::mutex> lock(hook_mutex);
    if (crash_hook) return crash_hook(name);
  }
  static const std::pair<std::string, int64_t> target = [] {
    const char* env = std::getenv("KILN_CRASH_AT");
    std::string spec = env ? env : "";
    const size_t colon = spec.find(':');
    if (colon == std::string::npos) return std::make_pair(spec, int64_t(1));
    return std::make_pair(spec.substr(0, colon), int64_t(std::atoll(spec.c_str() + colon + 1)));
  }();
  static std::atomic<int64_t> arrivals{0};
  if (target.first.empty() || target.first != name) return;
  if (++arrivals == target.second) ::_exit(86);
}

void set_crash_hook(std::function<void(const char*)> hook) {
  std::lock_guard<std::mutex> lock(hook_mutex);
  crash_hook = std::move(hook);
}

CheckpointDir::CheckpointDir(std::string dir, std::string marker) : dir_(std::move(dir)), marker_(std::move(marker)) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
}

int64_t CheckpointDir::complete_step(const std::string& d) const {
  std::ifstream f(d + "/" + marker_);
  if (!f.good()) return -1;
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) return -1;
  const int64_t step = j["step"].get<int64_t>();
  return step >= 0 ? step : -1;
}

int64_t CheckpointDir::recover() const {
  const std::string drop = dir_ + ".drop";  // a superseded dir on its way out
  struct Candidate {
    std::string path;
    int64_t step;
  };
  std::vector<Candidate> complete;
  for (const std::string& d : {dir_, old(), tmp()}) {
    if (!exists(d)) continue;
    const int64_t step = complete_step(d);
    // dir and dir.old only ever come from renaming a complete dir.tmp: without a marker they are
    // not kiln's, or were damaged, and are left to the user.
    KILN_CHECK(step >= 0 || d == tmp(), "checkpoint: ", d, " has no readable ", marker_,
               " with a \"step\", so it is not a complete checkpoint; move it away or restore its ", marker_);
    if (step >= 0) complete.push_back({d, step});
  }
  if (complete.empty()) {
    remove_tree(tmp());  // an interrupted write
    remove_tree(drop);
    return -1;
  }
  Candidate best = complete.front();  // ties go to dir, then dir.old
  for (const auto& c : complete)
    if (c.step > best.step) best = c;
  if (best.path != dir_) {
    if (exists(dir_)) {
      remove_tree(drop);
      rename_synced(dir_, drop);
    }
    rename_synced(best.path, dir_);
  }
  for (const std::string& d : {old(), tmp(), drop}) remove_tree(d);
  sync_parent(dir_);
  return best.step;
}

void CheckpointDir::begin() const {
  recover();
  remove_tree(tmp());
  std::error_code ec;
  fs::create_directories(tmp(), ec);
  KILN_CHECK(!ec, "checkpoint: cannot create ", tmp(), " (", ec.message(), "); check the run directory");
}

void CheckpointDir::write_marker(const std::string& json) const {
  crash_point("checkpoint.written");
  sync_tree(tmp());  // everything else is on disk before the marker says it is
  const std::string part = tmp() + "/" + marker_ + ".part", path = tmp() + "/" + marker_;
  {
    std::ofstream f(part);
    f << json;
    f.flush();
    KILN_CHECK(f.good(), "checkpoint: cannot write ", part, "; check the disk space");
  }
  fsync_path(part, false);
  rename_synced(part, path);
  crash_point("checkpoint.synced");
}

void CheckpointDir::commit() const {
  KILN_CHECK(complete_step(tmp()) >= 0, "checkpoint: ", tmp(), " is not complete (no ", marker_,
             "); write_marker() comes before commit()");
  if (exists(dir_)) {
    remove_tree(old());
    rename_synced(dir_, old());
    crash_point("checkpoint.moved_old");
  }
  rename_synced(tmp(), dir_);
  crash_point("checkpoint.moved_new");
  remove_tree(old());
  sync_parent(dir_);
  crash_point("checkpoint.removed_old");
}

}  // namespace kiln
