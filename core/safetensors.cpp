// safetensors reading (mmap, full header validation, zero-copy views) and atomic writing of single
// files and sharded checkpoints with model.safetensors.index.json (docs/MODEL.md §3.1).
#include "core/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/torch_version.h"

#define KILN_TORCH_HAS_FLOAT8 KILN_TORCH_AT_LEAST(2, 1)

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kiln safetensors I/O assumes a little-endian host (tensor bytes are written as they lie in memory)"
#endif

namespace kiln::safetensors {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kAllDTypes = "BOOL U8 I8 I16 I32 I64 F16 BF16 F32 F64 F8_E4M3 F8_E5M2";
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

std::string at_tensor(const std::string& path, const std::string& name) {
  return str_cat("file=", path, ", tensor=", name);
}

std::string errno_text(int err) { return std::strerror(err); }

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void put_u64_le(uint64_t v, char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// Removes a temporary file unless release() was called (the file was renamed into place).
class TempFileGuard {
 public:
  explicit TempFileGuard(std::string path) : path_(std::move(path)) {}
  ~TempFileGuard() {
    if (fd_ >= 0) ::close(fd_);
    if (!released_) ::unlink(path_.c_str());
  }
  int& fd() { return fd_; }
  void release() { released_ = true; }

 private:
  std::string path_;
  int fd_ = -1;
  bool released_ = false;
};

std::string temp_path_for(const std::string& path) {
  return str_cat(path, ".tmp.", static_cast<long>(::getpid()));
}

void write_all(int fd, const void* data, size_t size, const std::string& path, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    KILN_CHECK(n > 0, "safetensors: write failed (file=", path, ", writing=", what,
               ", error=", n < 0 ? errno_text(errno) : std::string("no progress"),
               "); check free disk space and permissions");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

// Closes, fsyncs and renames the temporary file of `guard` to `path`.
void publish(TempFileGuard& guard, const std::string& tmp, const std::string& path) {
  int fd = guard.fd();
  KILN_CHECK(::fsync(fd) == 0, "safetensors: fsync failed (file=", path, ", error=", errno_text(errno),
             "); check free disk space");
  guard.fd() = -1;
  KILN_CHECK(::close(fd) == 0, "safetensors: close failed (file=", path, ", error=", errno_text(errno),
             "); check free disk space");
  std::error_code ec;
  fs::rename(tmp, path, ec);
  KILN_CHECK(!ec, "safetensors: cannot rename the temporary file into place (file=", path,
             ", temp=", tmp, ", error=", ec.message(), "); check the directory permissions");
  guard.release();
}

int open_temp(const std::string& tmp, const std::string& path) {
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KILN_CHECK(fd >= 0, "safetensors: cannot create the temporary file (file=", path, ", temp=", tmp,
             ", error=", errno_text(errno), "); check that the directory exists and is writable");
  return fd;
}

// The header dtype and byte size a NamedTensor is written with.
struct Planned {
  DType dtype;
  uint64_t nbytes;
};

Planned plan(const NamedTensor& nt, const std::string& path) {
  KILN_CHECK(nt.tensor.defined(), "safetensors: undefined tensor (file=", path, ", tensor=", nt.name,
             "); pass a defined tensor");
  DType natural = dtype_of(nt.tensor.scalar_type());
  DType dtype = nt.dtype.value_or(natural);
  uint64_t numel = static_cast<uint64_t>(nt.tensor.numel());
  uint64_t nbytes = numel * static_cast<uint64_t>(nt.tensor.element_size());
  KILN_CHECK(numel * dtype_size(dtype) == nbytes, "safetensors: dtype override does not match the ",
             "tensor's bytes (file=", path, ", tensor=", nt.name, ", dtype=", dtype_name(dtype),
             ", tensor_dtype=", nt.tensor.scalar_type(), ", numel=", numel, ", bytes=", nbytes,
             "); the override must have the same item size as the tensor (e.g. uint8 bytes as F8_E4M3)");
  return {dtype, nbytes};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// dtypes

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::BOOL: return "BOOL";
    case DType::U8: return "U8";
    case DType::I8: return "I8";
    case DType::I16: return "I16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::F8_E5M2: return "F8_E5M2";
  }
  return "?";
}

DType dtype_from_name(const std::string& name, const std::string& where) {
  static const std::map<std::string, DType> kByName = {
      {"BOOL", DType::BOOL}, {"U8", DType::U8},     {"I8", DType::I8},
      {"I16", DType::I16},   {"I32", DType::I32},   {"I64", DType::I64},
      {"F16", DType::F16},   {"BF16", DType::BF16}, {"F32", DType::F32},
      {"F64", DType::F64},   {"F8_E4M3", DType::F8_E4M3}, {"F8_E5M2", DType::F8_E5M2}};
  auto it = kByName.find(name);
  KILN_CHECK(it != kByName.end(), "safetensors: unknown dtype (dtype=", name, ", ", where,
             "); expected one of ", kAllDTypes);
  return it->second;
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::BOOL:
    case DType::U8:
    case DType::I8:
    case DType::F8_E4M3:
    case DType::F8_E5M2: return 1;
    case DType::I16:
    case DType::F16:
    case DType::BF16: return 2;
    case DType::I32:
    case DType::F32: return 4;
    case DType::I64:
    case DType::F64: return 8;
  }
  return 0;
}

at::ScalarType scalar_type(DType dtype) {
  switch (dtype) {
    case DType::BOOL: return at::kBool;
    case DType::U8: return at::kByte;
    case DType::I8: return at::kChar;
    case DType::I16: return at::kShort;
    case DType::I32: return at::kInt;
    case DType::I64: return at::kLong;
    case DType::F16: return at::kHalf;
    case DType::BF16: return at::kBFloat16;
    case DType::F32: return at::kFloat;
    case DType::F64: return at::kDouble;
#if KILN_TORCH_HAS_FLOAT8
    case DType::F8_E4M3: return at::kFloat8_e4m3fn;
    case DType::F8_E5M2: return at::kFloat8_e5m2;
#else
    case DType::F8_E4M3:
    case DType::F8_E5M2: return at::kByte;  // raw bytes: this libtorch has no float8 types
#endif
  }
  return at::kByte;
}

DType dtype_of(at::ScalarType type) {
  switch (type) {
    case at::kBool: return DType::BOOL;
    case at::kByte: return DType::U8;
    case at::kChar: return DType::I8;
    case at::kShort: return DType::I16;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
#if KILN_TORCH_HAS_FLOAT8
    case at::kFloat8_e4m3fn: return DType::F8_E4M3;
    case at::kFloat8_e5m2: return DType::F8_E5M2;
#endif
    default: break;
  }
  KILN_FAIL("safetensors: torch dtype has no safetensors equivalent (dtype=", type,
            "); convert the tensor to one of bool, uint8, int8/16/32/64, float16, bfloat16, "
            "float32, float64");
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------------
// File

namespace {

// The header's JSON, parsed from the header_size bytes at text, with duplicate top-level keys refused.
json parse_header(const std::string& path, const char* text, uint64_t header_size) {
  // nlohmann keeps the last of duplicate keys; the callback notices top-level duplicates first.
  std::set<std::string> seen;
  std::string duplicate;
  json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, text + header_size, on_event);
  } catch (const json::exception& e) {
    KILN_FAIL("safetensors: header is not valid JSON (file=", path, ", header_size=", header_size,
              ", parser=", e.what(), "); the file is corrupt or not safetensors");
  }
  KILN_CHECK(duplicate.empty(), "safetensors: duplicate tensor name in the header (",
             at_tensor(path, duplicate), "); the writer is broken, rewrite the file");
  return header;
}

// One tensor's header entry, {dtype, shape, data_offsets}, checked against itself and the data section.
TensorInfo parse_entry(const std::string& name, const json& entry, const std::string& where, uint64_t data_size) {
  KILN_CHECK(entry.is_object(), "safetensors: header entry is not an object (", where, ", type=",
             entry.type_name(), "); expected {dtype, shape, data_offsets}");
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    KILN_CHECK(entry.contains(key), "safetensors: header entry lacks '", key, "' (", where,
               "); expected {dtype, shape, data_offsets}");
  }
  const json& jdtype = entry["dtype"];
  KILN_CHECK(jdtype.is_string(), "safetensors: dtype is not a string (", where, ", type=",
             jdtype.type_name(), "); expected one of ", kAllDTypes);
  TensorInfo info;
  info.name = name;
  info.dtype = dtype_from_name(jdtype.get<std::string>(), where);

