// AdamW and Muon updates: ATen ops for any device, a fused Eigen loop for AdamW on the CPU.
#include "optimizers/updates.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <ATen/Parallel.h>
#include <Eigen/Core>
#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <mutex>

#include "core/error.h"

namespace kiln::optimizers {
namespace {
constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;

// Runs fn(begin, end) over [0, n) in up to at::get_num_threads() ranges of at least `grain`: one
// on this thread, the others on ATen's inter-op pool. Not at::parallel_for: with the OpenMP
// backend it is an inline `#pragma omp parallel`, which runs serially in code built without
// -fopenmp (ours; measured 1.9x slower than torch's AdamW on 16 threads before this).
template <class F>
void fork_join(int64_t n, int64_t grain, const F& fn) {
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(grain, 1)));
  if (tasks == 1) return fn(int64_t(0), n);
  std::mutex mu;
  std::condition_variable cv;
  int64_t left = tasks - 1;
  std::exception_ptr error;
  auto range = [&](int64_t t) { return std::make_pair(n * t / tasks, n * (t + 1) / tasks); };
  for (int64_t t = 1; t < tasks; ++t)
    at::launch([&, t] {
      try {
        auto [b, e] = range(t);
        fn(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu);
      if (--left == 0) cv.notify_one();
    });
  auto [b, e] = range(0);
  fn(b, e);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
  if (error) std::rethrow_exception(error);
}

// Newton-Schulz on one row-major matrix in Eigen (T = float or double), for the CPU: the small
// matrices of CPU models spend most of their time in ATen's per-op overhead (muse-tiny's Muon
// step took 170 ms in ATen ops).
template <class T>
void newton_schulz5_eigen(const T* in, T* out, int64_t rows, int64_t cols, int64_t steps) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<const Mat> g(in, rows, cols);
  const bool tall = rows > cols;
  Mat x = tall ? Mat(g.transpose()) : Mat(g);
  x /= x.norm() + T(1e-7);
  Mat a, b;
  for (int64_t i = 0; i < steps; ++i) {
    a.noalias() = x * x.transpose();
    b.noalias() = T(kC) * (a * a);
    b += T(kB) * a;
    x = T(kA) * x + b * x;  // the product is evaluated into a temporary before x is written
  }
  Eigen::Map<Mat> o(out, rows, cols);
  if (tall)
    o = x.transpose();
  else
    o = x;
}
}  // namespace

at::Tensor newton_schulz5(const at::Tensor& g, int64_t steps, at::ScalarType dtype) {
  KILN_CHECK(g.dim() >= 2, "newton_schulz5: needs a matrix or a stack of matrices (got ", g.sizes(), ")");
  at::NoGradGuard no_grad;
  if (g.is_cpu()) {
    // fp64 when asked for (tests), else fp32: bf16 matmuls on the CPU are emulated and slow.
    const bool f64 = dtype == at::kDouble;
    at::Tensor flat = g.to(f64 ? at::kDouble : at::kFloat).reshape({-1, g.size(-2), g.size(-1)}).contiguous();
    at::Tensor out = at::empty_like(flat);
    const int64_t r = g.size(-2), c = g.size(-1);
    fork_join(flat.size(0), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        if (f64)
          newton_schulz5_eigen(flat.data_ptr<double>() + i * r * c, out.data_ptr<double>() + i * r * c, r, c, steps);
        else
          newton_schulz5_eigen(flat.data_ptr<float>() + i * r * c, out.data_ptr<float>() + i * r * c, r, c, steps);
      }
    });
    return out.view(g.sizes()).to(g.scalar_type());
  }
  // Three batched GEMMs per iteration, the scaled sums in their epilogues (beta C + alpha AB, one
  // rounding): elementwise passes over the stack were half the time of the GEMMs in bf16.
  const bool tall = g.size(-2) > g.size(-1);
  at::Tensor x = g.to(at::kFloat).reshape({-1, g.size(-2), g.size(-1)});
  x = x / (at::linalg_norm(x, "fro", {-2, -1}, /*keepdim=*/true) + 1e-7);
  x = (tall ? x.transpose(-2, -1) : x).to(dtype).contiguous();
  for (int64_t i = 0; i < steps; ++i) {
    at::Tensor a = at::bmm(x, x.transpose(-2, -1));
    at::Tensor b = at::baddbmm(a, a, a, /*beta=*/kB, /*alpha=*/kC);
    x = at::baddbmm(x, b, x, /*beta=*/kA, /*alpha=*/1);
  }
  return (tall ? x.transpose(-2, -1) : x).to(g.scalar_type()).reshape(g.sizes()).contiguous();
}

double newton_schulz5_scalar(double s, int64_t steps) {
  for (int64_t i = 0; i < steps; ++i) s = kA * s + kB * s * s * s + kC * s * s * s * s * s;
  return s;
}

void AdamWConfig::validate() const {
  KILN_CHECK(lr >= 0 && eps > 0 && beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1 && weight_decay >= 0,
             "adamw: lr=", lr, ", eps=", eps, ", betas=(", beta1, ", ", beta2, "), weight_decay=", weight_decay,
             " must satisfy lr >= 0, eps > 0, 0 <= beta < 1, weight_decay >= 0");
}

