// NVFP4 reference: scalar encoders written out from the format definitions, the tensor quantiser
// built on them (one row, one 16-value block at a time), the W4A16/W4A4 linears in fp32, the
// kernel layout, and the dispatch to the CUDA kernels.
#include "kernels/nvfp4.h"

#include <ATen/ATen.h>

#include <cmath>
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/torch_version.h"
#include "kernels/nvfp4_dispatch.h"
#include "kernels/nvfp4_layout.h"

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


Nvfp4Tensor Nvfp4Tensor::to(at::Device device) const {
  return {packed.to(device), block_scale.to(device), tensor_scale.to(device), kernel_layout,
          input_scale.defined() ? input_scale.to(device) : input_scale};
}

void nvfp4_check(const Nvfp4Tensor& q, const char* what) {
  KILN_CHECK(q.packed.defined() && (q.packed.dim() == 2 || q.packed.dim() == 3) && q.packed.scalar_type() == at::kByte,
             what, ": packed weights must be uint8 [N, K/2] or [E, N, K/2] (got ",
             q.packed.defined() ? q.packed.sizes() : at::IntArrayRef{}, ")");
  const int64_t N = q.rows(), K = q.cols();
  KILN_CHECK(K % kNvfp4Block == 0, what, ": K = ", K, " (twice the packed width ", K / 2, ") must be a multiple of ",
             kNvfp4Block);
  std::vector<int64_t> want(q.packed.sizes().begin(), q.packed.sizes().end());
  want.back() = K / kNvfp4Block;
  KILN_CHECK(q.block_scale.defined(), what, ": missing block scales (weight_scale, F8_E4M3 ", at::IntArrayRef(want), ")");
  KILN_CHECK(q.block_scale.sizes() == at::IntArrayRef(want) && q.block_scale.element_size() == 1, what,
             ": block scales must be 1-byte E4M3 ", at::IntArrayRef(want), " for packed weights ", q.packed.sizes(),
             " (got ", q.block_scale.sizes(), " ", q.block_scale.scalar_type(), ")");
  const int64_t matrices = q.stacked() ? q.packed.size(0) : 1;
  KILN_CHECK(q.tensor_scale.defined(), what, ": missing tensor scale (weight_scale_2, F32)");
  KILN_CHECK(q.tensor_scale.numel() == matrices && q.tensor_scale.scalar_type() == at::kFloat &&
                 q.tensor_scale.dim() == (q.stacked() ? 1 : 0),
             what, ": tensor scale must be fp32 ", q.stacked() ? str_cat("[", matrices, "]") : std::string("[] (a scalar)"),
             " (got ", q.tensor_scale.sizes(), " ", q.tensor_scale.scalar_type(), ")");
  KILN_CHECK(q.packed.device() == q.block_scale.device() && q.packed.device() == q.tensor_scale.device(), what,
             ": packed weights and scales must share a device");
  KILN_CHECK(!q.input_scale.defined() || (q.input_scale.numel() == matrices && q.input_scale.scalar_type() == at::kFloat),
             what, ": input scale must be fp32 with one value per matrix (", matrices, "), got ", q.input_scale.sizes(),
             " ", q.input_scale.scalar_type());
  (void)N;
}