  const json& jshape = entry["shape"];
  KILN_CHECK(jshape.is_array(), "safetensors: shape is not an array (", where, ", shape=",
             jshape.dump(), "); expected a list of non-negative integers");
  uint64_t numel = 1;
  bool overflow = false;
  for (const json& d : jshape) {
    KILN_CHECK(d.is_number_integer(), "safetensors: shape has a non-integer dimension (", where,
               ", shape=", jshape.dump(), "); expected a list of non-negative integers");
    KILN_CHECK(d.is_number_unsigned(), "safetensors: shape has a negative dimension (", where,
               ", shape=", jshape.dump(), "); the file is corrupt");
    uint64_t dim = d.get<uint64_t>();
    KILN_CHECK(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
               "safetensors: shape dimension too large (", where, ", shape=", jshape.dump(),
               "); the file is corrupt");
    info.shape.push_back(static_cast<int64_t>(dim));
    overflow |= __builtin_mul_overflow(numel, dim, &numel);
  }
  uint64_t nbytes = 0;
  overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(info.dtype)), &nbytes);
  KILN_CHECK(!overflow, "safetensors: shape too large (", where, ", shape=", jshape.dump(),
             "); the file is corrupt");

  const json& joff = entry["data_offsets"];
  KILN_CHECK(joff.is_array() && joff.size() == 2 && joff[0].is_number_unsigned() &&
                 joff[1].is_number_unsigned(),
             "safetensors: data_offsets is not two non-negative integers (", where,
             ", data_offsets=", joff.dump(), "); the file is corrupt");
  info.begin = joff[0].get<uint64_t>();
  info.end = joff[1].get<uint64_t>();
  KILN_CHECK(info.begin <= info.end, "safetensors: data_offsets begin after end (", where,
             ", begin=", info.begin, ", end=", info.end, "); the file is corrupt");
  KILN_CHECK(info.end - info.begin == nbytes, "safetensors: shape/byte mismatch (", where,
             ", dtype=", dtype_name(info.dtype), ", shape=", shape_str(info.shape),
             ", expected_bytes=", nbytes, ", data_offsets=[", info.begin, ",", info.end,
             "], bytes=", info.end - info.begin, "); the file is corrupt");
  KILN_CHECK(info.end <= data_size, "safetensors: tensor data out of range, past the end ",
             "of the file (", where, ", data_offsets=[", info.begin, ",", info.end,
             "], data_size=", data_size, "); the file is truncated or corrupt");
  return info;
}

