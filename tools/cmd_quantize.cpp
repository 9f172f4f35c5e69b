// `kiln quantize <bf16 dir> <out dir>`: an NVFP4 checkpoint in the ModelOpt format (docs/MODEL.md §4.4),
// with activation scales calibrated on random token sequences or on lines of a text file.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <fstream>

#include "core/error.h"
#include "core/files.h"
#include "model/checkpoint.h"
#include "model/nvfp4_model.h"
#include "tools/commands.h"

namespace kiln::tools {
namespace {

// Calibration sequences: each non-empty line of `path` as byte ids, or `seqs` random sequences.
std::vector<std::vector<int64_t>> calibration_sequences(const std::string& path, int64_t seqs, int64_t len,
                                                        uint64_t seed, int64_t vocab) {
  std::vector<std::vector<int64_t>> out;
  if (!path.empty()) {
    check_input_file(path, "quantize: --calib-text", "give a text file, one calibration sequence per line");
    std::ifstream in(path);
    KILN_CHECK(in.good(), "quantize: cannot open calibration text ", path);
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.empty()) continue;
      std::vector<int64_t> ids;
      for (unsigned char c : line) {
        KILN_CHECK(int64_t(c) < vocab, "quantize: ", path, ":", n, ": byte ", int(c),
                   " is not a token id of this model (vocab_size ", vocab, "); use --calib-seqs instead");
        ids.push_back(int64_t(c));
      }
      out.push_back(std::move(ids));
    }
    KILN_CHECK(!out.empty(), "quantize: calibration text ", path, " has no non-empty lines");
    return out;
  }
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (int64_t s = 0; s < seqs; ++s) {
    at::Tensor t = at::randint(vocab, {len}, gen, at::kLong);
    out.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + len);
  }
  return out;
}

}  // namespace

Run add_quantize(CLI::App& app) {
  auto* cmd = app.add_subcommand("quantize", "Write an NVFP4 (ModelOpt-format) checkpoint of a BF16 checkpoint");
  struct Args {
    std::string in, out, device = "cpu", calib_text;
    int64_t calib_seqs = 16, calib_len = 128;
    uint64_t seed = 0;
    bool no_calibrate = false;
    double max_shard_gb = 5.0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("in", a->in, "BF16 checkpoint directory")->required();
  cmd->add_option("out", a->out, "Output directory")->required();
  cmd->add_option("--device", a->device, "Where to quantise (cpu or cuda)")->capture_default_str();
  cmd->add_option("--calib-text", a->calib_text, "Calibrate input scales on this file's lines (byte ids)");
  cmd->add_option("--calib-seqs", a->calib_seqs, "Otherwise, on this many random sequences")->capture_default_str();
  cmd->add_option("--calib-len", a->calib_len, "... of this many tokens")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed of the random calibration sequences")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_flag("--no-calibrate", a->no_calibrate, "Write no input_scale tensors (W4A4 then scales dynamically)");
  cmd->add_option("--max-shard-gb", a->max_shard_gb, "Largest safetensors shard in GB")->check(CLI::PositiveNumber)->capture_default_str();
  return [a] {
    check_distinct_output(a->out, {a->in}, "quantize");
    KILN_CHECK(!model::is_nvfp4_checkpoint(a->in), "quantize: ", a->in, " is already an NVFP4 checkpoint");
    KILN_CHECK(a->calib_seqs > 0 && a->calib_len > 0, "quantize: --calib-seqs and --calib-len must be positive");
    const model::ModelConfig cfg = model::ModelConfig::from_json_file(a->in + "/config.json");
    KILN_CHECK(a->no_calibrate || a->calib_len <= cfg.max_position_embeddings, "quantize: --calib-len ", a->calib_len,
               " is beyond the model's max_position_embeddings (", cfg.max_position_embeddings, ")");
    const at::Device device = model::parse_device(a->device, "quantize: --device");
    model::Muse m = model::load_checkpoint(a->in, model::parse_dtype(cfg.dtype), device);
    model::quantize_model(m, /*kernel_layout=*/false, /*drop_dense=*/false);
    if (!a->no_calibrate) {
      auto seqs = calibration_sequences(a->calib_text, a->calib_seqs, a->calib_len, a->seed, cfg.vocab_size);
      int64_t tokens = 0;
      for (const auto& s : seqs) tokens += int64_t(s.size());
      model::calibrate_input_scales(m, model::PackedBatch::from_sequences(seqs, device));
      fmt::print("calibrated input scales on {} sequences ({} tokens)\n", seqs.size(), tokens);
    }
    model::save_nvfp4_checkpoint(m, a->out, uint64_t(a->max_shard_gb * 1e9));
    int64_t q = 0;
    for (int64_t i = 0; i < cfg.num_layers; ++i) q += model::experts_quantized(cfg, i) ? 1 : 0;
    fmt::print("wrote NVFP4 {} to {}: attention, pooler and unpooler in all {} layers, experts in {} "
               "(bf16_expert_layers keep BF16)\n", cfg.name, a->out, cfg.num_layers, q);
  };
}

}  // namespace kiln::tools
