// `kiln train <recipe.yaml>` (GRPO; the loop itself is trainer/run.h) and `kiln sft <recipe.yaml>`
// (its supervised warm start), on one process or data-parallel under mpirun: the resolved recipe in
// the run directory and the resulting weights (with their tokenizer files) as a checkpoint. Rank 0
// prints and writes; a GPU rank uses the device of its local rank.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <fstream>
#include <functional>
#include <memory>

#include "core/comm.h"
#include "core/error.h"
#include "core/stop_signal.h"
#include "core/files.h"
#include "core/yaml_util.h"
#include "model/checkpoint.h"
#include "model/lora.h"
#include "tools/commands.h"
#include "tools/kernel_flags.h"
#include "text/tokenizer.h"
#include "trainer/dry_run.h"
#include "trainer/grpo.h"
#include "trainer/plan.h"
#include "trainer/recipe.h"
#include "trainer/run.h"
#include "trainer/sft.h"

namespace kiln::tools {
namespace {

// --steps accepts 0..10^9. CLI11 2.1 saturates an integer too large for int64 to its maximum, so
// the bound is what turns "--steps 99999999999999999999" into an error instead of an endless run.
CLI::Range step_count() { return CLI::Range(int64_t{0}, int64_t{1'000'000'000}, "STEPS"); }

struct Setup {
  trainer::Recipe recipe;
  std::unique_ptr<model::Muse> policy;
  std::shared_ptr<const text::Tokenizer> tokenizer;
  trainer::Dataset data;
  trainer::LoadReport train_lines, eval_lines;
};

// What a command writes into its run directory; any of them there means the directory is used.
const std::vector<std::string> kTrainOutputs = {"recipe.yaml", "metrics.jsonl", "samples.jsonl", "tensorboard",
                                                "checkpoint",  "checkpoint.old", "checkpoint.tmp", "final", "adapter"};
const std::vector<std::string> kSftOutputs = {"sft-recipe.yaml", "sft-metrics.jsonl", "sft"};

// How a command may treat a run directory that already holds its outputs.
enum class Reuse { kRefuse, kOverwrite, kResume };

// A used run directory is refused (a second run would append to its metrics and replace its
// checkpoints), emptied of this command's outputs with --overwrite, or continued with --resume.
void claim_run_dir(const std::string& dir, const std::vector<std::string>& outputs, Reuse reuse, const char* cmd) {
  if (reuse == Reuse::kResume) return;
  std::vector<std::string> found;
  for (const auto& name : outputs)
    if (std::filesystem::exists(std::filesystem::symlink_status(dir + "/" + name))) found.push_back(name);
  if (found.empty()) return;
  KILN_CHECK(reuse == Reuse::kOverwrite, cmd, ": the run directory ", dir, " already holds a run (",
             fmt::format("{}", fmt::join(found, ", ")), "); pass --resume ", dir,
             " to continue it, --overwrite to replace it, or another --out");
  comm::Group::world().barrier();  // every rank has looked before rank 0 clears
  if (comm::Group::world().rank() == 0)
    for (const auto& name : found) remove_tree(dir + "/" + name);
  comm::Group::world().barrier();
}

// A resumed run keeps its recipe: anything but the step count differing from the recipe it was
// started with (its resolved recipe.yaml) is refused, naming the keys.
void check_same_recipe(const std::string& dir, const trainer::Recipe& r) {
  const std::string saved = dir + "/recipe.yaml";
  KILN_CHECK(std::filesystem::exists(saved), "train: --resume ", dir, ": no recipe.yaml there; is it a run directory?");
  YAML::Node before = yaml::load_file(saved), now = YAML::Load(r.to_yaml());
  // A resumed run may be extended (steps) and named by another path (out); its weights come from
  // the checkpoint, whatever the model was built from first (config, init_from); a requeued job
  // may wait longer or shorter in its collectives.
  for (YAML::Node* n : {&before, &now}) {
    for (const char* key : {"steps", "out"})
      if ((*n)["run"].IsMap()) (*n)["run"].remove(key);
    for (const char* key : {"config", "init_from"})
      if ((*n)["model"].IsMap()) (*n)["model"].remove(key);
    // How long a collective may wait and which GEMM kernels run are the job's, not the run's (and
    // runs started before those keys existed have none).
    if ((*n)["parallel"].IsMap()) (*n)["parallel"].remove("collective_timeout_s");
    n->remove("kernels");
  }
  // Runs started before grpo.async.placement existed ran the producer beside the trainer.
  YAML::Node async_before = before["grpo"].IsMap() ? before["grpo"]["async"] : YAML::Node();
  if (async_before.IsMap() && !async_before["placement"]) async_before["placement"] = "colocated";
  const std::vector<std::string> changed = yaml::diff(before, now);
  KILN_CHECK(changed.empty(), "train: --resume ", dir, ": the recipe differs from the one the run was started with (",
             saved, ") at ", fmt::format("{}", fmt::join(changed, ", ")),
             "; resume with that recipe (only --steps and the model's source may change), or start a new run");
}

// Before a GPU model is allocated: the recipe's memory plan (trainer/plan.h) on this job's ranks and
// this GPU. A recipe the plan says cannot fit is refused with the plan's numbers, not an OOM later.
// parallel.rollout: auto becomes the placement the plan picks (a replica where one fits).
void check_plan(trainer::Recipe& r, const model::ModelConfig& cfg, const comm::Group& world, at::Device device) {
  parallel::ParallelConfig par = r.grpo.parallel;
  // Under grpo.async.placement split the layout is the training half's; the plan puts the engine
  // on the other half.
  const int trainers = r.grpo.split_placement() ? world.size() / 2 : world.size();  // even (prepare)
  par.resolve(trainers, cfg.num_experts);
  trainer::Cluster c;
  c.nodes = 1;
  c.gpus_per_node = trainers;  // the per-GPU numbers depend on the world, not on how nodes split it
  // The smallest GPU of the job, so that every rank plans (and places the rollout) alike.
  c.gpu_bytes = world.all_reduce(model::device_memory_bytes(device), comm::ReduceOp::kMin);
  c.host_bytes = c.nvme_bytes = std::numeric_limits<double>::infinity();  // not checked here
  const trainer::Plan plan = trainer::make_plan(cfg, trainer::plan_job(r.grpo, r.dtype), c,
                                                {*par.dp, par.ep, 1, par.dense, par.cp});
  if (r.grpo.parallel.rollout == parallel::RolloutPlacement::kAuto) {
    r.grpo.parallel.rollout = plan.rollout_sharded ? parallel::RolloutPlacement::kSharded : parallel::RolloutPlacement::kReplica;
    if (world.rank() == 0 && par.ep > 1) fmt::print("train: parallel.rollout {}\n", plan.rollout_choice);
  }
  KILN_CHECK(plan.fits(), "train: by kiln's memory plan this recipe does not fit ", device, ": ",
             fmt::format("{}", fmt::join(plan.problems, "; ")), ". Lower optim.micro_batch_seqs or rollout.kv_cache_mb, "
             "set grpo.recompute: true, move the optimizer state (optim.state: cpu), or add ranks (parallel.ep); "
             "`kiln plan` prints the whole plan and searches layouts. The plan:\n", plan.report());
}

// Reads the recipe, applies the flags, writes the resolved recipe and builds model, tokenizer and data.
Setup prepare(const std::string& path, const std::string& out, const std::string& init_from,
              const char* resolved_name, const std::vector<std::string>& outputs, Reuse reuse,
              const KernelFlags& kernel_flags, const std::function<void(trainer::Recipe&)>& overrides) {
  Setup s{trainer::Recipe::from_yaml_file(path), nullptr, nullptr, {}, {}, {}};
  trainer::Recipe& r = s.recipe;
  overrides(r);
  r.sync_schedules();
  select_kernels(kernel_flags, r.kernels);
  if (!out.empty()) r.run.out = out;
  if (!init_from.empty()) r.init_from = init_from, r.model_config.clear();
  const comm::Group& world = comm::Group::world();
  const bool train = resolved_name == std::string("recipe.yaml");
  KILN_CHECK(!train || !r.grpo.split_placement() || (world.size() >= 2 && world.size() % 2 == 0), "train: ", path,
             " sets grpo.async.placement split, which needs an even number of ranks, the first half to train and the ",
             "second to roll out (got ", world.size(), "); launch with mpirun -np 2, 4, ...");
  comm::set_collective_timeout(r.grpo.parallel.collective_timeout_s);
  claim_run_dir(r.run.out, outputs, reuse, train ? "train" : "sft");
  if (reuse == Reuse::kResume) {
    // parallel.rollout: auto keeps the placement the run chose when it started.
    // A run saved before the key existed served a replica.
    const std::string saved_path = r.run.out + "/recipe.yaml";
    if (r.grpo.parallel.rollout == parallel::RolloutPlacement::kAuto && std::filesystem::exists(saved_path)) {
      const YAML::Node saved = yaml::load_file(saved_path);
      const bool named = saved["parallel"].IsMap() && saved["parallel"]["rollout"].IsScalar();
      r.grpo.parallel.rollout = named ? parallel::parse_rollout_placement(saved["parallel"]["rollout"].as<std::string>())
                                      : parallel::RolloutPlacement::kReplica;
    }
    check_same_recipe(r.run.out, r);
  }
  world.barrier();  // every rank has looked at the directory before rank 0 writes into it
  std::error_code ec;
  std::filesystem::create_directories(r.run.out, ec);  // ranks race here; a real failure shows at the first write
  const at::ScalarType dtype = model::parse_dtype(r.dtype);
  const at::Device device =
      model::rank_device(model::parse_device(r.device, "recipe model.device"), world.local_rank(), world.size());
  const model::ModelConfig config = r.init_from.empty() ? model::ModelConfig::from_yaml_file(r.model_config)
                                                        : model::ModelConfig::from_json_file(r.init_from + "/config.json");
  if (train && device.is_cuda()) check_plan(r, config, world, device);
  // Off the GPU nothing is planned: auto is a replica.
  if (r.grpo.parallel.rollout == parallel::RolloutPlacement::kAuto) r.grpo.parallel.rollout = parallel::RolloutPlacement::kReplica;
  // Under expert parallelism or ZeRO-3 (GRPO and SFT alike) each rank draws or reads only its
  // share of the model (its experts, the dense tensors it owns), never the whole of it. A bad
  // layout is left for the trainers to report.
  trainer::PolicyShare share;
  try {
    share = trainer::policy_share(config, dtype, r.grpo.parallel, world);
  } catch (const Error&) {
  }
  const auto keep = share.keep ? share.keep : [](const std::string&) { return true; };
  if (share.whole())
    s.policy = std::make_unique<model::Muse>(r.init_from.empty() ? model::Muse::init(config, r.model_seed, dtype, device)
                                                                 : model::load_checkpoint(r.init_from, dtype, device));
  else if (r.init_from.empty())
    s.policy = std::make_unique<model::Muse>(
        model::Muse::init_owned(config, r.model_seed, dtype, device, share.expert_rank, share.expert_ranks, keep));
  else
    s.policy = std::make_unique<model::Muse>(
        model::load_checkpoint_owned(r.init_from, dtype, device, share.expert_rank, share.expert_ranks, keep));
  s.tokenizer = trainer::load_recipe_tokenizer(r, config);
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

// --dry-run and the launch it plans for.
struct DryArgs {
  bool on = false;
  int64_t nodes = 0, gpus_per_node = 8;
  std::string gpu_mem;
};

void add_dry_run_flags(CLI::App* cmd, DryArgs& d) {
  cmd->add_flag("--dry-run", d.on,
                "Check the recipe and exit: model config and checkpoint index, tokenizer and chat template, a "
                "sample of the data, every worker with one probe request, the memory plan; one line per check");
  cmd->add_option("--nodes", d.nodes, "With --dry-run: plan for this many nodes (default: this launch's ranks)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--gpus-per-node", d.gpus_per_node, "With --dry-run --nodes: GPUs per node")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--gpu-mem", d.gpu_mem,
                  "With --dry-run: memory per GPU, e.g. 80GiB (default: 140GiB with --nodes, else this rank's GPU)");
}

// Reads the recipe as the command would (flags applied), runs the checks on rank 0 and prints one
// line per check; every rank fails alike when one check failed.
void run_dry_run(const std::string& path, const DryArgs& d, bool sft, const KernelFlags& kernel_flags,
                 const std::function<void(trainer::Recipe&)>& overrides) {
  const comm::Group& world = comm::Group::world();
  trainer::Recipe r = trainer::Recipe::from_yaml_file(path);
  overrides(r);
  r.sync_schedules();
  select_kernels(kernel_flags, r.kernels);
  trainer::DryRunOptions o;
  o.sft = sft;
  o.ranks = world.size();
  o.nodes = d.nodes;
  o.gpus_per_node = d.gpus_per_node;
  // The GPU to plan for: --gpu-mem, else kiln plan's default for a cluster named by --nodes (a
  // login node without GPUs checks a cluster's job), else this rank's GPU when the recipe runs on one.
  if (!d.gpu_mem.empty()) o.gpu_bytes = trainer::parse_bytes(d.gpu_mem, "--gpu-mem");
  else if (d.nodes > 0) o.gpu_bytes = trainer::Cluster().gpu_bytes;
  else if (const at::Device device = model::parse_device(r.device, "recipe model.device"); device.is_cuda())
    o.gpu_bytes = model::device_memory_bytes(device);
  int64_t failed = 0;
  if (world.rank() == 0) {
    const std::vector<trainer::DryRunCheck> checks = trainer::dry_run(r, o);
    for (const trainer::DryRunCheck& c : checks) {
      fmt::print("{:<12} {}  {}\n", c.name, c.skipped ? "skip" : c.ok ? "ok  " : "FAIL", c.detail);
      failed += c.ok || c.skipped ? 0 : 1;
    }
    std::fflush(stdout);
  }
  failed = int64_t(world.all_reduce(double(failed), comm::ReduceOp::kMax));
  KILN_CHECK(failed == 0, sft ? "sft" : "train", " --dry-run: ", failed, " check(s) failed for ", path);
  if (world.rank() == 0) fmt::print("{} --dry-run: every check passed for {}\n", sft ? "sft" : "train", path);
}

}  // namespace

Run add_sft(CLI::App& app) {
  auto* cmd = app.add_subcommand("sft", "Supervised warm start of a recipe's model on its (prompt, label) pairs");
  struct Args {
    std::string recipe, out;
    int64_t steps = -1;
    bool overwrite = false;
    KernelFlags kernels;
    DryArgs dry;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("recipe", a->recipe, "Recipe (YAML)")->required();
  cmd->add_option("--out", a->out, "Run directory (overrides run.out); weights go to <out>/sft");
  cmd->add_option("--steps", a->steps, "SFT steps (overrides sft.steps)")->check(step_count());
  cmd->add_flag("--overwrite", a->overwrite, "Replace the sft outputs already in the run directory");
  add_kernel_flags(cmd, a->kernels);
  add_dry_run_flags(cmd, a->dry);
  return [a] {
    if (a->dry.on)
      return run_dry_run(a->recipe, a->dry, /*sft=*/true, a->kernels, [&](trainer::Recipe& r) {
        if (a->steps >= 0) r.sft.steps = a->steps;
      });
    Setup s = prepare(a->recipe, a->out, "", "sft-recipe.yaml", kSftOutputs,
                      a->overwrite ? Reuse::kOverwrite : Reuse::kRefuse, a->kernels, [&](trainer::Recipe& r) {
                        if (a->steps >= 0) r.sft.steps = a->steps;
                      });
    trainer::Recipe& r = s.recipe;
    const bool lead = comm::Group::world().rank() == 0;
    if (lead) report_data(s);
    // The environment's workers demonstrate an episode per training example (trainer/sft.h).
    std::unique_ptr<trainer::Environment> env;
    if (r.sft.demonstrations == trainer::Demonstrations::kEnvironment)
      env = std::make_unique<trainer::Environment>(r.grpo.environment);
    // The recipe's parallel layout, as kiln train runs it: experts over ep ranks, the dense part
    // under ZeRO-3 when asked.
    trainer::SftTrainer sft(*s.policy, r.sft, s.tokenizer, s.data.train, comm::Group::world(), env.get(),
                            r.grpo.parallel);
    if (const trainer::DemoReport& d = sft.demonstrations(); lead && env)
      fmt::print("sft: the environment demonstrated {} of {} examples ({} without a demonstration, {} failed, "
                 "answered by their label)\n", d.demonstrated, d.demonstrated + d.label + d.failed, d.label, d.failed);
    env.reset();  // its workers are done
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
      KILN_CHECK(std::fclose(log) == 0, "sft: cannot write ", log_path, " (", std::strerror(errno), "); check the disk space");
      std::fprintf(stderr, "\n");
    }
    sft.save_model(r.run.out + "/sft");  // every rank its own tensors
    // Held-out accuracy of the warm-started model, measured the way GRPO measures it.
    trainer::GrpoConfig g = r.grpo;
    g.async.reset();  // every rank evaluates, none waits to roll out for another
    trainer::GrpoTrainer probe(*s.policy, g, s.tokenizer, s.data);
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
    bool overwrite = false;
    KernelFlags kernels;
    DryArgs dry;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("recipe", a->recipe, "Recipe (YAML), e.g. recipes/grpo-arith-tiny.yaml")->required();
  cmd->add_option("--out", a->out, "Run directory (overrides run.out)");
  cmd->add_option("--steps", a->steps, "GRPO steps (overrides run.steps)")->check(step_count());
  cmd->add_option("--init-from", a->init_from, "Start from this checkpoint (overrides model.*), e.g. <out>/sft");
  cmd->add_option("--resume", a->resume, "Continue the run in this directory from its newest complete checkpoint");
  cmd->add_flag("--overwrite", a->overwrite, "Replace the run already in the run directory (its metrics and checkpoints)");
  add_kernel_flags(cmd, a->kernels);
  add_dry_run_flags(cmd, a->dry);
  return [a] {
    if (a->dry.on)
      return run_dry_run(a->recipe, a->dry, /*sft=*/false, a->kernels, [&](trainer::Recipe& r) {
        if (a->steps >= 0) r.run.steps = a->steps;
        if (!a->init_from.empty()) r.init_from = a->init_from, r.model_config.clear();
      });
    KILN_CHECK(a->resume.empty() || !a->overwrite, "train: --resume and --overwrite exclude each other");
    const Reuse reuse = !a->resume.empty() ? Reuse::kResume : a->overwrite ? Reuse::kOverwrite : Reuse::kRefuse;
    Setup s = prepare(a->recipe, a->resume.empty() ? a->out : a->resume, a->init_from, "recipe.yaml", kTrainOutputs,
                      reuse, a->kernels, [&](trainer::Recipe& r) {
                        if (a->steps >= 0) r.run.steps = a->steps;
                      });
    trainer::Recipe& r = s.recipe;
    model::Muse& policy = *s.policy;
    // First: a bad parallel layout fails before any work, reported by rank 0 alone (the other
    // ranks wait until its MPI_Abort ends them); then a bad optimizer setting.
    const comm::Group& world = comm::Group::world();
    const bool lead = world.rank() == 0;
    parallel::ParallelConfig layout = r.grpo.parallel;
    // Under grpo.async.placement split the second half of the ranks only roll out.
    const int trainers = r.grpo.split_placement() ? world.size() / 2 : world.size();
    try {
      layout.resolve(trainers, policy.config().num_experts);
    } catch (const Error&) {
      if (!lead) world.barrier();
      throw;
    }
    if (lead) report_data(s);
    trainer::GrpoTrainer trainer(policy, r.grpo, s.tokenizer, s.data);
    stop_signal::install();  // a scheduler's SIGTERM/SIGUSR1: checkpoint after this step and exit
    if (trainer.serves_rollouts()) {  // until the trainer it rolls out for is done
      trainer.serve_rollouts();
      return;
    }
    const std::string ckpt = r.run.out + "/checkpoint";
    if (!a->resume.empty()) {
      trainer.load(ckpt);
      KILN_CHECK(trainer.steps_done() <= r.run.steps, "train: the checkpoint in ", ckpt, " is at step ",
                 trainer.steps_done(), ", past run.steps=", r.run.steps, "; pass --steps ", trainer.steps_done(),
                 " or more to continue the run");
    }
    if (lead) {
      const auto& tp = trainer.train_prompts();
      fmt::print("train: {} steps of {} prompts x {} samples; {} train / {} test prompts ({} too long, dropped; "
                 "mean {:.0f}, max {} tokens); tokenizer {}; {} rank(s), {}; run dir {} (checkpoint {})\n",
                 r.run.steps, r.grpo.prompts_per_step, r.grpo.samples_per_prompt, tp.kept, trainer.test_prompts().kept,
                 tp.too_long + trainer.test_prompts().too_long, tp.mean_tokens, tp.max_tokens, s.tokenizer->name(),
                 world.size(), layout.describe() + (r.grpo.split_placement() ? fmt::format(", {} rollout rank(s)", trainers) : ""), r.run.out,
                 r.run.checkpoint_every > 0 ? fmt::format("every {} steps and at the end", r.run.checkpoint_every)
                                            : std::string("at the end only"));
    }
    if (!a->resume.empty() && lead) fmt::print("train: resumed from {} at step {}\n", ckpt, trainer.steps_done());
    if (lead && !trainer.construction_memory().empty()) {  // CUDA: what each part of the trainer allocated
      std::string parts;
      double before = 0;
      for (const auto& [what, gb] : trainer.construction_memory()) {
        parts += fmt::format("{}{} {:+.2f}", parts.empty() ? "" : ", ", what, gb - before);
        before = gb;
      }
      fmt::print("train: device memory allocated, GB: {}; {:.2f} in all\n", parts, before);
    }
    const trainer::RunResult result = trainer::run_grpo(trainer, r.run, lead ? stderr : nullptr);
    const trainer::EvalMetrics& last = result.last;
    if (result.stopped_at > 0) {
      if (lead)
        fmt::print("train: stopped by {} after step {} of {}; checkpoint in {}; continue with kiln train {} --resume {}\n",
                   stop_signal::name(result.stop_signal), result.stopped_at, r.run.steps, ckpt, a->recipe, r.run.out);
      return;
    }
    // Every rank writes its own tensors (or rank 0 the adapters); the base of a LoRA run is
    // unchanged, so the adapters go alone.
    const bool adapters = model::lora_rank(policy) > 0;
    trainer.save_model(r.run.out + (adapters ? "/adapter" : "/final"));
    if (!lead) return;
    if (adapters) {
      fmt::print("train: done; held-out mean@{} {:.3f}; metrics in {}/metrics.jsonl, PEFT adapter in "
                 "{}/adapter (kiln merge <base> {}/adapter <out> folds it in)\n",
                 last.k, last.all.mean_at_k, r.run.out, r.run.out, r.run.out);
      return;
    }
    fmt::print("train: done; held-out mean@{} {:.3f}; metrics in {}/metrics.jsonl, weights in {}/final\n", last.k,
               last.all.mean_at_k, r.run.out, r.run.out);
  };
}

}  // namespace kiln::tools
