// The collectives at whatever world size mpirun gives (ctest runs 2 and 4 ranks): each result is
// checked against the value every rank can compute on its own.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/comm.h"
#include "tests/test_util.h"
#include "tests/trainer/produced_fixture.h"

#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace kiln::comm {
namespace {

// Rank r's contribution: a deterministic function of (r, shape).
at::Tensor part(int r, std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(100 + r);
  return at::randn(shape, g).to(dtype);
}

TEST(Comm, AllReduceSumMaxMinInEveryDtype) {
  const Group& w = Group::world();
  for (at::ScalarType dt : {at::kFloat, at::kDouble, at::kBFloat16}) {
    for (int64_t n : {1, 19, 111, 4097}) {
      at::Tensor mine = part(w.rank(), {n}, dt), sum = at::zeros({n}, at::kDouble), mx = part(0, {n}, at::kDouble);
      for (int r = 0; r < w.size(); ++r) {
        sum += part(r, {n}, dt).to(at::kDouble);
        mx = at::maximum(mx, part(r, {n}, dt).to(at::kDouble));
      }
      at::Tensor t = mine.clone();
      w.all_reduce(t);
      const double tol = dt == at::kBFloat16 ? 2e-2 : 1e-6;
      EXPECT_TRUE(test::all_close(t.to(at::kDouble), sum, tol, tol)) << dt << " n=" << n;
      at::Tensor m = mine.clone();
      w.all_reduce(m, ReduceOp::kMax);
      EXPECT_TRUE(test::all_equal(m.to(at::kDouble), mx.to(dt).to(at::kDouble))) << dt << " n=" << n;
    }
  }
  at::Tensor ids = at::full({3}, int64_t(w.rank()));
  w.all_reduce(ids, ReduceOp::kMin);
  EXPECT_TRUE(test::all_equal(ids, at::zeros({3}, at::kLong)));
  EXPECT_EQ(w.all_reduce(double(w.rank() + 1)), w.size() * (w.size() + 1) / 2.0);
}

TEST(Comm, ReduceScatterAllGatherBroadcast) {
  const Group& w = Group::world();
  const int S = w.size();
  at::Tensor rs = w.reduce_scatter(part(w.rank(), {S * 19, 3}));
  at::Tensor expect = at::zeros({S * 19, 3});
  for (int r = 0; r < S; ++r) expect += part(r, {S * 19, 3});
  EXPECT_TRUE(test::all_close(rs, expect.narrow(0, w.rank() * 19, 19), 1e-6, 1e-6));

  at::Tensor ag = w.all_gather(part(w.rank(), {5, 7}));
  std::vector<at::Tensor> parts;
  for (int r = 0; r < S; ++r) parts.push_back(part(r, {5, 7}));
  EXPECT_TRUE(test::all_equal(ag, at::cat(parts, 0)));

  // Ragged: rank r gives r + 1 rows.
  at::Tensor agv = w.all_gather_v(part(w.rank(), {w.rank() + 1, 2}));
  parts.clear();
  for (int r = 0; r < S; ++r) parts.push_back(part(r, {r + 1, 2}));
  EXPECT_TRUE(test::all_equal(agv, at::cat(parts, 0)));

  at::Tensor b = part(w.rank(), {4097});
  w.broadcast(b, S - 1);
  EXPECT_TRUE(test::all_equal(b, part(S - 1, {4097})));
}

TEST(Comm, ReduceToOneRootInEveryDtype) {
  const Group& w = Group::world();
  const int S = w.size();
  for (at::ScalarType dt : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong}) {
    for (int root : {0, S - 1}) {
      at::Tensor t = part(w.rank(), {111}).mul(8).round().to(dt);  // integers: every order sums exactly
      w.reduce(t, root);
      at::Tensor expect = at::zeros({111});
      for (int r = 0; r < S; ++r) expect += part(r, {111}).mul(8).round();
      if (w.rank() == root) EXPECT_TRUE(test::all_equal(t.to(at::kDouble), expect.to(at::kDouble))) << dt << " root " << root;
    }
  }
}

