// GPU decode against its references: the paged-attention and sampling kernels on odd sizes in
// fp32 and bf16, and the rollout engine on CUDA (bf16 CUDA-graph decode, fp32 eager decode)
// against the full forward, including in-place weight updates under captured graphs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/paged_attention.h"
#include "kernels/sampling.h"
#include "model/muse.h"
#include "rollout/engine.h"
#include "tests/cuda/cuda_util.h"
#include "tests/rollout/engine_fixtures.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

TEST(CudaPagedAttention, MatchesReferenceOnOddSizes) {
  ASSERT_TRUE(at::hasCUDA()) << "the cuda label needs a GPU";
  at::manual_seed(0);
  std::mt19937 rng(1);
  const auto dev = at::TensorOptions().device(at::kCUDA);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t hd : {16, 64, 128}) {
      for (int64_t group : {1, 2, 8, 12, 16}) {
        for (int64_t n : {1, 19, 111}) {
          for (int64_t window : {0, 111}) {
            // n = 111 with 4 KV heads fills the GPU without key splits; smaller n split the keys.
            const int64_t hkv = n == 111 ? 4 : 2, block = n == 19 ? 5 : 16;
            const int64_t longest = n == 111 ? 300 : 4096;
            const int64_t ring = window > 0 ? (window + block - 1) / block + 1 : 0;
            std::vector<int64_t> pos(n);
            for (auto& p : pos) p = std::uniform_int_distribution<int64_t>(0, longest)(rng);
            pos[0] = n == 1 ? longest : 0;  // 4097 keys, and a single key
            const int64_t cols = ring > 0 ? ring : longest / block + 1;
            const int64_t blocks = n * cols + 3;
            std::vector<int64_t> perm(blocks);
            std::iota(perm.begin(), perm.end(), 0);
            std::shuffle(perm.begin(), perm.end(), rng);
            at::Tensor table = at::tensor(std::vector<int64_t>(perm.begin(), perm.begin() + n * cols)).view({n, cols});
            at::Tensor kc = at::randn({blocks * block, hkv, hd}, dev).to(dtype);
            at::Tensor vc = at::randn({blocks * block, hkv, hd}, dev).to(dtype);
            at::Tensor q = at::randn({n, hkv * group, hd}, dev).to(dtype);
            at::Tensor positions = at::tensor(pos).cuda();
            table = table.cuda();
            at::Tensor ref = kernels::paged_decode_attention_reference(
                q.to(at::kFloat), kc.to(at::kFloat), vc.to(at::kFloat), table, positions, block, window, ring);
            // bf16: the output's own rounding, and on tensor cores P rounded to bf16 before P.V.
            const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
            using K = kernels::PagedDecodeKernel;
            std::vector<K> kinds = {K::kAuto, K::kSimt};
            if (dtype == at::kBFloat16 && (hd == 64 || hd == 128)) kinds.push_back(K::kTensorCores);
            for (K kind : kinds) {
              at::Tensor got =
                  kernels::paged_decode_attention_cuda(q, kc, vc, table, positions, block, window, ring, kind);
              EXPECT_TRUE(test::all_close(got.to(at::kFloat).cpu(), ref.cpu(), tol, tol))
                  << dtype << " kernel " << int(kind) << " hd " << hd << " group " << group << " n " << n
                  << " window " << window;
            }
          }
        }
      }
    }
  }
  // Shapes without a kernel say so.
  EXPECT_FALSE(kernels::paged_decode_attention_cuda_supports(at::kFloat, 48, 2));
  EXPECT_FALSE(kernels::paged_decode_attention_cuda_supports(at::kFloat, 128, 17));
  at::Tensor q = at::zeros({1, 2, 48}, dev), kc = at::zeros({16, 1, 48}, dev);
  at::Tensor table = at::zeros({1, 1}, dev.dtype(at::kLong)), pos = at::zeros({1}, dev.dtype(at::kLong));
  EXPECT_TRUE(test::throws_with([&] { kernels::paged_decode_attention_cuda(q, kc, kc, table, pos, 16, 0, 0); },
                                {"no kernel for dtype", "head_dim 48"}));
  at::Tensor q32 = at::zeros({1, 2, 32}, dev), kc32 = at::zeros({16, 1, 32}, dev);
  EXPECT_TRUE(test::throws_with(
      [&] {
        kernels::paged_decode_attention_cuda(q32, kc32, kc32, table, pos, 16, 0, 0,
                                             kernels::PagedDecodeKernel::kTensorCores);
      },
      {"tensor-core kernel takes bf16", "head_dim 32"}));
}

