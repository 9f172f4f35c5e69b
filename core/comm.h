// Process groups and collectives (issue 6): MPI moves CPU tensors and bootstraps everything, NCCL
// moves CUDA tensors (its unique id broadcast over MPI). Without mpirun the world has one rank.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace kiln::comm {

enum class ReduceOp { kSum, kMax, kMin };

// A collective in flight (all_reduce_async); wait() before reading the tensor. Keeps the tensor
// alive. A default Work is already done.
class Work {
 public:
  void wait();
  bool pending() const { return state_ != nullptr; }

 private:
  friend class Group;
  struct State;
  std::shared_ptr<State> state_;
};

// MPI for this process (thread level SERIALIZED): call once from main; a process that never calls
// it has a one-rank world and every collective is a copy.
// Does nothing unless launched by mpirun or srun (their environment variables are set).
void init(int* argc, char*** argv);
void finalize();
bool active();  // init ran and finalize did not
// Ends every rank of the job now (MPI_Abort) when there is more than one; else returns.
void abort_job(int code);
// From now on a blocking MPI call (every collective of Group over MPI) that waits longer than
// `seconds` prints which rank waited how long in which call and aborts the job; 0 turns it off.
// NCCL work is asynchronous and not watched here. Starts a watchdog thread once (multi-rank jobs).
void set_collective_timeout(double seconds);

class Group {
 public:
  static Group& world();
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The rank among the processes on this node (OMPI/SLURM variables, else a shared-memory split,
  // which is collective: then every rank must call it): the CUDA device a GPU rank uses.
  int local_rank() const;
  // Sub-groups: ranks with the same color, ordered by key.
  Group split(int color, int key) const;

  // In place, every rank gets the reduction. fp32, fp64, bf16, fp16 (bf16/fp16 reduce in fp32 on
  // the MPI path), int8/uint8/int32/int64; int16 on MPI only.
  void all_reduce(at::Tensor& t, ReduceOp op = ReduceOp::kSum) const;
  double all_reduce(double v, ReduceOp op = ReduceOp::kSum) const;
  // Sum in place without waiting: MPI_Iallreduce for fp32/fp64 CPU tensors, NCCL on the current
  // stream for CUDA ones (ordered with later work on that stream); otherwise done at once. Every
  // rank must start the same collectives in the same order.
  Work all_reduce_async(at::Tensor& t) const;
  // In place on `root`, which alone gets the reduction (ZeRO-3's gradients to their owner); the
  // other ranks' t is left unspecified. Same dtypes as all_reduce.
  void reduce(at::Tensor& t, int root, ReduceOp op = ReduceOp::kSum) const;
  // t's dim 0 is size()*n: rank r gets the reduction of rows [r*n, (r+1)*n).
  at::Tensor reduce_scatter(const at::Tensor& t, ReduceOp op = ReduceOp::kSum) const;
  // Every rank gives a tensor of the same shape; the result concatenates them along dim 0 by rank.
  at::Tensor all_gather(const at::Tensor& t) const;
  // Like all_gather, but dim 0 may differ per rank.
  at::Tensor all_gather_v(const at::Tensor& t) const;
  void broadcast(at::Tensor& t, int root) const;
  // Rows [sum(send_rows[:j]), +send_rows[j]) of t go to rank j; the result holds the rows every
  // rank sent here, in rank order. recv_rows (if given) receives how many came from each rank.
  at::Tensor all_to_all_v(const at::Tensor& t, const std::vector<int64_t>& send_rows,
                          std::vector<int64_t>* recv_rows = nullptr) const;
  // all_to_all_v with the counts agreed beforehand: recv_rows[j] rows come from rank j, which must
  // send exactly that many. No count exchange and no host sync: over NCCL, a CUDA graph captures it.
  at::Tensor all_to_all_known(const at::Tensor& t, const std::vector<int64_t>& send_rows,
                              const std::vector<int64_t>& recv_rows) const;
  void barrier() const;
  // Point to point, blocking (and watched like the collectives): `bytes` (a contiguous CPU uint8
  // tensor, any size) to rank `dst` of this group under `tag` (0 to 32767); recv_bytes returns what
  // rank `src` sent under `tag`, in the order sent. A one-rank group has no one to talk to: both
  // throw. Two ranks sending to each other at once may block each other (a large send waits for its
  // receive), and under MPI's SERIALIZED threading only one thread may be in MPI at a time.
  // `watched` false: the wait for the message to begin is not timed (a rank that idles until
  // another has work for it, or whose message waits until the other is ready for it); its bytes are.
  void send_bytes(const at::Tensor& bytes, int dst, int tag, bool watched = true) const;
  at::Tensor recv_bytes(int src, int tag, bool watched = true) const;
  // recv_bytes into `buffer` (a CPU uint8 vector, grown with its own options, pinned ones
  // included, when too small): returns its first bytes, valid until the buffer's next use.
  at::Tensor recv_bytes_into(at::Tensor& buffer, int src, int tag, bool watched = true) const;

 private:
  bool nccl_path(const at::Tensor& t) const;
  struct Impl;
  std::shared_ptr<Impl> impl_;
  int rank_ = 0, size_ = 1;
};

}  // namespace kiln::comm
