// Cutting a run's logs back to a step (core/step_logs.h): the lines and event records at or before
// it stay byte for byte, later ones and a torn last write go, and what cannot be placed is an error.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/step_logs.h"
#include "core/tensorboard.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

ino_t inode(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

std::string line(int64_t step, const std::string& rest = "") {
  return "{\"step\":" + std::to_string(step) + rest + "}\n";
}

// A resumed run's metrics.jsonl: the eval at step 0, steps 1-3 with the eval at 3, then step 4
// of the interrupted run and a line it was killed while writing.
TEST(StepLogs, JsonlKeepsTheLinesThroughTheStepAndDropsATornOne) {
  test::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  const std::string kept =
      line(0, ",\"eval_k\":1") + line(1, ",\"loss\":0.5") + line(2) + line(3) + line(3, ",\"eval\":{}");
  write_bytes(path, kept + line(4) + "{\"step\":5,\"los");
  const ino_t before = inode(path);
  LogCut cut = keep_jsonl_through(path, 3);
  EXPECT_EQ(read_bytes(path), kept);
  EXPECT_EQ(cut.kept, 5);
  EXPECT_EQ(cut.dropped, 1);
  EXPECT_EQ(cut.torn_bytes, 14u);
  EXPECT_EQ(inode(path), before) << "a tail to drop is truncated in place";
  // Nothing more to drop: the file is left as it is; a second cut changes nothing.
  cut = keep_jsonl_through(path, 3);
  EXPECT_EQ(read_bytes(path), kept);
  EXPECT_EQ(cut.dropped + int64_t(cut.torn_bytes), 0);
  // A cut at or past the last step keeps everything; a missing file is nothing to cut.
  EXPECT_EQ(keep_jsonl_through(path, 100).kept, 5);
  EXPECT_EQ(keep_jsonl_through(dir / "none.jsonl", 1).kept, 0);
}

// Lines of a later step before kept ones (a log that was appended to without a cut): the kept
// lines are written beside the file, in order, and renamed over it; no temporary is left.
TEST(StepLogs, JsonlWithLaterStepsBeforeKeptOnesIsRewritten) {
  test::TempDir dir;
  const std::string path = dir / "samples.jsonl";
  write_bytes(path, line(2, ",\"prompt\":\"a\"") + line(3, ",\"prompt\":\"b\"") + line(2, ",\"prompt\":\"c\"") + "\n" +
                        line(4) + line(1));
  const LogCut cut = keep_jsonl_through(path, 2);
  EXPECT_EQ(read_bytes(path), line(2, ",\"prompt\":\"a\"") + line(2, ",\"prompt\":\"c\"") + "\n" + line(1));
  EXPECT_EQ(cut.kept, 4);  // a blank line stays where it was
  EXPECT_EQ(cut.dropped, 2);
  EXPECT_FALSE(std::filesystem::exists(path + ".cut.tmp"));
}

TEST(StepLogs, JsonlLineWithoutAStepIsAnErrorNamingTheLine) {
  test::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  for (const std::string& bad : {std::string("not json\n"), std::string("[1, 2]\n"), std::string("{\"step\":\"3\"}\n"),
                                 std::string("{\"loss\":1}\n")}) {
    const std::string text = line(1) + bad + line(2);
    write_bytes(path, text);
    EXPECT_TRUE(test::throws_with([&] { keep_jsonl_through(path, 1); },
                                  {"resume: " + path + ":2", "integer \"step\"", "fix or remove that line"}))
        << bad;
    EXPECT_EQ(read_bytes(path), text) << "an error leaves the file as it was";
  }
}

// Event files: every file in the folder keeps the records through the step (its file_version
// among them) byte for byte and loses the later ones and a torn last record; a copy left by an
// interrupted cut is removed, other files are not touched.
TEST(StepLogs, EventsKeepTheRecordsThroughTheStep) {
  test::TempDir dir;
  const std::string tb = dir / "tensorboard";
  std::filesystem::create_directories(tb);
  const std::string a = tb + "/events.out.tfevents.1.host.1.kiln", b = tb + "/events.out.tfevents.2.host.2.kiln";
  {
    tensorboard::EventWriter w = tensorboard::EventWriter::open_file(a);
    w.add_scalar("eval/accuracy", 0.1, 0, 10.0);
    for (int64_t s = 1; s <= 5; ++s) {
      w.add_scalar("train/loss", 1.0 / double(s), s, 10.0 + double(s));
      w.add_text("samples", "step " + std::to_string(s), s, 10.0 + double(s));
    }
    w.close();
  }
  const std::string whole = read_bytes(a);
  const tensorboard::EventFileScan scan = tensorboard::scan_event_file(a);
  ASSERT_EQ(scan.records.size(), 12u);
  const uint64_t through3 = scan.records[7].offset + scan.records[7].size;  // version, eval, 3 x (loss, text)
  ASSERT_EQ(scan.records[7].step, 3);
  ASSERT_EQ(scan.records[8].step, 4);
  write_bytes(a, whole + whole.substr(scan.records[1].offset, 9));  // a record cut short
  {
    tensorboard::EventWriter w = tensorboard::EventWriter::open_file(b);  // a later writer, all after the cut
    w.add_scalar("train/loss", 0.25, 4, 20.0);
    w.close();
  }
  write_bytes(tb + "/kiln-cut.tmp", "left by a kill");
  write_bytes(tb + "/notes.txt", "{\"step\": 9}\n");
  const LogCut cut = keep_events_through(tb, 3);
  EXPECT_EQ(read_bytes(a), whole.substr(0, through3));
  EXPECT_EQ(tensorboard::scan_event_file(b).records.size(), 1u);  // its file_version alone
  EXPECT_EQ(cut.kept, 9);
  EXPECT_EQ(cut.dropped, 5);
  EXPECT_EQ(cut.torn_bytes, 9u);
  EXPECT_FALSE(std::filesystem::exists(tb + "/kiln-cut.tmp"));
  EXPECT_EQ(read_bytes(tb + "/notes.txt"), "{\"step\": 9}\n");
  EXPECT_EQ(keep_events_through(dir / "none", 3).kept, 0);
  // A record of a later step before kept ones (b: version, version, step 2, version): rewritten
  // in order.
  {
    tensorboard::EventWriter w = tensorboard::EventWriter::open_file(b);
    w.add_scalar("train/loss", 0.5, 2, 21.0);
    w.close();
    tensorboard::EventWriter::open_file(b).close();
  }
  EXPECT_EQ(keep_events_through(tb, 3).dropped, 0);
  EXPECT_EQ(keep_events_through(tb, 1).dropped, 5);  // a: steps 2 and 3, loss and text; b: its step 2
  const tensorboard::EventFileScan left = tensorboard::scan_event_file(b);
  ASSERT_EQ(left.records.size(), 3u);  // the three file_version records
  for (const auto& r : left.records) EXPECT_EQ(r.step, 0);
  EXPECT_FALSE(std::filesystem::exists(tb + "/kiln-cut.tmp"));
}

}  // namespace
}  // namespace kiln