// The tensors, sorted by offset, are contiguous, with no holes, and cover the data section.
void check_contiguous(const std::string& path, const std::vector<TensorInfo>& tensors, uint64_t data_size) {
  uint64_t expected = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : tensors) {
    KILN_CHECK(t.begin >= expected, "safetensors: overlapping data_offsets (", at_tensor(path, t.name),
               ", begin=", t.begin, ", overlaps_tensor=", prev ? prev->name : std::string(),
               ", its_end=", expected, "); the file is corrupt");
    KILN_CHECK(t.begin == expected, "safetensors: hole in the data section before a tensor (",
               at_tensor(path, t.name), ", begin=", t.begin, ", previous_tensor=",
               prev ? prev->name : std::string("(none)"), ", previous_end=", expected,
               "); tensors must be contiguous, the file is corrupt");
    expected = t.end;
    prev = &t;
  }
  KILN_CHECK(expected == data_size, "safetensors: data section has bytes no tensor covers (",
             at_tensor(path, prev ? prev->name : std::string("(none)")), ", last_end=", expected,
             ", data_size=", data_size, "); the file is corrupt");
}

}  // namespace

File::~File() = default;

std::shared_ptr<File> File::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KILN_CHECK(fd >= 0, "safetensors: cannot open file (file=", path, ", error=", errno_text(errno),
             "); check the path");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    KILN_FAIL("safetensors: cannot stat file (file=", path, ", error=", errno_text(err),
              "); check the path");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    KILN_FAIL("safetensors: not a regular file (file=", path,
              "); pass a .safetensors file, or a checkpoint directory to Checkpoint::open");
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    KILN_FAIL("safetensors: file shorter than the 8-byte header length (file=", path,
              ", file_size=", file_size, "); the file is truncated or not safetensors");
  }
  void* addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);  // the mapping stays valid without the descriptor
  KILN_CHECK(addr != MAP_FAILED, "safetensors: mmap failed (file=", path, ", file_size=", file_size,
             ", error=", errno_text(map_err), "); check memory limits");

  std::shared_ptr<File> file(new File());
  file->path_ = path;
  file->mapping_ = std::shared_ptr<void>(addr, [file_size](void* p) { ::munmap(p, file_size); });
  const uint8_t* base = static_cast<const uint8_t*>(addr);

  const uint64_t header_size = read_u64_le(base);
  KILN_CHECK(header_size <= file_size - 8, "safetensors: header length beyond the end of the file (file=",
             path, ", header_size=", header_size, ", file_size=", file_size,
             "); the file is truncated or not safetensors");
  file->data_ = base + 8 + header_size;
  file->data_size_ = file_size - 8 - header_size;

  json header = parse_header(path, reinterpret_cast<const char*>(base + 8), header_size);
  KILN_CHECK(header.is_object(), "safetensors: header is not a JSON object (file=", path,
             ", type=", header.type_name(), "); the file is corrupt or not safetensors");

  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      KILN_CHECK(entry.is_object(), "safetensors: __metadata__ is not an object (file=", path,
                 ", type=", entry.type_name(), "); it must map strings to strings");
      for (auto& [key, value] : entry.items()) {
        KILN_CHECK(value.is_string(), "safetensors: __metadata__ value is not a string (file=", path,
                   ", key=", key, ", type=", value.type_name(), "); it must map strings to strings");
        file->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = at_tensor(path, name);
    file->tensors_.push_back(parse_entry(name, entry, where, file->data_size_));
  }

  auto& tensors = file->tensors_;
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  check_contiguous(path, tensors, file->data_size_);
  for (size_t i = 0; i < tensors.size(); ++i) file->index_[tensors[i].name] = i;
  return file;
}

