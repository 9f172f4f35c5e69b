// A flat byte encoding for moving structs between ranks (comm::Group::send_bytes): numbers, strings,
// vectors and CPU tensors appended in order, read back in the same order. Every read checks what is
// left, and an error names what was being read, at which offset, and what the buffer held.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"

namespace kiln {

class ByteWriter {
 public:
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  void put(T v) {
    raw(&v, sizeof(T));
  }
  void put(const std::string& s) {
    put(int64_t(s.size()));
    raw(s.data(), s.size());
  }
  template <typename T>
  void put(const std::vector<T>& v) {
    put(int64_t(v.size()));
    if constexpr (std::is_arithmetic_v<T>) {
      raw(v.data(), v.size() * sizeof(T));
    } else {
      for (const T& x : v) put(x);
    }
  }
  // A CPU tensor (undefined allowed): its dtype, shape and contiguous bytes.
  void put_tensor(const at::Tensor& t);
  // The bytes written, as a CPU uint8 vector (comm::Group::send_bytes takes it).
  at::Tensor tensor() const;
  const std::vector<uint8_t>& bytes() const { return buf_; }

 private:
  void raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  std::vector<uint8_t> buf_;
};

class ByteReader {
 public:
  // `what` names the buffer in errors, e.g. "the batch from rank 3".
  ByteReader(const uint8_t* data, size_t size, std::string what) : p_(data), n_(size), what_(std::move(what)) {}
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  T get(const char* field) {
    T v;
    raw(&v, sizeof(T), field);
    return v;
  }
  std::string get_string(const char* field);
  template <typename T>
  std::vector<T> get_vector(const char* field) {
    static_assert(std::is_arithmetic_v<T>, "get_vector reads numbers; read structs element by element");
    const int64_t n = count(field, sizeof(T));
    std::vector<T> v(static_cast<size_t>(n));
    raw(v.data(), size_t(n) * sizeof(T), field);
    return v;
  }
  at::Tensor get_tensor(const char* field);
  // An element count written by put (a vector's or a string's), checked against what is left.
  int64_t count(const char* field, size_t element_bytes);
  size_t left() const { return n_ - at_; }
  // Throws unless every byte was read (a reader that read less than was written has a bug).
  void expect_end() const;

 private:
  void raw(void* out, size_t n, const char* field);
  const uint8_t* p_;
  size_t n_, at_ = 0;
  std::string what_;
};

}  // namespace kiln
