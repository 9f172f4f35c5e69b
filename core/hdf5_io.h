// Minimal HDF5 output for kiln's result files (log-probs, samples): named datasets from tensors,
// string attributes, written to a temporary file and renamed. Readable by h5py.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

namespace kiln::hdf5 {

class Writer {
 public:
  explicit Writer(const std::string& path);  // creates path + ".tmp"
  ~Writer();                                 // closes without publishing if commit() was not called
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  // Writes a CPU copy of `tensor` as dataset `name` ("a/b" creates group a). Supports
  // bool, uint8, int8/16/32/64, float16 (as IEEE half), bfloat16 (stored as float32), float32/64.
  void write(const std::string& name, const at::Tensor& tensor);
  void attribute(const std::string& name, const std::string& value);  // on the root group
  void commit();  // closes and renames to the final path

 private:
  std::string path_;
  long long file_ = -1;  // hid_t
};

// Reads dataset `name` of `path` into a CPU tensor of the stored type (for tests and tools).
at::Tensor read(const std::string& path, const std::string& name);

}  // namespace kiln::hdf5