void MuonConfig::validate() const {
  KILN_CHECK(lr >= 0 && momentum >= 0 && momentum < 1 && ns_steps >= 1 && weight_decay >= 0, "muon: lr=", lr,
             ", momentum=", momentum, ", ns_steps=", ns_steps, ", weight_decay=", weight_decay,
             " must satisfy lr >= 0, 0 <= momentum < 1, ns_steps >= 1, weight_decay >= 0");
}

namespace {
// Runs `update` on fp32 copies of bf16 moments and rounds them back; fp32 moments are used as is.
template <class F>
void with_fp32(at::Tensor& a, F&& update) {
  if (a.scalar_type() == at::kFloat) return update(a);
  at::Tensor a32 = a.to(at::kFloat);
  update(a32);
  a.copy_(a32);
}
}  // namespace

void adamw_update(at::Tensor& w, const at::Tensor& g_any, at::Tensor& m, at::Tensor& v, const AdamWConfig& cfg,
                  int64_t step) {
  at::NoGradGuard no_grad;
  const double bc1 = 1 - std::pow(cfg.beta1, double(step)), bc2 = 1 - std::pow(cfg.beta2, double(step));
  at::Tensor g = g_any.to(at::kFloat).reshape(w.sizes());
  // The order of torch.optim.AdamW (single-tensor path): decay, moments, then the step.
  w.mul_(1 - cfg.lr * cfg.weight_decay);
  with_fp32(m, [&](at::Tensor& m32) {
    m32.lerp_(g, 1 - cfg.beta1);
    with_fp32(v, [&](at::Tensor& v32) {
      v32.mul_(cfg.beta2).addcmul_(g, g, 1 - cfg.beta2);
      at::Tensor denom = (v32.sqrt() / std::sqrt(bc2)).add_(cfg.eps);
      w.addcdiv_(m32, denom, -cfg.lr / bc1);
    });
  });
}

namespace {
using Span = Eigen::Map<Eigen::ArrayXf>;
using ConstSpan = Eigen::Map<const Eigen::ArrayXf>;
using Bf16Span = Eigen::Map<Eigen::Array<Eigen::bfloat16, Eigen::Dynamic, 1>>;
constexpr int64_t kBlock = 2048;  // elements per pass: the working set stays in L1/L2

struct AdamWScalars {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, eps, step_size;
};

// One block of at most kBlock elements; m and v are fp32 spans (converted by the caller for bf16).
inline void adamw_block(Span w, ConstSpan g, Span m, Span v, const AdamWScalars& s) {
  w *= s.decay;
  m += s.one_minus_beta1 * (g - m);  // lerp with weight < 0.5, as ATen computes it
  v = v * s.beta2 + s.one_minus_beta2 * g * g;
  w -= s.step_size * m / (v.sqrt() / s.sqrt_bc2 + s.eps);
}
}  // namespace

void adamw_update_cpu(float* w, const float* g, void* m, void* v, bool moments_bf16, int64_t n,
                      const AdamWConfig& cfg, int64_t step) {
  const double bc1 = 1 - std::pow(cfg.beta1, double(step)), bc2 = 1 - std::pow(cfg.beta2, double(step));
  const AdamWScalars s{float(1 - cfg.lr * cfg.weight_decay), float(cfg.beta1), float(1 - cfg.beta1),
                       float(cfg.beta2), float(1 - cfg.beta2), float(std::sqrt(bc2)), float(cfg.eps),
                       float(cfg.lr / bc1)};
  fork_join((n + kBlock - 1) / kBlock, 16, [&](int64_t b0, int64_t b1) {
    alignas(64) float mbuf[kBlock], vbuf[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i = b * kBlock, len = std::min(kBlock, n - i);
      if (!moments_bf16) {
        adamw_block(Span(w + i, len), ConstSpan(g + i, len), Span(static_cast<float*>(m) + i, len),
                    Span(static_cast<float*>(v) + i, len), s);
        continue;
      }
      Bf16Span mb(static_cast<Eigen::bfloat16*>(m) + i, len), vb(static_cast<Eigen::bfloat16*>(v) + i, len);
      Span m32(mbuf, len), v32(vbuf, len);
      m32 = mb.cast<float>();
      v32 = vb.cast<float>();
      adamw_block(Span(w + i, len), ConstSpan(g + i, len), m32, v32, s);
      mb = m32.cast<Eigen::bfloat16>();
      vb = v32.cast<Eigen::bfloat16>();
    }
  });
}

void muon_update(at::Tensor& w, const at::Tensor& g_any, at::Tensor& m, const MuonConfig& cfg) {
  at::NoGradGuard no_grad;
  KILN_CHECK(w.dim() == 3, "muon_update: weights must be [k, rows, cols] (got ", w.sizes(), ")");
  at::Tensor g = g_any.to(at::kFloat).reshape(w.sizes());
  at::Tensor u;
  with_fp32(m, [&](at::Tensor& m32) {
    m32.mul_(cfg.momentum).add_(g.view(m32.sizes()));
    u = cfg.nesterov ? g.add(m32.view(w.sizes()), cfg.momentum) : m32.view(w.sizes()).clone();
  });
  at::Tensor o = newton_schulz5(u, cfg.ns_steps, w.is_cpu() ? at::kFloat : cfg.ns_dtype);
  const double scale = 0.2 * std::sqrt(double(std::max(w.size(-2), w.size(-1))));
  w.mul_(1 - cfg.lr * cfg.weight_decay).add_(o, -cfg.lr * scale);
}
}  // namespace kiln::optimizers
