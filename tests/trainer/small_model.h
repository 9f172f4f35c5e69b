// A small model with the byte vocabulary (128), shared by the trainer tests.
#pragma once
#include "model/config.h"

namespace kiln::test {

inline model::ModelConfig byte_vocab_config() {
  model::ModelConfig c;
  c.name = "byte-vocab-test";
  c.vocab_size = 128;
  c.hidden_size = 32;
  c.latent_size = 16;
  c.num_layers = 2;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_ffn_size = 32;
  c.num_q_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 16;
  c.sliding_window = 8;
  c.full_attention_period = 2;
  c.init_std = 0.1;
  c.dtype = "float32";
  return c;
}

}  // namespace kiln::test
