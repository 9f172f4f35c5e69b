// `kiln train <recipe.yaml>` (GRPO; the loop itself is trainer/run.h) and `kiln sft <recipe.yaml>`
// (its supervised warm start), on one process or data-parallel under mpirun: the resolved recipe in
// the run directory and the resulting weights (with their tokenizer files) as a checkpoint. Rank 0
// prints and writes; a GPU rank uses the device of its local rank.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>

#include "core/comm.h"
#include "core/error.h"
#include "core/files.h"
#include "model/checkpoint.h"
#include "model/lora.h"
#include "tools/commands.h"
#include "text/tokenizer.h"
#include "trainer/grpo.h"
#include "trainer/recipe.h"
#include "trainer/run.h"
#include "trainer/sft.h"

namespace kiln::tools {
namespace {

struct Setup {
  trainer::Recipe recipe;
  std::unique_ptr<model::Muse> policy;
  std::shared_ptr<const text::Tokenizer> tokenizer;
  trainer::Dataset data;
  trainer::LoadReport train_lines, eval_lines;
};

// Reads the recipe, applies the flags, writes the resolved recipe and builds model, tokenizer and data.
Setup prepare(const std::string& path, const std::string& out, const std::string& init_from,
              const char* resolved_name, const std::function<void(trainer::Recipe&)>& overrides) {
  Setup s{trainer::Recipe::from_yaml_file(path), nullptr, nullptr, {}, {}, {}};
  trainer::Recipe& r = s.recipe;
  overrides(r);
  r.sync_schedules();
  if (!out.empty()) r.run.out = out;
  if (!init_from.empty()) r.init_from = init_from, r.model_config.clear();
  const comm::Group& world = comm::Group::world();
  std::error_code ec;
  std::filesystem::create_directories(r.run.out, ec);  // ranks race here; a real failure shows at the first write
  const at::ScalarType dtype = model::parse_dtype(r.dtype);
  at::Device device(r.device);
  if (device.is_cuda() && !device.has_index() && world.size() > 1) {
    device = at::Device(at::kCUDA, c10::DeviceIndex(world.local_rank()));
#if KILN_WITH_CUDA
    c10::cuda::set_device(device.index());
#endif
  }
  s.policy = std::make_unique<model::Muse>(
      r.init_from.empty() ? model::Muse::init(model::ModelConfig::from_yaml_file(r.model_config), r.model_seed, dtype, device)
                          : model::load_checkpoint(r.init_from, dtype, device));
  s.tokenizer = trainer::load_recipe_tokenizer(r, s.policy->config());
  s.data = trainer::load_data(r, &s.train_lines, &s.eval_lines);
  if (world.rank() == 0) write_text_atomic(r.run.out + "/" + resolved_name, r.to_yaml());
  return s;
}

// What the data loader dropped, said once.
void report_data(const Setup& s) {
  for (const auto* lines : {&s.train_lines, &s.eval_lines}) {
    if (lines->skipped == 0) continue;
    fmt::print("data: skipped {} malformed line(s) of {}; first: {}\n", lines->skipped, lines->lines,
               lines->examples.empty() ? "" : lines->examples.front());
  }
}

// A checkpoint carries the tokenizer it was trained with, so that it loads on its own.
void copy_tokenizer(const text::Tokenizer& tok, const std::string& dir) {
  const std::string from = text::tokenizer_dir(tok);
  if (!from.empty()) text::copy_tokenizer_files(from, dir);
}

}  // namespace

Run add_sft(CLI::App& app) {
  auto* cmd = app.add_subcommand("sft", "Supervised warm start of a recipe's model on its (prompt, label) pairs");
  struct Args {
    std::string recipe, out;
    int64_t steps = -1;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("recipe", a->recipe, "Recipe (YAML)")->required();
  cmd->add_option("--out", a->out, "Run directory (overrides run.out); weights go to <out>/sft");
  cmd->add_option("--steps", a->steps, "SFT steps (overrides sft.steps)");
  return [a] {
    Setup s = prepare(a->recipe, a->out, "", "sft-recipe.yaml", [&](trainer::Recipe& r) {
      if (a->steps >= 0) r.sft.steps = a->steps;
    });
    trainer::Recipe& r = s.recipe;
    const bool lead = comm::Group::world().rank() == 0;
    if (lead) report_data(s);
    trainer::SftTrainer sft(*s.policy, r.sft, s.tokenizer, s.data.train);
    std::FILE* log = nullptr;
    const std::string log_path = r.run.out + "/sft-metrics.jsonl";
    if (lead) {
      log = std::fopen(log_path.c_str(), "w");
      KILN_CHECK(log, "sft: cannot open ", log_path, " for writing; check the run directory");
    }
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 1; i <= r.sft.steps; ++i) {
      trainer::SftMetrics m = sft.step();
      if (!lead) continue;
      const std::string line = m.to_json() + "\n";
      KILN_CHECK(std::fputs(line.c_str(), log) >= 0 && std::fflush(log) == 0, "sft: cannot write ", log_path,
                 "; check the disk space");
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "\rsft %lld/%lld  loss %.4f  token acc %.3f  ETA %.0f s   ", (long long)i,
                   (long long)r.sft.steps, m.loss, m.token_accuracy, secs / double(i) * double(r.sft.steps - i));
      std::fflush(stderr);
    }
    if (lead) {
      std::fclose(log);
      std::fprintf(stderr, "\n");
      model::save_checkpoint(*s.policy, r.run.out + "/sft");
      copy_tokenizer(*s.tokenizer, r.run.out + "/sft");
    }
    // Held-out accuracy of the warm-started model, measured the way GRPO measures it.
    trainer::GrpoTrainer probe(*s.policy, r.grpo, s.tokenizer, s.data);
    const trainer::EvalMetrics e = probe.evaluate(r.run.eval);
    if (lead)
      fmt::print("sft: done; held-out mean@{} {:.3f}, pass@{} {:.3f}; weights in {}/sft\n", e.k, e.all.mean_at_k, e.k,
                 e.all.pass_at_k, r.run.out);
  };
}

