// TensorBoard event files: CRC32C known answers and the SSE4.2 path against the table, kiln's files decoded
// by an independent Python reader (tests/core/read_tfevents.py, python3-protobuf), corruption and write errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensorboard.h"
#include "tests/test_util.h"

namespace kiln::tensorboard {
namespace {

using test::throws_with;
using nlohmann::json;

constexpr const char* kPython = "/usr/bin/python3";

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct ReaderRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

ReaderRun run_reader(const std::string& path) {
  const std::string cmd = std::string(kPython) + " " + shell_quote(test::source_path("tests/core/read_tfevents.py")) +
                          " " + shell_quote(path) + " 2>&1";
  ReaderRun run;
  std::FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return run;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) run.output.append(buf, n);
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

// Python or protobuf missing is a failure, never a skip: a skipped reader would leave the writer unchecked.
::testing::AssertionResult reader_ready() {
  if (access(kPython, X_OK) != 0) {
    return ::testing::AssertionFailure() << kPython << " is missing; run tools/setup.sh (it installs python3 and "
                                         << "python3-protobuf)";
  }
  return ::testing::AssertionSuccess();
}

// The reader's JSON lines; a failed run is reported with its output and gives no lines.
std::vector<json> decode(const std::string& path) {
  const ReaderRun run = run_reader(path);
  if (run.exit_code != 0) {
    ADD_FAILURE() << "read_tfevents.py failed on " << path << " (exit=" << run.exit_code << "):\n"
                  << run.output << (run.exit_code == 3 || run.exit_code == 127 ? "\nrun tools/setup.sh" : "");
    return {};
  }
  std::vector<json> lines;
  size_t begin = 0;
  for (size_t end; (end = run.output.find('\n', begin)) != std::string::npos; begin = end + 1) {
    lines.push_back(json::parse(run.output.substr(begin, end - begin)));
  }
  return lines;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// What the reader must print for a scalar written as `value`: its float32 rounding, or the non-finite name.
json expected_simple_value(double value) {
  const float f = static_cast<float>(value);
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  return static_cast<double>(f);
}

TEST(TensorBoard, Crc32cKnownAnswers) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xE3069283u);
  EXPECT_EQ(crc32c_table(digits.data(), digits.size()), 0xE3069283u);
  // RFC 3720 (iSCSI) appendix B.4.
  const std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xFF);
  std::vector<unsigned char> ascending(32);
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(ascending.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
  // Rotate 0xE3069283 right by 15 (0x2507C60D) and add 0xA282EAD8, worked by hand and by the Python reader.
  EXPECT_EQ(mask_crc32c(0xE3069283u), 0xC78AB0E5u);
  EXPECT_EQ(mask_crc32c(0u), 0xA282EAD8u);
}

TEST(TensorBoard, Crc32cFastPathMatchesTable) {
  std::mt19937 rng(17);
  std::vector<unsigned char> bytes(4097 + 8);
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  for (size_t size : {0, 1, 7, 8, 9, 19, 111, 4097}) {
    for (size_t offset = 0; offset < 8; ++offset) {  // every alignment of the 8-byte loads
      EXPECT_EQ(crc32c(bytes.data() + offset, size), crc32c_table(bytes.data() + offset, size))
          << "size=" << size << " offset=" << offset << " hardware=" << crc32c_uses_hardware();
    }
  }
  std::printf("crc32c uses the SSE4.2 instruction here: %s\n", crc32c_uses_hardware() ? "yes" : "no");
}

TEST(TensorBoard, PythonReaderDecodesScalarsAndText) {
  ASSERT_TRUE(reader_ready());
  test::TempDir dir;
  struct Scalar {
    std::string tag;
    double value;
    int64_t step;
    double wall_time;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Scalar> scalars = {
      {"train/loss", 2.5, 0, 1700000000.25},
      {"train/loss", 0.1, 1, 1700000001.125},  // not a float: read back as float(0.1)
      {"train/reward", -3.75, 1, 1700000001.5},
      {"train/reward", -123456789.123, int64_t{1} << 40, 1700000002.0},
      {"stats/small", 1e-30, 2, 1700000003.0},
      {"stats/subnormal", 1e-42, 3, 1700000004.0},
      {"stats/huge", 3.0e38, 4, 1700000005.0},
      {"stats/beyond_float", -1e300, 5, 1700000006.0},  // becomes -inf as a float32
      {"stats/zero", 0.0, -1, 1700000007.0},            // a negative step is a 10-byte varint
      {"stats/nan", std::nan(""), 6, 1700000008.0},
      {"stats/inf", inf, 7, 1700000009.0},
      {"ünïcödé/损失 🚀", 42.0, 8, 1700000010.0},
  };
  const std::string text = "line one\nline two: ünïcödé, 日本語, 🚀\n\n| a | b |\n|---|---|\n| 1 | 2 |";
  std::string path;
  const double before = now_seconds();
  {
    EventWriter w(dir.path());
    path = w.path();
    for (const auto& s : scalars) w.add_scalar(s.tag, s.value, s.step, s.wall_time);
    w.add_text("samples/prompt 0", text, 9, 1700000011.0);
    w.add_text("samples/broken", std::string("cut\xE6\x97") + "|bad\xFF|", 10, 1700000012.0);
    w.add_scalar("default/wall_time", 1.0, 11);
    w.flush();
  }  // the destructor closes; nothing is left in a buffer
  const double after = now_seconds();

  const std::vector<json> lines = decode(path);
  ASSERT_EQ(lines.size(), scalars.size() + 4);
  EXPECT_EQ(lines[0]["file_version"], "brain.Event:2");
  EXPECT_EQ(lines[0]["step"], 0);
  EXPECT_GE(lines[0]["wall_time"].get<double>(), before - 1);
  EXPECT_LE(lines[0]["wall_time"].get<double>(), after + 1);
  for (size_t i = 0; i < scalars.size(); ++i) {
    const json& line = lines[i + 1];
    const Scalar& s = scalars[i];
    EXPECT_EQ(line["tag"], s.tag) << i;
    EXPECT_EQ(line["step"].get<int64_t>(), s.step) << s.tag;
    EXPECT_EQ(line["wall_time"].get<double>(), s.wall_time) << s.tag;
    EXPECT_EQ(line["simple_value"], expected_simple_value(s.value)) << s.tag << " wrote " << s.value;
  }
  const json& t = lines[scalars.size() + 1];
  EXPECT_EQ(t["tag"], "samples/prompt 0");
  EXPECT_EQ(t["text"], text);
  EXPECT_EQ(t["plugin_name"], "text");
  EXPECT_EQ(t["step"], 9);
  EXPECT_EQ(t["wall_time"].get<double>(), 1700000011.0);
  // A cut multi-byte character and a stray byte each become U+FFFD.
  EXPECT_EQ(lines[scalars.size() + 2]["text"], "cut\xEF\xBF\xBD\xEF\xBF\xBD|bad\xEF\xBF\xBD|");
  const json& d = lines[scalars.size() + 3];
  EXPECT_EQ(d["tag"], "default/wall_time");
  EXPECT_GE(d["wall_time"].get<double>(), before);
  EXPECT_LE(d["wall_time"].get<double>(), after);
}

TEST(TensorBoard, FileNameAndDirectory) {
  ASSERT_TRUE(reader_ready());
  test::TempDir dir;
  const std::string logdir = dir / "run/tb/";  // parents created, trailing slash dropped
  EventWriter a(logdir);
  EventWriter b(logdir);  // same second and process: must not share a file
  EXPECT_NE(a.path(), b.path());
  const std::string prefix = dir / "run/tb/events.out.tfevents.";
  for (const std::string& p : {a.path(), b.path()}) {
    EXPECT_EQ(p.rfind(prefix, 0), 0u) << p;
    EXPECT_EQ(p.substr(p.size() - 5), ".kiln") << p;
    EXPECT_NE(p.find("." + std::to_string(getpid()) + "."), std::string::npos) << p;
  }
  a.add_scalar("x", 1.0, 1, 5.0);
  b.add_scalar("y", 2.0, 2, 6.0);
  a.close();
  b.close();
  const auto la = decode(a.path());
  const auto lb = decode(b.path());
  ASSERT_EQ(la.size(), 2u);
  ASSERT_EQ(lb.size(), 2u);
  EXPECT_EQ(la[1]["tag"], "x");
  EXPECT_EQ(lb[1]["tag"], "y");
}

TEST(TensorBoard, PythonReaderCatchesCorruptedBytes) {
  ASSERT_TRUE(reader_ready());
  test::TempDir dir;
  const std::string path = dir / "events.out.tfevents.test";
  {
    EventWriter w = EventWriter::open_file(path);
    w.add_scalar("loss", 1.5, 1, 100.0);
    w.add_text("note", "hello", 2, 101.0);
    w.close();
  }
  const std::string good = read_bytes(path);
  ASSERT_EQ(run_reader(path).exit_code, 0) << run_reader(path).output;  // so a failure below is the corruption

  std::string bad = good;
  bad[bad.size() - 6] ^= 0x01;  // inside the last record's data
  write_bytes(path, bad);
  ReaderRun run = run_reader(path);
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("data CRC mismatch"), std::string::npos) << run.output;

  bad = good;
  bad[0] ^= 0x40;  // the first record's length
  write_bytes(path, bad);
  run = run_reader(path);
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("length CRC mismatch"), std::string::npos) << run.output;
}

