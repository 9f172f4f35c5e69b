// `kiln train <recipe.yaml>` (the GRPO loop) and `kiln sft <recipe.yaml>` (its supervised warm
// start), on one process or data-parallel under mpirun: live progress, one JSONL line of metrics
// per step, the resolved recipe in the run directory and the resulting weights as a checkpoint.
// Rank 0 prints and writes; a GPU rank uses the device of its local rank.
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
#include "model/checkpoint.h"
#include "model/lora.h"
#include "tools/commands.h"
#include "trainer/grpo.h"
#include "trainer/recipe.h"
#include "trainer/sft.h"

namespace kiln::tools {
namespace {

struct Setup {
  trainer::Recipe recipe;
  std::unique_ptr<model::Muse> policy;
  trainer::Dataset data;
};

// Reads the recipe, applies the flags, writes the resolved recipe and builds model and data.
Setup prepare(const std::string& path, const std::string& out, const std::string& init_from,
              const char* resolved_name, const std::function<void(trainer::Recipe&)>& overrides) {
  Setup s{trainer::Recipe::from_yaml_file(path), nullptr, {}};
  trainer::Recipe& r = s.recipe;
  overrides(r);
  r.sync_schedules();
  if (!out.empty()) r.out = out;
  if (!init_from.empty()) r.init_from = init_from, r.model_config.clear();
  const comm::Group& world = comm::Group::world();
  std::error_code ec;
  std::filesystem::create_directories(r.out, ec);  // ranks race here; a real failure shows at the first write
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
  s.data = r.task == "jsonl" ? trainer::load_jsonl(r.data_path, r.test_fraction, r.grpo.seed)
                             : trainer::split(trainer::arithmetic_problems(r.num_problems, r.difficulty, r.grpo.seed),
                                              r.test_fraction, r.grpo.seed);
  if (world.rank() == 0) {
    std::ofstream f(r.out + "/" + resolved_name);
    f << r.to_yaml();
    KILN_CHECK(f.good(), "train: cannot write ", r.out, "/", resolved_name);
  }
  return s;
}

trainer::CharTokenizer tokenizer_for(const model::Muse& m) {
  return trainer::CharTokenizer(std::min<int64_t>(m.config().vocab_size, 256));
}

}  // namespace

Run add_sft(CLI::App& app) {
  auto* cmd = app.add_subcommand("sft", "Supervised warm start of a recipe's model on its (prompt, answer) pairs");
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
    trainer::SftTrainer sft(*s.policy, r.sft, tokenizer_for(*s.policy), s.data.train);
    std::ofstream log;
    if (lead) log.open(r.out + "/sft-metrics.jsonl");
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 1; i <= r.sft.steps; ++i) {
      trainer::SftMetrics m = sft.step();
      if (!lead) continue;
      log << fmt::format("{{\"step\":{},\"loss\":{},\"token_accuracy\":{}}}\n", m.step, m.loss, m.token_accuracy);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "\rsft %lld/%lld  loss %.4f  token acc %.3f  ETA %.0f s   ", (long long)i,
                   (long long)r.sft.steps, m.loss, m.token_accuracy, secs / double(i) * double(r.sft.steps - i));
      std::fflush(stderr);
    }
    if (lead) std::fprintf(stderr, "\n");
    if (lead) model::save_checkpoint(*s.policy, r.out + "/sft");
    // Held-out greedy accuracy of the warm-started model, measured the way GRPO measures it.
    trainer::GrpoTrainer probe(*s.policy, r.grpo, tokenizer_for(*s.policy), s.data);
    const double acc = probe.evaluate(r.eval_problems);
    if (lead) fmt::print("sft: done; held-out greedy accuracy {:.3f}; weights in {}/sft\n", acc, r.out);
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
                        if (a->steps >= 0) r.steps = a->steps;
                      });
    trainer::Recipe& r = s.recipe;
    model::Muse& policy = *s.policy;
    trainer::Dataset& data = s.data;
    trainer::CharTokenizer tok = tokenizer_for(policy);
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
    trainer::GrpoTrainer trainer(policy, r.grpo, tok, data);
    if (lead)
      fmt::print("train: {} steps of {} prompts x {} samples; {} train / {} test problems; {} rank(s), {}; run dir {}\n",
                 r.steps, r.grpo.prompts_per_step, r.grpo.samples_per_prompt, data.train.size(), data.test.size(),
                 world.size(), layout.describe(), r.out);
    const std::string ckpt = r.out + "/checkpoint";
    if (!a->resume.empty()) {
      trainer.load(ckpt);
      if (lead) fmt::print("train: resumed from {} at step {}\n", ckpt, trainer.steps_done());
    }
    std::ofstream log;
    if (lead) {
      log.open(r.out + "/metrics.jsonl", std::ios::app);
      KILN_CHECK(log.good(), "train: cannot write ", r.out, "/metrics.jsonl");
    }
    auto evaluate = [&](int64_t step) {
      const double acc = trainer.evaluate(r.eval_problems);
      if (lead) log << fmt::format("{{\"step\":{},\"eval_accuracy\":{}}}\n", step, acc) << std::flush;
      return acc;
    };
    const int64_t first = trainer.steps_done() + 1;
    double eval_acc = first == 1 ? evaluate(0) : 0.0;
    if (first == 1 && lead) fmt::print("step 0: held-out greedy accuracy {:.3f}\n", eval_acc);
    const auto start = std::chrono::steady_clock::now();
    int64_t tokens = 0;
    for (int64_t s = first; s <= r.steps; ++s) {
      trainer::StepMetrics m = trainer.step();
      tokens += m.tokens;
      if (lead) log << m.to_json() << "\n" << std::flush;
      if ((r.eval_every > 0 && s % r.eval_every == 0) || s == r.steps) eval_acc = evaluate(s);
      if ((r.checkpoint_every > 0 && s % r.checkpoint_every == 0) || s == r.steps) trainer.save(ckpt);
      if (!lead) continue;
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr,
                   "\rstep %lld/%lld  reward %.3f  acc %.3f  eval %.3f  mismatch %.2e  sync %.1f MB %.1f ms (%.1f GB/s)  "
                   "%.0f tok/s  ETA %.0f s   ",
                   (long long)s, (long long)r.steps, m.reward, m.accuracy, eval_acc, m.mismatch.mean_abs_token,
                   double(m.sync_bytes) / 1e6, m.sync_seconds * 1e3, m.sync_gbps(), double(tokens) / secs,
                   secs / double(s - first + 1) * double(r.steps - s));
      std::fflush(stderr);
    }
    trainer.sync_policy();  // collective: a sharded rollout leaves the full experts to the end
    if (!lead) return;
    std::fprintf(stderr, "\n");
    if (model::lora_rank(policy) > 0) {  // the base is unchanged: write the adapters alone
      model::save_peft_adapter(policy, r.out + "/adapter");
      fmt::print("train: done; held-out greedy accuracy {:.3f}; metrics in {}/metrics.jsonl, PEFT adapter in "
                 "{}/adapter (kiln merge <base> {}/adapter <out> folds it in)\n",
                 eval_acc, r.out, r.out, r.out);
      return;
    }
    model::save_checkpoint(policy, r.out + "/final");
    fmt::print("train: done; held-out greedy accuracy {:.3f}; metrics in {}/metrics.jsonl, weights in {}/final\n",
               eval_acc, r.out, r.out);
  };
}

}  // namespace kiln::tools
