// `kiln plan <model.yaml> <recipe.yaml>`: the job's memory per GPU and per node for a cluster
// (trainer/plan.h), the best layouts, or the fewest nodes that fit. Nothing is allocated.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "core/error.h"
#include "model/config.h"
#include "tools/commands.h"
#include "trainer/plan.h"
#include "trainer/recipe.h"

namespace kiln::tools {
namespace {

struct PlanArgs {
  std::string model, recipe;
  int64_t nodes = 1, gpus_per_node = 8, seq_len = 0, show = 6, max_nodes = 1024;
  std::string gpu_mem = "140GiB", reserve = "6GiB", host_mem = "2TiB", nvme = "0";
  int64_t dp = 0, ep = 0, tp = 1, cp = 0;  // cp 0: searched (1 in a layout checked with --ep)
  std::string dense = "replicated";
  bool implemented_only = false;
};

// Under grpo.async.placement split the first half of the ranks train. mpirun places ranks by
// slot, so on several nodes that is the first half of the nodes (an even number of them), and on
// one node half of its GPUs (an even number of them). None where the halves share a node.
std::optional<trainer::Cluster> training_half(trainer::Cluster c) {
  if (c.nodes == 1 && c.gpus_per_node % 2 == 0) {
    c.gpus_per_node /= 2;
    return c;
  }
  if (c.nodes > 1 && c.nodes % 2 == 0) {
    c.nodes /= 2;
    return c;
  }
  return std::nullopt;
}

// The searched layouts of `c`, only those of --cp where it is given.
std::vector<trainer::Plan> layouts(const model::ModelConfig& cfg, const trainer::PlanJob& job,
                                   const trainer::Cluster& c, int64_t cp) {
  std::vector<trainer::Plan> plans = trainer::search_layouts(cfg, job, c);
  if (cp > 0)
    plans.erase(std::remove_if(plans.begin(), plans.end(), [&](const trainer::Plan& p) { return p.layout.cp != cp; }),
                plans.end());
  return plans;
}

// The best plan on `c` (implemented layouts only when asked), or none.
const trainer::Plan* best(const std::vector<trainer::Plan>& plans, bool implemented_only) {
  for (const trainer::Plan& p : plans)
    if (p.fits() && (!implemented_only || p.layout.implemented())) return &p;
  return nullptr;
}

void run_plan(const PlanArgs& a) {
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(a.model);
  const trainer::Recipe r = trainer::Recipe::from_yaml_file(a.recipe);
  KILN_CHECK(a.ep > 0 || (a.cp & (a.cp - 1)) == 0, "plan: --cp ", a.cp, ": the search tries cp in powers of two; ",
             "give --ep as well to check one layout with cp ", a.cp);
  trainer::PlanJob job = trainer::plan_job(r.grpo, r.dtype);
  if (a.seq_len > 0) job.seq_len = a.seq_len;
  trainer::Cluster c;
  c.nodes = a.nodes;
  c.gpus_per_node = a.gpus_per_node;
  c.gpu_bytes = trainer::parse_bytes(a.gpu_mem, "plan: --gpu-mem");
  c.reserve_bytes = trainer::parse_bytes(a.reserve, "plan: --reserve");
  c.host_bytes = trainer::parse_bytes(a.host_mem, "plan: --host-mem");
  c.nvme_bytes = trainer::parse_bytes(a.nvme, "plan: --nvme");
  if (job.rollout_split) {
    KILN_CHECK(a.ep <= 1 && a.dense == "replicated", "plan: ", a.recipe, " puts the rollout on ranks of its own ",
               "(grpo.async.placement split), whose trainers run ep 1 with the dense part replicated; --ep ", a.ep,
               " --dense ", a.dense, " is not a layout it trains");
    KILN_CHECK(a.nodes == 0 || training_half(c), "plan: ", a.recipe, " puts the rollout on ranks of its own ",
               "(grpo.async.placement split): the first half of the ranks train, which is whole nodes only on an even ",
               "number of them, or half of one node; --nodes ", a.nodes, " with --gpus-per-node ", c.gpus_per_node,
               " is neither");
    if (a.nodes > 0) {
      const trainer::Cluster half = *training_half(c);
      fmt::print("plan: grpo.async.placement split: {} train and as many roll out; the layouts below are the training "
                 "half's\n", c.nodes == 1 ? fmt::format("{} of the node's {} GPUs", half.gpus_per_node, c.gpus_per_node)
                                         : fmt::format("the first {} of the {} nodes", half.nodes, c.nodes));
      c = half;
    }
  }
  fmt::print("plan: {} ({}) with {}: {} sequences of {} tokens per micro-batch{}, {} weights, {}{}, optimizer "
             "state on {}, rollout {} ({})\n",
             cfg.name, a.model, a.recipe, job.micro_batch_seqs, job.seq_len, job.recompute ? " (recompute)" : "",
             job.weight_bytes == 2 ? "bf16" : "fp32",
             job.lora ? fmt::format("LoRA rank {}", job.lora_rank) : std::string("full-parameter"),
             job.lora ? " (AdamW on the adapters)" : job.muon ? " with Muon" : " (AdamW)", job.state_placement, job.rollout_quantization,
             job.rollout_auto ? "auto" : job.rollout_sharded ? "sharded" : "replica");
  if (a.ep > 0) {  // one layout, checked
    trainer::Layout l;
    l.ep = a.ep;
    l.tp = a.tp;
    l.cp = a.cp > 0 ? a.cp : 1;
    l.dense = trainer::parse_dense_sharding(a.dense);
    l.dp = a.dp > 0 ? a.dp : c.world() / std::max<int64_t>(1, a.ep * a.tp);
    fmt::print("{}", trainer::make_plan(cfg, job, c, l).report());
    return;
  }
  if (a.nodes == 0) {  // the fewest nodes with a layout that fits
    for (int64_t n = 1; n <= a.max_nodes; ++n) {
      c.nodes = n;
      const std::optional<trainer::Cluster> half = job.rollout_split ? training_half(c) : c;
      if (!half) continue;
      const std::vector<trainer::Plan> plans = layouts(cfg, job, *half, a.cp);
      if (const trainer::Plan* p = best(plans, a.implemented_only)) {
        fmt::print("fewest nodes of {} GPUs that fit{}: {}{}\n{}", c.gpus_per_node,
                   a.implemented_only ? " (layouts kiln trains today)" : "", n,
                   job.rollout_split ? fmt::format(" (the training half: {} x {} GPUs)", half->nodes, half->gpus_per_node)
                                     : std::string(), p->report());
        if (const trainer::Plan* today = best(plans, true); !a.implemented_only && today != p)
          fmt::print("with a layout kiln trains today (tp 1, dense replicated or zero3): {}\n",
                     today ? today->layout.describe() : std::string("none fits on this many nodes"));
        return;
      }
    }
    KILN_CHECK(!job.rollout_split || a.gpus_per_node % 2 == 0 || a.max_nodes > 1, "plan: ", a.recipe,
               " puts the rollout on ranks of its own (grpo.async.placement split), which needs an even number of ",
               "nodes or of GPUs on one node");
    KILN_FAIL("plan: no layout", a.cp > 0 ? fmt::format(" with --cp {}", a.cp) : std::string(), " fits on up to ",
              a.max_nodes, " nodes of ", c.gpus_per_node, " GPUs (raise --max-nodes)");
  }
  const std::vector<trainer::Plan> plans = layouts(cfg, job, c, a.cp);
  KILN_CHECK(!plans.empty(), "plan: no valid dp x ep x tp layout (cp folded over it) for ", c.world(), " GPUs and ", cfg.num_experts,
             " experts", a.cp > 0 ? fmt::format(" with --cp {} (searched: powers of two that divide the GPUs left by "
                                               "ep x tp, at most half the sequence's {} tokens)", a.cp, job.seq_len)
                                  : std::string());
  const trainer::Plan* p = best(plans, a.implemented_only);
  fmt::print("{}", (p ? *p : plans.front()).report());
  fmt::print("\nlayouts, best first (fitting, implemented, smaller cp, most memory left; per GPU of {}):\n",
             trainer::format_bytes(c.gpu_bytes));
  fmt::print("  {:<46} {:>4} {:>12} {:>12}\n", "layout", "cp", "activations", "used");
  for (size_t i = 0; i < plans.size() && int64_t(i) < a.show; ++i)
    fmt::print("  {:<46} {:>4} {:>12} {:>12}  {}{}\n", plans[i].layout.describe(), plans[i].layout.cp,
               trainer::format_bytes(plans[i].activations), trainer::format_bytes(plans[i].gpu_used),
               plans[i].fits() ? "fits" : "does not fit", plans[i].layout.implemented() ? "" : " (not implemented yet)");
}

}  // namespace

Run add_plan(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan", "Memory per GPU and per node of a GRPO job on a cluster, and the layouts that fit");
  auto a = std::make_shared<PlanArgs>();
  cmd->add_option("model", a->model, "Model config (YAML), e.g. configs/muse-spark-open-816b.yaml")->required();
  cmd->add_option("recipe", a->recipe, "GRPO recipe (YAML): batch, optimizer, LoRA, rollout")->required();
  cmd->add_option("--nodes", a->nodes, "Nodes (0: the fewest that fit)")->check(CLI::Range(int64_t(0), int64_t(1) << 20))->capture_default_str();
  cmd->add_option("--gpus-per-node", a->gpus_per_node, "GPUs per node")->check(CLI::Range(int64_t(1), int64_t(1024)))->capture_default_str();
  cmd->add_option("--gpu-mem", a->gpu_mem, "Memory per GPU")->capture_default_str();
  cmd->add_option("--reserve", a->reserve, "Per GPU, kept free for the CUDA context, workspaces and fragmentation")->capture_default_str();
  cmd->add_option("--host-mem", a->host_mem, "Host memory per node")->capture_default_str();
  cmd->add_option("--nvme", a->nvme, "NVMe space per node (optimizer state placement nvme)")->capture_default_str();
  cmd->add_option("--seq-len", a->seq_len, "Tokens per sequence (default: the recipe's max prompt tokens, or 256, + max_tokens)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--ep", a->ep, "Check this layout instead of searching: expert-parallel ranks")->check(CLI::PositiveNumber);
  cmd->add_option("--dp", a->dp, "... data-parallel ranks (default: the rest)")->check(CLI::PositiveNumber);
  cmd->add_option("--tp", a->tp, "... tensor-parallel ranks")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--cp", a->cp, "Context-parallel ranks: with --ep part of the layout checked (default 1), else "
                                 "the search keeps only layouts of this cp (default: searched)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--dense", a->dense, "... dense part: replicated, zero3 or tp")->capture_default_str();
  cmd->add_option("--show", a->show, "Layouts listed after the best one")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--max-nodes", a->max_nodes, "Largest cluster tried with --nodes 0")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--implemented", a->implemented_only, "Only layouts kiln trains today (tp 1, dense replicated or zero3)");
  return [a] { run_plan(*a); };
}

}  // namespace kiln::tools
