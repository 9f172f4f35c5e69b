// A produced batch's rewards made into GRPO's group advantages, with the step's reward metrics
// summed over every rank; the rule for a correct sample and the keyed sums evaluation shares.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/comm.h"
#include "trainer/grpo_config.h"
#include "trainer/grpo_metrics.h"
#include "trainer/produced.h"

namespace kiln::trainer {

// A sample is correct when its "correct" component, or without one its reward, is at least 0.5.
bool is_correct(const RewardResult& r);

// Sums under names that may differ between ranks (reward components, data sources): each rank's
// map, added up key by key over every rank (collective).
using KeyedSums = std::map<std::string, std::vector<double>>;
KeyedSums all_reduce_keyed(const comm::Group& g, const KeyedSums& mine);

// The trajectories of `p` with their shaped rewards and advantages; fills the reward, length,
// worker and rollout-engine metrics of `m` over every rank (collective) and `samples` with this
// rank's samples for the dump. Throws on every rank alike when more of the batch's samples (all
// ranks) failed than the reward's or environment's max_failure_fraction allows.
std::vector<Trajectory> finish_rewards(ProducedBatch p, const GrpoConfig& cfg, const comm::Group& group,
                                       StepMetrics& m, std::vector<SampleRecord>& samples);

}  // namespace kiln::trainer
