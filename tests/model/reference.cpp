// The naive per-token reference forward used by the model tests.
#include "tests/model/reference.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kiln::test {
namespace {

using at::Tensor;

Tensor d64(const Tensor& t) { return t.detach().to(at::kCPU, at::kDouble); }

Tensor rmsnorm(const Tensor& x, const Tensor& w, double eps) {
  double ss = 0;
  auto a = x.accessor<double, 1>();
  for (int64_t i = 0; i < x.size(0); ++i) ss += a[i] * a[i];
  return x / std::sqrt(ss / double(x.size(0)) + eps) * w;
}

// Rotate-half RoPE on one head vector at position pos.
Tensor rope(const Tensor& x, int64_t pos, double theta) {
  const int64_t hd = x.size(0), half = hd / 2;
  Tensor y = x.clone();
  auto a = x.accessor<double, 1>();
  auto b = y.accessor<double, 1>();
  for (int64_t p = 0; p < half; ++p) {
    const double ang = double(pos) * std::pow(theta, -2.0 * double(p) / double(hd));
    b[p] = a[p] * std::cos(ang) - a[p + half] * std::sin(ang);
    b[p + half] = a[p + half] * std::cos(ang) + a[p] * std::sin(ang);
  }
  return y;
}

Tensor silu_ref(const Tensor& x) { return x / (1 + at::exp(-x)); }

}  // namespace

model::ModelConfig micro_config() {
  model::ModelConfig c;
  c.name = "micro";
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.latent_size = 4;
  c.num_layers = 2;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_ffn_size = 6;
  c.num_q_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  c.sliding_window = 3;
  c.full_attention_period = 2;
  c.rope_theta = 10000;
  c.init_std = 0.5;  // large weights make routing and attention non-trivial
  c.dtype = "float32";
  return c;
}

model::ModelConfig nvfp4_micro_config() {
  model::ModelConfig c = micro_config();
  c.vocab_size = 23;
  c.hidden_size = 32;
  c.latent_size = 16;
  c.expert_ffn_size = 32;
  c.head_dim = 16;
  c.init_std = 0.3;
  return c;
}

ReferenceOutput reference_forward(const model::Muse& model, const std::vector<int64_t>& tokens,
                                  const at::Tensor& replay) {
  const model::ModelConfig& c = model.config();
  const model::Weights& w = model.weights();
  const int64_t n = int64_t(tokens.size()), L = c.num_layers, hd = c.head_dim;
  const int64_t group = c.num_q_heads / c.num_kv_heads;
  const double eps = c.rms_norm_eps;
  std::vector<Tensor> x(n);
  for (int64_t t = 0; t < n; ++t) x[t] = d64(w.embed[tokens[t]]);
  ReferenceOutput out;
  out.routing.assign(n * L, {});
  for (int64_t i = 0; i < L; ++i) {
    const model::LayerWeights& lw = w.layers[i];
    const bool full = (L - 1 - i) % c.full_attention_period == 0;
    std::vector<Tensor> q(n), k(n), v(n);
    for (int64_t t = 0; t < n; ++t) {
      Tensor h = rmsnorm(x[t], d64(lw.input_norm), eps);
      q[t] = at::mv(d64(lw.q_proj), h).view({c.num_q_heads, hd});
      k[t] = at::mv(d64(lw.k_proj), h).view({c.num_kv_heads, hd});
      v[t] = at::mv(d64(lw.v_proj), h).view({c.num_kv_heads, hd});
      for (int64_t hh = 0; hh < c.num_q_heads; ++hh) q[t][hh].copy_(rope(q[t][hh], t, c.rope_theta));
      for (int64_t hh = 0; hh < c.num_kv_heads; ++hh) k[t][hh].copy_(rope(k[t][hh], t, c.rope_theta));
    }
    for (int64_t t = 0; t < n; ++t) {
      Tensor o = at::zeros({c.num_q_heads, hd}, at::kDouble);
      for (int64_t hh = 0; hh < c.num_q_heads; ++hh) {
        const int64_t kvh = hh / group;
        std::vector<double> s;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j <= t; ++j) {
          if (!full && !(t - c.sliding_window < j)) continue;
          keys.push_back(j);
          s.push_back(at::dot(q[t][hh], k[j][kvh]).item<double>() / std::sqrt(double(hd)));
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - mx));
        for (size_t a = 0; a < keys.size(); ++a) o[hh] += s[a] / z * v[keys[a]][kvh];
      }
      x[t] = x[t] + rmsnorm(at::mv(d64(lw.o_proj), o.view({-1})), d64(lw.post_attn_norm), eps);
    }
    for (int64_t t = 0; t < n; ++t) {
      Tensor h = rmsnorm(x[t], d64(lw.pre_moe_norm), eps);
      Tensor logits = at::mv(d64(lw.router), h);
      std::vector<double> p(c.num_experts), sel(c.num_experts);
      double mx = logits.max().item<double>(), z = 0;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const double s = logits[e].item<double>();
        if (c.router_score == model::RouterScore::kSigmoid) {
          p[e] = 1.0 / (1.0 + std::exp(-s));
        } else {
          p[e] = std::exp(s - mx);
          z += p[e];
        }
      }
      for (int64_t e = 0; e < c.num_experts; ++e) {
        if (c.router_score != model::RouterScore::kSigmoid) p[e] /= z;
        sel[e] = p[e] + (lw.router_bias.defined() ? lw.router_bias[e].item<double>() : 0.0);
      }
      std::vector<int64_t> chosen;
      if (replay.defined()) {
        for (int64_t j = 0; j < c.top_k; ++j) chosen.push_back(replay[t][i][j].item<int64_t>());
      } else {
        std::vector<int64_t> idx(c.num_experts);
        std::iota(idx.begin(), idx.end(), 0);
        std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return sel[a] > sel[b]; });
        chosen.assign(idx.begin(), idx.begin() + c.top_k);
      }
      double wsum = 0;
      for (int64_t e : chosen) wsum += p[e];
      Tensor zl = at::mv(d64(lw.pooler), h);
      Tensor m = at::zeros({c.latent_size}, at::kDouble);
      for (int64_t e : chosen) {
        Tensor a = silu_ref(at::mv(d64(lw.expert_gate[e]), zl)) * at::mv(d64(lw.expert_up[e]), zl);
        Tensor y = rmsnorm(at::mv(d64(lw.expert_down[e]), a), d64(lw.expert_norm[e]), eps);
        m += p[e] / wsum * y;
      }
      x[t] = x[t] + rmsnorm(at::mv(d64(lw.unpooler), m), d64(lw.post_moe_norm), eps);
      out.routing[t * L + i] = chosen;
    }
  }
  out.logits = at::empty({n, c.vocab_size}, at::kDouble);
  for (int64_t t = 0; t < n; ++t) out.logits[t] = at::mv(d64(w.lm_head), rmsnorm(x[t], d64(w.final_norm), eps));
  return out;
}

}  // namespace kiln::test
