// Parameter-group rules: glob matching on names, dimension bounds, and the docs/MODEL.md §7.3 default.
#include "optimizers/groups.h"

#include "core/error.h"

namespace kiln::optimizers {

const char* kind_name(Kind kind) { return kind == Kind::kMuon ? "muon" : "adamw"; }

Kind parse_kind(const std::string& name) {
  if (name == "muon") return Kind::kMuon;
  if (name == "adamw") return Kind::kAdamW;
  KILN_FAIL("optimizer: unknown optimizer '", name, "'; expected muon or adamw");
}

bool glob_match(const std::string& pattern, const std::string& text) {
  // Iterative matcher with one backtrack point for the last '*': linear in practice.
  size_t p = 0, t = 0, star = std::string::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == text[t])) {
      ++p, ++t;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (star != std::string::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

bool GroupRule::matches(const std::string& name, const at::Tensor& param) const {
  return param.dim() >= min_dim && param.dim() <= max_dim && glob_match(match, name);
}

bool default_uses_muon(const std::string& name, const at::Tensor& param) {
  if (param.dim() < 2 || param.dim() > 3 || name.find("norm") != std::string::npos) return false;
  if (name.find(".lora_") != std::string::npos) return false;  // LoRA adapters: AdamW, as PEFT trains them
  for (const char* key : {"q_proj", "k_proj", "v_proj", "o_proj", "mlp.pooler", "mlp.unpooler", "experts.gate_proj",
                          "experts.up_proj", "experts.down_proj"})
    if (name.find(key) != std::string::npos) return true;
  return false;  // embed_tokens, lm_head, the router
}

Kind assign(const std::vector<GroupRule>& rules, bool use_muon, const std::string& name, const at::Tensor& param) {
  if (!use_muon) return Kind::kAdamW;
  for (const GroupRule& r : rules)
    if (r.matches(name, param)) {
      KILN_CHECK(r.kind != Kind::kMuon || param.dim() == 2 || param.dim() == 3, "optimizer: rule '", r.match,
                 "' gives Muon to ", name, " with shape ", param.sizes(),
                 ", but Muon needs a matrix or a stack of matrices; add a min_dim: 2 bound or an AdamW rule before it");
      return r.kind;
    }
  return default_uses_muon(name, param) ? Kind::kMuon : Kind::kAdamW;
}

}  // namespace kiln::optimizers
