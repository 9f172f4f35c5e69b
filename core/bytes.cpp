// The byte encoding of bytes.h: tensors as dtype, rank, shape and raw bytes; reads checked.
#include "core/bytes.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace kiln {

void ByteWriter::put_tensor(const at::Tensor& t) {
  put(uint8_t(t.defined()));
  if (!t.defined()) return;
  KILN_CHECK(t.is_cpu(), "bytes: put_tensor takes CPU tensors (got one on ", t.device(), ")");
  const at::Tensor c = t.contiguous();
  put(int32_t(c.scalar_type()));
  put(c.sizes().vec());
  raw(c.data_ptr(), c.nbytes());
}

at::Tensor ByteWriter::tensor() const {
  at::Tensor t = at::empty({int64_t(buf_.size())}, at::TensorOptions().dtype(at::kByte));
  if (!buf_.empty()) std::memcpy(t.data_ptr(), buf_.data(), buf_.size());
  return t;
}

void ByteReader::raw(void* out, size_t n, const char* field) {
  KILN_CHECK(n <= n_ - at_, "bytes: reading ", field, " of ", what_, " at offset ", at_, ": needs ", n,
             " bytes, ", n_ - at_, " left of ", n_, " (a truncated or mismatched message)");
  if (n > 0) std::memcpy(out, p_ + at_, n);
  at_ += n;
}

int64_t ByteReader::count(const char* field, size_t element_bytes) {
  const size_t at = at_;
  const int64_t n = get<int64_t>(field);
  KILN_CHECK(n >= 0 && uint64_t(n) <= (n_ - at_) / std::max<size_t>(1, element_bytes), "bytes: reading ", field,
             " of ", what_, " at offset ", at, ": a count of ", n, " elements of ", element_bytes,
             " bytes does not fit the ", n_ - at_, " bytes left");
  return n;
}

std::string ByteReader::get_string(const char* field) {
  std::string s(size_t(count(field, 1)), '\0');
  raw(s.data(), s.size(), field);
  return s;
}

at::Tensor ByteReader::get_tensor(const char* field) {
  if (get<uint8_t>(field) == 0) return at::Tensor();
  const size_t at = at_;
  const int32_t code = get<int32_t>(field);
  static constexpr at::ScalarType kPlain[] = {at::kByte, at::kChar,   at::kShort, at::kInt,  at::kLong,
                                              at::kHalf, at::kFloat, at::kDouble, at::kBool, at::kBFloat16};
  KILN_CHECK(std::any_of(std::begin(kPlain), std::end(kPlain), [&](at::ScalarType t) { return int32_t(t) == code; }),
             "bytes: reading ", field, " of ", what_, " at offset ", at, ": ", code,
             " is not a dtype this encoding writes");
  const std::vector<int64_t> shape = get_vector<int64_t>(field);
  // The product of the dimensions, zeros counted as ones, stays far below int64's range, so that
  // at::empty's strides cannot overflow on a garbled shape; the bytes themselves are checked below.
  constexpr int64_t kMaxExtent = int64_t(1) << 48;
  int64_t numel = 1, extent = 1;
  for (int64_t d : shape) {
    KILN_CHECK(d >= 0 && extent <= kMaxExtent / std::max<int64_t>(d, 1), "bytes: reading ", field, " of ", what_,
               " at offset ", at, ": a dimension of ", d, " in a shape of ", shape.size(), " does not fit");
    numel *= d;
    extent *= std::max<int64_t>(d, 1);
  }
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::ScalarType(code)));  // a plain dtype, checked
  KILN_CHECK(uint64_t(numel) * t.element_size() <= n_ - at_, "bytes: reading ", field, " of ", what_, " at offset ",
             at, ": a tensor of ", numel, " elements does not fit the ", n_ - at_, " bytes left");
  raw(t.data_ptr(), t.nbytes(), field);
  return t;
}

void ByteReader::expect_end() const {
  KILN_CHECK(at_ == n_, "bytes: ", what_, " holds ", n_ - at_, " bytes past what was read (", at_, " of ", n_,
             "); the writer and the reader disagree");
}

}  // namespace kiln