Run add_train(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Run a GRPO recipe");
  struct Args {
    std::string recipe, out, init_from, resume;
    int64_t steps = -1;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("recipe", a->recipe, "Recipe (YAML), e.g. recipes/grpo-arith-tiny.yaml")->required();
  cmd->add_option("--out", a->out, "Run directory (overrides run.out)");
  cmd->add_option("--steps", a->steps, "GRPO steps (overrides run.steps)");
  cmd->add_option("--init-from", a->init_from, "Start from this checkpoint (overrides model.*), e.g. <out>/sft");
  cmd->add_option("--resume", a->resume, "Continue the run in this directory from its <dir>/checkpoint");
  return [a] {
    Setup s = prepare(a->recipe, a->resume.empty() ? a->out : a->resume, a->init_from, "recipe.yaml",
                      [&](trainer::Recipe& r) {
                        if (a->steps >= 0) r.run.steps = a->steps;
                      });
    trainer::Recipe& r = s.recipe;
    model::Muse& policy = *s.policy;
    // First: a bad parallel layout fails before any work, reported by rank 0 alone (the other
    // ranks wait until its MPI_Abort ends them); then a bad optimizer setting.
    const comm::Group& world = comm::Group::world();
    const bool lead = world.rank() == 0;
    trainer::ParallelConfig layout = r.grpo.parallel;
    try {
      layout.resolve(world.size(), policy.config().num_experts);
    } catch (const Error&) {
      if (!lead) world.barrier();
      throw;
    }
    if (lead) report_data(s);
    trainer::GrpoTrainer trainer(policy, r.grpo, s.tokenizer, s.data);
    if (lead) {
      const auto& tp = trainer.train_prompts();
      fmt::print("train: {} steps of {} prompts x {} samples; {} train / {} test prompts ({} too long, dropped; "
                 "mean {:.0f}, max {} tokens); tokenizer {}; {} rank(s), {}; run dir {}\n",
                 r.run.steps, r.grpo.prompts_per_step, r.grpo.samples_per_prompt, tp.kept, trainer.test_prompts().kept,
                 tp.too_long + trainer.test_prompts().too_long, tp.mean_tokens, tp.max_tokens, s.tokenizer->name(),
                 world.size(), layout.describe(), r.run.out);
    }
    const std::string ckpt = r.run.out + "/checkpoint";
    if (!a->resume.empty()) {
      trainer.load(ckpt);
      if (lead) fmt::print("train: resumed from {} at step {}\n", ckpt, trainer.steps_done());
    }
    const trainer::EvalMetrics last = trainer::run_grpo(trainer, r.run, lead ? stderr : nullptr);
    trainer.sync_policy();  // collective: a sharded rollout leaves the full experts to the end
    if (!lead) return;
    if (model::lora_rank(policy) > 0) {  // the base is unchanged: write the adapters alone
      model::save_peft_adapter(policy, r.run.out + "/adapter");
      fmt::print("train: done; held-out mean@{} {:.3f}; metrics in {}/metrics.jsonl, PEFT adapter in "
                 "{}/adapter (kiln merge <base> {}/adapter <out> folds it in)\n",
                 last.k, last.all.mean_at_k, r.run.out, r.run.out, r.run.out);
      return;
    }
    model::save_checkpoint(policy, r.run.out + "/final");
    copy_tokenizer(*s.tokenizer, r.run.out + "/final");
    fmt::print("train: done; held-out mean@{} {:.3f}; metrics in {}/metrics.jsonl, weights in {}/final\n", last.k,
               last.all.mean_at_k, r.run.out, r.run.out);
  };
}

}  // namespace kiln::tools
