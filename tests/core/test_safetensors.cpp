// Tests of core/safetensors: round trips of every dtype and odd shape, hand-built files read by the
// reader, sharded checkpoints, and a clear error naming file and tensor for every kind of bad file.
#include "core/safetensors.h"

#include <ATen/ATen.h>
#include <signal.h>
#include <sys/resource.h>
#include <torch/version.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "tests/test_util.h"

namespace kiln::safetensors {
namespace {

namespace fs = std::filesystem;
using kiln::test::all_equal;
using kiln::test::TempDir;

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
constexpr bool kHasFloat8 = true;
#else
constexpr bool kHasFloat8 = false;
#endif

// Passes when fn throws kiln::Error whose message contains every one of `parts`.
using kiln::test::throws_with;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// An independent writer: the 8-byte length, the header text (space-padded to 8 when asked), data.
std::string build_file(std::string header, const std::string& data, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  return u64_le(header.size()) + header + data;
}

std::string float_bytes(std::initializer_list<float> values) {
  std::string s;
  for (float v : values) {
    char b[4];
    std::memcpy(b, &v, 4);
    s.append(b, 4);
  }
  return s;
}

at::Tensor make(at::ScalarType type, const std::vector<int64_t>& shape) {
  auto opts = at::TensorOptions().dtype(at::kLong);
  switch (type) {
    case at::kBool: return at::randint(0, 2, shape, opts).to(at::kBool);
    case at::kByte: return at::randint(0, 256, shape, opts).to(at::kByte);
    case at::kChar: return at::randint(-128, 128, shape, opts).to(at::kChar);
    case at::kShort: return at::randint(-32768, 32768, shape, opts).to(at::kShort);
    case at::kInt: return at::randint(-(1ll << 31), (1ll << 31) - 1, shape, opts).to(at::kInt);
    case at::kLong: return at::randint(-(1ll << 50), 1ll << 50, shape, opts);
    default: return (at::randn(shape, at::TensorOptions().dtype(at::kDouble)) * 100).to(type);
  }
}

const std::vector<at::ScalarType> kTypes = {at::kBool, at::kByte,  at::kChar,     at::kShort,
                                            at::kInt,  at::kLong,  at::kHalf,     at::kBFloat16,
                                            at::kFloat, at::kDouble};
const std::vector<std::vector<int64_t>> kShapes = {{}, {0}, {1}, {19}, {111}, {3, 4097}, {2, 0, 3}};

TEST(Safetensors, DTypeNamesSizesAndTorchTypes) {
  const std::vector<std::pair<DType, size_t>> all = {
      {DType::BOOL, 1}, {DType::U8, 1},   {DType::I8, 1},   {DType::I16, 2},
      {DType::I32, 4},  {DType::I64, 8},  {DType::F16, 2},  {DType::BF16, 2},
      {DType::F32, 4},  {DType::F64, 8},  {DType::F8_E4M3, 1}, {DType::F8_E5M2, 1}};
  for (auto [dtype, size] : all) {
    EXPECT_EQ(dtype_from_name(dtype_name(dtype), "test"), dtype);
    EXPECT_EQ(dtype_size(dtype), size) << dtype_name(dtype);
    EXPECT_EQ(static_cast<size_t>(c10::elementSize(scalar_type(dtype))), size) << dtype_name(dtype);
    if (dtype != DType::F8_E4M3 && dtype != DType::F8_E5M2) {
      EXPECT_EQ(dtype_of(scalar_type(dtype)), dtype) << dtype_name(dtype);
    }
  }
  EXPECT_EQ(dtype_of(at::kByte), DType::U8);
  EXPECT_EQ(scalar_type(DType::F8_E4M3) == at::kByte, !kHasFloat8);
  if (kHasFloat8) EXPECT_EQ(dtype_of(scalar_type(DType::F8_E4M3)), DType::F8_E4M3);
  EXPECT_TRUE(throws_with([] { dtype_from_name("F12", "file=x.safetensors, tensor=w"); },
                          {"unknown dtype", "F12", "x.safetensors", "tensor=w"}));
  EXPECT_TRUE(throws_with([] { dtype_of(at::kComplexFloat); }, {"safetensors"}));
}

TEST(Safetensors, EveryDTypeAndOddShapeRoundTrips) {
  at::manual_seed(1);
  TempDir dir;
  std::vector<NamedTensor> tensors;
  for (at::ScalarType type : kTypes) {
    for (const auto& shape : kShapes) {
      std::ostringstream name;
      name << "t." << c10::toString(type) << "." << at::IntArrayRef(shape);
      tensors.push_back({name.str(), make(type, shape)});
    }
  }
  const std::string path = dir / "all.safetensors";
  write_file(path, tensors);
  auto file = File::open(path);
  ASSERT_EQ(file->tensors().size(), tensors.size());
  EXPECT_EQ(file->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  for (const NamedTensor& nt : tensors) {
    SCOPED_TRACE(nt.name);
    const TensorInfo* info = file->find(nt.name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->dtype, dtype_of(nt.tensor.scalar_type()));
    EXPECT_EQ(info->shape, nt.tensor.sizes().vec());
    EXPECT_EQ(info->numel(), nt.tensor.numel());
    EXPECT_TRUE(all_equal(file->view(nt.name), nt.tensor));
    EXPECT_TRUE(all_equal(file->load(nt.name), nt.tensor));
  }
  // tensors() is sorted by offset and the offsets tile the data section.
  uint64_t end = 0;
  for (const TensorInfo& t : file->tensors()) {
    EXPECT_EQ(t.begin, end) << t.name;
    end = t.end;
  }
}

TEST(Safetensors, RawBytesAndHeaderLayout) {
  at::manual_seed(2);
  TempDir dir;
  // bf16 is written as its raw 2-byte values, in the order given, right after the padded header.
  at::Tensor a = at::randn({19}).to(at::kBFloat16);
  at::Tensor b = at::randint(0, 1000, {3, 5}, at::TensorOptions().dtype(at::kInt));
  at::Tensor strided = at::randn({6, 8}).t();  // not contiguous: written in row-major order
  const std::string path = dir / "layout.safetensors";
  write_file(path, {{"zz.a", a}, {"aa.b", b}, {"mm.c", strided}}, {});
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  ASSERT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.find("__metadata__"), std::string::npos) << "empty metadata is left out";
  EXPECT_LT(header.find("zz.a"), header.find("aa.b")) << header;
  EXPECT_LT(header.find("aa.b"), header.find("mm.c")) << header;
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}')) << "padding is spaces";
  const char* data = bytes.data() + 8 + n;
  ASSERT_EQ(bytes.size(), 8 + n + 19 * 2 + 15 * 4 + 48 * 4);
  EXPECT_EQ(std::memcmp(data, a.data_ptr(), 38), 0);
  EXPECT_EQ(std::memcmp(data + 38, b.data_ptr(), 60), 0);
  at::Tensor c = strided.contiguous();
  EXPECT_EQ(std::memcmp(data + 98, c.data_ptr(), 192), 0);
  auto file = File::open(path);
  EXPECT_TRUE(file->metadata().empty());
  EXPECT_TRUE(all_equal(file->load("mm.c"), strided));
}

TEST(Safetensors, MetadataRoundTrips) {
  TempDir dir;
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"step", "12"}, {"note", "quotes \" and \\ and unicode \xc3\xa9"}};
  write_file(dir / "m.safetensors", {{"x", at::ones({2})}}, meta);
  EXPECT_EQ(File::open(dir / "m.safetensors")->metadata(), meta);
}

