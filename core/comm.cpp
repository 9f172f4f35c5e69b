// Collectives over MPI (CPU tensors, and CUDA tensors staged through the host when NCCL is not
// built) and NCCL (CUDA tensors, on the current stream).
#include "core/comm.h"

#include <ATen/ATen.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "core/error.h"

#if KILN_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <nccl.h>
#endif

namespace kiln::comm {
namespace {

bool g_initialized_here = false;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  KILN_FAIL("comm: ", what, " failed: ", std::string(msg, size_t(len)));
}

// The collective timeout (set_collective_timeout): what this rank is blocked in, and since when.
// A watchdog thread aborts the job when one wait outlasts the timeout, naming the rank and the call.
std::atomic<const char*> g_waiting_in{nullptr};
std::atomic<int64_t> g_waiting_since_ms{0};
std::atomic<double> g_timeout_s{0.0};

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Marks one blocking MPI call for the watchdog.
class Waiting {
 public:
  explicit Waiting(const char* what) {
    if (g_timeout_s.load() <= 0) return;
    g_waiting_since_ms = now_ms();
    g_waiting_in = what;
  }
  ~Waiting() { g_waiting_in = nullptr; }
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;
};

[[noreturn]] void watchdog(int rank) {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const char* what = g_waiting_in.load();
    const double timeout = g_timeout_s.load();
    if (!what || timeout <= 0) continue;
    const double waited = double(now_ms() - g_waiting_since_ms.load()) / 1000.0;
    if (waited <= timeout) continue;
    std::fprintf(stderr,
                 "kiln: error: comm: rank %d has waited %.0f s in %s (parallel.collective_timeout_s = %g): another "
                 "rank stopped answering or died; aborting the job\n",
                 rank, waited, what, timeout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::_Exit(3);
  }
}

// A blocking MPI call, watched: KILN_MPI(MPI_Allreduce(...), "MPI_Allreduce").
#define KILN_MPI(call, what)        \
  do {                              \
    const Waiting waiting_(what);   \
    check_mpi((call), (what));      \
  } while (0)

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kSum ? MPI_SUM : op == ReduceOp::kMax ? MPI_MAX : MPI_MIN; }

// The MPI type of a reducible dtype; bf16 and fp16 are reduced as fp32 by the caller.
MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    default: KILN_FAIL("comm: no MPI reduction for dtype ", t);
  }
}

// What MPI reduces for t: t itself, or a CPU copy for a CUDA tensor (no NCCL) or a bf16/fp16 one
// (widened to fp32, which MPI can sum), for the caller to reduce and copy back.
at::Tensor mpi_reducible(const at::Tensor& t) {
  const bool low = t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
  if (!t.is_cuda() && !low) return t;
  return t.to(at::kCPU, low ? at::kFloat : t.scalar_type()).contiguous();
}

int checked_int(int64_t n, const char* what) {
  KILN_CHECK(n >= 0 && n <= INT_MAX, "comm: ", what, " of ", n, " bytes exceeds MPI's int count; split the tensor");
  return int(n);
}

constexpr int64_t kMaxCount = int64_t(1) << 28;  // elements per MPI call in chunked collectives
constexpr int kMaxTag = 32767;  // the largest tag every MPI must accept (MPI_TAG_UB is at least this)

#if KILN_WITH_NCCL
void check_nccl(ncclResult_t rc, const char* what) {
  KILN_CHECK(rc == ncclSuccess, "comm: NCCL ", what, " failed: ", ncclGetErrorString(rc));
}
ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    default: KILN_FAIL("comm: no NCCL type for dtype ", t);
  }
}
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : op == ReduceOp::kMax ? ncclMax : ncclMin; }
#endif

}  // namespace