// scan_event_file, what a resumed run cuts by: each record's offset, size and step agree with the
// Python reader; a record cut short ends the scan; a damaged one is an error at its offset.
TEST(TensorBoard, ScanFindsEveryRecordAndItsStep) {
  ASSERT_TRUE(reader_ready());
  test::TempDir dir;
  const std::string path = dir / "events.out.tfevents.scan";
  {
    EventWriter w = EventWriter::open_file(path);
    for (int64_t step : {int64_t{0}, int64_t{1}, int64_t{1}, int64_t{-1}, int64_t{1} << 40, int64_t{7}})
      w.add_scalar("s", double(step), step, 100.0);
    w.add_text("t", std::string(300, 'x'), 3, 101.0);  // a record longer than one varint byte's 127
    w.close();
  }
  const std::string good = read_bytes(path);
  const EventFileScan scan = scan_event_file(path);
  const std::vector<json> lines = decode(path);
  ASSERT_EQ(scan.records.size(), lines.size());
  uint64_t end = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(scan.records[i].step, lines[i]["step"].get<int64_t>()) << i;
    EXPECT_EQ(scan.records[i].offset, end) << i;
    end += scan.records[i].size;
  }
  EXPECT_EQ(scan.complete_size, good.size());
  EXPECT_EQ(scan.file_size, good.size());

  // Every cut inside the last record leaves the records before it.
  const EventRecordSpan last = scan.records.back();
  for (uint64_t keep = last.offset; keep < good.size(); keep += 37) {
    write_bytes(path, good.substr(0, keep));
    const EventFileScan cut = scan_event_file(path);
    EXPECT_EQ(cut.records.size(), scan.records.size() - 1) << keep;
    EXPECT_EQ(cut.complete_size, last.offset) << keep;
    EXPECT_EQ(cut.file_size, keep);
  }
  std::string bad = good;
  bad[last.offset + 14] ^= 0x01;  // the last record's data
  write_bytes(path, bad);
  EXPECT_TRUE(throws_with([&] { scan_event_file(path); },
                          {"record at offset " + std::to_string(last.offset), path, "data CRC", "damaged"}));
  bad = good;
  bad[scan.records[1].offset] ^= 0x01;  // the second record's length
  write_bytes(path, bad);
  EXPECT_TRUE(throws_with([&] { scan_event_file(path); },
                          {"record at offset " + std::to_string(scan.records[1].offset), "length CRC"}));
  // Framing and CRCs right, but the data no Event (a key whose varint never ends).
  const std::string data = "\xff\xff";
  std::string record;
  auto put = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) record.push_back(char((v >> (8 * i)) & 0xFF));
  };
  put(data.size(), 8);
  put(mask_crc32c(crc32c(record.data(), 8)), 4);
  record += data;
  put(mask_crc32c(crc32c(data.data(), data.size())), 4);
  write_bytes(path, good + record);
  EXPECT_TRUE(throws_with([&] { scan_event_file(path); },
                          {"record at offset " + std::to_string(good.size()), "not an Event proto"}));
}

