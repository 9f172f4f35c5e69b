// `kiln init <model.yaml> <dir>`: a randomly initialised checkpoint (config.json + safetensors).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "model/checkpoint.h"
#include "tools/commands.h"

namespace kiln::tools {

Run add_init(CLI::App& app) {
  auto* cmd = app.add_subcommand("init", "Write a randomly initialised checkpoint of a model config");
  struct Args {
    std::string config, dir, device = "cpu";
    uint64_t seed = 0;
    double max_shard_gb = 5.0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("config", a->config, "Model config (YAML)")->required();
  cmd->add_option("dir", a->dir, "Output directory")->required();
  cmd->add_option("--seed", a->seed, "Random seed")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--device", a->device, "Where to build the weights (cpu or cuda)")->capture_default_str();
  cmd->add_option("--max-shard-gb", a->max_shard_gb, "Largest safetensors shard in GB")->check(CLI::PositiveNumber)->capture_default_str();
  return [a] {
    const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(a->config);
    const auto dtype = model::parse_dtype(cfg.dtype);
    const model::Muse m = model::Muse::init(cfg, a->seed, dtype, model::parse_device(a->device, "init: --device"));
    model::save_checkpoint(m, a->dir, uint64_t(a->max_shard_gb * 1e9));
    fmt::print("wrote {} ({}, seed {}) to {}\n", cfg.name, cfg.dtype, a->seed, a->dir);
  };
}

}  // namespace kiln::tools
