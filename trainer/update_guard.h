// UpdateGuard: an optimizer update whose gradient norm is NaN or infinite is skipped and counted;
// `limit` such updates in a row stop the run with an error naming the step and the quantity
// (docs/RELIABILITY.md). The norm is the global one (after the gradient all-reduce), so every rank
// decides the same way.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace kiln::trainer {

struct UpdateGuard {
  int64_t limit = 3;     // non-finite updates in a row that stop the run (recipe: stop_after_nonfinite; >= 1)
  int64_t skipped = 0;   // all skipped updates so far
  int64_t in_a_row = 0;

  // True when the update may be applied. The norm alone decides (a non-finite loss makes it
  // non-finite too, and it is the same on every rank); `loss` (this rank's) is reported beside it.
  // `who` ("grpo", "sft") and `step` name the update in the error.
  bool admit(double grad_norm, double loss, const char* who, int64_t step) {
    if (std::isfinite(grad_norm)) {
      in_a_row = 0;
      return true;
    }
    ++skipped;
    ++in_a_row;
    KILN_CHECK(in_a_row < limit, who, ": step ", step, ": the gradient norm is not finite (grad norm ", grad_norm,
               ", loss ", loss, ") in ", in_a_row, " update(s) in a row (stop_after_nonfinite: ", limit,
               "): the run has diverged. None of these updates was applied; lower the lr or the grad_clip and "
               "resume from the last checkpoint");
    return false;
  }
};

}  // namespace kiln::trainer