TEST(CudaSampling, MatchesReferenceOnOddSizes) {
  at::manual_seed(1);
  for (int64_t V : {1, 19, 111, 4097, 65536}) {
    for (double spread : {3.0, 80.0}) {  // 80: most weights underflow to zero
      const int64_t rows = 37;
      at::Tensor logits = at::randn({rows, V}) * spread;
      if (V > 1) logits[3][V / 2] = logits[3].max().item<float>();  // a tie for the maximum
      std::vector<double> temps;
      std::vector<int64_t> seeds;
      for (int64_t r = 0; r < rows; ++r) {
        temps.push_back(std::vector<double>{0.0, 0.7, 1.0, 1.3}[size_t(r % 4)]);
        seeds.push_back(int64_t(kernels::mix64(uint64_t(r * 977 + V))));
      }
      at::Tensor t = at::tensor(temps, at::kDouble), s = at::tensor(seeds, at::kLong);
      auto [ref_ids, ref_lps] = kernels::sample_rows_reference(logits, t, s);
      auto [ids, lps] = kernels::sample_rows_cuda(logits.cuda(), t.cuda(), s.cuda());
      EXPECT_TRUE(test::all_equal(ids.cpu(), ref_ids)) << "V " << V << " spread " << spread;
      EXPECT_TRUE(test::all_close(lps.cpu(), ref_lps, 1e-5, 1e-5)) << "V " << V << " spread " << spread;
    }
  }
}

std::vector<rollout::Request> requests(double temperature) {
  // The 17-token prompt and 12 generated tokens wrap the window layers' ring (W = 7, block 4).
  return {test::request({1, 2, 3}, 2, 9, temperature, 1), test::request({4}, 3, 12, temperature, 2),
          test::request({5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21}, 2, 12, temperature, 3)};
}

// Teacher-forced forward of every sample with its own recorded routing replayed: |Δ log-prob|
// per generated token, and the fraction of (token, layer, slot) routing entries that the forward's
// own top-k reproduces.
struct Agreement {
  std::vector<double> diffs;
  double routing = 0;
};
Agreement compare(const model::Muse& m, const std::vector<rollout::Request>& reqs,
                  const std::vector<rollout::RequestOutput>& outs) {
  Agreement a;
  int64_t same = 0, total = 0;
  for (size_t r = 0; r < reqs.size(); ++r) {
    for (const auto& s : outs[r].samples) {
      std::vector<int64_t> all = reqs[r].prompt;
      all.insert(all.end(), s.tokens.begin(), s.tokens.end());
      const int64_t T = int64_t(all.size()), P = int64_t(reqs[r].prompt.size());
      std::vector<int64_t> targets(all.begin() + 1, all.end());
      targets.push_back(-100);
      model::ForwardOptions opt;
      opt.targets = at::tensor(targets, at::kLong);
      opt.temperature = reqs[r].params.temperature > 0 ? reqs[r].params.temperature : 1.0;
      opt.replay_routing = s.routing;
      auto batch = model::PackedBatch::from_sequences({all}, m.device());
      at::Tensor lp = m.forward(batch, opt).logprobs.cpu().to(at::kDouble);
      // A top-k/top-p sample's log-prob is under the filtered distribution: not comparable.
      const bool filtered = reqs[r].params.top_k > 0 || reqs[r].params.top_p < 1.0;
      for (int64_t t = 0; t < int64_t(s.tokens.size()) && !filtered; ++t) a.diffs.push_back(std::abs(lp[P - 1 + t].item<double>() - s.logprobs[size_t(t)]));
      at::Tensor own = m.forward(batch, model::ForwardOptions{}).routing.cpu();
      same += own.eq(s.routing).sum().item<int64_t>();
      total += own.numel();
      EXPECT_EQ(s.routing.size(0), T);
    }
  }
  a.routing = double(same) / double(total);
  return a;
}