struct Group::Impl {
  MPI_Comm comm = MPI_COMM_NULL;  // null: a one-rank group without MPI
  bool owned = false;
#if KILN_WITH_NCCL
  ncclComm_t nccl = nullptr;
  ncclComm_t nccl_comm(int rank, int size) {
    if (!nccl) {
      ncclUniqueId id;
      if (rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      KILN_MPI(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm), "MPI_Bcast of the NCCL id");
      check_nccl(ncclCommInitRank(&nccl, size, id, rank), "ncclCommInitRank");
    }
    return nccl;
  }
#endif
  ~Impl() {
#if KILN_WITH_NCCL
    if (nccl) ncclCommDestroy(nccl);
#endif
    if (owned && active()) MPI_Comm_free(&comm);
  }
};

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"})
    if (std::getenv(var)) return true;
  return false;
}

void init(int* argc, char*** argv) {
  if (!launched_by_mpi()) return;  // a plain run: a one-rank world, no MPI singleton start-up
  int done = 0;
  MPI_Initialized(&done);
  if (done) return;
  int provided = 0;
  // SERIALIZED: the autograd engine's CUDA worker thread calls collectives in backward (the
  // expert exchange, NCCL set-up) while the main thread waits in backward().
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  KILN_CHECK(provided >= MPI_THREAD_SERIALIZED, "comm: this MPI gives thread level ", provided,
             ", kiln needs MPI_THREAD_SERIALIZED; use an MPI built with thread support");
  g_initialized_here = true;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

void finalize() {
  if (!active()) return;
  Group::world() = Group();  // release the world's NCCL communicator first
  if (g_initialized_here) MPI_Finalize();
}

bool active() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

void set_collective_timeout(double seconds) {
  KILN_CHECK(std::isfinite(seconds) && seconds >= 0, "comm: the collective timeout must be a number of seconds >= 0 "
             "(got ", seconds, ")");
  g_timeout_s = seconds;
  static std::once_flag started;
  if (seconds > 0 && active() && Group::world().size() > 1)
    std::call_once(started, [] { std::thread(watchdog, Group::world().rank()).detach(); });
}

void abort_job(int code) {
  if (active() && Group::world().size() > 1) MPI_Abort(MPI_COMM_WORLD, code);
}

Group& Group::world() {
  static Group w;
  if (!w.impl_ && active()) {
    w.impl_ = std::make_shared<Impl>();
    w.impl_->comm = MPI_COMM_WORLD;
    MPI_Comm_rank(MPI_COMM_WORLD, &w.rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &w.size_);
  }
  return w;
}

int Group::local_rank() const {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "LOCAL_RANK"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  if (!impl_ || impl_->comm == MPI_COMM_NULL) return 0;
  MPI_Comm node;
  KILN_MPI(MPI_Comm_split_type(impl_->comm, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), "node split");
  int r = 0;
  MPI_Comm_rank(node, &r);
  MPI_Comm_free(&node);
  return r;
}

Group Group::split(int color, int key) const {
  Group g;
  if (!impl_ || impl_->comm == MPI_COMM_NULL) return g;
  g.impl_ = std::make_shared<Impl>();
  KILN_MPI(MPI_Comm_split(impl_->comm, color, key, &g.impl_->comm), "MPI_Comm_split");
  g.impl_->owned = true;
  MPI_Comm_rank(g.impl_->comm, &g.rank_);
  MPI_Comm_size(g.impl_->comm, &g.size_);
  return g;
}

// CUDA tensors go through NCCL whenever it is built and MPI runs, even on one rank (so a one-GPU
// job exercises the same calls as a cluster).
bool Group::nccl_path(const at::Tensor& t) const { return KILN_WITH_NCCL && t.is_cuda() && impl_ != nullptr; }

void Group::all_reduce(at::Tensor& t, ReduceOp op) const {
  KILN_CHECK(t.is_contiguous(), "comm: all_reduce needs a contiguous tensor");
  if (size_ == 1 && !nccl_path(t)) return;
#if KILN_WITH_NCCL
  if (t.is_cuda() && impl_) {
    check_nccl(ncclAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.scalar_type()), nccl_op(op),
                             impl_->nccl_comm(rank_, size_), at::cuda::getCurrentCUDAStream()),
               "all_reduce");
    return;
  }
