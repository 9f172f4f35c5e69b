// The parallel layout of a job and data parallelism for the trainers: dp x ep (and the dense
// sharding), gradient all-reduce in buckets, and ZeRO-1 ownership (each rank keeps the optimizer
// state of whole tensors, so Muon's matrices are never split) with a broadcast after the step.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "core/yaml_fwd.h"
#include "optimizers/optimizer.h"

namespace kiln::parallel {

class Zero3;

// How the dense part (attention, latent projections, router, norms, embedding and head) is held.
enum class DenseSharding {
  kReplicated,  // every rank holds it whole, with its gradients; ZeRO-1 optimizer state
  kZero3,       // parameters, gradients and state sharded over all ranks, a layer gathered at a time
  kTensor,      // attention heads, latent projections and the vocabulary split over tp ranks of a node
};
const char* dense_sharding_name(DenseSharding d);
DenseSharding parse_dense_sharding(const std::string& name);  // replicated | zero3 | tp

// Where the rollout engine's experts live under expert parallelism: a full replica on every rank
// (gathered after each step), or each rank's own shard (the group's engines step in lockstep).
// kAuto (the default): `kiln train` takes a replica where its memory plan says one fits, the shard
// where only that fits (trainer/plan.h); anything else reading the config treats it as a replica.
enum class RolloutPlacement { kAuto, kReplica, kSharded };
RolloutPlacement parse_rollout_placement(const std::string& name);  // "auto", "replica" or "sharded"
const char* rollout_placement_name(RolloutPlacement p);

struct ParallelConfig {
  std::optional<int64_t> dp;  // copies of each expert shard; unset (the recipe's 0): world size / ep (resolve)
  int64_t ep = 1;  // expert-parallel ranks
  // Context-parallel ranks (parallel/context_parallel.h): each packed micro-batch's tokens are split
  // over cp consecutive ranks, which train the trajectories all of them rolled out. cp folds over
  // dp x ep (it divides the world; a cp group's ranks may hold different experts, to which they
  // send their own tokens), so the data shards are world / cp.
  int64_t cp = 1;
  int64_t tp = 1;  // reserved: must be 1
  RolloutPlacement rollout = RolloutPlacement::kAuto;  // kSharded needs ep > 1
  // The dense part (and at ep = 1 the experts too): replicated with ZeRO-1 optimizer state, or
  // ZeRO-3 (parallel/zero3.h: each tensor whole on one rank, gathered a layer at a time, the layers
  // recomputed in the backward; sharded engines get the dense part from its owners after each
  // step). tp is planned (`kiln plan`) but not implemented.
  DenseSharding dense = DenseSharding::kReplicated;
  bool zero3() const { return dense == DenseSharding::kZero3; }
  // A blocking MPI collective that waits longer aborts the job naming the rank and the call
  // (comm::set_collective_timeout); 0 = wait forever. Long enough for rank 0's checkpoint writes.
  double collective_timeout_s = 1800;
  bool sharded_rollout() const { return rollout == RolloutPlacement::kSharded; }
  // Sets dp when unset and checks dp * ep == world, cp | world, ep | num_experts, tp == 1, rollout,
  // dense. Errors list every value.
  void resolve(int64_t world, int64_t num_experts);
  std::string describe() const;
};

// A recipe's parallel: section (parallel/parallel_yaml.cpp, docs/CONFIG.md): reads and checks every
// key, then finishes the section (an unknown key is an error at its file and line).
void read_yaml(yaml::MapReader& m, ParallelConfig& c);
void write_yaml(YAML::Emitter& e, const ParallelConfig& c);

// Sums every gradient over `group` (undefined gradients count as zeros and become defined),
// flattened into buckets of at most bucket_bytes per dtype. A one-rank group does nothing.
void all_reduce_grads(const comm::Group& group, const std::vector<at::Tensor>& params,
                      int64_t bucket_bytes = 32ll << 20);

// Sums gradients over a group while the last backward of a step runs. The parameters are cut into
// fixed buckets in reverse order (the order backward produces gradients); a hook on each parameter
// copies its gradient (plus what earlier micro-batches accumulated in .grad) into its bucket, and a
// bucket's asynchronous all-reduce starts once all its gradients are in and every earlier bucket
// has started, so every rank starts them in the same order. finish() starts the rest (parameters
// without a gradient this time count as their .grad or zero), waits, and writes the sums to .grad.
// Only for groups whose ranks issue no other collectives during backward: the start times differ
// between ranks (a rank whose experts got no tokens starts their buckets in finish()), so mixing
// in, e.g., the expert exchange could order collectives differently on different ranks.
class OverlappedGradReducer {
 public:
  OverlappedGradReducer(const comm::Group& group, std::vector<at::Tensor> params, int64_t bucket_bytes = 32ll << 20);
  ~OverlappedGradReducer();
  OverlappedGradReducer(const OverlappedGradReducer&) = delete;
  OverlappedGradReducer& operator=(const OverlappedGradReducer&) = delete;
  void arm();     // before the last backward of the step
  void finish();  // after it
  int64_t buckets_started_in_backward() const { return started_in_backward_; }

