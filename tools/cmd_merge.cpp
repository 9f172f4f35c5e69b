// `kiln merge <base dir> <adapter dir> <out dir>`: folds a PEFT LoRA adapter into its base
// (BF16, or NVFP4 dequantised) and writes a plain checkpoint in the base config's dtype.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/files.h"
#include "model/checkpoint.h"
#include "model/lora.h"
#include "tools/commands.h"

namespace kiln::tools {

Run add_merge(CLI::App& app) {
  auto* cmd = app.add_subcommand("merge", "Fold a PEFT LoRA adapter into its base checkpoint");
  struct Args {
    std::string base, adapter, out, device = "cpu";
    double max_shard_gb = 5.0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("base", a->base, "Base checkpoint directory (BF16 or NVFP4)")->required();
  cmd->add_option("adapter", a->adapter, "PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")
      ->required();
  cmd->add_option("out", a->out, "Output directory")->required();
  cmd->add_option("--device", a->device, "Where to merge (cpu or cuda)")->capture_default_str();
  cmd->add_option("--max-shard-gb", a->max_shard_gb, "Largest safetensors shard in GB")->check(CLI::PositiveNumber)->capture_default_str();
  return [a] {
    check_distinct_output(a->out, {a->base, a->adapter}, "merge");
    const model::ModelConfig cfg = model::ModelConfig::from_json_file(a->base + "/config.json");
    model::Muse m = model::load_checkpoint(a->base, model::parse_dtype(cfg.dtype), model::parse_device(a->device, "merge: --device"));
    model::load_peft_adapter(m, a->adapter);
    const int64_t rank = model::lora_rank(m);
    model::merge_lora(m);
    model::save_checkpoint(m, a->out, uint64_t(a->max_shard_gb * 1e9));
    fmt::print("merged the rank-{} adapter {} into {} ({}); wrote {}\n", rank, a->adapter, a->base, cfg.dtype, a->out);
  };
}

}  // namespace kiln::tools