TEST(Comm, AllToAllVRoutesRowsAndSplitsGroups) {
  const Group& w = Group::world();
  const int S = w.size(), me = w.rank();
  // Rank r sends (r + j) % 3 rows to rank j; row values encode (sender, receiver, index).
  auto rows_from_to = [](int r, int j) { return int64_t((r + j) % 3); };
  std::vector<int64_t> send;
  std::vector<at::Tensor> blocks;
  for (int j = 0; j < S; ++j) {
    send.push_back(rows_from_to(me, j));
    blocks.push_back(at::arange(rows_from_to(me, j), at::kFloat).unsqueeze(1).repeat({1, 2}) + 100.0 * me + 10.0 * j);
  }
  std::vector<int64_t> got;
  at::Tensor out = w.all_to_all_v(at::cat(blocks, 0), send, &got);
  std::vector<at::Tensor> expect;
  for (int r = 0; r < S; ++r) {
    EXPECT_EQ(got[size_t(r)], rows_from_to(r, me));
    expect.push_back(at::arange(rows_from_to(r, me), at::kFloat).unsqueeze(1).repeat({1, 2}) + 100.0 * r + 10.0 * me);
  }
  EXPECT_TRUE(test::all_equal(out, at::cat(expect, 0)));
  EXPECT_TRUE(test::throws_with([&] { w.all_to_all_v(at::zeros({1, 2}), std::vector<int64_t>(size_t(S), 5)); },
                                {"add up to"}));
  // With the counts known on both sides (no count exchange), the same rows arrive.
  EXPECT_TRUE(test::all_equal(w.all_to_all_known(at::cat(blocks, 0), send, got), out));
  EXPECT_TRUE(test::throws_with([&] { w.all_to_all_known(at::zeros({1, 2}), send, {}); }, {"one send and one receive"}));

  // Rank 0 sends nothing at all but still receives whole rows from everyone else.
  std::vector<int64_t> send2(size_t(S), me == 0 ? 0 : 2);
  at::Tensor rows = at::full({me == 0 ? 0 : 2 * S, 3}, double(me));
  std::vector<int64_t> got2;
  at::Tensor out2 = w.all_to_all_v(rows, send2, &got2);
  std::vector<at::Tensor> expect2;
  for (int r = 1; r < S; ++r) expect2.push_back(at::full({2, 3}, double(r)));
  EXPECT_TRUE(test::all_equal(out2, expect2.empty() ? at::empty({0, 3}) : at::cat(expect2, 0)))
      << "rank " << me;  // one rank: nothing at all

  // Split into even and odd ranks: each sub-group reduces only its own members.
  Group half = w.split(me % 2, me);
  at::Tensor t = at::full({2}, double(me));
  half.all_reduce(t);
  double expect_sum = 0;
  for (int r = me % 2; r < S; r += 2) expect_sum += r;
  EXPECT_TRUE(test::all_equal(t, at::full({2}, expect_sum)));
  EXPECT_EQ(half.size(), (S - me % 2 + 1) / 2);
}

#if KILN_WITH_CUDA
// CUDA tensors go through NCCL (when built): each rank needs a GPU of its own, so on the one-GPU
// machine this runs at one rank (ctest kiln_mpi_np1_cuda), which still exercises every NCCL call.
TEST(Comm, CudaTensorsGiveTheCpuResults) {
  const Group& w = Group::world();
  if (!at::hasCUDA() || c10::cuda::device_count() < w.size()) GTEST_SKIP() << "needs a GPU per rank";
  c10::cuda::set_device(c10::DeviceIndex(w.local_rank()));
  const at::Device gpu(at::kCUDA, c10::DeviceIndex(w.local_rank()));
  const int S = w.size();
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t n : {1, 19, 111, 4097}) {
      at::Tensor cpu = part(w.rank(), {S * n}, dt), dev = cpu.to(gpu);
      w.all_reduce(cpu);
      w.all_reduce(dev);
      EXPECT_TRUE(test::all_close(dev.cpu().to(at::kFloat), cpu.to(at::kFloat), 1e-2, 1e-2)) << dt << " " << n;
      at::Tensor src = part(w.rank(), {S * n}, dt);
      EXPECT_TRUE(test::all_close(w.reduce_scatter(src.to(gpu)).cpu().to(at::kFloat),
                                  w.reduce_scatter(src).to(at::kFloat), 1e-2, 1e-2)) << dt << " " << n;
      EXPECT_TRUE(test::all_equal(w.all_gather(src.to(gpu)).cpu(), w.all_gather(src))) << dt << " " << n;
      at::Tensor b = src.to(gpu);
      w.broadcast(b, 0);
      at::Tensor bc = src.clone();
      w.broadcast(bc, 0);
      EXPECT_TRUE(test::all_equal(b.cpu(), bc)) << dt << " " << n;
      at::Tensor r = src.to(gpu), rc = src.clone();
      w.reduce(r, S - 1);
      w.reduce(rc, S - 1);
      if (w.rank() == S - 1)
        EXPECT_TRUE(test::all_close(r.cpu().to(at::kFloat), rc.to(at::kFloat), 1e-2, 1e-2)) << dt << " " << n;
      std::vector<int64_t> send(size_t(S), n);
      EXPECT_TRUE(test::all_equal(w.all_to_all_v(src.view({S * n, 1}).to(gpu), send).cpu(),
                                  w.all_to_all_v(src.view({S * n, 1}), send)))
          << dt << " " << n;
      EXPECT_TRUE(test::all_equal(w.all_to_all_known(src.view({S * n, 1}).to(gpu), send, send).cpu(),
                                  w.all_to_all_v(src.view({S * n, 1}), send)))
          << dt << " " << n;
    }
  }
}
#endif