namespace {

Nvfp4Tensor quantize_matrix(const at::Tensor& w) {
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

// One matrix's values e2m1(q) * (float(sf) * s2) in fp32 (s2 = 1 gives the codes times block scales).
at::Tensor dequantize_matrix(const at::Tensor& packed_in, const at::Tensor& scales_in, float s2) {
  const int64_t N = packed_in.size(0), K = packed_in.size(1) * 2;
  at::Tensor packed = packed_in.cpu().contiguous(), scales = scales_in.cpu().contiguous().view(at::kByte);
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const uint8_t* ps = scales.data_ptr<uint8_t>();
  at::Tensor out = at::empty({N, K}, at::kFloat);
  float* po = out.data_ptr<float>();
  float lut[256];
  for (int c = 0; c < 256; ++c) lut[c] = e4m3_decode(uint8_t(c)) * s2;
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t byte = pk[r * (K / 2) + k / 2];
      const uint8_t code = k % 2 == 0 ? byte & 0xF : byte >> 4;
      po[r * K + k] = e2m1_decode(code) * lut[ps[r * (K / kNvfp4Block) + k / kNvfp4Block]];
    }
  return out;
}

// floor(log2(a)) of positive values as a float tensor (frexp: a = m * 2^e, m in [0.5, 1)).
at::Tensor floor_log2(const at::Tensor& a) { return std::get<1>(at::frexp(a)).to(at::kFloat) - 1; }

// Vectorised value-domain roundings, equal to the scalar encoders followed by the decoders.
// E4M3 for non-negative v: 3 mantissa bits, exponents -6..8, saturating at 448.
at::Tensor e4m3_round_values(const at::Tensor& v) {
  at::Tensor step = at::pow(2.0, at::clamp(floor_log2(v), -6, 8) - 3);
  return at::clamp_max(at::round(v / step) * step, 448.0);
}
// E2M1 for any v: steps 0.5 below 2, 1 up to 4, 2 up to 6; saturating at 6; the sign kept.
at::Tensor e2m1_round_values(const at::Tensor& v) {
  at::Tensor a = v.abs();
  at::Tensor step = at::pow(2.0, at::clamp(floor_log2(a), 0, 2) - 1);
  return at::copysign(at::clamp_max(at::round(a / step) * step, 6.0), v);
}

}  // namespace

Nvfp4Tensor nvfp4_quantize_reference(const at::Tensor& w) {
  KILN_CHECK((w.dim() == 2 || w.dim() == 3) && w.size(-1) % kNvfp4Block == 0,
             "nvfp4: weights must be [N, K] or [E, N, K] with K a multiple of ", kNvfp4Block, " (got ", w.sizes(), ")");
  if (w.dim() == 2) return quantize_matrix(w);
  std::vector<at::Tensor> p, s, t;
  for (int64_t e = 0; e < w.size(0); ++e) {
    Nvfp4Tensor q = quantize_matrix(w[e]);
    p.push_back(q.packed);
    s.push_back(q.block_scale);
    t.push_back(q.tensor_scale);
  }
  return {at::stack(p), at::stack(s), at::stack(t), false, at::Tensor()};
}

at::Tensor nvfp4_dequantize_reference(const Nvfp4Tensor& q, at::ScalarType dtype) {
  nvfp4_check(q);
  if (q.kernel_layout) return nvfp4_dequantize_reference(nvfp4_to_modelopt_layout(q), dtype);
  at::Tensor s2 = q.tensor_scale.cpu();
  if (!q.stacked()) return dequantize_matrix(q.packed, q.block_scale, s2.item<float>()).to(dtype);
  std::vector<at::Tensor> out;
  for (int64_t e = 0; e < q.packed.size(0); ++e)
    out.push_back(dequantize_matrix(q.packed[e], q.block_scale[e], s2[e].item<float>()));
  return at::stack(out).to(dtype);
}

Nvfp4Tensor nvfp4_quantize(const at::Tensor& w, bool kernel_layout) {
#if KILN_WITH_CUDA
  if (w.is_cuda()) return nvfp4_quantize_cuda(w, kernel_layout);  // writes either layout directly
#endif
  Nvfp4Tensor q = nvfp4_quantize_reference(w);
  return (kernel_layout ? nvfp4_to_kernel_layout(q) : q).to(w.device());
}

at::Tensor nvfp4_dequantize(const Nvfp4Tensor& q, at::ScalarType dtype) {
#if KILN_WITH_CUDA
  if (q.packed.is_cuda()) return nvfp4_dequantize_cuda(q, dtype);
#endif
  return nvfp4_dequantize_reference(q, dtype).to(q.packed.device());
}

namespace {

// The kernel layout's block places (nvfp4_layout::block_place) of one [N, nb] matrix, on `device`.
at::Tensor block_places(int64_t N, int64_t nb, bool scale, at::Device device) {
  at::Tensor places = at::empty({N * nb}, at::kLong);
  int64_t* p = places.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) p[n * nb + b] = nvfp4_layout::block_place(n, b, N, nb, scale);
  return places.to(device);
}