const TensorInfo* File::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

at::Tensor File::view(const std::string& name) const {
  const TensorInfo* info = find(name);
  KILN_CHECK(info, "safetensors: no such tensor in file (", at_tensor(path_, name),
             ", num_tensors=", tensors_.size(), "); check the name");
  auto options = at::TensorOptions().dtype(scalar_type(info->dtype)).device(at::kCPU);
  const uint8_t* ptr = data_ + info->begin;
  const size_t nbytes = info->end - info->begin;
  if (nbytes == 0) return at::empty(info->shape, options);
  if (reinterpret_cast<uintptr_t>(ptr) % dtype_size(info->dtype) != 0) {
    // Offsets are arbitrary, so a tensor may sit unaligned for its dtype; kernels need aligned data.
    at::Tensor copy = at::empty(info->shape, options);
    std::memcpy(copy.data_ptr(), ptr, nbytes);
    return copy;
  }
  // The mapping is PROT_READ: the const_cast only satisfies from_blob; writing to the view faults.
  std::shared_ptr<void> keep = mapping_;
  return at::from_blob(const_cast<uint8_t*>(ptr), info->shape, [keep](void*) mutable { keep.reset(); },
                       options);
}

at::Tensor File::load(const std::string& name, std::optional<at::ScalarType> dtype) const {
  at::Tensor v = view(name);
#if !KILN_TORCH_HAS_FLOAT8
  const TensorInfo* info = find(name);
  bool is_f8 = info->dtype == DType::F8_E4M3 || info->dtype == DType::F8_E5M2;
  KILN_CHECK(!is_f8 || !dtype || *dtype == at::kByte,
             "safetensors: cannot convert an F8 tensor on libtorch < 2.1 (", at_tensor(path_, name),
             ", dtype=", dtype_name(info->dtype), ", requested=", *dtype,
             "); load it as raw uint8 bytes and decode it explicitly");
#endif
  if (!dtype || *dtype == v.scalar_type()) return v.clone();
  return v.to(*dtype);
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint ckpt;
  ckpt.path_ = path;
  std::error_code ec;
  auto add_file = [&ckpt](std::shared_ptr<File> file) {
    size_t idx = ckpt.files_.size();
    for (const TensorInfo& t : file->tensors()) {
      auto [it, inserted] = ckpt.where_.emplace(t.name, idx);
      KILN_CHECK(inserted, "safetensors: the same tensor is in two shards (checkpoint=", ckpt.path_,
                 ", tensor=", t.name, ", shard=", ckpt.files_[it->second]->path(),
                 ", other_shard=", file->path(), "); remove one copy");
    }
    ckpt.files_.push_back(std::move(file));
  };

  if (fs::is_regular_file(path, ec)) {
    add_file(File::open(path));
    return ckpt;
  }
  KILN_CHECK(fs::is_directory(path, ec), "safetensors: checkpoint path does not exist (checkpoint=",
             path, "); pass a .safetensors file or a directory holding model.safetensors or ",
             kIndexName);

  const fs::path dir(path);
  const fs::path index_path = dir / kIndexName;
  if (!fs::exists(index_path, ec)) {
    const fs::path single = dir / kSingleName;
    KILN_CHECK(fs::exists(single, ec), "safetensors: checkpoint directory has neither ", kSingleName,
               " nor ", kIndexName, " (checkpoint=", path,
               "); write the checkpoint with write_checkpoint or point at the .safetensors file");
    add_file(File::open(single.string()));
    return ckpt;
  }

  const std::string index_str = index_path.string();
  json index;
  {
    std::ifstream in(index_path);
    KILN_CHECK(in.good(), "safetensors: cannot read the index (index=", index_str,
               "); check permissions");
    try {
      index = json::parse(in);
    } catch (const json::exception& e) {
      KILN_FAIL("safetensors: index is not valid JSON (index=", index_str, ", parser=", e.what(),
                "); the index is corrupt");
    }
  }
  KILN_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
             "safetensors: index has no weight_map object (index=", index_str,
             "); expected {\"metadata\": {...}, \"weight_map\": {name: file}}");
  const json& weight_map = index["weight_map"];
  std::vector<std::string> shard_names;
  std::map<std::string, size_t> shard_of_name;  // shard file name -> index into files_
  for (auto& [name, shard] : weight_map.items()) {
    KILN_CHECK(shard.is_string(), "safetensors: weight_map value is not a file name (index=",
               index_str, ", tensor=", name, ", value=", shard.dump(), "); the index is corrupt");
    const std::string& s = shard.get_ref<const std::string&>();
    if (!shard_of_name.count(s)) {
      shard_of_name[s] = shard_names.size();
      shard_names.push_back(s);
    }
  }
  for (const std::string& s : shard_names) {
    const fs::path shard_path = dir / s;
    KILN_CHECK(fs::is_regular_file(shard_path, ec), "safetensors: shard named in the index is missing ",
               "(index=", index_str, ", shard=", shard_path.string(), "); the checkpoint is incomplete");
    add_file(File::open(shard_path.string()));
  }
  for (auto& [name, shard] : weight_map.items()) {
    const File& file = *ckpt.files_[shard_of_name.at(shard.get<std::string>())];
    KILN_CHECK(file.find(name), "safetensors: tensor in the index is missing from its shard (index=",
               index_str, ", shard=", file.path(), ", tensor=", name,
               "); the checkpoint is incomplete or the index is stale");
  }
  for (const auto& file : ckpt.files_) {
    for (const TensorInfo& t : file->tensors()) {
      KILN_CHECK(weight_map.contains(t.name), "safetensors: tensor in a shard is not in the index ",
                 "(index=", index_str, ", shard=", file->path(), ", tensor=", t.name,
                 "); the index is stale, regenerate it");
    }
  }
  return ckpt;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, idx] : where_) out.push_back(name);
  return out;
}