// Point to point: every other rank sends rank 0 an empty message, a rolled-out batch (what a
// rollout rank hands its trainer) and a message of its own size, in that order under one tag; rank
// 0 gets each back equal and in order, also into a buffer of its own (grown once, then reused).
// A one-rank group refuses both sides.
TEST(Comm, BytesGoPointToPointInOrder) {
  const Group& w = Group::world();
  if (w.size() == 1) {
    EXPECT_TRUE(test::throws_with([&] { w.recv_bytes(0, 7); }, {"recv_bytes", "group of 1"}));
    return;
  }
  auto own = [](int r) { return (at::arange(1000 * r + 3, at::kLong) * 7 + r).remainder(251).to(at::kByte); };
  if (w.rank() > 0) {
    w.send_bytes(at::empty({0}, at::kByte), 0, 7);
    ByteWriter b;
    trainer::write_produced(b, test::produced_fixture(w.rank()));
    w.send_bytes(b.tensor(), 0, 7);
    w.send_bytes(own(w.rank()), 0, 7);
    w.send_bytes(own(w.rank()), 0, 7);  // into a buffer that must grow
    w.send_bytes(own(w.rank()).narrow(0, 0, 5).clone(), 0, 7);  // into the same buffer, not grown
  } else {
    for (int r = 1; r < w.size(); ++r) {
      EXPECT_EQ(w.recv_bytes(r, 7).numel(), 0);
      const at::Tensor bytes = w.recv_bytes(r, 7);
      ByteReader reader(bytes.data_ptr<uint8_t>(), size_t(bytes.numel()), "the batch from rank " + std::to_string(r));
      test::expect_same_produced(trainer::read_produced(reader), test::produced_fixture(r));
      reader.expect_end();
      EXPECT_TRUE(at::equal(w.recv_bytes(r, 7), own(r))) << "rank " << r;
      at::Tensor buffer = at::empty({10}, at::kByte);
      EXPECT_TRUE(at::equal(w.recv_bytes_into(buffer, r, 7), own(r))) << "rank " << r;
      EXPECT_GE(buffer.numel(), own(r).numel());
      const void* kept = buffer.data_ptr();
      EXPECT_TRUE(at::equal(w.recv_bytes_into(buffer, r, 7), own(r).narrow(0, 0, 5))) << "rank " << r;
      EXPECT_EQ(buffer.data_ptr(), kept) << "a message that fits reuses the buffer";
    }
  }
  EXPECT_TRUE(test::throws_with([&] { w.send_bytes(own(1), w.rank(), 7); }, {"send_bytes", "to rank"}));
  w.barrier();
}

// Unwatched point to point (a rollout rank's side of its link): a send whose receiver comes 2.5 s
// late, and a receive whose sender does, under a 1 s collective timeout, do not end the job; a
// watched one would (the watchdog aborts every rank, which fails the run). 64 MiB: MPI hands such a
// message over only once its receive is posted.
TEST(Comm, UnwatchedBytesMayWaitPastTheTimeout) {
  const Group& w = Group::world();
  if (w.size() < 2 || w.rank() > 1) {
    w.barrier();
    return;
  }
  const at::Tensor big = at::arange(64 << 20, at::kLong).remainder(253).to(at::kByte);
  comm::set_collective_timeout(1.0);
  if (w.rank() == 0) {
    w.send_bytes(big, 1, 11, /*watched=*/false);  // rank 1 is asleep
    const at::Tensor back = w.recv_bytes(1, 12, /*watched=*/false);  // rank 1 sleeps again first
    EXPECT_TRUE(at::equal(back, big.narrow(0, 0, 1000)));
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    EXPECT_TRUE(at::equal(w.recv_bytes(0, 11), big));
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    w.send_bytes(big.narrow(0, 0, 1000).clone(), 0, 12);
  }
  comm::set_collective_timeout(0);
  w.barrier();
}

}  // namespace
}  // namespace kiln::comm
