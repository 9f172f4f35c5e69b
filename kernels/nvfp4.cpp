// NVFP4 reference: scalar encoders written out from the format definitions, and the tensor
// quantiser built on them (one row at a time, one 16-value block at a time).
#include "kernels/nvfp4.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace kiln::kernels {
namespace {
constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
}  // namespace

uint8_t e2m1_encode(float x) {
  const uint8_t sign = std::signbit(x) ? 8 : 0;
  const float a = std::fabs(x);
  if (std::isnan(a)) return sign | 7;  // no NaN code: saturate like an overflow
  // Between neighbours i and i+1 the midpoint goes to the even code (codes 0, 2, 4, 6 are even).
  uint8_t code = 7;
  for (uint8_t i = 0; i < 7; ++i) {
    const float mid = 0.5f * (kE2m1[i] + kE2m1[i + 1]);  // exact in float
    if (a < mid || (a == mid && i % 2 == 0)) {
      code = i;
      break;
    }
  }
  return sign | code;
}

float e2m1_decode(uint8_t code) {
  const float v = kE2m1[code & 7];
  return (code & 8) ? -v : v;
}

uint8_t e4m3_encode(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(double(x));
  if (a >= 448.0) return sign | 0x7E;  // saturate (0x7E = 448)
  // Normal numbers have exponents -6..8 and 3 mantissa bits; below 2^-6 the step is 2^-9.
  int e = a > 0 ? int(std::floor(std::log2(a))) : -6;
  if (e < -6) e = -6;
  const double step = std::ldexp(1.0, e - 3);
  double m = std::nearbyint(a / step);  // round half to even (the default rounding mode)
  if (e >= -6 && m >= 16) {             // rounded up into the next binade
    m /= 2;
    ++e;
  }
  if (e == -6 && m < 8) return sign | uint8_t(m);  // subnormal: exponent field 0
  if (e > 8 || (e == 8 && m > 14)) return sign | 0x7E;
  return sign | uint8_t(((e + 7) << 3) | (int(m) - 8));
}

float e4m3_decode(uint8_t bits) {
  const int exp = (bits >> 3) & 0xF, man = bits & 7;
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  if (exp == 0xF && man == 7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(float(man), -9);
  return sign * std::ldexp(float(8 + man), exp - 10);
}

Nvfp4Tensor nvfp4_quantize_reference(const at::Tensor& w) {
  KILN_CHECK(w.dim() == 2 && w.size(1) % kNvfp4Block == 0, "nvfp4: weights must be [N, K] with K a multiple of ",
             kNvfp4Block, " (got ", w.sizes(), ")");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor x = w.to(at::kCPU, at::kFloat).contiguous();
  const float* px = x.data_ptr<float>();
  float amax = 0;
  for (int64_t i = 0; i < N * K; ++i) amax = std::max(amax, std::fabs(px[i]));
  const float s2 = amax > 0 ? amax / (6.0f * 448.0f) : 1.0f;
  Nvfp4Tensor q;
  q.packed = at::zeros({N, K / 2}, at::kByte);
  q.block_scale = at::zeros({N, K / kNvfp4Block}, at::kByte);
  q.tensor_scale = at::scalar_tensor(s2, at::kFloat);
  uint8_t* pk = q.packed.data_ptr<uint8_t>();
  uint8_t* ps = q.block_scale.data_ptr<uint8_t>();
  for (int64_t r = 0; r < N; ++r)
    for (int64_t b = 0; b < K / kNvfp4Block; ++b) {
      const float* blk = px + r * K + b * kNvfp4Block;
      float bmax = 0;
      for (int64_t j = 0; j < kNvfp4Block; ++j) bmax = std::max(bmax, std::fabs(blk[j]));
      const uint8_t sf = e4m3_encode(bmax / (6.0f * s2));
      ps[r * (K / kNvfp4Block) + b] = sf;
      const float scale = e4m3_decode(sf) * s2;
      for (int64_t j = 0; j < kNvfp4Block; ++j) {
        const uint8_t code = scale > 0 ? e2m1_encode(blk[j] / scale) : 0;
        const int64_t k = b * kNvfp4Block + j;
        pk[r * (K / 2) + k / 2] |= uint8_t(k % 2 == 0 ? code : code << 4);
      }
    }
  return q;
}

at::Tensor nvfp4_dequantize_reference(const Nvfp4Tensor& q, at::ScalarType dtype) {
  KILN_CHECK(q.packed.dim() == 2 && q.packed.scalar_type() == at::kByte, "nvfp4: packed weights must be uint8 [N, K/2] (got ",
             q.packed.sizes(), " ", q.packed.scalar_type(), ")");
  const int64_t N = q.packed.size(0), K = q.packed.size(1) * 2;
  KILN_CHECK(K % kNvfp4Block == 0, "nvfp4: K = ", K, " (twice the packed width) must be a multiple of ", kNvfp4Block);
  KILN_CHECK(q.block_scale.defined() && q.block_scale.sizes() == at::IntArrayRef({N, K / kNvfp4Block}) &&
                 q.block_scale.element_size() == 1,
             "nvfp4: block scales must be 1-byte [", N, ", ", K / kNvfp4Block, "] (got ",
             q.block_scale.defined() ? q.block_scale.sizes() : at::IntArrayRef{}, ")");
  KILN_CHECK(q.tensor_scale.defined() && q.tensor_scale.numel() == 1, "nvfp4: the tensor scale must be one fp32 value");
  const float s2 = q.tensor_scale.to(at::kFloat).item<float>();
  at::Tensor packed = q.packed.cpu().contiguous(), scales = q.block_scale.cpu().contiguous().view(at::kByte);
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const uint8_t* ps = scales.data_ptr<uint8_t>();
  at::Tensor out = at::empty({N, K}, at::kFloat);
  float* po = out.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t byte = pk[r * (K / 2) + k / 2];
      const uint8_t code = k % 2 == 0 ? byte & 0xF : byte >> 4;
      po[r * K + k] = e2m1_decode(code) * (e4m3_decode(ps[r * (K / kNvfp4Block) + k / kNvfp4Block]) * s2);
    }
  return out.to(dtype);
}

}  // namespace kiln::kernels
