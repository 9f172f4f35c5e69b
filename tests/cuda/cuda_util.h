// Helpers shared by the cuda-label tests: a small model config whose widths suit the grouped GEMM
// and the decode kernels, and a copy of a model onto another device and dtype.
#pragma once
#include <ATen/ATen.h>

#include "model/muse.h"
#include "tests/model/reference.h"

namespace kiln::test {

inline model::ModelConfig cuda_config() {
  // Widths that satisfy the grouped GEMM's 16-byte alignment; lengths stay odd.
  model::ModelConfig c = micro_config();
  c.vocab_size = 97;
  c.hidden_size = 64;
  c.latent_size = 32;
  c.expert_ffn_size = 48;
  c.num_experts = 8;
  c.top_k = 2;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.sliding_window = 7;
  c.num_layers = 4;
  c.full_attention_period = 4;
  c.init_std = 0.1;
  return c;
}

inline model::Muse to_device(const model::Muse& m, at::Device device, at::ScalarType dtype) {
  model::Weights w = m.weights();
  auto move = [&](at::Tensor& t, bool router) {
    if (t.defined()) t = t.to(device, router ? model::router_dtype(dtype) : dtype);
  };
  move(w.embed, false);
  move(w.lm_head, false);
  move(w.final_norm, false);
  for (auto& l : w.layers) {
    for (at::Tensor* t : {&l.input_norm, &l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.post_attn_norm,
                          &l.pre_moe_norm, &l.pooler, &l.expert_gate, &l.expert_up, &l.expert_down,
                          &l.expert_norm, &l.unpooler, &l.post_moe_norm})
      move(*t, false);
    move(l.router, true);
    move(l.router_bias, true);
  }
  return model::Muse(m.config(), w);
}

}  // namespace kiln::test
