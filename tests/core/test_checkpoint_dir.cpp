// CheckpointDir: a kill at every point of writing and swapping a checkpoint leaves the newest
// complete one findable, and recovery never removes a complete checkpoint before a newer one is in place.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "core/checkpoint_dir.h"
#include "core/error.h"
#include "core/files.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

struct Killed : std::runtime_error {
  Killed() : std::runtime_error("killed") {}
};

std::string read(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// One save of `step`: a payload file, the marker, the swap; `kill_at` names the crash point at
// which the "process dies" (an exception stands in for the kill: nothing cleans up after it).
void save(const CheckpointDir& ck, int step, const std::string& kill_at = "") {
  set_crash_hook([&](const char* point) {
    if (kill_at == point) throw Killed();
  });
  try {
    ck.begin();
    std::ofstream(ck.tmp() + "/weights") << "step " << step;
    ck.write_marker("{\"step\": " + std::to_string(step) + "}");
    ck.commit();
  } catch (const Killed&) {
  }
  set_crash_hook(nullptr);
}

class CheckpointDirTest : public ::testing::Test {
 protected:
  test::TempDir tmp;
  std::string dir() const { return tmp.path() + "/checkpoint"; }
};

TEST_F(CheckpointDirTest, CommitSwapsInTheNewCheckpoint) {
  CheckpointDir ck(dir());
  EXPECT_EQ(ck.recover(), -1);
  save(ck, 1);
  EXPECT_EQ(read(dir() + "/weights"), "step 1");
  save(ck, 2);
  EXPECT_EQ(read(dir() + "/weights"), "step 2");
  EXPECT_EQ(ck.complete_step(dir()), 2);
  EXPECT_FALSE(fs::exists(ck.tmp()));
  EXPECT_FALSE(fs::exists(ck.old()));
}

// The kill lands at each point of the second save; recovery finds step 1 before the marker is
// written and step 2 from then on, and leaves exactly one checkpoint behind.
TEST_F(CheckpointDirTest, AKillAtEveryPointLeavesTheNewestCompleteCheckpoint) {
  const std::pair<const char*, int> points[] = {{"checkpoint.written", 1},
                                                {"checkpoint.synced", 2},
                                                {"checkpoint.moved_old", 2},
                                                {"checkpoint.moved_new", 2},
                                                {"checkpoint.removed_old", 2}};
  for (const auto& [point, want] : points) {
    SCOPED_TRACE(point);
    remove_tree(tmp.path());  // not fs::remove_all: torch 2.11 interposes a copy that crashes (core/files.h)
    fs::create_directories(tmp.path());
    CheckpointDir ck(dir());
    save(ck, 1);
    save(ck, 2, point);
    EXPECT_EQ(ck.recover(), want);
    EXPECT_EQ(read(dir() + "/weights"), "step " + std::to_string(want));
    for (const std::string& leftover : {ck.tmp(), ck.old(), dir() + ".drop"}) EXPECT_FALSE(fs::exists(leftover)) << leftover;
    // Recovery is idempotent, and the run goes on from there.
    EXPECT_EQ(ck.recover(), want);
    save(ck, 3);
    EXPECT_EQ(ck.recover(), 3);
  }
}

// A kill during recovery itself (between its two renames) is recovered by the next call.
TEST_F(CheckpointDirTest, RecoveryPrefersTheNewestAndSurvivesItsOwnInterruption) {
  CheckpointDir ck(dir());
  save(ck, 4);
  fs::create_directories(ck.tmp());
  std::ofstream(ck.tmp() + "/weights") << "step 5";
  std::ofstream(ck.tmp() + "/state.json") << "{\"step\": 5}";
  fs::rename(dir(), dir() + ".drop");  // recovery was killed after moving the older one aside
  EXPECT_EQ(ck.recover(), 5);
  EXPECT_EQ(read(dir() + "/weights"), "step 5");
  EXPECT_FALSE(fs::exists(dir() + ".drop"));
}

TEST_F(CheckpointDirTest, AnIncompleteWriteAloneIsRemoved) {
  CheckpointDir ck(dir());
  fs::create_directories(ck.tmp());
  std::ofstream(ck.tmp() + "/weights") << "half";
  EXPECT_EQ(ck.recover(), -1);
  EXPECT_FALSE(fs::exists(ck.tmp()));
}

TEST_F(CheckpointDirTest, AForeignOrDamagedDirectoryIsLeftAloneWithAClearError) {
  CheckpointDir ck(dir());
  fs::create_directories(dir());
  std::ofstream(dir() + "/notes.txt") << "mine";
  EXPECT_TRUE(test::throws_with([&] { ck.recover(); }, {dir(), "state.json", "not a complete checkpoint"}));
  std::ofstream(dir() + "/state.json") << "{\"step\": \"five\"}";
  EXPECT_TRUE(test::throws_with([&] { ck.recover(); }, {"has no readable state.json"}));
  EXPECT_TRUE(fs::exists(dir() + "/notes.txt"));
  EXPECT_TRUE(test::throws_with([&] { ck.commit(); }, {"is not complete"}));
}

TEST_F(CheckpointDirTest, SyncTreeNamesWhatIsMissing) {
  EXPECT_TRUE(test::throws_with([&] { sync_tree(tmp.path() + "/absent"); }, {"absent", "does not exist"}));
  fs::create_directories(tmp.path() + "/a/b");
  std::ofstream(tmp.path() + "/a/b/f") << "x";
  sync_tree(tmp.path() + "/a");
}

}  // namespace
}  // namespace kiln
