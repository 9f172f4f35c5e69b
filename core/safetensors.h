// safetensors checkpoints (docs/MODEL.md §3.1): memory-mapped reading with validation, atomic writing,
// single files and sharded directories with model.safetensors.index.json.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace kiln::safetensors {

enum class DType { BOOL, U8, I8, I16, I32, I64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2 };

const char* dtype_name(DType dtype);
// Parses a header dtype string; throws naming `where` (file and tensor) for unknown strings.
DType dtype_from_name(const std::string& name, const std::string& where);
size_t dtype_size(DType dtype);
// The torch dtype a tensor of this safetensors dtype loads as. F8 types load as Float8 where
// libtorch has it (>= 2.1) and as raw uint8 bytes otherwise.
at::ScalarType scalar_type(DType dtype);
DType dtype_of(at::ScalarType type);

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the data section, [begin, end)
  uint64_t end = 0;
  int64_t numel() const;
};

// One mapped .safetensors file. Opening validates the whole header; tensors stay on disk until read.
class File {
 public:
  static std::shared_ptr<File> open(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // sorted by offset
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(const std::string& name) const;
  // Zero-copy, read-only CPU view of the mapped bytes; keeps the mapping alive while it lives.
  at::Tensor view(const std::string& name) const;
  // A fresh CPU tensor, converted to `dtype` when given.
  at::Tensor load(const std::string& name, std::optional<at::ScalarType> dtype = std::nullopt) const;

 private:
  File() = default;
  std::string path_;
  std::shared_ptr<void> mapping_;  // owns the mmap; shared with views
  const uint8_t* data_ = nullptr;  // start of the data section
  uint64_t data_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: a .safetensors file, or a directory with model.safetensors or a sharded set
// described by model.safetensors.index.json.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);
  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  at::Tensor load(const std::string& name, std::optional<at::ScalarType> dtype = std::nullopt) const;
  // Throws listing the missing and the unexpected names (first few of each) unless they match.
  void expect_names(const std::set<std::string>& expected) const;

 private:
  std::string path_;
  std::vector<std::shared_ptr<File>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

struct NamedTensor {
  std::string name;
  at::Tensor tensor;                  // any device; written as its bytes in row-major order
  std::optional<DType> dtype = {};    // override, e.g. F8_E4M3 for raw uint8 bytes
};

// Writes one file atomically (temporary file in the same directory, then rename).
void write_file(const std::string& path, const std::vector<NamedTensor>& tensors,
                const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Writes `dir`/model.safetensors, or shards of at most max_shard_bytes each
// (model-0000i-of-0000N.safetensors) plus model.safetensors.index.json. Creates `dir`.
void write_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors,
                      uint64_t max_shard_bytes = 5ull << 30);

// One writer's part of a checkpoint that several write at once (each rank its own tensors): files
// <stem>-00001.safetensors, ... of at most max_shard_bytes each and a small part index
// .index-part-<stem>.json. Once every writer is done, one caller runs merge_checkpoint_index, which
// joins the parts into model.safetensors.index.json (last: it marks the checkpoint complete) and
// removes them. No tensor passes between writers; a tensor two parts wrote is an error.
void write_checkpoint_part(const std::string& dir, const std::vector<NamedTensor>& tensors, const std::string& stem,
                           uint64_t max_shard_bytes = 5ull << 30);
void merge_checkpoint_index(const std::string& dir);

}  // namespace kiln::safetensors