const TensorInfo& Checkpoint::info(const std::string& name) const {
  auto it = where_.find(name);
  KILN_CHECK(it != where_.end(), "safetensors: tensor not in checkpoint (checkpoint=", path_,
             ", tensor=", name, ", num_tensors=", where_.size(), "); check the name");
  return *files_[it->second]->find(name);
}

at::Tensor Checkpoint::load(const std::string& name, std::optional<at::ScalarType> dtype) const {
  auto it = where_.find(name);
  KILN_CHECK(it != where_.end(), "safetensors: tensor not in checkpoint (checkpoint=", path_,
             ", tensor=", name, ", num_tensors=", where_.size(), "); check the name");
  return files_[it->second]->load(name, dtype);
}

void Checkpoint::expect_names(const std::set<std::string>& expected) const {
  std::vector<std::string> missing, unexpected;
  for (const std::string& name : expected) {
    if (!where_.count(name)) missing.push_back(name);
  }
  for (const auto& [name, idx] : where_) {
    if (!expected.count(name)) unexpected.push_back(name);
  }
  if (missing.empty() && unexpected.empty()) return;
  auto first_few = [](const std::vector<std::string>& names) {
    std::string s = std::to_string(names.size());
    for (size_t i = 0; i < names.size() && i < 5; ++i) s += (i ? ", " : ": ") + names[i];
    if (names.size() > 5) s += ", ...";
    return s;
  };
  KILN_FAIL("safetensors: checkpoint tensor names do not match the model (checkpoint=", path_,
            ", missing=", first_few(missing), "; unexpected=", first_few(unexpected),
            "); check that the model config matches the checkpoint");
}

