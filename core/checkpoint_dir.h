// Crash-safe replacement of a checkpoint directory, and finding the newest complete checkpoint
// after a kill at any point (docs/RELIABILITY.md). The protocol for a checkpoint `dir`:
//   1. begin(): recover() any earlier interruption, then an empty dir.tmp.
//   2. The caller writes its files into dir.tmp, and last the marker (marker.json with "step").
//   3. commit(): every file below dir.tmp is fsynced; dir -> dir.old, dir.tmp -> dir (the parent
//      synced after each rename); dir.old removed.
// Only a directory with a marker counts as complete, and nothing complete is removed before a
// newer complete one is in place.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace kiln {

class CheckpointDir {
 public:
  // `marker`: the file written last, a JSON object with an integer "step".
  explicit CheckpointDir(std::string dir, std::string marker = "state.json");

  const std::string& path() const { return dir_; }
  std::string tmp() const { return dir_ + ".tmp"; }
  std::string old() const { return dir_ + ".old"; }

  // After any interruption of commit(): the newest complete of dir, dir.old and dir.tmp (by the
  // marker's step) ends up as dir and the others are removed. Returns its step, or -1 when no
  // complete checkpoint exists (incomplete leftovers are removed).
  int64_t recover() const;
  void begin() const;            // recover(), then an empty dir.tmp
  void write_marker(const std::string& json) const;  // into dir.tmp, fsynced: the checkpoint is complete
  void commit() const;           // swaps dir.tmp in (see above); dir.tmp must be complete

  // The step in `d`'s marker, or -1 when `d` has no readable marker (not a complete checkpoint).
  int64_t complete_step(const std::string& d) const;

 private:
  std::string dir_, marker_;
};

// fsyncs every file and folder below `path` (and `path` itself).
void sync_tree(const std::string& path);
// fsyncs the folder that holds `path`, making a rename or removal inside it durable.
void sync_parent(const std::string& path);

// Test hook for "killed here". Names the points: checkpoint.{written, synced, moved_old, moved_new,
// removed_old}. With KILN_CRASH_AT=name[:n] in the environment the n-th (default first) arrival
// at that point ends the process at once (_exit 86, no clean-up), as a kill would; a hook set by
// set_crash_hook runs instead (unit tests throw from it).
void crash_point(const char* name);
void set_crash_hook(std::function<void(const char*)> hook);  // empty: back to the environment

}  // namespace kiln