// Moves every block's codes and scale to its place (or back) and permutes the bits of every 32-bit
// word (nvfp4_layout.h); `to_kernel` true maps the ModelOpt order to the kernel's. Each byte of a
// word contributes its bits through a 256-entry table, so the words take four gathers and three
// ORs, and the places one gather or scatter per tensor, on the tensors' own device.
Nvfp4Tensor change_layout(const Nvfp4Tensor& q, bool to_kernel) {
  nvfp4_check(q);
  KILN_CHECK(q.kernel_layout != to_kernel, "nvfp4: weights are already in the ",
             to_kernel ? "kernel" : "ModelOpt", " layout");
  const at::Device device = q.packed.device();
  std::vector<int64_t> table(4 * 256);
  for (int byte = 0; byte < 4; ++byte)
    for (int v = 0; v < 256; ++v) {
      const uint32_t word = uint32_t(v) << (8 * byte);
      table[byte * 256 + v] = int64_t(to_kernel ? nvfp4_layout::to_kernel_word(word) : nvfp4_layout::to_modelopt_word(word));
    }
  at::Tensor lut = at::tensor(table, at::kLong).to(device).view({4, 256});
  at::Tensor bytes = q.packed.contiguous().view({-1, 4}).to(at::kLong);  // little-endian words
  at::Tensor out = at::zeros({bytes.size(0)}, bytes.options());
  for (int64_t byte = 0; byte < 4; ++byte)
    out.bitwise_or_(lut[byte].index_select(0, bytes.select(1, byte)));
  // Back to 32-bit words (two's complement for the top bit), then to the bytes.
  const int64_t top = int64_t(1) << 31;
  at::Tensor words = at::where(out >= top, out - 2 * top, out).to(at::kInt);
  // Then the places: blocks of 8 code bytes and single scale bytes, per matrix.
  const int64_t E = q.stacked() ? q.packed.size(0) : 1, N = q.rows(), nb = q.cols() / 16;
  auto move = [&](const at::Tensor& t, bool scale) {
    at::Tensor places = block_places(N, nb, scale, device);
    at::Tensor v = t.contiguous().view(at::kByte).reshape({E, N * nb, scale ? 1 : 8});
    if (!to_kernel) return v.index_select(1, places).view(t.sizes()).view(t.scalar_type());
    return at::empty_like(v).index_copy_(1, places, v).view(t.sizes()).view(t.scalar_type());
  };
  Nvfp4Tensor r = q;
  r.packed = move(words.view(at::kByte).view(q.packed.sizes()), false);
  r.block_scale = move(q.block_scale, true);
  r.kernel_layout = to_kernel;
  return r;
}

at::Tensor acc_of(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? x.to(at::kDouble) : x.to(at::kFloat); }

void check_linear_input(const at::Tensor& x, const Nvfp4Tensor& w, const char* what) {
  KILN_CHECK(x.dim() == 2 && x.size(1) == w.cols(), what, ": input must be [M, ", w.cols(), "] for weights [",
             w.rows(), ", ", w.cols(), "] (got ", x.sizes(), ")");
  KILN_CHECK(at::isFloatingType(x.scalar_type()), what, ": input must be floating point (got ", x.scalar_type(), ")");
}

// The GEMM operand and its extra epilogue scale: x itself (scale 1), or W4A4's quantised x.
std::pair<at::Tensor, at::Tensor> gemm_input(const at::Tensor& x, const Nvfp4LinearOptions& opt) {
  if (!opt.w4a4) return {x, at::Tensor()};
  at::Tensor scale;
  at::Tensor xq = nvfp4_fake_quantize_activations(x, opt.input_scale, &scale);
  return {xq, scale};
}

}  // namespace

