// A rolled-out batch as the GRPO trainer consumes it: a step's prompts (this rank's share), their
// sampled and scored trajectories and the rollout's counters, and its byte encoding for moving it
// between ranks (core/bytes.h), so that rollout and training can run on different processes.
#pragma once
#include <cstdint>
#include <vector>

#include "core/bytes.h"
#include "trainer/dataset.h"
#include "trainer/rewards.h"
#include "trainer/scoring.h"

namespace kiln::trainer {

// A step's prompts: every rank draws the same ones and takes its contiguous share, so that
// sampling seeds can use global indices.
struct PromptBatch {
  std::vector<Example> prompts;  // this rank's
  int64_t total = 0, first = 0;  // prompts in all; the global index of prompts[0]
  int64_t step = 0;              // the step it is drawn for (sampling seeds)
};

// A batch rolled out and scored on one rank alone (no collective: under grpo.async a producer
// thread makes them), waiting for the trainer's finish_rewards.
struct ProducedBatch {
  PromptBatch batch;
  std::vector<Trajectory> trajs;
  std::vector<RewardRequest> reqs;    // what the metrics and the sample dump read
  std::vector<RewardResult> results;
  std::vector<double> lengths;        // drawn tokens per sample
  RewardStats worker;                 // the reward's or environment's counters over this batch
  double rollout_seconds = 0, reward_seconds = 0;
  double wait_seconds = 0;            // how long the producer waited for its weights before it (async)
  double turns = 0, observed = 0;     // episodes: sums of turns and observation tokens
  int64_t preemptions = 0;            // the engine's preemptions while sampling it
  int64_t expert_overflow_steps = 0;  // its graph steps a sharded engine redid (EngineStats)
  double kv_peak = 0;                 // the fullest KV pool's peak use while sampling it (fraction)
  int64_t version = 0;                // the engine's weight version it was sampled with
  uint64_t data_position = 0;         // the data stream's position before its prompts (async)
  double sync_check = -1;             // split ranks: the probe check of the weights it was sampled with
};

// One trajectory's fields, in order; read_trajectory gives back an equal one (routing on the CPU).
void write_trajectory(ByteWriter& w, const Trajectory& t);
Trajectory read_trajectory(ByteReader& r);

// Every field, in order; read_produced gives back an equal batch (tensors on the CPU).
void write_produced(ByteWriter& w, const ProducedBatch& p);
ProducedBatch read_produced(ByteReader& r);

// The batches a rollout made ahead of the trainer under grpo.async and the trainer has not taken,
// as a checkpoint keeps them: a resumed run trains them first, as the uninterrupted run would have
// (they were sampled with weights older than the checkpoint's).
struct BatchesAhead {
  int64_t max_staleness = 0;   // the schedule they were made under
  uint64_t next_position = 0;  // the data stream's position after the last of them
  std::vector<ProducedBatch> batches;
};
void write_ahead(ByteWriter& w, const BatchesAhead& a);
BatchesAhead read_ahead(ByteReader& r);

}  // namespace kiln::trainer
