// The in-memory optimizers of MUSE.md §7: AdamW exactly as torch.optim.AdamW, and Muon (Nesterov
// momentum, 5 quintic Newton-Schulz steps on the wide orientation, RMS-matching scale, decoupled
// weight decay), plus the default rule that assigns each parameter to one of them.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::optimizers {

// Quintic Newton-Schulz orthogonalisation of g [..., rows, cols], batched over leading dims (each
// expert matrix on its own): Frobenius-normalise each matrix, work on the wide orientation
// (transposed when rows > cols), apply X <- a X + (b A + c A^2) X with A = X X^T `steps` times,
// coefficients (3.4445, -4.7750, 2.0315), in `dtype`; returns g's shape in g's dtype.
at::Tensor newton_schulz5(const at::Tensor& g, int64_t steps = 5, at::ScalarType dtype = at::kBFloat16);
// The scalar map the iteration applies to each normalised singular value (for tests and docs).
double newton_schulz5_scalar(double sigma, int64_t steps = 5);

struct AdamWConfig {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

struct MuonConfig {
  double lr = 0.02, momentum = 0.95, weight_decay = 0.0;
  bool nesterov = true;
  int64_t ns_steps = 5;
  at::ScalarType ns_dtype = at::kBFloat16;  // the iteration's dtype; kFloat for exact tests
};

// AdamW over a list of parameters; state in fp32 (exp_avg, exp_avg_sq), updates in place.
class AdamW {
 public:
  AdamW(std::vector<at::Tensor> params, AdamWConfig cfg);
  void step();  // skips parameters without a gradient
  void set_lr(double lr) { cfg_.lr = lr; }
  int64_t steps() const { return step_; }

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_;
  AdamWConfig cfg_;
  int64_t step_ = 0;
};

// Muon over matrices [rows, cols] or stacks of them [E, rows, cols] (orthogonalised per matrix).
class Muon {
 public:
  Muon(std::vector<at::Tensor> params, MuonConfig cfg);
  void step();
  void set_lr(double lr) { cfg_.lr = lr; }

 private:
  std::vector<at::Tensor> params_, momentum_;
  MuonConfig cfg_;
};

// The default assignment (MUSE.md §7): Muon for attention projections, the latent pooler and
// unpooler and the expert matrices; AdamW for embeddings, lm_head, norms and the router.
bool default_uses_muon(const std::string& name, const at::Tensor& param);

}  // namespace kiln::optimizers