// ---------------------------------------------------------------------------------------------
// Writing

void write_file(const std::string& path, const std::vector<NamedTensor>& tensors,
                const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const NamedTensor& nt : tensors) {
    KILN_CHECK(nt.name != "__metadata__" && !nt.name.empty(), "safetensors: invalid tensor name (",
               at_tensor(path, nt.name), "); use a non-empty name other than __metadata__");
    KILN_CHECK(names.insert(nt.name).second, "safetensors: duplicate tensor name (",
               at_tensor(path, nt.name), "); give every tensor a distinct name");
    Planned p = plan(nt, path);
    header[nt.name] = {{"dtype", dtype_name(p.dtype)},
                       {"shape", nt.tensor.sizes().vec()},
                       {"data_offsets", {offset, offset + p.nbytes}}};
    offset += p.nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned

  const std::string tmp = temp_path_for(path);
  TempFileGuard guard(tmp);
  guard.fd() = open_temp(tmp, path);
  char len[8];
  put_u64_le(text.size(), len);
  write_all(guard.fd(), len, 8, path, "header length");
  write_all(guard.fd(), text.data(), text.size(), path, "header");
  for (const NamedTensor& nt : tensors) {
    if (nt.tensor.numel() == 0) continue;
    // One tensor at a time, so a checkpoint never needs a second copy of itself in host memory.
    at::Tensor cpu = nt.tensor.detach().to(at::kCPU).contiguous();
    write_all(guard.fd(), cpu.data_ptr(), cpu.numel() * cpu.element_size(), path, nt.name);
  }
  publish(guard, tmp, path);
}

namespace {

// Sizes of `tensors` (checked for duplicate names) and their total.
uint64_t sizes_of(const std::string& dir, const std::vector<NamedTensor>& tensors, std::vector<uint64_t>& sizes) {
  uint64_t total = 0;
  std::set<std::string> names;
  for (const NamedTensor& nt : tensors) {
    // Checked here too: write_file sees one shard at a time.
    KILN_CHECK(names.insert(nt.name).second, "safetensors: duplicate tensor name (dir=", dir,
               ", tensor=", nt.name, "); give every tensor a distinct name");
    sizes.push_back(plan(nt, dir).nbytes);
    total += sizes.back();
  }
  return total;
}

void make_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  KILN_CHECK(!ec, "safetensors: cannot create the checkpoint directory (dir=", dir, ", error=",
             ec.message(), "); check permissions");
}

// Greedy in order, at most max_shard_bytes per shard; a tensor larger than the limit gets a shard of
// its own. Shard s is written to file_name(s, count); returns the weight map.
json write_shards(const std::string& dir, const std::vector<NamedTensor>& tensors, const std::vector<uint64_t>& sizes,
                  uint64_t max_shard_bytes, const std::function<std::string(size_t, size_t)>& file_name) {
  std::vector<std::vector<NamedTensor>> shards;
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (shards.empty() || (!shards.back().empty() && shard_bytes + sizes[i] > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(tensors[i]);
    shard_bytes += sizes[i];
  }
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = file_name(s, shards.size());
    write_file((fs::path(dir) / name).string(), shards[s]);
    for (const NamedTensor& nt : shards[s]) weight_map[nt.name] = name;
  }
  return weight_map;
}

