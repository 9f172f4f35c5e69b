// The demo's task: arithmetic problems as dataset examples ("12+34=" -> label "46", data_source
// "arithmetic"), generated deterministically per seed. Pure C++; no torch.
#pragma once
#include <cstdint>
#include <vector>

#include "trainer/dataset.h"

namespace kiln::trainer {

// `count` distinct problems "<a><op><b>=" with the integer result as label. Difficulty:
// 1 = a+b, a and b in [0, 9] (100 distinct); 2 = a+b, a and b in [10, 99] (8100);
// 3 = a+b or a-b, a and b in [10, 99], results may be negative (16200);
// 4 = a+b, a-b or a*b, a and b in [0, 99] (30000).
// The same (count, difficulty, seed) gives the same problems in the same order on every platform.
std::vector<Example> arithmetic_problems(int64_t count, int difficulty, uint64_t seed);

}  // namespace kiln::trainer