#endif
  if (at::Tensor host = mpi_reducible(t); !host.is_same(t)) {
    all_reduce(host, op);
    t.copy_(host);
    return;
  }
  const int64_t n = t.numel(), elem = int64_t(t.element_size());
  auto* p = static_cast<char*>(t.data_ptr());
  for (int64_t i = 0; i < n; i += kMaxCount)
    KILN_MPI(MPI_Allreduce(MPI_IN_PLACE, p + i * elem, int(std::min(kMaxCount, n - i)), mpi_type(t.scalar_type()),
                            mpi_op(op), impl_->comm),
              "MPI_Allreduce");
}

void Group::reduce(at::Tensor& t, int root, ReduceOp op) const {
  KILN_CHECK(t.is_contiguous(), "comm: reduce needs a contiguous tensor");
  KILN_CHECK(root >= 0 && root < size_, "comm: reduce root ", root, " outside the group of ", size_);
  if (size_ == 1 && !nccl_path(t)) return;
#if KILN_WITH_NCCL
  if (t.is_cuda() && impl_) {
    check_nccl(ncclReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.scalar_type()), nccl_op(op),
                          root, impl_->nccl_comm(rank_, size_), at::cuda::getCurrentCUDAStream()),
               "reduce");
    return;
  }
#endif
  if (at::Tensor host = mpi_reducible(t); !host.is_same(t)) {
    reduce(host, root, op);
    if (rank_ == root) t.copy_(host);
    return;
  }
  const int64_t n = t.numel(), elem = int64_t(t.element_size());
  auto* p = static_cast<char*>(t.data_ptr());
  for (int64_t i = 0; i < n; i += kMaxCount) {
    void* chunk = p + i * elem;
    KILN_MPI(MPI_Reduce(rank_ == root ? MPI_IN_PLACE : chunk, rank_ == root ? chunk : nullptr,
                        int(std::min(kMaxCount, n - i)), mpi_type(t.scalar_type()), mpi_op(op), root, impl_->comm),
             "MPI_Reduce");
  }
}

double Group::all_reduce(double v, ReduceOp op) const {
  if (size_ == 1) return v;
  double out = 0;
  KILN_MPI(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, mpi_op(op), impl_->comm), "MPI_Allreduce");
  return out;
}

at::Tensor Group::reduce_scatter(const at::Tensor& t, ReduceOp op) const {
  KILN_CHECK(t.dim() >= 1 && t.size(0) % size_ == 0, "comm: reduce_scatter needs dim 0 (", t.dim() ? t.size(0) : 0,
             ") divisible by the group size ", size_);
  const int64_t rows = t.size(0) / size_;
  if (size_ == 1 && !nccl_path(t)) return t.clone();
#if KILN_WITH_NCCL
  if (t.is_cuda() && impl_) {
    at::Tensor src = t.contiguous(), out = at::empty_like(src.narrow(0, 0, rows));
    check_nccl(ncclReduceScatter(src.data_ptr(), out.data_ptr(), size_t(out.numel()), nccl_type(t.scalar_type()),
                                 nccl_op(op), impl_->nccl_comm(rank_, size_), at::cuda::getCurrentCUDAStream()),
               "reduce_scatter");
    return out;
  }
#endif
  // All-reduce then keep this rank's rows: simple, and the MPI path serves small CPU runs.
  at::Tensor all = t.contiguous().clone();
  all_reduce(all, op);
  return all.narrow(0, rank_ * rows, rows).clone();
}