 private:
  struct Bucket {
    std::vector<size_t> members;  // indices into params_
    std::vector<int64_t> offsets; // element offset of each member in `flat`
    at::Tensor flat;
    int64_t ready = 0;
    comm::Work work;
  };
  void on_grad(size_t param, const at::Tensor& grad);
  void start_ready();
  comm::Group group_;  // a handle: shares the communicator
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> where_;  // param -> (bucket, member)
  std::vector<bool> seen_;
  std::vector<unsigned> hooks_;
  size_t next_ = 0;  // the first bucket not started
  bool armed_ = false;
  int64_t started_in_backward_ = 0;
};

// The global gradient norm when expert shards differ between the ranks of `experts` (each expert
// counted once) and ZeRO-3's tensors have their gradient on their owner alone (zero3, if given),
// and clipping of every gradient to max_norm (0: only measure). Returns the norm.
double clip_grads_expert_parallel(const std::vector<at::Tensor>& params, const std::vector<bool>& is_expert,
                                  const comm::Group& experts, double max_norm, const Zero3* zero3 = nullptr);

// ZeRO-1 with whole tensors (Muon never sees a slice): each tensor's owner keeps its optimizer
// state, steps it and broadcasts it. Expert shards (is_expert, ep > 1) are owned among the ranks
// holding the same shard (`expert_copies`), every other tensor among all ranks of `all`.
class ZeroOne {
 public:
  // is_expert: one flag per tensor, or empty (no expert shards).
  // zero3: the tensors it shards (ZeRO-3 over `all`) keep its owners; their gradients are
  // already summed on the owner by the backward and their values stay there (no broadcast).
  ZeroOne(const std::vector<std::pair<std::string, at::Tensor>>& named, const std::vector<bool>& is_expert,
          const comm::Group& all, const comm::Group& expert_copies, optimizers::OptimizerConfig cfg,
          const Zero3* zero3 = nullptr);
  optimizers::Optimizer* optimizer() const { return opt_.get(); }  // null when this rank owns nothing
  void set_lr_factor(double factor) {
    if (opt_) opt_->set_lr_factor(factor);
  }
  // Sums each kind's gradients over its group (blocking, bucketed); ZeRO-3's are summed already.
  void all_reduce_grads() const;
  // The owners step; then every rank gets every tensor from its owner.
  void step();

 private:
  struct Kind {
    comm::Group group;
    std::vector<at::Tensor> params;
    std::vector<int> owners;  // rank in `group`, per entry of params
  };
  std::array<Kind, 3> kinds_;  // replicated, expert shards, ZeRO-3 (reduced in the backward, never broadcast)
  std::unique_ptr<optimizers::Optimizer> opt_;
};

// The ZeRO-1 owner rank of each parameter: largest first, each to the least-loaded rank
// (the rule ZeRO-3 shares: zero_owners over element counts, parallel/zero3.h).
std::vector<int> zero_owners(const std::vector<at::Tensor>& params, int ranks);

// After the owners' optimizer steps: every rank gets every parameter from its owner.
void broadcast_from_owners(const comm::Group& group, const std::vector<at::Tensor>& params,
                           const std::vector<int>& owners);

}  // namespace kiln::parallel
