// The arithmetic task of the GRPO demo. Randomness comes from trainer/rng.h so that a seed gives
// the same problems with every standard library.
#include "trainer/tasks.h"

#include <string>
#include <unordered_set>

#include "core/error.h"
#include "trainer/rng.h"

namespace kiln::trainer {
namespace {

struct Level {
  const char* ops;
  int64_t lo, hi;  // operand range
};

Level level_of(int difficulty) {
  switch (difficulty) {
    case 1: return {"+", 0, 9};
    case 2: return {"+", 10, 99};
    case 3: return {"+-", 10, 99};
    case 4: return {"+-*", 0, 99};
    default:
      KILN_FAIL("arithmetic_problems: unknown difficulty (difficulty=", difficulty,
                "); use 1 (single-digit +), 2 (two-digit +), 3 (two-digit + and -) or 4 (+, - and * "
                "with operands up to two digits)");
  }
}

}  // namespace

std::vector<Example> arithmetic_problems(int64_t count, int difficulty, uint64_t seed) {
  const Level level = level_of(difficulty);
  const int64_t num_ops = int64_t(std::char_traits<char>::length(level.ops));
  const int64_t span = level.hi - level.lo + 1;
  const int64_t distinct = num_ops * span * span;
  KILN_CHECK(count >= 0 && count <= distinct, "arithmetic_problems: count outside [0, ", distinct,
             "] (count=", count, ", difficulty=", difficulty, "); level ", difficulty, " has ", distinct,
             " distinct problems: ask for fewer, a higher difficulty, or repeat them in epochs");
  rng::Rng rng(rng::mix(seed, rng::kSaltProblems));
  std::unordered_set<std::string> seen;
  std::vector<Example> out;
  out.reserve(size_t(count));
  while (int64_t(out.size()) < count) {
    const char op = level.ops[rng.below(uint64_t(num_ops))];
    const int64_t a = rng.between(level.lo, level.hi);
    const int64_t b = rng.between(level.lo, level.hi);
    std::string prompt = std::to_string(a) + op + std::to_string(b) + "=";
    if (!seen.insert(prompt).second) continue;
    const int64_t result = op == '+' ? a + b : op == '-' ? a - b : a * b;
    Example ex;
    ex.prompt = std::move(prompt);
    ex.label = std::to_string(result);
    ex.data_source = "arithmetic";
    ex.metadata = "{}";
    ex.origin = str_cat("arithmetic#", out.size());
    out.push_back(std::move(ex));
  }
  return out;
}

}  // namespace kiln::trainer