TEST(Safetensors, Float8AsRawBytesWithDTypeOverride) {
  at::manual_seed(3);
  TempDir dir;
  at::Tensor e4m3 = at::randint(0, 256, {5, 16}, at::TensorOptions().dtype(at::kLong)).to(at::kByte);
  at::Tensor e5m2 = at::randint(0, 256, {7}, at::TensorOptions().dtype(at::kLong)).to(at::kByte);
  const std::string path = dir / "f8.safetensors";
  write_file(path, {{"w.weight_scale", e4m3, DType::F8_E4M3}, {"e5", e5m2, DType::F8_E5M2}});
  auto file = File::open(path);
  EXPECT_EQ(file->find("w.weight_scale")->dtype, DType::F8_E4M3);
  EXPECT_EQ(file->find("e5")->dtype, DType::F8_E5M2);
  at::Tensor v = file->view("w.weight_scale");
  EXPECT_EQ(v.scalar_type(), scalar_type(DType::F8_E4M3));
  EXPECT_TRUE(all_equal(v.view(at::kByte), e4m3));
  EXPECT_TRUE(all_equal(file->load("e5").view(at::kByte), e5m2));
  // The override must keep the item size.
  EXPECT_TRUE(throws_with([&] { write_file(dir / "bad.safetensors", {{"f", at::ones({4}), DType::F8_E4M3}}); },
                          {"bad.safetensors", "tensor=f", "F8_E4M3"}));
  EXPECT_FALSE(fs::exists(dir / "bad.safetensors"));
  if (!kHasFloat8) {
    EXPECT_TRUE(throws_with([&] { file->load("e5", at::kFloat); }, {"f8.safetensors", "tensor=e5"}));
  }
}