TEST(CudaEngine, Bf16GraphDecodeTracksTheForward) {
  // Tolerance: both sides bf16, but decode runs other kernels (paged attention with an fp32
  // softmax, GEMMs of other shapes) than the teacher-forced forward; bounds as for bf16 vs fp32.
  model::Muse cpu = model::Muse::init(test::cuda_config(), 5, at::kFloat, at::kCPU);
  model::Muse m = test::to_device(cpu, at::kCUDA, at::kBFloat16);
  // Roomy, and small: 24 window-ring blocks (36864 B) plus 12 full blocks for 7 samples of up to
  // 8 blocks each, so samples get preempted.
  for (int64_t kv : {int64_t(1) << 20, int64_t(36864 + 12 * 512)}) {
    rollout::Engine engine(m, test::small_engine(kv));
    auto reqs = requests(1.0);
    reqs[0].params.temperature = 0;  // greedy rows share the graphs with sampled ones
    reqs[1].params.top_k = 5;        // filtered rows sample on the host from the graph's logits
    auto outs = engine.generate(reqs);
    const auto st = engine.stats();
    EXPECT_GT(st.graph_steps, 0);
    EXPECT_GE(st.graphs_captured, 1);
    Agreement a = compare(m, reqs, outs);
    const double mean = std::accumulate(a.diffs.begin(), a.diffs.end(), 0.0) / double(a.diffs.size());
    const double mx = *std::max_element(a.diffs.begin(), a.diffs.end());
    std::printf("bf16 graph decode vs bf16 forward (kv %ld B, %ld graph steps, %ld graphs, %ld preemptions): "
                "mean |dlp| %.3e, max %.3e over %zu tokens; routing agreement %.4f\n",
                long(kv), long(st.graph_steps), long(st.graphs_captured), long(st.preemptions), mean, mx,
                a.diffs.size(), a.routing);
    EXPECT_LT(mean, 2e-2);
    EXPECT_LT(mx, 1.5e-1);
    EXPECT_GT(a.routing, 0.9);
    if (kv < (int64_t(1) << 20)) EXPECT_GT(st.preemptions, 0);
  }
}

// RoPE fused with the cache write in the captured decode step changes no bit of what is sampled.
TEST(CudaEngine, FusedRopeCacheWriteSamplesTheSameBits) {
  model::Muse m = test::to_device(model::Muse::init(test::cuda_config(), 9, at::kFloat, at::kCPU), at::kCUDA,
                                  at::kBFloat16);
  auto reqs = requests(1.0);
  std::vector<std::vector<rollout::RequestOutput>> outs;
  for (bool fused : {true, false}) {
    rollout::EngineConfig ec = test::small_engine();
    ec.fused_rope_cache = fused;
    rollout::Engine engine(m, ec);
    outs.push_back(engine.generate(reqs));
    EXPECT_GT(engine.stats().graph_steps, 0);
  }
  for (size_t r = 0; r < reqs.size(); ++r)
    for (size_t j = 0; j < outs[0][r].samples.size(); ++j) {
      const rollout::Sample &a = outs[0][r].samples[j], &b = outs[1][r].samples[j];
      EXPECT_EQ(a.tokens, b.tokens) << "request " << r << " sample " << j;
      EXPECT_EQ(a.logprobs, b.logprobs) << "request " << r << " sample " << j;
      EXPECT_TRUE(test::all_equal(a.routing, b.routing)) << "request " << r << " sample " << j;
    }
}

