// `kiln info <model.yaml>`: parameter counts by part, active parameters per token, the layer
// pattern, KV-cache bytes, and the weights' size in BF16 and NVFP4 and that of LoRA adapters,
// computed from the config alone (nothing is allocated).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "model/config.h"
#include "model/lora.h"
#include "model/nvfp4_model.h"
#include "tools/commands.h"

namespace kiln::tools {
namespace {

std::string billions(int64_t n) {
  if (n >= 1000000000) return fmt::format("{:>10.2f} B", double(n) / 1e9);
  if (n >= 1000000) return fmt::format("{:>10.2f} M", double(n) / 1e6);
  return fmt::format("{:>10.2f} K", double(n) / 1e3);
}

std::string count(int64_t n) {  // billions() without the column padding
  const std::string s = billions(n);
  return s.substr(s.find_first_not_of(' '));
}

std::string bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return fmt::format("{:.2f} {}", b, units[u]);
}

}  // namespace

Run add_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Print parameter counts, layer pattern and KV-cache size of a model config");
  auto path = std::make_shared<std::string>();
  auto context = std::make_shared<int64_t>(0);
  auto lora_rank = std::make_shared<int64_t>(32);
  cmd->add_option("config", *path, "Model config (YAML), e.g. configs/muse-spark-open-816b.yaml")->required();
  cmd->add_option("--context", *context, "Context length for the KV-cache line (default: max_position_embeddings)");
  cmd->add_option("--lora-rank", *lora_rank, "Rank for the LoRA adapters line (default: 32, a recipe's default)");
  return [path, context, lora_rank] {
    const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(*path);
    const model::ParamCounts p = model::count_parameters(cfg);
    const int64_t ctx = *context > 0 ? *context : cfg.max_position_embeddings;
    fmt::print("{} ({})\n", cfg.name, *path);
    fmt::print("layers {}: {} sliding-window (W={}) + {} full attention, period {} anchored at the last layer\n",
               cfg.num_layers, cfg.num_window_layers(), cfg.sliding_window, cfg.num_full_layers(),
               cfg.full_attention_period);
    fmt::print("hidden {}, latent {}, {} experts top-{} of width {}, {} q / {} kv heads of {}, vocab {}\n\n",
               cfg.hidden_size, cfg.latent_size, cfg.num_experts, cfg.top_k, cfg.expert_ffn_size,
               cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size);
    fmt::print("parameters\n");
    fmt::print("  embedding + head    {}\n", billions(p.embedding + p.head));
    fmt::print("  attention           {}\n", billions(p.attention));
    fmt::print("  latent projections  {}\n", billions(p.latent));
    fmt::print("  router              {}\n", billions(p.router));
    fmt::print("  experts             {}\n", billions(p.experts));
    fmt::print("  norms               {}\n", billions(p.norms));
    fmt::print("  total               {}   ({} parameters)\n", billions(p.total()), p.total());
    fmt::print("active per token      {}   (attention + latent + router + {}/{} of experts + norms)\n",
               billions(p.active_per_token), cfg.top_k, cfg.num_experts);
    fmt::print("  with embedding+head {}\n\n", billions(p.active_per_token + p.embedding + p.head));
    const double per_token = model::kv_cache_bytes_per_token(cfg, ctx);
    model::ModelConfig all_full = cfg;
    all_full.full_attention_period = 1;
    const double full_per_token = model::kv_cache_bytes_per_token(all_full, ctx);
    fmt::print("KV cache (bf16) at context {}: {}/token, {} per sequence; {:.4f} of an all-full model\n", ctx,
               bytes(per_token), bytes(per_token * double(ctx)), per_token / full_per_token);
    fmt::print("weights in bf16: {}\n", bytes(2.0 * double(p.total())));
    const model::Nvfp4Footprint nv = model::nvfp4_footprint(cfg);
    fmt::print("weights in NVFP4 (kiln quantize, the rollout's copy): {}; {} as codes + block scales, {} kept "
               "(router FP32, the rest BF16{})\n",
               bytes(double(nv.bytes)), count(nv.quantized_params), count(nv.kept_params),
               cfg.bf16_expert_layers.empty() ? "" : ", with the bf16_expert_layers' experts");
    model::LoraConfig lc;
    lc.rank = *lora_rank;
    lc.validate();
    const int64_t lp = model::lora_parameter_count(cfg, lc);
    fmt::print("LoRA adapters, rank {} on every target: {} parameters; {} in BF16, about {} to train them "
               "(16 bytes each: BF16 weight and gradient, FP32 master and two AdamW moments)\n",
               lc.rank, count(lp), bytes(2.0 * double(lp)), bytes(16.0 * double(lp)));
  };
}

}  // namespace kiln::tools
