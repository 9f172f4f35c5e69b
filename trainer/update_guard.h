// UpdateGuard: an optimizer update whose gradient norm (or, where the caller has it on every rank,
// whose loss) is NaN or infinite is skipped and counted; `limit` such updates in a row stop the run
// with an error naming the step and the quantity (docs/RELIABILITY.md). What decides must be the
// same on every rank (the norm after the gradient all-reduce, a reduced loss), so that every rank
// skips alike.
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
  // Whether a non-finite loss skips the update too. Set it where `loss` is the run's (reduced over
  // the ranks): a loss can be inf while the gradient stays finite (a target's log-prob that
  // overflows to -inf can have a finite gradient), and applying that update trains on a diverged
  // step.
  bool loss_decides = false;
  // What the error tells the user to try, after "the run has diverged".
  std::string hint = "lower the lr or the grad_clip and resume from the last checkpoint";

  // True when the update may be applied. `loss` is reported beside the norm (and decides with
  // loss_decides); `who` ("grpo", "sft") and `step` name the update in the error.
  bool admit(double grad_norm, double loss, const char* who, int64_t step) {
    const bool bad_norm = !std::isfinite(grad_norm), bad_loss = loss_decides && !std::isfinite(loss);
    if (!bad_norm && !bad_loss) {
      in_a_row = 0;
      return true;
    }
    ++skipped;
    ++in_a_row;
    const char* what = bad_norm && bad_loss ? "the loss and the gradient norm are"
                       : bad_norm           ? "the gradient norm is"
                                            : "the loss is";
    KILN_CHECK(in_a_row < limit, who, ": step ", step, ": ", what, " not finite (grad norm ", grad_norm, ", loss ",
               loss, ") in ", in_a_row, " update(s) in a row (stop_after_nonfinite: ", limit,
               "): the run has diverged. None of these updates was applied; ", hint);
    return false;
  }
};

}  // namespace kiln::trainer