at::Tensor Group::all_gather(const at::Tensor& t) const {
  if (size_ == 1 && !nccl_path(t)) return t.dim() == 0 ? t.reshape({1}).clone() : t.clone();
  at::Tensor src = t.contiguous();
  std::vector<int64_t> shape = src.sizes().vec();
  if (shape.empty()) shape.push_back(1);
  const int64_t rows = shape[0];
  shape[0] = rows * size_;
#if KILN_WITH_NCCL
  if (t.is_cuda() && impl_) {
    at::Tensor out = at::empty(shape, src.options());
    check_nccl(ncclAllGather(src.data_ptr(), out.data_ptr(), size_t(src.numel()), nccl_type(t.scalar_type()),
                             impl_->nccl_comm(rank_, size_), at::cuda::getCurrentCUDAStream()),
               "all_gather");
    return out;
  }
#endif
  at::Tensor host = src.cpu(), out = at::empty(shape, host.options());
  const int bytes = checked_int(int64_t(host.nbytes()), "all_gather");
  KILN_MPI(MPI_Allgather(host.data_ptr(), bytes, MPI_BYTE, out.data_ptr(), bytes, MPI_BYTE, impl_->comm),
            "MPI_Allgather");
  return out.to(t.device());
}

at::Tensor Group::all_gather_v(const at::Tensor& t) const {
  KILN_CHECK(t.dim() >= 1, "comm: all_gather_v needs at least one dimension");
  if (size_ == 1) return t.clone();
  at::Tensor counts = all_gather(at::tensor({t.size(0)}, at::kLong));
  const int64_t most = counts.max().item<int64_t>();
  // Pad every rank's rows to the longest, gather, and drop the padding.
  std::vector<int64_t> padded_shape = t.sizes().vec();
  padded_shape[0] = most;
  at::Tensor padded = at::zeros(padded_shape, t.options());
  padded.narrow(0, 0, t.size(0)).copy_(t);
  at::Tensor all = all_gather(padded);
  std::vector<at::Tensor> parts;
  for (int r = 0; r < size_; ++r) parts.push_back(all.narrow(0, r * most, counts[r].item<int64_t>()));
  return at::cat(parts, 0);
}

void Group::broadcast(at::Tensor& t, int root) const {
  KILN_CHECK(t.is_contiguous(), "comm: broadcast needs a contiguous tensor");
  KILN_CHECK(root >= 0 && root < size_, "comm: broadcast root ", root, " outside the group of ", size_);
  if (size_ == 1 && !nccl_path(t)) return;
#if KILN_WITH_NCCL
  if (t.is_cuda() && impl_) {
    check_nccl(ncclBroadcast(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.scalar_type()), root,
                             impl_->nccl_comm(rank_, size_), at::cuda::getCurrentCUDAStream()),
               "broadcast");
    return;
  }
#endif
  if (t.is_cuda()) {
    at::Tensor host = t.cpu();
    broadcast(host, root);
    t.copy_(host);
    return;
  }
  auto* p = static_cast<char*>(t.data_ptr());
  const int64_t bytes = int64_t(t.nbytes()), step = kMaxCount;
  for (int64_t i = 0; i < bytes; i += step)
    KILN_MPI(MPI_Bcast(p + i, int(std::min(step, bytes - i)), MPI_BYTE, root, impl_->comm), "MPI_Bcast");
}

at::Tensor Group::all_to_all_v(const at::Tensor& t, const std::vector<int64_t>& send_rows,
                               std::vector<int64_t>* recv_rows) const {
  KILN_CHECK(int(send_rows.size()) == size_, "comm: all_to_all_v needs one row count per rank (", size_, "), got ",
             send_rows.size());
  // Everyone learns how many rows it receives from each rank.
  at::Tensor sc = at::tensor(send_rows, at::kLong), rc = at::empty({size_}, at::kLong);
  if (size_ == 1)
    rc.copy_(sc);
  else
    KILN_MPI(MPI_Alltoall(sc.data_ptr(), 1, MPI_INT64_T, rc.data_ptr(), 1, MPI_INT64_T, impl_->comm), "MPI_Alltoall");
  std::vector<int64_t> recv(rc.data_ptr<int64_t>(), rc.data_ptr<int64_t>() + size_);
  if (recv_rows) *recv_rows = recv;
  return all_to_all_known(t, send_rows, recv);
}

