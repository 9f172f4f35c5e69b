// Strict YAML reading: unknown keys, wrong types and missing keys name the file, line and key path.
#include <gtest/gtest.h>

#include <fstream>

#include "core/yaml_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

std::string write(const test::TempDir& dir, const std::string& text) {
  std::string path = dir / "c.yaml";
  std::ofstream(path) << text;
  return path;
}

using test::error_of;

TEST(Yaml, ReadsKnownKeysAndNestedMaps) {
  test::TempDir dir;
  std::string path = write(dir, "a: 3\nb:\n  c: 2.5\n  d: [1, 2]\n");
  yaml::MapReader r(yaml::load_file(path), path, "");
  int64_t a = 0;
  r.get("a", a);
  auto b = r.child("b");
  double c = 0;
  std::vector<int64_t> d;
  b.get("c", c);
  b.get("d", d);
  std::string missing = "keep";
  r.get("missing", missing);
  b.finish();
  r.finish();
  EXPECT_EQ(a, 3);
  EXPECT_EQ(c, 2.5);
  EXPECT_EQ(d, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(missing, "keep");
}

// The recorder sees every key asked for, present or not, under its path, a list's entries as "[]",
// and only while it is alive.
TEST(Yaml, KeyRecorderCollectsEveryKeyAskedFor) {
  test::TempDir dir;
  std::string path = write(dir, "a: 3\nrules:\n  - m: x\n  - m: y\n    n: 2\n");
  std::set<std::string> keys, lists;
  {
    yaml::KeyRecorder recorder;
    yaml::MapReader r(yaml::load_file(path), path, "top");
    int64_t a = 0, absent = 0;
    r.get("a", a);
    r.get("absent", absent);
    auto sub = r.child("sub");
    sub.get("deep", absent);
    for (yaml::MapReader& e : r.children("rules")) {
      std::string m;
      e.get("m", m);
      e.get("n", absent);
    }
    keys = recorder.keys();
    lists = recorder.lists();
  }
  EXPECT_EQ(keys, (std::set<std::string>{"top.a", "top.absent", "top.sub", "top.sub.deep", "top.rules",
                                         "top.rules[].m", "top.rules[].n"}));
  EXPECT_EQ(lists, (std::set<std::string>{"top.rules"}));
  EXPECT_EQ(yaml::KeyRecorder::active(), nullptr);
}

TEST(Yaml, UnknownKeyNamesPathAndLine) {
  test::TempDir dir;
  std::string path = write(dir, "a: 3\nb:\n  c: 2.5\n  typo: 1\n");
  yaml::MapReader r(yaml::load_file(path), path, "");
  int64_t a = 0;
  double c = 0;
  r.get("a", a);
  auto b = r.child("b");
  b.get("c", c);
  std::string msg = error_of([&] { b.finish(); });
  EXPECT_NE(msg.find("c.yaml:4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("b.typo"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown key"), std::string::npos) << msg;
}

TEST(Yaml, WrongTypeNamesKeyAndLine) {
  test::TempDir dir;
  std::string path = write(dir, "x: 1\nn: abc\n");
  yaml::MapReader r(yaml::load_file(path), path, "model");
  int64_t n = 0;
  std::string msg = error_of([&] { r.get("n", n); });
  EXPECT_NE(msg.find("c.yaml:2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.n"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected an integer"), std::string::npos) << msg;
}

TEST(Yaml, AbsentOrEmptySectionsReadAsEmptyMaps) {
  test::TempDir dir;
  std::string path = write(dir, "a:\nb: 1\n");
  yaml::MapReader r(yaml::load_file(path), path, "");
  int64_t x = 7, b = 0;
  auto empty = r.child("a"), absent = r.child("zzz");
  empty.get("x", x);
  absent.get("x", x);
  empty.finish();
  absent.finish();
  r.get("b", b);
  r.finish();
  EXPECT_EQ(x, 7);
  EXPECT_EQ(b, 1);
  std::string list = write(dir, "a: [1, 2]\n");
  yaml::MapReader l(yaml::load_file(list), list, "");
  EXPECT_NE(error_of([&] { l.child("a"); }).find("expected a mapping"), std::string::npos);
}

TEST(Yaml, MissingRequiredKeyAndSyntaxError) {
  test::TempDir dir;
  std::string path = write(dir, "x: 1\n");
  yaml::MapReader r(yaml::load_file(path), path, "");
  int64_t y = 0;
  EXPECT_NE(error_of([&] { r.require("y", y); }).find("required key is missing"), std::string::npos);
  std::string bad = write(dir, "a: [1, 2\nb: 3\n");
  std::string msg = error_of([&] { yaml::load_file(bad); });
  EXPECT_NE(msg.find("YAML syntax error"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { yaml::load_file(dir / "nope.yaml"); }).find("cannot open"), std::string::npos);
}

TEST(Yaml, AKeyGivenTwiceIsAnErrorNamingBothLines) {
  test::TempDir dir;
  std::string msg = error_of([&] { yaml::load_file(write(dir, "a: 1\nb:\n  c: 2\n  d: 3\n  c: 4\n")); });
  EXPECT_NE(msg.find("c.yaml:5: key 'c' appears twice in one mapping (first at line 3)"), std::string::npos) << msg;
  msg = error_of([&] { yaml::load_file(write(dir, "list:\n  - {x: 1, x: 2}\n")); });
  EXPECT_NE(msg.find("key 'x' appears twice"), std::string::npos) << msg;
  EXPECT_NO_THROW(yaml::load_file(write(dir, "a: {c: 1}\nb: {c: 1}\n")));  // the same key in two mappings
}

TEST(Yaml, AKeyThatIsNotANameIsAnError) {
  // Found by fuzz_recipe: such a key threw yaml-cpp's bad conversion past every reader.
  test::TempDir dir;
  EXPECT_TRUE(test::throws_with([&] { yaml::load_file(write(dir, "a:\n  {b: 1}: 2\n")); }, {"c.yaml:2: a key must be a name, not a mapping"}));
  EXPECT_TRUE(test::throws_with([&] { yaml::load_file(write(dir, "[1, 2]: 3\n")); }, {"a key must be a name, not a list"}));
  EXPECT_TRUE(test::throws_with([&] { yaml::load_file(write(dir, "~: 3\n")); }, {"a key must be a name, not a null"}));
}

TEST(Yaml, DiffNamesEveryChangedKeyPath) {
  const YAML::Node a = YAML::Load("optim: {lr: 0.1, clip: 1}\nparts: [{w: 1}, {w: 2}]\nrun: {steps: 5}\n");
  EXPECT_TRUE(yaml::diff(a, a).empty());
  const YAML::Node b = YAML::Load("optim: {lr: 0.2, clip: 1, extra: 3}\nparts: [{w: 1}, {w: 5}]\nrun: {steps: 5}\n");
  EXPECT_EQ(yaml::diff(a, b), (std::vector<std::string>{"optim.extra", "optim.lr", "parts[1].w"}));
  EXPECT_EQ(yaml::diff(a, YAML::Load("optim: 3\nparts: []\nrun: {steps: 5}\n")),
            (std::vector<std::string>{"optim", "parts"}));
}

}  // namespace
}  // namespace kiln