TEST(CudaEngine, Fp32EagerDecodeEqualsTheForward) {
  // fp32 on the GPU runs the eager path (graphs need the bf16 grouped GEMM) with the sampling
  // kernel: log-probs within 1e-4 of the forward and routing identical.
  model::Muse cpu = model::Muse::init(test::cuda_config(), 6, at::kFloat, at::kCPU);
  model::Muse m = test::to_device(cpu, at::kCUDA, at::kFloat);
  rollout::Engine engine(m, test::small_engine());
  auto reqs = requests(0.8);
  auto outs = engine.generate(reqs);
  EXPECT_EQ(engine.stats().graph_steps, 0);
  Agreement a = compare(m, reqs, outs);
  EXPECT_LT(*std::max_element(a.diffs.begin(), a.diffs.end()), 1e-4);
  EXPECT_EQ(a.routing, 1.0);
}

TEST(CudaEngine, CapturedGraphsSeeInPlaceWeightUpdates) {
  model::Muse a = test::to_device(model::Muse::init(test::cuda_config(), 7, at::kFloat, at::kCPU), at::kCUDA, at::kBFloat16);
  model::Muse b = test::to_device(model::Muse::init(test::cuda_config(), 8, at::kFloat, at::kCPU), at::kCUDA, at::kBFloat16);
  auto reqs = requests(1.0);
  rollout::Engine updated(a, test::small_engine());
  auto before = updated.generate(reqs);  // captures graphs with a's weights
  updated.update_weights(b.named_parameters());
  auto after = updated.generate(reqs);
  rollout::Engine fresh(b, test::small_engine());
  auto expect = fresh.generate(reqs);
  EXPECT_GT(updated.stats().graph_steps, 0);
  for (size_t r = 0; r < reqs.size(); ++r) {
    for (size_t s = 0; s < expect[r].samples.size(); ++s) {
      EXPECT_EQ(after[r].samples[s].tokens, expect[r].samples[s].tokens) << "request " << r << " sample " << s;
      EXPECT_EQ(after[r].samples[s].logprobs, expect[r].samples[s].logprobs) << "request " << r << " sample " << s;
      EXPECT_TRUE(test::all_equal(after[r].samples[s].routing, expect[r].samples[s].routing));
    }
  }
}

TEST(CudaEngine, RoutingUnderForcedPreemptionIsTheSamplingSteps) {
  // bf16 with CUDA graphs and a cache so small that samples are preempted and recomputed. A
  // recompute runs other batch shapes, so bf16 can route a token differently; the recorded routing
  // must stay the one of the step that drew its successor. The second pass changes the weights
  // at the first preemption, which makes the recompute route differently for certain.
  model::Muse a = test::to_device(model::Muse::init(test::cuda_config(), 9, at::kFloat, at::kCPU), at::kCUDA, at::kBFloat16);
  model::Muse b = test::to_device(model::Muse::init(test::cuda_config(), 10, at::kFloat, at::kCPU), at::kCUDA, at::kBFloat16);
  for (bool update : {false, true}) {
    rollout::Engine engine(a, test::small_engine(36864 + 12 * 512));
    bool done = false;
    const int64_t rerouted = test::check_routing_of_sampling_steps(engine, requests(1.0), [&](rollout::Engine& e) {
      if (update && !done && e.stats().preemptions > 0) {
        e.update_weights(b.named_parameters());
        done = true;
      }
    });
    const auto st = engine.stats();
    std::printf("bf16, %s: %ld preemptions, %ld graph steps, %ld recomputed positions routed otherwise\n",
                update ? "weights updated at the first preemption" : "same weights", long(st.preemptions),
                long(st.graph_steps), long(rerouted));
    EXPECT_GT(st.preemptions, 0);
    if (update) EXPECT_GT(rerouted, 0);
  }
}

}  // namespace
}  // namespace kiln
