// The load-balance term of one MoE layer, over a whole batch or over one split across ranks
// (ForwardOptions::batch_reduce).
#include <ATen/ATen.h>

#include "core/error.h"
#include "model/muse.h"

namespace kiln::model {

at::Tensor load_balance_term(const at::Tensor& counts, const at::Tensor& scores, int64_t top_k,
                             const BatchReduce* reduce) {
  const int64_t E = counts.size(0), T = scores.size(0);
  if (!reduce) return (counts / double(T * top_k) * scores.mean(0)).sum() * double(E);
  // One reduction per layer: the slot counts, the score sums and the token count side by side.
  // f and P are ratios of the group's sums, so they equal the whole batch's (not a mean of each
  // rank's, which a rank with few tokens would skew).
  at::Tensor local = at::cat({counts.to(scores.scalar_type()), scores.sum(0),
                              at::full({1}, double(T), scores.options())});
  at::Tensor all = reduce->sum(local);
  KILN_CHECK(all.sizes() == local.sizes(), "load balance: the group's sum has shape ", all.sizes(), ", expected ",
             local.sizes());
  const at::Tensor tokens = all.narrow(0, 2 * E, 1);
  at::Tensor f = all.narrow(0, 0, E) / (tokens * double(top_k));
  at::Tensor p = all.narrow(0, E, E) / tokens;
  return (f * p).sum() * double(E);
}

}  // namespace kiln::model