TEST(Safetensors, ViewIsZeroCopyAndLoadConverts) {
  at::manual_seed(4);
  TempDir dir;
  at::Tensor w = at::randn({111, 19}).to(at::kBFloat16);
  const std::string path = dir / "bf16.safetensors";
  write_file(path, {{"w", w}});
  auto file = File::open(path);
  at::Tensor v1 = file->view("w");
  at::Tensor v2 = file->view("w");
  EXPECT_EQ(v1.data_ptr(), v2.data_ptr()) << "views alias the one mapping";
  at::Tensor loaded = file->load("w");
  EXPECT_NE(loaded.data_ptr(), v1.data_ptr()) << "load returns a fresh tensor";
  loaded.fill_(0);  // owned, so writable
  at::Tensor f32 = file->load("w", at::kFloat);
  EXPECT_EQ(f32.scalar_type(), at::kFloat);
  EXPECT_TRUE(all_equal(f32, w.to(at::kFloat)));
  file.reset();  // the views keep the mapping alive
  EXPECT_TRUE(all_equal(v1, w));
}

TEST(Safetensors, UnalignedTensorsReadCorrectly) {
  at::manual_seed(5);
  TempDir dir;
  at::Tensor u8 = at::arange(3, at::TensorOptions().dtype(at::kLong)).to(at::kByte);
  at::Tensor f32 = at::randn({5});
  at::Tensor i64 = at::randint(-(1ll << 40), 1ll << 40, {3}, at::TensorOptions().dtype(at::kLong));
  at::Tensor f16 = at::randn({4}).to(at::kHalf);
  at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kByte));
  at::Tensor f64 = at::randn({2}, at::TensorOptions().dtype(at::kDouble));
  const std::string path = dir / "unaligned.safetensors";
  write_file(path, {{"u8", u8}, {"f32", f32}, {"i64", i64}, {"one", one}, {"f16", f16}, {"f64", f64}});
  auto file = File::open(path);
  EXPECT_EQ(file->find("f32")->begin, 3u);  // unaligned for a float
  for (auto [name, t] : std::vector<std::pair<std::string, at::Tensor>>{
           {"u8", u8}, {"f32", f32}, {"i64", i64}, {"one", one}, {"f16", f16}, {"f64", f64}}) {
    at::Tensor v = file->view(name);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data_ptr()) % v.element_size(), 0u) << name;
    EXPECT_TRUE(all_equal(v, t)) << name;
    EXPECT_TRUE(all_equal(file->load(name), t)) << name;
    EXPECT_TRUE(all_equal(v * 2, t * 2)) << name;  // kernels run on it
  }
}