Nvfp4Tensor nvfp4_to_kernel_layout(const Nvfp4Tensor& q) { return change_layout(q, true); }
Nvfp4Tensor nvfp4_to_modelopt_layout(const Nvfp4Tensor& q) { return change_layout(q, false); }

at::Tensor nvfp4_fake_quantize_activations(const at::Tensor& x, const at::Tensor& input_scale, at::Tensor* scale) {
  KILN_CHECK(x.dim() == 2 && x.size(1) % kNvfp4Block == 0, "nvfp4: W4A4 activations must be [M, K] with K a multiple of ",
             kNvfp4Block, " (got ", x.sizes(), ")");
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor s;
  if (input_scale.defined()) {
    s = input_scale.to(xf.device(), at::kFloat).reshape({});
  } else {
    // Dynamic: one scale per row (token), so a token's numerics do not depend on its batch. The
    // division runs in fp64 so CPU and GPU agree (ATen divides by a scalar with a reciprocal on GPU).
    at::Tensor amax = xf.abs().amax(-1, /*keepdim=*/true);  // [M, 1]
    s = at::where(amax > 0, (amax.to(at::kDouble) / (6.0 * 448.0)).to(at::kFloat), at::ones_like(amax));
  }
  if (scale) *scale = s;
  at::Tensor blocks = xf.view({x.size(0), -1, kNvfp4Block});
  at::Tensor s3 = s.dim() == 2 ? s.unsqueeze(-1) : s;  // broadcasts over [M, K/16, 16]
  at::Tensor sf = e4m3_round_values(blocks.abs().amax(-1, true) / (s3 * 6.0f));  // the weights' order
  at::Tensor block_scale = sf * s3;
  at::Tensor codes = at::where(block_scale > 0, e2m1_round_values(blocks / block_scale), at::zeros_like(blocks));
  return (codes * sf).view_as(xf).to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

at::Tensor nvfp4_linear_reference(const at::Tensor& x, const Nvfp4Tensor& w, const Nvfp4LinearOptions& opt) {
  nvfp4_check(w, "nvfp4_linear");
  KILN_CHECK(!w.stacked(), "nvfp4_linear: weights must be one matrix (got a stack ", w.packed.sizes(), ")");
  check_linear_input(x, w, "nvfp4_linear");
  auto [xin, extra] = gemm_input(x, opt);
  Nvfp4Tensor unit = w;  // codes times block scales; the tensor scale goes in the epilogue
  unit.tensor_scale = at::ones({}, w.tensor_scale.options());
  at::Tensor xa = acc_of(xin);
  at::Tensor wq = nvfp4_dequantize_reference(unit, xa.scalar_type()).to(x.device());
  at::Tensor y = at::matmul(xa, wq.t()) * w.tensor_scale.to(x.device(), xa.scalar_type());
  if (extra.defined()) y = y * extra.to(xa.scalar_type());
  return y.to(x.scalar_type());
}

at::Tensor nvfp4_grouped_linear_reference(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& offsets,
                                          const Nvfp4LinearOptions& opt) {
  nvfp4_check(w, "nvfp4_grouped_linear");
  KILN_CHECK(w.stacked(), "nvfp4_grouped_linear: weights must be a stack [E, N, K/2] (got ", w.packed.sizes(), ")");
  check_linear_input(x, w, "nvfp4_grouped_linear");
  const int64_t E = w.packed.size(0);
  KILN_CHECK(offsets.dim() == 1 && offsets.size(0) == E + 1, "nvfp4_grouped_linear: offsets must be [", E + 1,
             "] (got ", offsets.sizes(), ")");
  at::Tensor off = offsets.cpu().to(at::kLong);
  const int64_t* o = off.data_ptr<int64_t>();
  KILN_CHECK(o[0] == 0 && o[E] <= x.size(0), "nvfp4_grouped_linear: offsets must run from 0 to at most the rows (",
             x.size(0), "), got ", o[0], "..", o[E]);
  at::Tensor y = at::zeros({x.size(0), w.rows()}, x.options());  // rows past offsets[E] belong to no expert
  // W4A4 scales the whole grouped input with one per-tensor scale, as one GEMM call would.
  auto [xin, extra] = gemm_input(x, opt);
  for (int64_t e = 0; e < E; ++e) {
    KILN_CHECK(o[e + 1] >= o[e], "nvfp4_grouped_linear: offsets must not decrease (expert ", e, ")");
    if (o[e + 1] == o[e]) continue;
    Nvfp4Tensor one{w.packed[e], w.block_scale[e], w.tensor_scale[e], w.kernel_layout, at::Tensor()};
    Nvfp4LinearOptions plain;
    at::Tensor part = nvfp4_linear_reference(xin.narrow(0, o[e], o[e + 1] - o[e]), one, plain);
    if (extra.defined())
      part = part * (extra.dim() == 0 ? extra : extra.narrow(0, o[e], o[e + 1] - o[e])).to(part.scalar_type());
    y.narrow(0, o[e], o[e + 1] - o[e]).copy_(part);
  }
  return y;
}

namespace {

constexpr int64_t kGroupAlign = 16;  // torch's grouped GEMM: each segment starts on a 16-row boundary

// The call as the dispatch table (nvfp4_dispatch.cpp) sees it. wgmma's usability (a device guard
// and a lookup) is asked only where the table would take wgmma if it were usable.
Nvfp4Call describe(const at::Tensor& x, const Nvfp4Tensor& w, int64_t rows, Nvfp4Gemm gemm) {
  Nvfp4Call c;
  c.bf16 = x.scalar_type() == at::kBFloat16;
  c.served = KILN_WITH_CUDA && x.is_cuda() && (c.bf16 || x.scalar_type() == at::kFloat) && w.packed.defined() &&
             w.kernel_layout;
  if (!c.served) return c;
  c.rows = rows;
  c.experts = w.stacked() ? w.packed.size(0) : 0;
  c.out = w.rows();
  c.staged_aligned = c.experts > 0 && grouped_stack_aligned(w.rows(), w.cols());
  c.grouped_mm = KILN_TORCH_AT_LEAST(2, 8);
  c.wgmma_usable = true;  // first: would the table take wgmma if it could run here?
  c.wgmma_usable = nvfp4_kernel(c, gemm) == Nvfp4Kernel::kWgmma && nvfp4_wgmma_usable(x, w);
  return c;
}

Nvfp4Kernel dense_kernel(const at::Tensor& x, const Nvfp4Tensor& w) {
  const Nvfp4Gemm gemm = nvfp4_gemm_selected();
  return w.stacked() ? Nvfp4Kernel::kReference : nvfp4_kernel(describe(x, w, x.size(0), gemm), gemm);
}

Nvfp4Kernel grouped_kernel(const at::Tensor& x, const Nvfp4Tensor& w, int64_t rows) {
  const Nvfp4Gemm gemm = nvfp4_gemm_selected();
  return !w.stacked() ? Nvfp4Kernel::kReference : nvfp4_kernel(describe(x, w, rows, gemm), gemm);
}

#if KILN_WITH_CUDA
#if KILN_TORCH_AT_LEAST(2, 8)
// Torch's grouped GEMM on the whole stack dequantised in one launch (each weight rounded once to
// x's dtype, its expert's tensor scale included); xp's segments end at `ends` (int32) and start
// on 16-row boundaries.
at::Tensor dequantized_grouped_mm(const at::Tensor& xp, const Nvfp4Tensor& w, const at::Tensor& ends) {
  return at::_grouped_mm(xp, nvfp4_dequantize_cuda(w, xp.scalar_type()).transpose(1, 2), ends);
}

// Grouped prefill for rows sorted by expert: each expert's rows moved to a segment that starts on
// a 16-row boundary (the grouped GEMM's alignment; the bound R + 15 E is static) and back. The
// offsets stay on the device: nothing waits for the host.
at::Tensor grouped_prefill(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& offsets) {
  const int64_t R = x.size(0), E = w.packed.size(0);
  const at::Tensor ends_in = offsets.narrow(0, 1, E), starts_in = offsets.narrow(0, 0, E);
  const at::Tensor padded = at::floor_divide(ends_in - starts_in + (kGroupAlign - 1), kGroupAlign) * kGroupAlign;
  const at::Tensor ends = padded.cumsum(0);
  const at::Tensor rows = at::arange(R, offsets.options());
  // Rows past the last expert's (an expert exchange's padding) ride after expert E - 1's rows:
  // inside the buffer, and their outputs are never read.
  const at::Tensor expert = at::searchsorted(ends_in, rows, /*out_int32=*/false, /*right=*/true).clamp_max(E - 1);
  const at::Tensor dest = (ends - padded).index_select(0, expert) + rows - starts_in.index_select(0, expert);
  // Padding rows stay uninitialised: a GEMM row depends on its own input row only, and no padded
  // output row is read back.
  at::Tensor xp = at::empty({R + (kGroupAlign - 1) * E, x.size(1)}, x.options()).index_copy_(0, dest, x);
  return dequantized_grouped_mm(xp, w, ends.to(at::kInt)).index_select(0, dest);
}
#endif
#endif

}  // namespace

const char* nvfp4_linear_path(const at::Tensor& x, const Nvfp4Tensor& w) {
  return nvfp4_kernel_name(dense_kernel(x, w));
}

const char* nvfp4_grouped_linear_path(const at::Tensor& x, const Nvfp4Tensor& w, int64_t rows) {
  return nvfp4_kernel_name(grouped_kernel(x, w, rows));
}

at::Tensor nvfp4_linear(const at::Tensor& x, const Nvfp4Tensor& w, const Nvfp4LinearOptions& opt) {
  const Nvfp4Kernel path = dense_kernel(x, w);
  if (path == Nvfp4Kernel::kReference) return nvfp4_linear_reference(x, w, opt);
#if KILN_WITH_CUDA
  auto [xq, extra] = gemm_input(x, opt);
  at::Tensor xin = xq.to(x.scalar_type());
  const bool scalar = !extra.defined() || extra.dim() == 0;  // else per-row (dynamic W4A4)
  const bool fused = path != Nvfp4Kernel::kDequantized;
  const Nvfp4Gemm gemm = path == Nvfp4Kernel::kWgmma ? Nvfp4Gemm::kWgmma : Nvfp4Gemm::kSplitK;
  at::Tensor y = fused ? nvfp4_linear_cuda(xin, w, scalar ? extra : at::Tensor(), gemm)
                       : at::linear(xin, nvfp4_dequantize_cuda(w, x.scalar_type()));
  if (!extra.defined() || (scalar && fused)) return y;
  return (y.to(at::kFloat) * extra).to(x.scalar_type());
#else
  return nvfp4_linear_reference(x, w, opt);
#endif
}

bool nvfp4_grouped_dequantizes(const Nvfp4Tensor& w, int64_t rows, const at::Tensor& x) {
  return grouped_kernel(x, w, rows) == Nvfp4Kernel::kDequantizedGrouped;
}

at::Tensor nvfp4_grouped_linear(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& offsets,
                                const Nvfp4LinearOptions& opt) {
  const int64_t rows = opt.live_rows > 0 ? opt.live_rows : x.size(0);
  const Nvfp4Kernel path = grouped_kernel(x, w, rows);
#if KILN_WITH_CUDA
  if (path != Nvfp4Kernel::kReference) {
    auto [xq, extra] = gemm_input(x, opt);
    at::Tensor xin = xq.to(x.scalar_type());
    const int64_t E = w.packed.size(0);
    if (path == Nvfp4Kernel::kSplitK || path == Nvfp4Kernel::kStaged || path == Nvfp4Kernel::kStagedTiles ||
        path == Nvfp4Kernel::kWgmma) {
      const bool scalar = !extra.defined() || extra.dim() == 0;
      const Nvfp4Gemm gemm = path == Nvfp4Kernel::kWgmma         ? Nvfp4Gemm::kWgmma
                             : path == Nvfp4Kernel::kStaged      ? Nvfp4Gemm::kStaged
                             : path == Nvfp4Kernel::kStagedTiles ? Nvfp4Gemm::kStagedTiles
                                                                 : Nvfp4Gemm::kAuto;
      at::Tensor y = nvfp4_grouped_linear_cuda(xin, w, offsets, scalar ? extra : at::Tensor(), opt.live_rows, gemm);
      return scalar ? y : (y.to(at::kFloat) * extra).to(x.scalar_type());
    }
#if KILN_TORCH_AT_LEAST(2, 8)
    if (path == Nvfp4Kernel::kDequantizedGrouped) {
      at::Tensor y = grouped_prefill(xin, w, offsets);
      return extra.defined() ? (y.to(at::kFloat) * extra).to(x.scalar_type()) : y;
    }
#endif
    // Prefill without torch's grouped GEMM (fp32, or torch before 2.8): one cuBLAS GEMM per expert
    // on its dequantised weights, the offsets read on the host.
    at::Tensor off = offsets.cpu();
    const int64_t* o = off.data_ptr<int64_t>();
    at::Tensor y = at::empty({x.size(0), w.rows()}, x.options());
    for (int64_t e = 0; e < E; ++e) {
      if (o[e + 1] == o[e]) continue;
      Nvfp4Tensor one{w.packed[e], w.block_scale[e], w.tensor_scale[e], true, at::Tensor()};
      at::Tensor part = at::linear(xin.narrow(0, o[e], o[e + 1] - o[e]), nvfp4_dequantize_cuda(one, x.scalar_type()));
      if (extra.defined())
        part = part.to(at::kFloat) * (extra.dim() == 0 ? extra : extra.narrow(0, o[e], o[e + 1] - o[e]));
      y.narrow(0, o[e], o[e + 1] - o[e]).copy_(part);
    }
    return y;
  }
#endif
  (void)path;  // CPU builds: always the reference
  return nvfp4_grouped_linear_reference(x, w, offsets, opt);
}

bool nvfp4_grouped_on_device(const Nvfp4Tensor& w, const at::Tensor& x) {
  return KILN_WITH_CUDA && KILN_TORCH_AT_LEAST(2, 8) && x.is_cuda() && x.scalar_type() == at::kBFloat16 &&
         w.packed.defined() && w.kernel_layout && w.stacked();
}

at::Tensor nvfp4_grouped_linear_aligned(const at::Tensor& xp, const Nvfp4Tensor& w, const at::Tensor& ends,
                                        const Nvfp4LinearOptions& opt, const at::Tensor& segments) {
  KILN_CHECK(w.stacked() && ends.dim() == 1 && ends.size(0) == w.packed.size(0),
             "nvfp4_grouped_linear_aligned: ends must be [E] for a stack of E experts (got ", ends.sizes(), " for ",
             w.packed.sizes(), ")");
#if KILN_WITH_CUDA && KILN_TORCH_AT_LEAST(2, 8)
  if (nvfp4_grouped_dequantizes(w, opt.live_rows > 0 ? opt.live_rows : xp.size(0), xp)) {
    auto [xq, extra] = gemm_input(xp, opt);
    at::Tensor y = dequantized_grouped_mm(xq.to(xp.scalar_type()), w, ends.to(at::kInt));
    return extra.defined() ? (y.to(at::kFloat) * extra).to(xp.scalar_type()) : y;
  }
#endif
  // Elsewhere: each padded segment as one expert's rows (its padding rows run through that expert).
  if (segments.defined()) {
    KILN_CHECK(segments.dim() == 1 && segments.size(0) == ends.size(0) + 1 && segments.scalar_type() == at::kLong,
               "nvfp4_grouped_linear_aligned: segments must be int64 [E + 1] (got ", segments.sizes(), " ",
               segments.scalar_type(), ")");
    return nvfp4_grouped_linear(xp, w, segments, opt);
  }
  at::Tensor starts = at::zeros({1}, ends.options().dtype(at::kLong));
  return nvfp4_grouped_linear(xp, w, at::cat({starts, ends.to(at::kLong)}), opt);
}

}  // namespace kiln::kernels
