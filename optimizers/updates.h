// The update arithmetic of docs/MODEL.md §7, applied to one parameter or one chunk of it: AdamW exactly as
// torch.optim.AdamW (in ATen on any device, and a fused Eigen loop for the CPU), and Muon (Nesterov
// momentum, 5 quintic Newton-Schulz steps on the wide orientation, RMS-matching scale, decoupled wd).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::optimizers {

struct AdamWConfig {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  void validate() const;
};

struct MuonConfig {
  double lr = 1e-3, momentum = 0.95, weight_decay = 0.0;  // lr: the update is RMS-matched to AdamW's
  bool nesterov = true;
  int64_t ns_steps = 5;
  // The iteration's dtype on GPUs (kFloat for exact tests). On the CPU it always runs in fp32:
  // bf16 matmuls there are emulated and ~10x slower, with nothing to gain.
  at::ScalarType ns_dtype = at::kBFloat16;
  void validate() const;
};

// Quintic Newton-Schulz orthogonalisation of g [..., rows, cols], batched over leading dims (each
// expert matrix on its own): Frobenius-normalise each matrix, work on the wide orientation
// (transposed when rows > cols), apply X <- a X + (b A + c A^2) X with A = X X^T `steps` times,
// coefficients (3.4445, -4.7750, 2.0315), in `dtype`; returns g's shape in g's dtype.
at::Tensor newton_schulz5(const at::Tensor& g, int64_t steps = 5, at::ScalarType dtype = at::kBFloat16);
// The scalar map the iteration applies to each normalised singular value (for tests and docs).
double newton_schulz5_scalar(double sigma, int64_t steps = 5);

// One AdamW step (number `step`, 1-based) on fp32 weights `w`, in ATen ops in the order of
// torch.optim.AdamW's single-tensor path. `g` is any float dtype; the moments `m`, `v` are fp32 or
// bf16 (then updated in fp32 and rounded back). All on one device, same number of elements.
void adamw_update(at::Tensor& w, const at::Tensor& g, at::Tensor& m, at::Tensor& v, const AdamWConfig& cfg,
                  int64_t step);

// The same step as one fused, vectorised pass over CPU memory (Eigen), split over ATen's intra-op
// threads. Moments are fp32 (moments_bf16 = false) or bf16 bit patterns. Equal to adamw_update
// within float rounding (the division by sqrt(bc2) is the same; the fused multiply-adds are not).
void adamw_update_cpu(float* w, const float* g, void* m, void* v, bool moments_bf16, int64_t n,
                      const AdamWConfig& cfg, int64_t step);

// One Muon step on fp32 weights `w` [k, rows, cols] (k matrices, each orthogonalised on its own):
// m <- momentum*m + g; u = g + momentum*m (Nesterov) or m; w <- w*(1 - lr*wd) - lr*0.2*sqrt(max(rows,
// cols))*NS5(u). `m` is fp32 or bf16. NS5 runs in cfg.ns_dtype on GPUs, fp32 on the CPU.
void muon_update(at::Tensor& w, const at::Tensor& g, at::Tensor& m, const MuonConfig& cfg);

}  // namespace kiln::optimizers
