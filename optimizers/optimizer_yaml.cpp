// The optimizer's settings as keys of a recipe's optim: (and sft:) section: read (strict, errors at
// file:line) and written back in the resolved recipe, in the same key order.
#include <yaml-cpp/yaml.h>

#include <algorithm>

#include "core/yaml_util.h"
#include "optimizers/optimizer.h"

namespace kiln::optimizers {

namespace {

constexpr double kMiB = double(1 << 20);

// optim.rules: each entry a GroupRule, tried before the default assignment.
void read_rules(yaml::MapReader& m, std::vector<GroupRule>& rules) {
  for (yaml::MapReader& r : m.children("rules")) {
    GroupRule rule;
    std::string kind;
    r.get("match", rule.match);
    r.get("min_dim", rule.min_dim);
    r.get("max_dim", rule.max_dim);
    r.require("optimizer", kind);
    r.finish();
    r.check("optimizer", [&] { rule.kind = parse_kind(kind); });
    rules.push_back(rule);
  }
}

}  // namespace

void read_yaml(yaml::MapReader& m, OptimizerConfig& o) {
  m.get("lr", o.adamw.lr);
  m.get("weight_decay", o.adamw.weight_decay);
  // Muon's update is scaled to AdamW's RMS, so by default both groups share lr and decay.
  o.muon.weight_decay = o.adamw.weight_decay;
  o.muon.lr = o.adamw.lr;
  m.get("beta1", o.adamw.beta1);
  m.get("beta2", o.adamw.beta2);
  m.get("eps", o.adamw.eps);
  m.get("muon", o.use_muon);
  m.get("muon_lr", o.muon.lr);
  m.get("muon_momentum", o.muon.momentum);
  m.get("muon_weight_decay", o.muon.weight_decay);
  m.get("muon_nesterov", o.muon.nesterov);
  m.get("ns_steps", o.muon.ns_steps);
  std::string state = placement_name(o.state), moments = o.moments == at::kFloat ? "fp32" : "bf16";
  m.get("state", state);
  m.get("nvme_dir", o.nvme_dir);
  double chunk_mb = double(o.chunk_bytes) / kMiB;
  m.get("chunk_mb", chunk_mb);
  o.chunk_bytes = std::max<int64_t>(1, int64_t(chunk_mb * kMiB));
  m.get("master_weights", o.master_weights);
  m.get("moments", moments);
  read_rules(m, o.rules);
  m.check("state", [&] { o.state = parse_placement(state); });
  if (moments != "fp32" && moments != "bf16") m.fail("moments", "must be fp32 or bf16 (got " + moments + ")");
  o.moments = moments == "bf16" ? at::kBFloat16 : at::kFloat;
  m.check("", [&] { o.validate(); });
}

void write_yaml(YAML::Emitter& e, const OptimizerConfig& o) {
  e << YAML::Key << "lr" << YAML::Value << o.adamw.lr;
  e << YAML::Key << "weight_decay" << YAML::Value << o.adamw.weight_decay;
  e << YAML::Key << "beta1" << YAML::Value << o.adamw.beta1;
  e << YAML::Key << "beta2" << YAML::Value << o.adamw.beta2;
  e << YAML::Key << "eps" << YAML::Value << o.adamw.eps;
  e << YAML::Key << "muon" << YAML::Value << o.use_muon;
  e << YAML::Key << "muon_lr" << YAML::Value << o.muon.lr;
  e << YAML::Key << "muon_momentum" << YAML::Value << o.muon.momentum;
  e << YAML::Key << "muon_weight_decay" << YAML::Value << o.muon.weight_decay;
  e << YAML::Key << "muon_nesterov" << YAML::Value << o.muon.nesterov;
  e << YAML::Key << "ns_steps" << YAML::Value << o.muon.ns_steps;
  e << YAML::Key << "state" << YAML::Value << placement_name(o.state);
  if (!o.nvme_dir.empty()) e << YAML::Key << "nvme_dir" << YAML::Value << o.nvme_dir;
  e << YAML::Key << "chunk_mb" << YAML::Value << double(o.chunk_bytes) / kMiB;
  e << YAML::Key << "master_weights" << YAML::Value << o.master_weights;
  e << YAML::Key << "moments" << YAML::Value << (o.moments == at::kFloat ? "fp32" : "bf16");
  if (o.rules.empty()) return;
  e << YAML::Key << "rules" << YAML::Value << YAML::BeginSeq;
  for (const GroupRule& r : o.rules)
    e << YAML::BeginMap << YAML::Key << "match" << YAML::Value << r.match << YAML::Key << "min_dim" << YAML::Value
      << r.min_dim << YAML::Key << "max_dim" << YAML::Value << r.max_dim << YAML::Key << "optimizer" << YAML::Value
      << kind_name(r.kind) << YAML::EndMap;
  e << YAML::EndSeq;
}

}  // namespace kiln::optimizers
