// Which optimizer each parameter gets: ordered rules on the name and the shape (first match wins),
// then the default of docs/MODEL.md §7.3 (Muon for attention, the latent projections and the experts;
// AdamW for embeddings, lm_head, norms and the router).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::optimizers {

enum class Kind { kAdamW, kMuon };
const char* kind_name(Kind kind);
Kind parse_kind(const std::string& name);  // "adamw" or "muon"; throws otherwise

struct GroupRule {
  std::string match = "*";  // glob on the parameter name: '*' any run of characters, '?' one
  int64_t min_dim = 0;      // and the parameter's number of dimensions in [min_dim, max_dim]
  int64_t max_dim = 64;
  Kind kind = Kind::kAdamW;
  bool matches(const std::string& name, const at::Tensor& param) const;
};

// The default assignment (docs/MODEL.md §7.3). Muon needs a matrix or a stack of matrices, so it applies
// only to parameters with 2 or 3 dimensions.
bool default_uses_muon(const std::string& name, const at::Tensor& param);

// The rules first, in order, then the default; with use_muon = false everything is AdamW.
Kind assign(const std::vector<GroupRule>& rules, bool use_muon, const std::string& name, const at::Tensor& param);

bool glob_match(const std::string& pattern, const std::string& text);

}  // namespace kiln::optimizers
