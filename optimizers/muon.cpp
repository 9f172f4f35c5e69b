// AdamW and Muon in ATen ops: fp32 state, in-place updates without autograd.
#include "optimizers/muon.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>

#include "core/error.h"

namespace kiln::optimizers {
namespace {
constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;
}

at::Tensor newton_schulz5(const at::Tensor& g, int64_t steps, at::ScalarType dtype) {
  KILN_CHECK(g.dim() >= 2, "newton_schulz5: needs a matrix or a stack of matrices (got ", g.sizes(), ")");
  at::NoGradGuard no_grad;
  const bool tall = g.size(-2) > g.size(-1);
  at::Tensor x = g.to(at::kFloat);
  x = x / (at::linalg_norm(x, "fro", {-2, -1}, /*keepdim=*/true) + 1e-7);
  x = (tall ? x.transpose(-2, -1) : x).to(dtype);
  for (int64_t i = 0; i < steps; ++i) {
    at::Tensor a = at::matmul(x, x.transpose(-2, -1));
    at::Tensor b = kB * a + kC * at::matmul(a, a);
    x = kA * x + at::matmul(b, x);
  }
  return (tall ? x.transpose(-2, -1) : x).to(g.scalar_type()).contiguous();
}

double newton_schulz5_scalar(double s, int64_t steps) {
  for (int64_t i = 0; i < steps; ++i) s = kA * s + kB * s * s * s + kC * s * s * s * s * s;
  return s;
}

AdamW::AdamW(std::vector<at::Tensor> params, AdamWConfig cfg) : params_(std::move(params)), cfg_(cfg) {
  KILN_CHECK(cfg_.lr >= 0 && cfg_.eps > 0 && cfg_.beta1 >= 0 && cfg_.beta1 < 1 && cfg_.beta2 >= 0 && cfg_.beta2 < 1,
             "adamw: lr=", cfg_.lr, ", eps=", cfg_.eps, ", betas=(", cfg_.beta1, ", ", cfg_.beta2,
             ") must satisfy lr >= 0, eps > 0, 0 <= beta < 1");
  for (const at::Tensor& p : params_) {
    exp_avg_.push_back(at::zeros_like(p, p.options().dtype(at::kFloat)));
    exp_avg_sq_.push_back(at::zeros_like(p, p.options().dtype(at::kFloat)));
  }
}

void AdamW::step() {
  at::NoGradGuard no_grad;
  ++step_;
  const double bc1 = 1 - std::pow(cfg_.beta1, double(step_)), bc2 = 1 - std::pow(cfg_.beta2, double(step_));
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    at::Tensor g = p.grad().to(at::kFloat);
    at::Tensor w = p.scalar_type() == at::kFloat ? p : p.to(at::kFloat);
    // The order of torch.optim.AdamW (single-tensor path): decay, moments, then the step.
    w.mul_(1 - cfg_.lr * cfg_.weight_decay);
    exp_avg_[i].lerp_(g, 1 - cfg_.beta1);
    exp_avg_sq_[i].mul_(cfg_.beta2).addcmul_(g, g, 1 - cfg_.beta2);
    at::Tensor denom = (exp_avg_sq_[i].sqrt() / std::sqrt(bc2)).add_(cfg_.eps);
    w.addcdiv_(exp_avg_[i], denom, -cfg_.lr / bc1);
    if (!w.is_same(p)) p.copy_(w);
  }
}

Muon::Muon(std::vector<at::Tensor> params, MuonConfig cfg) : params_(std::move(params)), cfg_(cfg) {
  KILN_CHECK(cfg_.lr >= 0 && cfg_.momentum >= 0 && cfg_.momentum < 1 && cfg_.ns_steps >= 1, "muon: lr=", cfg_.lr,
             ", momentum=", cfg_.momentum, ", ns_steps=", cfg_.ns_steps,
             " must satisfy lr >= 0, 0 <= momentum < 1, ns_steps >= 1");
  for (const at::Tensor& p : params_) {
    KILN_CHECK(p.dim() == 2 || p.dim() == 3, "muon: parameters must be matrices or stacks of matrices (got ",
               p.sizes(), "); give vectors and embeddings to AdamW");
    momentum_.push_back(at::zeros_like(p, p.options().dtype(at::kFloat)));
  }
}

void Muon::step() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    at::Tensor g = p.grad().to(at::kFloat);
    at::Tensor& buf = momentum_[i];
    buf.mul_(cfg_.momentum).add_(g);
    at::Tensor u = cfg_.nesterov ? g.add(buf, cfg_.momentum) : buf;
    at::Tensor o = newton_schulz5(u, cfg_.ns_steps, cfg_.ns_dtype);
    const double scale = 0.2 * std::sqrt(double(std::max(p.size(-2), p.size(-1))));
    at::Tensor w = p.scalar_type() == at::kFloat ? p : p.to(at::kFloat);
    w.mul_(1 - cfg_.lr * cfg_.weight_decay).add_(o, -cfg_.lr * scale);
    if (!w.is_same(p)) p.copy_(w);
  }
}

bool default_uses_muon(const std::string& name, const at::Tensor& param) {
  if (param.dim() < 2 || name.find("norm") != std::string::npos) return false;  // norms (expert norms are 2-D)
  for (const char* key : {"q_proj", "k_proj", "v_proj", "o_proj", "mlp.pooler", "mlp.unpooler", "experts.gate_proj",
                          "experts.up_proj", "experts.down_proj"})
    if (name.find(key) != std::string::npos) return true;
  return false;  // embed_tokens, lm_head, the router
}

}  // namespace kiln::optimizers
