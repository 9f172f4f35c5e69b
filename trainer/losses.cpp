// GRPO advantages, the PPO-clip policy loss and its options, mismatch metrics and routing
// disagreement, in ATen ops (autograd flows through the loss).
#include "trainer/losses.h"

#include <ATen/ATen.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>

#include "core/error.h"
#include "core/yaml_util.h"

namespace kiln::trainer {
namespace {

void check_tokens(const at::Tensor& t, int64_t T, const char* name) {
  KILN_CHECK(t.defined() && t.dim() == 1 && t.size(0) == T, "policy_loss: ", name, " must be [", T, "] (got ",
             t.defined() ? t.sizes() : at::IntArrayRef{}, ")");
}

// Per-sequence sums of x [T] over tokens, [num_seqs].
at::Tensor per_seq_sum(const at::Tensor& x, const at::Tensor& seq_ids, int64_t num_seqs) {
  return at::zeros({num_seqs}, x.options()).index_add(0, seq_ids, x);
}

}  // namespace

at::Tensor group_advantages(const at::Tensor& rewards, int64_t group_size, bool std_normalize, double eps) {
  KILN_CHECK(rewards.dim() == 1 && group_size >= 1 && rewards.size(0) % group_size == 0,
             "group_advantages: rewards must be [num_groups * group_size] (got ", rewards.sizes(),
             ", group_size=", group_size, ")");
  KILN_CHECK(!std_normalize || group_size >= 2, "group_advantages: std normalisation needs group_size >= 2 (got ",
             group_size, "); use n >= 2 samples per prompt or turn std normalisation off");
  at::Tensor r = rewards.to(at::kDouble).view({-1, group_size});
  at::Tensor a = r - r.mean(1, /*keepdim=*/true);
  if (std_normalize) a = a / (r.std(1, /*unbiased=*/true, /*keepdim=*/true) + eps);
  return a.reshape(-1);
}

Aggregation parse_aggregation(const std::string& name) {
  if (name == "token-mean") return Aggregation::kTokenMean;
  if (name == "seq-mean-token-mean") return Aggregation::kSeqMeanTokenMean;
  KILN_FAIL("policy loss: unknown aggregation '", name, "'; use token-mean or seq-mean-token-mean");
}

const char* aggregation_name(Aggregation a) {
  return a == Aggregation::kTokenMean ? "token-mean" : "seq-mean-token-mean";
}

void read_yaml(yaml::MapReader& l, PolicyLossConfig& c) {
  std::string agg = aggregation_name(c.aggregation);
  l.get("eps_low", c.eps_low);
  l.get("eps_high", c.eps_high);
  l.get("aggregation", agg);
  l.get("kl_coef", c.kl_coef);
  l.get("tis", c.tis);
  l.get("tis_cap", c.tis_cap);
  l.get("gspo", c.gspo);
  l.get("mis", c.mis);
  l.get("mis_low", c.mis_low);
  l.get("mis_high", c.mis_high);
  l.finish();
  l.check("aggregation", [&] { c.aggregation = parse_aggregation(agg); });
  if (c.kl_coef < 0) l.fail("kl_coef", "must be >= 0 (0 turns the KL term off)");
}

void write_yaml(YAML::Emitter& e, const PolicyLossConfig& c) {
  e << YAML::Key << "eps_low" << YAML::Value << c.eps_low;
  e << YAML::Key << "eps_high" << YAML::Value << c.eps_high;
  e << YAML::Key << "aggregation" << YAML::Value << aggregation_name(c.aggregation);
  e << YAML::Key << "kl_coef" << YAML::Value << c.kl_coef;
  e << YAML::Key << "tis" << YAML::Value << c.tis;
  e << YAML::Key << "tis_cap" << YAML::Value << c.tis_cap;
  e << YAML::Key << "gspo" << YAML::Value << c.gspo;
  e << YAML::Key << "mis" << YAML::Value << c.mis;
  e << YAML::Key << "mis_low" << YAML::Value << c.mis_low;
  e << YAML::Key << "mis_high" << YAML::Value << c.mis_high;
}

PolicyLossOutput policy_loss(const PolicyLossInputs& in, const PolicyLossConfig& cfg) {
  const int64_t T = in.logprobs.size(0);
  check_tokens(in.logprobs, T, "logprobs");
  check_tokens(in.old_logprobs, T, "old_logprobs");
  check_tokens(in.advantages, T, "advantages");
  check_tokens(in.mask, T, "mask");
  check_tokens(in.seq_ids, T, "seq_ids");
  KILN_CHECK(in.num_seqs > 0, "policy_loss: num_seqs must be positive (got ", in.num_seqs, ")");
  KILN_CHECK(cfg.eps_low >= 0 && cfg.eps_low < 1 && cfg.eps_high >= 0, "policy_loss: clip range must satisfy ",
             "0 <= eps_low < 1 and eps_high >= 0 (eps_low=", cfg.eps_low, ", eps_high=", cfg.eps_high, ")");
  const auto acc = in.logprobs.scalar_type();
  at::Tensor mask = in.mask.to(acc);
  at::Tensor ids = in.seq_ids.to(at::kLong);
  at::Tensor adv = in.advantages.to(acc);
  at::Tensor log_ratio = in.logprobs - in.old_logprobs.to(acc).detach();
  at::Tensor seq_tokens = per_seq_sum(mask, ids, in.num_seqs);  // response tokens per sequence
  if (cfg.gspo) {
    // s_i = exp(mean over the sequence's response tokens of the log-ratio), on each of its tokens.
    at::Tensor mean_lr = per_seq_sum(log_ratio * mask, ids, in.num_seqs) / seq_tokens.clamp_min(1);
    log_ratio = mean_lr.index_select(0, ids);
  }
  at::Tensor rho = at::exp(log_ratio);
  at::Tensor unclipped = -adv * rho;
  at::Tensor clipped = -adv * rho.clamp(1 - cfg.eps_low, 1 + cfg.eps_high);
  at::Tensor per_token = at::maximum(unclipped, clipped);
  PolicyLossOutput out;
  const double n_tokens = mask.sum().item<double>();
  const double denom_tokens = std::max(n_tokens, 1.0);
  // The rollout correction's ratio exp(lp_old - lp_roll), no gradient: TIS caps it, MIS masks by it.
  at::Tensor roll_ratio;
  if (cfg.tis || cfg.mis) {
    KILN_CHECK(in.rollout_logprobs.defined(), "policy_loss: ", cfg.tis ? "TIS" : "MIS", " needs rollout_logprobs");
    check_tokens(in.rollout_logprobs, T, "rollout_logprobs");
    roll_ratio = at::exp(in.old_logprobs.to(acc) - in.rollout_logprobs.to(acc)).detach();
  }
  if (cfg.tis) {
    at::Tensor w = roll_ratio.clamp_max(cfg.tis_cap);
    per_token = per_token * w;
    out.tis_weight_mean = (w * mask).sum().item<double>() / denom_tokens;
  }
  if (cfg.mis) {
    KILN_CHECK(cfg.mis_low >= 0 && cfg.mis_low <= 1 && cfg.mis_high >= 1, "policy_loss: MIS range must satisfy ",
               "0 <= mis_low <= 1 <= mis_high (mis_low=", cfg.mis_low, ", mis_high=", cfg.mis_high, ")");
    at::Tensor keep = roll_ratio.ge(cfg.mis_low).logical_and(roll_ratio.le(cfg.mis_high)).to(acc);
    per_token = per_token * keep;
    out.mis_masked_fraction = ((1 - keep) * mask).sum().item<double>() / denom_tokens;
  }
  if (cfg.kl_coef != 0) {
    KILN_CHECK(in.ref_logprobs.defined(), "policy_loss: kl_coef=", cfg.kl_coef, " needs ref_logprobs");
    check_tokens(in.ref_logprobs, T, "ref_logprobs");
    at::Tensor diff = in.ref_logprobs.to(acc).detach() - in.logprobs;
    at::Tensor k3 = at::exp(diff) - diff - 1;
    per_token = per_token + cfg.kl_coef * k3;
    out.kl = (k3.detach() * mask).sum().item<double>() / denom_tokens;
  }
  per_token = per_token * mask;
  if (cfg.aggregation == Aggregation::kTokenMean) {
    const double norm = in.total_tokens > 0 ? in.total_tokens : denom_tokens;
    out.loss = per_token.sum() / norm;
  } else {
    at::Tensor seq_mean = per_seq_sum(per_token, ids, in.num_seqs) / seq_tokens.clamp_min(1);
    const double live = seq_tokens.gt(0).sum().item<double>();
    const double norm = in.total_seqs > 0 ? in.total_seqs : std::max(live, 1.0);
    out.loss = seq_mean.sum() / norm;
  }
  at::Tensor active_clip = clipped.gt(unclipped).to(acc) * mask;
  out.clip_fraction = active_clip.sum().item<double>() / denom_tokens;
  out.ratio_mean = (rho.detach() * mask).sum().item<double>() / denom_tokens;
  return out;
}

double overlong_penalty(int64_t length, int64_t max_tokens, int64_t buffer, double penalty) {
  KILN_CHECK(buffer >= 0 && buffer <= max_tokens && penalty >= 0, "overlong_penalty: need 0 <= buffer <= max_tokens ",
             "and penalty >= 0 (buffer=", buffer, ", max_tokens=", max_tokens, ", penalty=", penalty, ")");
  const int64_t free_len = max_tokens - buffer;
  if (buffer == 0 || length <= free_len) return 0.0;
  return -penalty * double(std::min(length, max_tokens) - free_len) / double(buffer);
}

MismatchMetrics mismatch_metrics(const at::Tensor& old_logprobs, const at::Tensor& rollout_logprobs,
                                 const at::Tensor& mask, const at::Tensor& seq_ids, int64_t num_seqs) {
  const int64_t T = old_logprobs.size(0);
  KILN_CHECK(rollout_logprobs.sizes() == old_logprobs.sizes() && mask.sizes() == old_logprobs.sizes() &&
                 seq_ids.sizes() == old_logprobs.sizes(),
             "mismatch_metrics: inputs must all be [", T, "]");
  at::Tensor m = mask.to(at::kDouble).cpu();
  at::Tensor d = (old_logprobs.to(at::kDouble) - rollout_logprobs.to(at::kDouble)).detach().cpu() * m;
  at::Tensor ids = seq_ids.to(at::kLong).cpu();
  MismatchMetrics r;
  r.tokens = int64_t(m.sum().item<double>());
  if (r.tokens == 0) return r;
  at::Tensor ad = d.abs();
  r.mean_abs_token = ad.sum().item<double>() / double(r.tokens);
  r.max_abs = ad.max().item<double>();
  r.k3_kl = ((at::exp(d) - d - 1) * m).sum().item<double>() / double(r.tokens);
  at::Tensor ratio = at::exp(d);
  r.frac_outside = ((ratio.lt(0.5).logical_or(ratio.gt(2.0))).to(at::kDouble) * m).sum().item<double>() / double(r.tokens);
  at::Tensor per_seq = per_seq_sum(ad, ids, num_seqs), counts = per_seq_sum(m, ids, num_seqs);
  at::Tensor live = counts.gt(0);
  r.mean_abs_seq = (per_seq.masked_select(live) / counts.masked_select(live)).mean().item<double>();
  return r;
}

double routing_disagreement(const at::Tensor& own, const at::Tensor& replayed, const at::Tensor& mask) {
  KILN_CHECK(own.sizes() == replayed.sizes() && own.dim() == 3 && mask.dim() == 1 && mask.size(0) == own.size(0),
             "routing_disagreement: own and replayed must both be [T, L, k] and mask [T] (got ", own.sizes(), ", ",
             replayed.sizes(), ", ", mask.sizes(), ")");
  at::Tensor a = std::get<0>(own.to(at::kLong).sort(2)), b = std::get<0>(replayed.to(at::kLong).sort(2));
  at::Tensor differs = a.ne(b).any(2).to(at::kDouble);  // [T, L]
  at::Tensor m = mask.to(at::kDouble).unsqueeze(1).expand_as(differs);
  const double pairs = m.sum().item<double>();
  return pairs > 0 ? (differs * m).sum().item<double>() / pairs : 0.0;
}

}  // namespace kiln::trainer