TEST(Safetensors, ReadsAFileBuiltByteByByte) {
  TempDir dir;
  // "a": F32 [2] = {1.5, -2}; "b": I16 [2] = {258, -1}; "s": BF16 scalar 1.0; "e": F64 [0].
  const std::string header =
      R"({"b":{"dtype":"I16","shape":[2],"data_offsets":[8,12]},)"
      R"("__metadata__":{"format":"pt","origin":"hand"},)"
      R"("s":{"dtype":"BF16","shape":[],"data_offsets":[12,14]},)"
      R"("e":{"dtype":"F64","shape":[0],"data_offsets":[14,14]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data = std::string("\x00\x00\xc0\x3f\x00\x00\x00\xc0", 8) +  // 1.5f, -2.0f
                           std::string("\x02\x01\xff\xff", 4) +                  // 258, -1
                           std::string("\x80\x3f", 2);                           // bf16 1.0
  for (bool pad : {true, false}) {
    SCOPED_TRACE(pad ? "padded header" : "unpadded header");
    const std::string path = dir / "hand.safetensors";
    write_bytes(path, build_file(header, data, pad));
    auto file = File::open(path);
    ASSERT_EQ(file->tensors().size(), 4u);
    EXPECT_EQ(file->tensors()[0].name, "a");
    EXPECT_EQ(file->metadata().at("origin"), "hand");
    EXPECT_TRUE(all_equal(file->view("a"), at::tensor({1.5f, -2.0f})));
    EXPECT_TRUE(all_equal(file->view("b"), at::tensor({258, -1}, at::TensorOptions().dtype(at::kShort))));
    at::Tensor s = file->view("s");
    EXPECT_EQ(s.dim(), 0);
    EXPECT_EQ(s.scalar_type(), at::kBFloat16);
    EXPECT_EQ(s.item<float>(), 1.0f);
    at::Tensor e = file->load("e");
    EXPECT_EQ(e.sizes().vec(), std::vector<int64_t>{0});
    EXPECT_EQ(e.scalar_type(), at::kDouble);
    EXPECT_EQ(file->find("nope"), nullptr);
  }
  // A header padded with leading spaces too, and an empty file with only a header.
  write_bytes(dir / "lead.safetensors",
              build_file("  " + std::string(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})"),
                         data.substr(0, 8)));
  EXPECT_TRUE(all_equal(File::open(dir / "lead.safetensors")->view("a"), at::tensor({1.5f, -2.0f})));
  write_bytes(dir / "empty.safetensors", build_file("{}", ""));
  EXPECT_TRUE(File::open(dir / "empty.safetensors")->tensors().empty());
}

TEST(Safetensors, WriteRejectsBadInputAndLeavesNoTempFile) {
  TempDir dir;
  EXPECT_TRUE(throws_with(
      [&] { write_file(dir / "dup.safetensors", {{"x", at::ones({1})}, {"x", at::ones({2})}}); },
      {"duplicate", "dup.safetensors", "tensor=x"}));
  EXPECT_TRUE(throws_with([&] { write_file(dir / "c.safetensors", {{"x", at::ones({1}, at::kComplexFloat)}}); },
                          {"safetensors"}));
  EXPECT_TRUE(throws_with([&] { write_file(dir / "no/such/dir/x.safetensors", {{"x", at::ones({1})}}); },
                          {"no/such/dir/x.safetensors"}));
  EXPECT_TRUE(throws_with(
      [&] { write_checkpoint(dir / "ck", {{"x", at::ones({4})}, {"y", at::ones({4})}, {"x", at::ones({4})}}, 16); },
      {"duplicate", "tensor=x"}));
  EXPECT_FALSE(fs::exists(dir / "ck")) << "nothing is created for bad input";
  write_file(dir / "ok.safetensors", {{"x", at::ones({1})}});
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename(), "ok.safetensors") << "left behind: " << entry.path();
  }
}

// A file size limit makes write() fail the way a full disk does.
TEST(Safetensors, WriteFailureRemovesTempFileAndNamesPath) {
  TempDir dir;
  const std::string path = dir / "big.safetensors";
  write_file(path, {{"old", at::ones({2})}});
  struct rlimit old_limit {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  auto old_handler = signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  auto result = throws_with([&] { write_file(path, {{"w", at::zeros({1 << 16})}}); },
                            {"write failed", path, "writing=w", "disk space"});
  setrlimit(RLIMIT_FSIZE, &old_limit);
  signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(result);
  // The old file is untouched and no temporary file is left.
  EXPECT_TRUE(File::open(path)->find("old"));
  size_t num_files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path())) ++num_files, (void)entry;
  EXPECT_EQ(num_files, 1u);
}