at::Tensor Group::all_to_all_known(const at::Tensor& t, const std::vector<int64_t>& send_rows,
                                   const std::vector<int64_t>& recv) const {
  KILN_CHECK(int(send_rows.size()) == size_ && int(recv.size()) == size_, "comm: all_to_all_known needs one send ",
             "and one receive row count per rank (", size_, "), got ", send_rows.size(), " and ", recv.size());
  int64_t total = 0;
  for (int64_t r : send_rows) total += r;
  KILN_CHECK(t.dim() >= 1 && total == t.size(0), "comm: all_to_all send counts add up to ", total,
             " rows but the tensor has ", t.dim() ? t.size(0) : 0);
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = 0;
  for (int64_t r : recv) shape[0] += r;
  if (size_ == 1 && !nccl_path(t)) return t.clone();
  at::Tensor src = t.contiguous();
  // From the row shape, not the row count: a rank that sends nothing still receives full rows.
  int64_t row_bytes = int64_t(src.element_size());
  for (int64_t d = 1; d < src.dim(); ++d) row_bytes *= src.size(d);
#if KILN_WITH_NCCL
  if (t.is_cuda() && impl_) {
    at::Tensor out = at::empty(shape, src.options());
    ncclComm_t c = impl_->nccl_comm(rank_, size_);
    auto stream = at::cuda::getCurrentCUDAStream();
    int64_t so = 0, ro = 0;
    check_nccl(ncclGroupStart(), "group start");
    for (int j = 0; j < size_; ++j) {
      if (send_rows[size_t(j)])
        check_nccl(ncclSend(static_cast<char*>(src.data_ptr()) + so * row_bytes, size_t(send_rows[size_t(j)] * row_bytes),
                            ncclUint8, j, c, stream), "send");
      if (recv[size_t(j)])
        check_nccl(ncclRecv(static_cast<char*>(out.data_ptr()) + ro * row_bytes, size_t(recv[size_t(j)] * row_bytes),
                            ncclUint8, j, c, stream), "recv");
      so += send_rows[size_t(j)];
      ro += recv[size_t(j)];
    }
    check_nccl(ncclGroupEnd(), "group end");
    return out;
  }
#endif
  at::Tensor host = src.cpu(), out = at::empty(shape, host.options());
  const size_t ranks = size_t(size_);
  std::vector<int> scount(ranks), sdispl(ranks), rcount(ranks), rdispl(ranks);
  int64_t so = 0, ro = 0;
  for (int j = 0; j < size_; ++j) {
    scount[size_t(j)] = checked_int(send_rows[size_t(j)] * row_bytes, "all_to_all_v send");
    rcount[size_t(j)] = checked_int(recv[size_t(j)] * row_bytes, "all_to_all_v receive");
    sdispl[size_t(j)] = checked_int(so, "all_to_all_v offset");
    rdispl[size_t(j)] = checked_int(ro, "all_to_all_v offset");
    so += scount[size_t(j)];
    ro += rcount[size_t(j)];
  }
  KILN_MPI(MPI_Alltoallv(host.data_ptr(), scount.data(), sdispl.data(), MPI_BYTE, out.data_ptr(), rcount.data(),
                          rdispl.data(), MPI_BYTE, impl_->comm),
            "MPI_Alltoallv");
  return out.to(t.device());
}

struct Work::State {
  MPI_Request request = MPI_REQUEST_NULL;
  at::Tensor keep;  // the buffer MPI writes into: alive until the request completes
  ~State() {
    if (request != MPI_REQUEST_NULL && active()) MPI_Wait(&request, MPI_STATUS_IGNORE);  // never free it mid-flight
  }
};

void Work::wait() {
  if (!state_) return;
  KILN_MPI(MPI_Wait(&state_->request, MPI_STATUS_IGNORE), "MPI_Wait");
  state_.reset();
}

Work Group::all_reduce_async(at::Tensor& t) const {
  Work w;
  const bool mpi_async = size_ > 1 && t.is_cpu() && t.is_contiguous() &&
                         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble) &&
                         t.numel() <= kMaxCount;
  if (!mpi_async) {
    all_reduce(t);  // NCCL is asynchronous on its stream already; the rest is small or rare
    return w;
  }
  w.state_ = std::make_shared<Work::State>();
  w.state_->keep = t;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), int(t.numel()), mpi_type(t.scalar_type()), MPI_SUM,
                           impl_->comm, &w.state_->request),
            "MPI_Iallreduce");
  return w;
}