// Writes `text` to dir/name atomically.
void write_text_file(const std::string& dir, const std::string& name, const std::string& text, const char* what) {
  const std::string path = (fs::path(dir) / name).string();
  const std::string tmp = temp_path_for(path);
  TempFileGuard guard(tmp);
  guard.fd() = open_temp(tmp, path);
  write_all(guard.fd(), text.data(), text.size(), path, what);
  publish(guard, tmp, path);
}

constexpr const char* kPartPrefix = ".index-part-";

}  // namespace

void write_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors,
                      uint64_t max_shard_bytes) {
  KILN_CHECK(max_shard_bytes > 0, "safetensors: max_shard_bytes must be positive (dir=", dir,
             "); pass a shard size in bytes");
  std::vector<uint64_t> sizes;
  const uint64_t total = sizes_of(dir, tensors, sizes);
  make_dir(dir);
  const fs::path root(dir);
  if (total <= max_shard_bytes) {
    write_file((root / kSingleName).string(), tensors);
    // A stale index would take precedence over the file just written.
    std::error_code ec;
    fs::remove(root / kIndexName, ec);
    return;
  }
  const json weight_map = write_shards(dir, tensors, sizes, max_shard_bytes, [](size_t s, size_t n) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, n);
    return std::string(name);
  });
  // The index goes last: a checkpoint with an index is complete.
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text_file(dir, kIndexName, index.dump(2) + "\n", "index");
}

void write_checkpoint_part(const std::string& dir, const std::vector<NamedTensor>& tensors, const std::string& stem,
                           uint64_t max_shard_bytes) {
  KILN_CHECK(max_shard_bytes > 0 && !stem.empty() && stem.find('/') == std::string::npos,
             "safetensors: a checkpoint part needs a positive max_shard_bytes and a file stem without '/' (dir=",
             dir, ", stem='", stem, "')");
  std::vector<uint64_t> sizes;
  const uint64_t total = sizes_of(dir, tensors, sizes);
  make_dir(dir);
  const json weight_map = write_shards(dir, tensors, sizes, max_shard_bytes, [&](size_t s, size_t) {
    char n[32];
    std::snprintf(n, sizeof(n), "-%05zu.safetensors", s + 1);
    return stem + n;
  });
  json part = {{"total_size", total}, {"weight_map", weight_map}};
  write_text_file(dir, kPartPrefix + stem + ".json", part.dump() + "\n", "index part");
}

void merge_checkpoint_index(const std::string& dir) {
  std::vector<fs::path> parts;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string().rfind(kPartPrefix, 0) == 0) parts.push_back(entry.path());
  KILN_CHECK(!ec && !parts.empty(), "safetensors: no checkpoint parts (", kPartPrefix, "*.json) in ", dir,
             "; every writer calls write_checkpoint_part before the index is merged");
  std::sort(parts.begin(), parts.end());
  json weight_map = json::object();
  std::map<std::string, std::string> from;  // tensor -> the part that wrote it
  uint64_t total = 0;
  for (const fs::path& p : parts) {
    std::ifstream f(p);
    json part;
    try {
      f >> part;
    } catch (const json::exception& e) {
      KILN_FAIL("safetensors: checkpoint part ", p.string(), " is not valid JSON (", e.what(), ")");
    }
    KILN_CHECK(part.is_object() && part.contains("weight_map") && part["weight_map"].is_object() &&
                   part.contains("total_size") && part["total_size"].is_number_unsigned(),
               "safetensors: checkpoint part ", p.string(), " lacks weight_map or total_size");
    total += part["total_size"].get<uint64_t>();
    for (auto& [name, file] : part["weight_map"].items()) {
      KILN_CHECK(!from.count(name), "safetensors: tensor ", name, " is written by two checkpoint parts, ", from[name],
                 " and ", p.filename().string(), " (dir=", dir, ")");
      from[name] = p.filename().string();
      weight_map[name] = file;
    }
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text_file(dir, kIndexName, index.dump(2) + "\n", "index");
  for (const fs::path& p : parts) fs::remove(p, ec);
}

}  // namespace kiln::safetensors
