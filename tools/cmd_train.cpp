// `kiln train <recipe.yaml> [--out DIR] [--steps N]`: the GRPO loop on one process, with a live
// progress line, one JSONL line of metrics per step, periodic greedy evaluation, the resolved
// recipe in the run directory and the final weights as a checkpoint.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "model/checkpoint.h"
#include "tools/commands.h"
#include "trainer/grpo.h"
#include "trainer/recipe.h"

namespace kiln::tools {

Run add_train(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Run a GRPO recipe");
  struct Args {
    std::string recipe, out;
    int64_t steps = -1;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("recipe", a->recipe, "Recipe (YAML), e.g. recipes/grpo-arith-tiny.yaml")->required();
  cmd->add_option("--out", a->out, "Run directory (overrides run.out)");
  cmd->add_option("--steps", a->steps, "GRPO steps (overrides run.steps)");
  return [a] {
    trainer::Recipe r = trainer::Recipe::from_yaml_file(a->recipe);
    if (!a->out.empty()) r.out = a->out;
    if (a->steps >= 0) r.steps = a->steps;
    std::filesystem::create_directories(r.out);
    {
      std::ofstream f(r.out + "/recipe.yaml");
      f << r.to_yaml();
      KILN_CHECK(f.good(), "train: cannot write ", r.out, "/recipe.yaml");
    }
    const at::ScalarType dtype = model::parse_dtype(r.dtype);
    const at::Device device(r.device);
    model::Muse policy = r.init_from.empty()
                             ? model::Muse::init(model::ModelConfig::from_yaml_file(r.model_config), r.model_seed,
                                                 dtype, device)
                             : model::load_checkpoint(r.init_from, dtype, device);
    trainer::CharTokenizer tok(std::min<int64_t>(policy.config().vocab_size, 256));
    trainer::Dataset data = r.task == "jsonl"
                                ? trainer::load_jsonl(r.data_path, r.test_fraction, r.grpo.seed)
                                : trainer::split(trainer::arithmetic_problems(r.num_problems, r.difficulty, r.grpo.seed),
                                                 r.test_fraction, r.grpo.seed);
    fmt::print("train: {} steps of {} prompts x {} samples; {} train / {} test problems; run dir {}\n", r.steps,
               r.grpo.prompts_per_step, r.grpo.samples_per_prompt, data.train.size(), data.test.size(), r.out);
    trainer::GrpoTrainer trainer(policy, r.grpo, tok, data);
    std::ofstream log(r.out + "/metrics.jsonl", std::ios::app);
    KILN_CHECK(log.good(), "train: cannot write ", r.out, "/metrics.jsonl");
    auto evaluate = [&](int64_t step) {
      const double acc = trainer.evaluate(r.eval_problems);
      log << fmt::format("{{\"step\":{},\"eval_accuracy\":{}}}\n", step, acc) << std::flush;
      return acc;
    };
    double eval_acc = evaluate(0);
    fmt::print("step 0: held-out greedy accuracy {:.3f}\n", eval_acc);
    const auto start = std::chrono::steady_clock::now();
    int64_t tokens = 0;
    for (int64_t s = 1; s <= r.steps; ++s) {
      trainer::StepMetrics m = trainer.step();
      tokens += m.tokens;
      log << m.to_json() << "\n" << std::flush;
      if ((r.eval_every > 0 && s % r.eval_every == 0) || s == r.steps) eval_acc = evaluate(s);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "\rstep %lld/%lld  reward %.3f  acc %.3f  eval %.3f  mismatch %.2e  %.0f tok/s  ETA %.0f s   ",
                   (long long)s, (long long)r.steps, m.reward, m.accuracy, eval_acc, m.mismatch.mean_abs_token,
                   double(tokens) / secs, secs / double(s) * double(r.steps - s));
      std::fflush(stderr);
    }
    std::fprintf(stderr, "\n");
    model::save_checkpoint(policy, r.out + "/final");
    fmt::print("train: done; held-out greedy accuracy {:.3f}; metrics in {}/metrics.jsonl, weights in {}/final\n",
               eval_acc, r.out, r.out);
  };
}

}  // namespace kiln::tools