TEST(Safetensors, SingleFileCheckpoint) {
  at::manual_seed(6);
  TempDir dir;
  std::vector<NamedTensor> tensors = {{"b", at::randn({19})}, {"a", at::randn({3, 4})}};
  write_checkpoint(dir / "ckpt", tensors);
  EXPECT_TRUE(fs::exists(dir / "ckpt/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "ckpt/model.safetensors.index.json"));
  for (const std::string& p : {dir / "ckpt", dir / "ckpt/model.safetensors"}) {
    Checkpoint ckpt = Checkpoint::open(p);
    EXPECT_EQ(ckpt.path(), p);
    EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b"}));
    EXPECT_TRUE(all_equal(ckpt.load("a"), tensors[1].tensor));
    EXPECT_EQ(ckpt.info("b").shape, std::vector<int64_t>{19});
    EXPECT_NO_THROW(ckpt.expect_names({"a", "b"}));
  }
}

TEST(Safetensors, ShardedCheckpointRoundTrips) {
  at::manual_seed(7);
  TempDir dir;
  std::vector<NamedTensor> tensors;
  uint64_t total = 0;
  for (int i = 0; i < 7; ++i) {
    tensors.push_back({"model.layers." + std::to_string(i) + ".weight", at::randn({19})});  // 76 B
    total += 76;
  }
  tensors.push_back({"lm_head.weight", at::randn({111}).to(at::kBFloat16)});  // 222 B > limit
  tensors.push_back({"scale", at::randint(0, 256, {4}, at::TensorOptions().dtype(at::kLong)).to(at::kByte),
                     DType::F8_E4M3});
  total += 222 + 4;
  const std::string ckdir = dir / "sharded";
  write_checkpoint(ckdir, tensors, /*max_shard_bytes=*/200);
  // Greedy in order: [0,1], [2,3], [4,5], [6], [lm_head], [scale].
  const int num_shards = 6;
  for (int s = 1; s <= num_shards; ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", s, num_shards);
    EXPECT_TRUE(fs::exists(ckdir + "/" + name)) << name;
  }
  EXPECT_FALSE(fs::exists(ckdir + "/model.safetensors"));
  const std::string index = read_bytes(ckdir + "/model.safetensors.index.json");
  EXPECT_NE(index.find("\"total_size\": " + std::to_string(total)), std::string::npos) << index;
  EXPECT_NE(index.find("\"lm_head.weight\": \"model-00005-of-00006.safetensors\""), std::string::npos)
      << index;
  EXPECT_NE(index.find("\"model.layers.3.weight\": \"model-00002-of-00006.safetensors\""),
            std::string::npos)
      << index;
  EXPECT_EQ(File::open(ckdir + "/model-00001-of-00006.safetensors")->tensors().size(), 2u);

  Checkpoint ckpt = Checkpoint::open(ckdir);
  std::set<std::string> names;
  for (const NamedTensor& nt : tensors) {
    names.insert(nt.name);
    EXPECT_TRUE(ckpt.contains(nt.name));
    EXPECT_TRUE(all_equal(ckpt.load(nt.name).view(nt.tensor.scalar_type()), nt.tensor)) << nt.name;
  }
  EXPECT_EQ(ckpt.names().size(), tensors.size());
  EXPECT_EQ(ckpt.info("scale").dtype, DType::F8_E4M3);
  EXPECT_NO_THROW(ckpt.expect_names(names));

  // Rewriting the same directory as a single file drops the stale index.
  write_checkpoint(ckdir, {{"only", at::ones({2})}});
  EXPECT_EQ(Checkpoint::open(ckdir).names(), std::vector<std::string>{"only"});
}

// ---------------------------------------------------------------------------------------------
// Bad files: each is built byte by byte and must give an error naming the file and the tensor.

struct Corrupt {
  const char* what;
  std::string bytes;
  std::vector<std::string> parts;  // besides the file path
};

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

TEST(Safetensors, CorruptFilesGiveClearErrors) {
  TempDir dir;
  const std::string d16 = float_bytes({1, 2, 3, 4});
  const std::string good = build_file("{" + entry("w", "F32", "[4]", "[0,16]") + "}", d16);
  const std::vector<Corrupt> cases = {
      {"truncated data", good.substr(0, good.size() - 6), {"tensor=w", "out of range", "truncated"}},
      {"truncated header", good.substr(0, 20), {"header length beyond", "header_size="}},
      {"shorter than 8 bytes", good.substr(0, 5), {"shorter", "file_size=5"}},
      {"header length beyond file", u64_le(1ull << 40) + "{}", {"header length beyond"}},
      {"invalid json", build_file(R"({"w":{"dtype":"F32",)", d16), {"not valid JSON"}},
      {"header not an object", build_file("[1,2]", ""), {"not a JSON object"}},
      {"unknown dtype", build_file("{" + entry("w", "F12", "[4]", "[0,16]") + "}", d16),
       {"tensor=w", "unknown dtype", "F12"}},
      {"shape/byte mismatch", build_file("{" + entry("w", "F32", "[3]", "[0,16]") + "}", d16),
       {"tensor=w", "shape/byte mismatch", "expected_bytes=12"}},
      {"out-of-range offsets", build_file("{" + entry("w", "F32", "[4]", "[8,24]") + "}", d16),
       {"tensor=w", "out of range"}},
      {"overlapping offsets",
       build_file("{" + entry("a", "F32", "[4]", "[0,16]") + "," + entry("b", "F32", "[2]", "[8,16]") + "}",
                  d16),
       {"tensor=b", "overlapping", "overlaps_tensor=a"}},
      {"hole between tensors",
       build_file("{" + entry("a", "F32", "[1]", "[0,4]") + "," + entry("b", "F32", "[2]", "[8,16]") + "}",
                  d16),
       {"tensor=b", "hole", "previous_tensor=a"}},
      {"hole at the start", build_file("{" + entry("w", "F32", "[3]", "[4,16]") + "}", d16),
       {"tensor=w", "hole"}},
      {"trailing bytes", build_file("{" + entry("w", "F32", "[3]", "[0,12]") + "}", d16),
       {"tensor=w", "no tensor covers"}},
      {"negative dim", build_file("{" + entry("w", "F32", "[-4]", "[0,16]") + "}", d16),
       {"tensor=w", "negative"}},
      {"begin after end", build_file("{" + entry("w", "F32", "[0]", "[16,0]") + "}", d16),
       {"tensor=w", "begin after end"}},
      {"three offsets", build_file("{" + entry("w", "F32", "[4]", "[0,16,16]") + "}", d16),
       {"tensor=w", "data_offsets"}},
      {"missing dtype", build_file(R"({"w":{"shape":[4],"data_offsets":[0,16]}})", d16),
       {"tensor=w", "lacks 'dtype'"}},
      {"entry not an object", build_file(R"({"w":[1]})", ""), {"tensor=w", "not an object"}},
      {"non-string metadata", build_file(R"({"__metadata__":{"step":12}})", ""), {"__metadata__", "step"}},
      {"duplicate name",
       build_file("{" + entry("w", "F32", "[2]", "[0,8]") + "," + entry("w", "F32", "[2]", "[8,16]") + "}",
                  d16),
       {"tensor=w", "duplicate"}},
      {"huge shape", build_file("{" + entry("w", "F32", "[4294967296,4294967296]", "[0,16]") + "}", d16),
       {"tensor=w"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Corrupt& c = cases[i];
    SCOPED_TRACE(c.what);
    const std::string path = dir / ("bad" + std::to_string(i) + ".safetensors");
    write_bytes(path, c.bytes);
    std::vector<std::string> parts = c.parts;
    parts.push_back("file=" + path);
    EXPECT_TRUE(throws_with([&] { File::open(path); }, parts));
    EXPECT_TRUE(throws_with([&] { Checkpoint::open(path); }, parts));
  }
  EXPECT_TRUE(throws_with([&] { File::open(dir / "absent.safetensors"); }, {"absent.safetensors"}));
  EXPECT_TRUE(throws_with([&] { File::open(dir.path()); }, {"not a regular file", dir.path()}));
}

// Writes a sharded checkpoint of tensors a, b (shard 1) and c (shard 2), then a hand-written index.
std::string sharded_with_index(const TempDir& dir, const std::string& name, const std::string& weight_map) {
  const std::string ckdir = dir / name;
  write_checkpoint(ckdir, {{"a", at::ones({4})}, {"b", at::ones({4})}, {"c", at::ones({4})}}, 32);
  write_bytes(ckdir + "/model.safetensors.index.json",
              R"({"metadata": {"total_size": 48}, "weight_map": )" + weight_map + "}");
  return ckdir;
}

TEST(Safetensors, BadShardedCheckpointsGiveClearErrors) {
  TempDir dir;
  const std::string s1 = "model-00001-of-00002.safetensors", s2 = "model-00002-of-00002.safetensors";
  {
    const std::string ck = sharded_with_index(
        dir, "ok", R"({"a":")" + s1 + R"(","b":")" + s1 + R"(","c":")" + s2 + R"("})");
    EXPECT_EQ(Checkpoint::open(ck).names(), (std::vector<std::string>{"a", "b", "c"}));
  }
  {  // the index points at a tensor the shard does not hold
    const std::string ck = sharded_with_index(
        dir, "ghost",
        R"({"a":")" + s1 + R"(","b":")" + s1 + R"(","c":")" + s2 + R"(","ghost":")" + s2 + R"("})");
    EXPECT_TRUE(throws_with([&] { Checkpoint::open(ck); },
                            {"missing from its shard", "index=" + ck + "/model.safetensors.index.json",
                             "shard=" + ck + "/" + s2, "tensor=ghost"}));
  }
  {  // the index names the wrong shard for a tensor
    const std::string ck = sharded_with_index(
        dir, "wrong", R"({"a":")" + s1 + R"(","b":")" + s2 + R"(","c":")" + s2 + R"("})");
    EXPECT_TRUE(throws_with([&] { Checkpoint::open(ck); },
                            {"missing from its shard", "shard=" + ck + "/" + s2, "tensor=b"}));
  }
  {  // a shard holds a tensor the index does not list
    const std::string ck =
        sharded_with_index(dir, "unlisted", R"({"a":")" + s1 + R"(","c":")" + s2 + R"("})");
    EXPECT_TRUE(throws_with([&] { Checkpoint::open(ck); },
                            {"not in the index", "shard=" + ck + "/" + s1, "tensor=b"}));
  }
  {  // a shard named in the index is missing
    const std::string ck = sharded_with_index(
        dir, "noshard", R"({"a":")" + s1 + R"(","b":")" + s1 + R"(","c":"model-00003-of-00003.safetensors"})");
    EXPECT_TRUE(throws_with([&] { Checkpoint::open(ck); },
                            {"shard named in the index is missing", "model-00003-of-00003.safetensors"}));
  }
  {  // the same tensor in two shards
    const std::string ck = sharded_with_index(
        dir, "twice", R"({"a":")" + s1 + R"(","b":")" + s1 + R"(","c":")" + s2 + R"("})");
    write_file(ck + "/" + s2, {{"c", at::ones({4})}, {"a", at::ones({4})}});
    EXPECT_TRUE(throws_with([&] { Checkpoint::open(ck); },
                            {"two shards", "tensor=a", "checkpoint=" + ck, s1, s2}));
  }
  {  // the index is not JSON
    const std::string ck = sharded_with_index(dir, "badjson", "{");
    EXPECT_TRUE(throws_with([&] { Checkpoint::open(ck); },
                            {"index is not valid JSON", ck + "/model.safetensors.index.json"}));
  }
  fs::create_directories(dir / "empty");
  EXPECT_TRUE(throws_with([&] { Checkpoint::open(dir / "empty"); },
                          {"checkpoint=" + (dir / "empty"), "model.safetensors", "index.json"}));
  EXPECT_TRUE(throws_with([&] { Checkpoint::open(dir / "nowhere"); },
                          {"does not exist", "checkpoint=" + (dir / "nowhere")}));
}

TEST(Safetensors, ExpectNamesAndMissingTensorsGiveClearErrors) {
  TempDir dir;
  write_checkpoint(dir / "ck", {{"a", at::ones({1})}, {"b", at::ones({1})}, {"c", at::ones({1})}});
  Checkpoint ckpt = Checkpoint::open(dir / "ck");
  EXPECT_NO_THROW(ckpt.expect_names({"a", "b", "c"}));
  EXPECT_TRUE(throws_with([&] { ckpt.expect_names({"a", "b"}); },
                          {"checkpoint=" + (dir / "ck"), "missing=0", "unexpected=1: c"}));
  EXPECT_TRUE(throws_with([&] { ckpt.expect_names({"a", "b", "c", "d"}); },
                          {"missing=1: d", "unexpected=0"}));
  EXPECT_TRUE(throws_with([&] { ckpt.expect_names({"a", "m1", "m2", "m3", "m4", "m5", "m6", "m7"}); },
                          {"missing=7: m1, m2, m3, m4, m5, ...", "unexpected=2: b, c"}));
  EXPECT_TRUE(throws_with([&] { ckpt.info("nope"); }, {"checkpoint=" + (dir / "ck"), "tensor=nope"}));
  EXPECT_TRUE(throws_with([&] { ckpt.load("nope"); }, {"checkpoint=" + (dir / "ck"), "tensor=nope"}));
  auto file = File::open(dir / "ck/model.safetensors");
  EXPECT_TRUE(throws_with([&] { file->view("nope"); }, {"model.safetensors", "tensor=nope"}));
}

}  // namespace
}  // namespace kiln::safetensors