void Group::send_bytes(const at::Tensor& bytes, int dst, int tag, bool watched) const {
  KILN_CHECK(bytes.is_cpu() && bytes.is_contiguous() && bytes.scalar_type() == at::kByte && bytes.dim() == 1,
             "comm: send_bytes takes a contiguous CPU uint8 vector (got ", bytes.scalar_type(), " ", bytes.sizes(),
             " on ", bytes.device(), ")");
  KILN_CHECK(size_ > 1 && dst >= 0 && dst < size_ && dst != rank_, "comm: send_bytes to rank ", dst,
             " of a group of ", size_, " from rank ", rank_);
  KILN_CHECK(tag >= 0 && tag <= kMaxTag, "comm: send_bytes tag ", tag, " outside [0, ", kMaxTag, "]");
  int64_t n = bytes.numel();
  // Unwatched, the size and the first chunk may wait for the receiver (a large send does not
  // return before its receive is posted); the chunks after it may not.
  const auto send = [&](const void* p, int count, MPI_Datatype type, bool timed, const char* what) {
    if (timed) KILN_MPI(MPI_Send(p, count, type, dst, tag, impl_->comm), what);
    else check_mpi(MPI_Send(p, count, type, dst, tag, impl_->comm), what);
  };
  send(&n, 1, MPI_INT64_T, watched, "MPI_Send of a size");
  const auto* p = static_cast<const char*>(bytes.data_ptr());
  for (int64_t i = 0; i < n; i += kMaxCount)  // a pair's messages under one tag arrive in order
    send(p + i, int(std::min(kMaxCount, n - i)), MPI_BYTE, watched || i > 0, "MPI_Send");
}

at::Tensor Group::recv_bytes(int src, int tag, bool watched) const {
  at::Tensor buffer = at::empty({0}, at::TensorOptions().dtype(at::kByte));
  return recv_bytes_into(buffer, src, tag, watched);
}

at::Tensor Group::recv_bytes_into(at::Tensor& buffer, int src, int tag, bool watched) const {
  KILN_CHECK(size_ > 1 && src >= 0 && src < size_ && src != rank_, "comm: recv_bytes from rank ", src,
             " of a group of ", size_, " at rank ", rank_);
  KILN_CHECK(tag >= 0 && tag <= kMaxTag, "comm: recv_bytes tag ", tag, " outside [0, ", kMaxTag, "]");
  KILN_CHECK(buffer.defined() && buffer.is_cpu() && buffer.scalar_type() == at::kByte && buffer.dim() == 1 &&
                 buffer.is_contiguous(),
             "comm: recv_bytes_into takes a contiguous CPU uint8 vector");
  int64_t n = 0;
  if (watched) KILN_MPI(MPI_Recv(&n, 1, MPI_INT64_T, src, tag, impl_->comm, MPI_STATUS_IGNORE), "MPI_Recv of a size");
  else check_mpi(MPI_Recv(&n, 1, MPI_INT64_T, src, tag, impl_->comm, MPI_STATUS_IGNORE), "MPI_Recv of a size");
  KILN_CHECK(n >= 0, "comm: recv_bytes from rank ", src, " announced ", n, " bytes");
  if (buffer.numel() < n) buffer = at::empty({n}, buffer.options().pinned_memory(buffer.is_pinned()));
  at::Tensor out = buffer.narrow(0, 0, n);
  auto* p = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; i += kMaxCount)
    KILN_MPI(MPI_Recv(p + i, int(std::min(kMaxCount, n - i)), MPI_BYTE, src, tag, impl_->comm, MPI_STATUS_IGNORE),
             "MPI_Recv");
  return out;
}

void Group::barrier() const {
  if (size_ > 1) KILN_MPI(MPI_Barrier(impl_->comm), "MPI_Barrier");
}

}  // namespace kiln::comm