TEST(TensorBoard, ErrorsNameThePath) {
  test::TempDir dir;
  const std::string file = dir / "plain_file";
  write_bytes(file, "x");
  // A regular file where a directory should be: fails even as root, unlike a read-only directory.
  EXPECT_TRUE(throws_with([&] { EventWriter w(file + "/tb"); }, {"tensorboard:", file + "/tb", "log directory"}));
  EXPECT_TRUE(throws_with([&] { EventWriter w(file); }, {"tensorboard:", file}));
  EXPECT_TRUE(throws_with([&] { EventWriter::open_file(file + "/events"); }, {"tensorboard:", file + "/events"}));

  EventWriter w(dir / "tb");
  EXPECT_TRUE(throws_with([&] { w.add_scalar("", 1.0, 0); }, {"tensorboard:", "tag is empty"}));
  EXPECT_TRUE(throws_with([&] { w.add_text("bad\xC0\xAF", "t", 0); }, {"tensorboard:", "not UTF-8", "offset=3"}));
  w.close();
  EXPECT_TRUE(throws_with([&] { w.add_scalar("x", 1.0, 0); }, {"tensorboard:", "closed", w.path()}));
  EXPECT_TRUE(throws_with([&] { w.flush(); }, {"tensorboard:", "closed", w.path()}));
  w.close();  // a second close does nothing
}

TEST(TensorBoard, FullDiskIsAnErrorNamingTheFile) {
  {
    EventWriter w = EventWriter::open_file("/dev/full");
    w.add_scalar("loss", 1.0, 1);  // still in the stdio buffer
    EXPECT_TRUE(throws_with([&] { w.flush(); }, {"tensorboard:", "cannot flush", "/dev/full", "No space"}));
    // The file was closed, so nothing is written after a torn record.
    EXPECT_TRUE(throws_with([&] { w.add_scalar("loss", 2.0, 2); }, {"tensorboard:", "failed write", "/dev/full"}));
    EXPECT_TRUE(throws_with([&] { w.flush(); }, {"tensorboard:", "/dev/full"}));
  }
  {
    // A record larger than the buffer fails in the write itself.
    EventWriter w = EventWriter::open_file("/dev/full");
    EXPECT_TRUE(throws_with([&] { w.add_text("big", std::string(1 << 20, 'a'), 1); },
                            {"tensorboard:", "cannot write", "/dev/full"}));
  }
  {
    EventWriter w = EventWriter::open_file("/dev/full");
    w.add_scalar("loss", 1.0, 1);
    EXPECT_TRUE(throws_with([&] { w.close(); }, {"tensorboard:", "/dev/full"}));
  }
}

}  // namespace
}  // namespace kiln::tensorboard
