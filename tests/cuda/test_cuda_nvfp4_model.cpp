// NVFP4 serving on the GPU: the dispatcher's prefill paths (dequantise + cuBLAS, one GEMM per
// expert) and W4A4 against the CPU references, dequantisation from the kernel layout, a Muse
// served from NVFP4 against its dequantisation and against the CPU reference, the engine's
// CUDA-graph decode over NVFP4 weights with a re-quantising weight sync, and LoRA on the GPU
// (grouped-GEMM adapters with gradients; adapters over an NVFP4 rollout base, under CUDA graphs).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "core/torch_version.h"
#include "kernels/nvfp4.h"
#include "model/lora.h"
#include "model/nvfp4_model.h"
#include "rollout/engine.h"
#include "tests/cuda/cuda_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using kernels::Nvfp4Tensor;

// |got - ref| <= rtol |ref| + atol * max|ref| + bound, elementwise (bound: optional, per element).
::testing::AssertionResult near_ref(const at::Tensor& got, const at::Tensor& ref, double rtol, double atol,
                                    const at::Tensor& bound = at::Tensor()) {
  at::Tensor g = got.cpu().to(at::kDouble), r = ref.cpu().to(at::kDouble);
  const double scale = r.abs().max().item<double>();
  at::Tensor tol = r.abs() * rtol + atol * scale;
  if (bound.defined()) tol = tol + bound.cpu().to(at::kDouble);
  at::Tensor bad = (g - r).abs() > tol;
  if (!bad.any().item<bool>()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad.sum().item<int64_t>() << " of " << r.numel()
                                       << " elements off; max |diff| " << (g - r).abs().max().item<double>()
                                       << " vs max |ref| " << scale;
}

// |W| of a ModelOpt-layout tensor: the codes' sign bits cleared (scales are positive).
Nvfp4Tensor magnitudes(const Nvfp4Tensor& q) {
  Nvfp4Tensor a = q;
  a.packed = at::bitwise_and(q.packed, 0x77);
  return a;
}

TEST(CudaNvfp4Serving, PrefillPathsAndW4a4MatchTheReferences) {
  at::manual_seed(21);
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    // bf16: the output rounds once (fused) or twice (W4A4's per-row scale after the product); the
    // prefill paths also round each weight (tensor scale folded in) to bf16, at most 2^-9 of it, so
    // their error is also bounded by 2^-9 sum_k |x_k w_k|: the reference on |x| and |W|.
    const bool bf16 = dtype == at::kBFloat16;
    const double rtol = bf16 ? 1.0 / 64 : 1e-4, atol = bf16 ? 1e-3 : 1e-5, wround = bf16 ? std::ldexp(1.0, -9) : 0.0;
    Nvfp4Tensor q = kernels::nvfp4_quantize_reference(at::randn({111, 4112}) * 0.02);
    Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
    for (int64_t M : {1, 19, 111, 4097}) {  // fused up to 64 rows, dequantise + cuBLAS above
      at::Tensor x = at::randn({M, 4112}).to(dtype);
      const at::Tensor bound = kernels::nvfp4_linear_reference(x.abs(), magnitudes(q)) * wround;
      EXPECT_TRUE(near_ref(kernels::nvfp4_linear(x.cuda(), kq), kernels::nvfp4_linear_reference(x, q), rtol, atol, bound))
          << "M " << M << " " << dtype;
      if (M > 64) {  // the prefill path multiplies by exactly the weights a dequantised trainer holds
        EXPECT_TRUE(test::all_equal(kernels::nvfp4_linear(x.cuda(), kq).cpu(),
                                    at::linear(x.cuda(), kernels::nvfp4_dequantize(kq, dtype)).cpu()))
            << "M " << M << " " << dtype;
      }
      kernels::Nvfp4LinearOptions w4;
      w4.w4a4 = true;  // dynamic activation scale, computed on the device
      const at::Tensor bound4 = kernels::nvfp4_linear_reference(x.abs(), magnitudes(q), w4) * wround;
      EXPECT_TRUE(near_ref(kernels::nvfp4_linear(x.cuda(), kq, w4), kernels::nvfp4_linear_reference(x, q, w4), rtol,
                           atol, bound4))
          << "W4A4 M " << M << " " << dtype;
    }
    // Grouped: 3 experts; 19 rows per expert on average runs fused; above 64 the prefill path (bf16:
    // torch's grouped GEMM over 16-aligned segments; fp32: one GEMM per expert), with an empty
    // expert, odd counts, and W4A4's per-row scales.
    Nvfp4Tensor gq = kernels::nvfp4_quantize_reference(at::randn({3, 48, 64}) * 0.1);
    Nvfp4Tensor gk = kernels::nvfp4_to_kernel_layout(gq).to(at::kCUDA);
    for (const std::vector<int64_t>& off : {std::vector<int64_t>{0, 19, 19, 57}, std::vector<int64_t>{0, 400, 401, 900},
                                            std::vector<int64_t>{0, 0, 401, 1111}}) {
      at::Tensor offsets = at::tensor(off, at::kLong);
      at::Tensor x = at::randn({off.back(), 64}).to(dtype);
      const at::Tensor bound = kernels::nvfp4_grouped_linear_reference(x.abs(), magnitudes(gq), offsets) * wround;
      EXPECT_TRUE(near_ref(kernels::nvfp4_grouped_linear(x.cuda(), gk, offsets.cuda()),
                           kernels::nvfp4_grouped_linear_reference(x, gq, offsets), rtol, atol, bound))
          << "grouped rows " << off.back() << " " << dtype;
      kernels::Nvfp4LinearOptions w4;
      w4.w4a4 = true;
      const at::Tensor bound4 =
          kernels::nvfp4_grouped_linear_reference(x.abs(), magnitudes(gq), offsets, w4) * wround;
      EXPECT_TRUE(near_ref(kernels::nvfp4_grouped_linear(x.cuda(), gk, offsets.cuda(), w4),
                           kernels::nvfp4_grouped_linear_reference(x, gq, offsets, w4), rtol, atol, bound4))
          << "grouped W4A4 rows " << off.back() << " " << dtype;
      // The same rows in the MoE layer's layout (each expert's segment padded with zero rows to a
      // multiple of 16): above 64 rows per expert in bf16, the GEMM the dispatcher runs on its own
      // copy of that layout, bit for bit; elsewhere within the references' tolerance.
      std::vector<int64_t> ends, dest;
      for (size_t e = 0; e + 1 < off.size(); ++e) {
        const int64_t start = ends.empty() ? 0 : ends.back();
        for (int64_t r = off[e]; r < off[e + 1]; ++r) dest.push_back(start + r - off[e]);
        ends.push_back(start + (off[e + 1] - off[e] + 15) / 16 * 16);
      }
      at::Tensor rows = at::tensor(dest, at::kLong).cuda();
      at::Tensor xp = at::zeros({ends.back(), 64}, x.options()).cuda().index_copy_(0, rows, x.cuda());
      at::Tensor e32 = at::tensor(ends, at::kLong).to(at::kInt).cuda();
      for (const kernels::Nvfp4LinearOptions& o : {kernels::Nvfp4LinearOptions(), w4}) {
        at::Tensor got = kernels::nvfp4_grouped_linear_aligned(xp, gk, e32, o).index_select(0, rows);
        at::Tensor want = kernels::nvfp4_grouped_linear(x.cuda(), gk, offsets.cuda(), o);
        EXPECT_TRUE(bf16 && kernels::nvfp4_grouped_dequantizes(gk, off.back(), x.cuda())
                        ? test::all_equal(got.cpu(), want.cpu())
                         : bool(near_ref(got, kernels::nvfp4_grouped_linear_reference(x, gq, offsets, o), rtol, atol,
                                         o.w4a4 ? bound4 : bound)))
            << "aligned rows " << off.back() << " " << dtype << " w4a4 " << o.w4a4;
        // Rows past the last segment (the MoE layout's static bound) belong to no expert: with
        // the layout's segments given, every expert row comes out bit for bit as without them.
        at::Tensor tail = at::cat({xp, at::randn({37, 64}).to(dtype).cuda()});
        at::Tensor segments = at::cat({at::zeros({1}, at::kLong), at::tensor(ends, at::kLong)}).cuda();
        at::Tensor cut = kernels::nvfp4_grouped_linear_aligned(tail, gk, e32, o, segments).index_select(0, rows);
        EXPECT_TRUE(test::all_equal(cut.cpu(), got.cpu())) << "aligned rows with a tail " << off.back() << " " << dtype;
      }
    }
  }
  // Dequantisation reads either layout; the on-device activation quantiser equals the CPU one.
  Nvfp4Tensor q = kernels::nvfp4_quantize_reference(at::randn({19, 48}));
  EXPECT_TRUE(test::all_equal(kernels::nvfp4_dequantize(kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA), at::kFloat).cpu(),
                              kernels::nvfp4_dequantize_reference(q)));
  at::Tensor x = at::randn({19, 48}), s, sc;
  EXPECT_TRUE(test::all_equal(kernels::nvfp4_fake_quantize_activations(x.cuda(), at::Tensor(), &sc).cpu(),
                              kernels::nvfp4_fake_quantize_activations(x, at::Tensor(), &s)));
  EXPECT_TRUE(test::all_equal(sc.cpu(), s));  // per-row dynamic scales, divided in fp64 on both
}

model::ModelConfig nvfp4_cuda_config() {
  model::ModelConfig c = test::cuda_config();  // hidden 64, latent 32, experts 48 wide, head_dim 16
  c.bf16_expert_layers = {3};
  return c;
}

at::Tensor score(const model::Muse& m, const std::vector<std::vector<int64_t>>& seqs, at::Tensor* routing = nullptr) {
  model::ForwardOptions o;
  model::PackedBatch b = model::PackedBatch::from_sequences(seqs, m.device());
  o.targets = (b.tokens * 7 + 3).remainder(m.config().vocab_size);
  model::ForwardOutput out = m.forward(b, o);
  if (routing) *routing = out.routing.cpu();
  return out.logprobs.cpu().to(at::kDouble);
}

// Generates `reqs` and returns the mean |log-prob difference| between the engine's decode and a
// rescoring forward of the samples by the engine's own model.
double decode_vs_rescoring(rollout::Engine& engine, const std::vector<rollout::Request>& reqs) {
  auto out = engine.generate(reqs);
  // The engine's log-probs are its own model's: rescore the samples with that model's forward.
  std::vector<std::vector<int64_t>> seqs;
  std::vector<float> lps;
  std::vector<int64_t> at_rows;
  int64_t row = 0;
  for (size_t r = 0; r < out.size(); ++r)
    for (const auto& s : out[r].samples) {
      std::vector<int64_t> t = reqs[r].prompt;
      for (size_t i = 0; i < s.tokens.size(); ++i) {
        at_rows.push_back(row + int64_t(t.size()) - 1);
        lps.push_back(s.logprobs[i]);
        t.push_back(s.tokens[i]);
      }
      row += int64_t(t.size());
      seqs.push_back(t);
    }
  model::ForwardOptions o;
  model::PackedBatch b = model::PackedBatch::from_sequences(seqs, at::kCUDA);
  at::Tensor tokens = b.tokens.cpu(), targets = at::full({b.num_tokens()}, -100L, at::kLong);
  for (int64_t r : at_rows) targets[r] = tokens[r + 1];  // the token sampled after row r
  o.targets = targets.cuda();
  at::Tensor rescored = engine.model().forward(b, o).logprobs.cpu();
  double diff = 0;
  for (size_t i = 0; i < at_rows.size(); ++i) diff += std::abs(rescored[at_rows[i]].item<double>() - lps[i]);
  return diff / double(at_rows.size());
}

TEST(CudaNvfp4Serving, ModelServedFromNvfp4MatchesItsDequantisationAndTheCpuReference) {
  const model::ModelConfig cfg = nvfp4_cuda_config();
  model::Muse base = model::Muse::init(cfg, 5, at::kFloat, at::kCPU);
  model::Muse served = test::to_device(base, at::kCUDA, at::kBFloat16);
  model::quantize_model(served, /*kernel_layout=*/true, /*drop_dense=*/true);  // CUDA quantiser
  model::Muse trainer = served.clone();
  model::dequantize_model(trainer, at::kBFloat16);
  // The CPU reference: the same codes (the CUDA quantiser is bit-exact; both quantise the
  // bf16-rounded weights), fp32 activations.
  model::Muse cpu_served = test::to_device(test::to_device(base, at::kCPU, at::kBFloat16), at::kCPU, at::kFloat);
  model::quantize_model(cpu_served, /*kernel_layout=*/false, /*drop_dense=*/true);
  EXPECT_TRUE(test::all_equal(kernels::nvfp4_to_modelopt_layout(served.weights().layers[0].nvfp4.expert_up).packed.cpu(),
                              cpu_served.weights().layers[0].nvfp4.expert_up.packed));
  std::vector<std::vector<int64_t>> seqs;  // 171 tokens: dense calls above 64 rows take the prefill path
  for (int64_t s = 0; s < 3; ++s) {
    std::vector<int64_t> t;
    for (int64_t i = 0; i < 19 + 38 * s; ++i) t.push_back((i * 13 + s * 5 + 1) % cfg.vocab_size);
    seqs.push_back(t);
  }
  for (auto batch : {seqs, std::vector<std::vector<int64_t>>{seqs[0]}}) {  // and 19 tokens: all fused
    at::Tensor r_served, r_trainer;
    at::Tensor a = score(served, batch, &r_served), b = score(trainer, batch, &r_trainer), c = score(cpu_served, batch);
    const double ab = (a - b).abs().mean().item<double>(), ac = (a - c).abs().mean().item<double>();
    const double agree = r_served.eq(r_trainer).to(at::kFloat).mean().item<double>();
    std::printf("nvfp4 W4A16 bf16 GPU (%ld tokens): mean |dlp| vs its bf16 dequantisation %.3e, vs fp32 CPU reference "
                "%.3e; routing agreement %.4f\n",
                long(a.size(0)), ab, ac, agree);
    // bf16 noise: bf16 CUDA vs fp32 CPU is ~1e-2 for the plain model; W4A16 (the tensor scale after
    // the sum) against bf16-rounded dequantised weights measured 2.9e-2 over 171 tokens (H200).
    EXPECT_LT(ab, 5e-2);
    EXPECT_LT(ac, 4e-2);
    EXPECT_GT(agree, 0.9);
  }
  // 971 tokens, 1942 expert slots (above the grouped staged kernel's 192 per expert): every NVFP4
  // call multiplies by the dequantised weights (dense: dequantise + cuBLAS; experts: the fused MoE
  // path on the dequantised stacks), so the served model's prefill is its dequantisation's, bit for
  // bit, routing included.
  std::vector<std::vector<int64_t>> longer = seqs;
  longer.emplace_back();
  for (int64_t i = 0; i < 800; ++i) longer.back().push_back((i * 29 + 3) % cfg.vocab_size);
  at::Tensor r_served, r_trainer;
  const at::Tensor a = score(served, longer, &r_served), b = score(trainer, longer, &r_trainer);
  EXPECT_EQ(a.size(0), 971);
  EXPECT_TRUE(test::all_equal(a, b)) << "max |dlp| " << (a - b).abs().max().item<double>();
  EXPECT_TRUE(test::all_equal(r_served, r_trainer));
}

// A model whose NVFP4 widths fit the wgmma GEMM (multiples of 64 out, 256 in), served under the
// dispatch kiln_test_cuda was told to use: the default run (: split-K, dequantise + cuBLAS)
// and kiln_cuda_nvfp4_wgmma (--nvfp4-gemm=wgmma: every NVFP4 linear above 16 rows per matrix or
// expert on wgmma; the MoE layer's padded rows count). 337, 100 and 19 tokens: token tiles of 128,
// 64 and 32. First each of layer 0's NVFP4 tensors through the forced wgmma GEMM against the CPU
// reference, on its own shape; then the served model within bf16 noise of its dequantisation,
// routing mostly agreeing. The two ctests print the same line, so the dispatches compare.
TEST(CudaNvfp4Serving, WgmmaServedModelMatchesItsDequantisation) {
  model::ModelConfig cfg = test::cuda_config();
  cfg.hidden_size = 256;
  cfg.latent_size = 256;
  cfg.expert_ffn_size = 256;
  cfg.head_dim = 64;  // q 4 x 64, k and v 2 x 64
  cfg.bf16_expert_layers = {3};
  cfg.init_std = 0.02;  // 0.1 at width 256 grows the residual stream until bf16 noise moves log-probs by 0.2
  model::Muse base = model::Muse::init(cfg, 7, at::kFloat, at::kCPU);
  model::Muse served = test::to_device(base, at::kCUDA, at::kBFloat16);
  model::quantize_model(served, /*kernel_layout=*/true, /*drop_dense=*/true);
  const model::LayerWeights::Nvfp4& nv = served.weights().layers[0].nvfp4;
  at::Tensor x19 = at::zeros({19, cfg.hidden_size}, at::kCUDA).to(at::kBFloat16);
  const bool wgmma = kernels::nvfp4_wgmma_usable(x19, nv.q_proj);
  if (kernels::nvfp4_wgmma_selected() && !wgmma) GTEST_SKIP() << "--nvfp4-gemm=wgmma where the wgmma GEMM cannot run";
  EXPECT_STREQ(kernels::nvfp4_linear_path(x19, nv.q_proj), kernels::nvfp4_wgmma_selected() ? "wgmma" : "splitK");
  EXPECT_STREQ(kernels::nvfp4_linear_path(x19.narrow(0, 0, 16), nv.q_proj), "splitK");
  if (wgmma) {
    at::manual_seed(3);
    const std::pair<const char*, const Nvfp4Tensor*> tensors[] = {
        {"q_proj", &nv.q_proj},   {"k_proj", &nv.k_proj},     {"v_proj", &nv.v_proj},
        {"o_proj", &nv.o_proj},   {"pooler", &nv.pooler},     {"unpooler", &nv.unpooler},
        {"expert_gate", &nv.expert_gate}, {"expert_up", &nv.expert_up}, {"expert_down", &nv.expert_down}};
    for (const auto& [name, t] : tensors) {
      if (!t->packed.defined() || !kernels::nvfp4_wgmma_usable(x19, *t)) continue;
      const Nvfp4Tensor ref_w = kernels::nvfp4_to_modelopt_layout(*t).to(at::kCPU);
      for (int64_t M : {19, 100, 337}) {
        at::Tensor x = at::randn({M, t->cols()}).to(at::kBFloat16);
        at::Tensor got, ref;
        if (t->stacked()) {  // M rows over the experts, the last expert's rows past the others
          const int64_t E = t->packed.size(0);
          std::vector<int64_t> off{0};
          for (int64_t e = 0; e < E; ++e) off.push_back(e + 1 == E ? M : off.back() + M / (2 * E));
          at::Tensor offsets = at::tensor(off, at::kLong);
          got = kernels::nvfp4_grouped_linear_cuda(x.cuda(), *t, offsets.cuda(), at::Tensor(), 0,
                                                   kernels::Nvfp4Gemm::kWgmma);
          ref = kernels::nvfp4_grouped_linear_reference(x, ref_w, offsets);
        } else {
          got = kernels::nvfp4_linear_cuda(x.cuda(), *t, at::Tensor(), kernels::Nvfp4Gemm::kWgmma);
          ref = kernels::nvfp4_linear_reference(x, ref_w);
        }
        EXPECT_TRUE(near_ref(got, ref, 0x1p-7, 1e-3)) << name << " M " << M;
      }
    }
  }
  model::Muse trainer = served.clone();
  model::dequantize_model(trainer, at::kBFloat16);
  for (int64_t n : {337, 100, 19}) {
    std::vector<std::vector<int64_t>> seqs(1);
    for (int64_t i = 0; i < n; ++i) seqs[0].push_back((i * 29 + 3) % cfg.vocab_size);
    at::Tensor r_served, r_trainer;
    const at::Tensor a = score(served, seqs, &r_served), b = score(trainer, seqs, &r_trainer);
    const double d = (a - b).abs().mean().item<double>();
    const double agree = r_served.eq(r_trainer).to(at::kFloat).mean().item<double>();
    const kernels::Nvfp4Gemm chosen = kernels::nvfp4_gemm_selected();
    std::printf("nvfp4 %s (%ld tokens): mean |dlp| vs its bf16 dequantisation %.3e; routing agreement %.4f\n",
                chosen == kernels::Nvfp4Gemm::kWgmma    ? "wgmma"
                : chosen == kernels::Nvfp4Gemm::kSplitK ? "split-K experts"
                : chosen == kernels::Nvfp4Gemm::kStagedTiles ? "staged tiles"
                                                        : "default dispatch",
                long(n), d, agree);
    EXPECT_LT(d, 5e-2) << n << " tokens";
    EXPECT_GT(agree, 0.9) << n << " tokens";
  }
}

TEST(CudaNvfp4Serving, EngineDecodesNvfp4InCudaGraphsAndRequantisesOnSync) {
  const model::ModelConfig cfg = nvfp4_cuda_config();
  std::vector<rollout::Request> reqs;
  for (int64_t r = 0; r < 5; ++r) {
    rollout::Request q;
    for (int64_t i = 0; i < 3 + 7 * r; ++i) q.prompt.push_back((i * 11 + r) % cfg.vocab_size);
    q.params.n = 2;
    q.params.max_tokens = 9;
    q.params.seed = uint64_t(r);
    reqs.push_back(q);
  }
  // bf16 decodes in CUDA graphs; fp32 eagerly, where decode and a rescoring forward differ only in
  // the last bits of their sums, so both must agree tightly (W4A4 up to the odd 4-bit code step).
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    model::Muse m = test::to_device(model::Muse::init(cfg, 6, at::kFloat, at::kCPU), at::kCUDA, dtype);
    for (const char* mode : {"nvfp4", "w4a4"}) {
      const bool bf16 = dtype == at::kBFloat16, w4a4 = std::string(mode) == "w4a4";
      rollout::EngineConfig ec;
      ec.quantization = rollout::parse_quantization(mode);
      ec.kv_cache_bytes = 4 << 20;
      rollout::Engine engine(m, ec);
      const double diff = decode_vs_rescoring(engine, reqs);
      EXPECT_EQ(engine.stats().graph_steps > 0, bf16) << mode;
      std::printf("nvfp4 engine (%s, %s): mean |dlp| between decode and a rescoring forward %.3e\n", mode,
                  bf16 ? "bf16, graphs" : "fp32, eager", diff);
      // bf16: decode and prefill see activations that differ in the last bits; W4A4's 4-bit
      // activations turn some of those into whole code steps, and routing flips follow (measured
      // on the H200: nvfp4 2.7e-2, w4a4 3.2e-1). fp32: 5.8e-6 for nvfp4; W4A4 6.9e-3, because the
      // prefill multiplies by the dequantised weights (tensor scale folded into each, as the trainer
      // holds them) and decode applies the scale after the sum: a one-ulp difference moves the odd
      // activation across a 4-bit rounding boundary. A wrong activation scale costs far more.
      EXPECT_LT(diff, !bf16 ? (w4a4 ? 2e-2 : 1e-4) : w4a4 ? 0.5 : 4e-2) << mode << " " << dtype;
      // A full-weight sync re-quantises on the GPU, in place.
      model::Muse next = m.clone();
      for (auto& [name, t] : next.named_parameters()) t.mul_(-1);
      const void* addr = engine.model().weights().layers[1].nvfp4.pooler.packed.data_ptr();
      engine.update_weights(next.named_parameters());
      const Nvfp4Tensor& q = engine.model().weights().layers[1].nvfp4.pooler;
      EXPECT_EQ(q.packed.data_ptr(), addr);
      EXPECT_TRUE(test::all_equal(kernels::nvfp4_to_modelopt_layout(q).packed.cpu(),
                                  kernels::nvfp4_quantize_reference(next.weights().layers[1].pooler.cpu()).packed));
      auto again = engine.generate(reqs);
      EXPECT_EQ(again.size(), reqs.size());
    }
  }
}

// Batches wide enough that a decode step gives each expert more than 64 rows (RL rollouts with
// every sample in flight): at 328 sequences (82 rows per expert on average, 97 by the MoE's padded
// bound) the experts take the grouped staged kernel's tiled launch, at 776 (194, 209) the
// dequantised stack on torch's grouped GEMM; either way the engine decodes in CUDA graphs, as close
// to a rescoring forward as at small batch.
TEST(CudaNvfp4Serving, EngineDecodesInCudaGraphsAboveSixtyFourRowsPerExpert) {
  const model::ModelConfig cfg = nvfp4_cuda_config();  // 8 experts, top 2
  model::Muse m = test::to_device(model::Muse::init(cfg, 6, at::kFloat, at::kCPU), at::kCUDA, at::kBFloat16);
  // --nvfp4-gemm=splitk keeps the dequantised stack above 64 rows; =wgmma takes none of these
  // widths (K = 32), so the same.
  const bool no_staged = kernels::nvfp4_gemm_selected() == kernels::Nvfp4Gemm::kSplitK || kernels::nvfp4_wgmma_selected();
  const char* deq = KILN_TORCH_AT_LEAST(2, 8) ? "deq+grouped_mm" : "deq+mm per expert";
  for (auto [prompts, path] : {std::pair{int64_t(41), no_staged ? deq : "staged tiles"}, {int64_t(97), deq}}) {
    const int64_t seqs = 8 * prompts;
    std::vector<rollout::Request> reqs;
    for (int64_t r = 0; r < prompts; ++r) {
      rollout::Request q;
      for (int64_t i = 0; i < 3 + r % 5; ++i) q.prompt.push_back((i * 13 + r) % cfg.vocab_size);
      q.params.n = 8;
      q.params.max_tokens = 6;
      q.params.seed = uint64_t(r);
      reqs.push_back(q);
    }
    rollout::EngineConfig ec;
    ec.quantization = rollout::Quantization::kNvfp4;
    ec.max_num_seqs = seqs;
    ec.max_batch_tokens = 4096;
    ec.kv_cache_bytes = rollout::kv_cache_bytes_for(cfg, ec, 2, 48);  // 13 tokens and copied fork blocks
    rollout::Engine engine(m, ec);
    const kernels::Nvfp4Tensor& gate = engine.model().weights().layers[0].nvfp4.expert_gate;
    const at::Tensor z = at::zeros({(seqs + 8) * cfg.top_k, cfg.latent_size}, m.weights().embed.options());
    EXPECT_STREQ(kernels::nvfp4_grouped_linear_path(z, gate, z.size(0)), path) << seqs << " sequences";
    const double diff = decode_vs_rescoring(engine, reqs);
    EXPECT_GT(engine.stats().graph_steps, 0) << seqs << " sequences";
    EXPECT_EQ(engine.stats().preemptions, 0) << seqs << " sequences";
    std::printf("nvfp4 engine at %ld sequences (bf16, graphs, experts %s): mean |dlp| between decode and a rescoring "
                "forward %.3e\n",
                long(seqs), path, diff);
    EXPECT_LT(diff, 4e-2) << seqs << " sequences";
  }
}

TEST(CudaLora, GroupedGemmAdaptersMatchTheCpuLoopAndTrain) {
  const model::ModelConfig cfg = nvfp4_cuda_config();
  model::Muse cpu = model::Muse::init(cfg, 8, at::kFloat, at::kCPU);
  model::LoraConfig lc;
  lc.rank = 8;
  lc.alpha = 16;
  model::add_lora(cpu, lc, 1);
  {
    at::NoGradGuard g;
    at::manual_seed(3);
    for (auto& [n, t] : model::lora_parameters(cpu))
      if (n.find("lora_B") != std::string::npos) t.copy_(at::randn_like(t) * 0.1);
  }
  model::Muse gpu = test::to_device(cpu, at::kCUDA, at::kBFloat16);
  for (size_t i = 0; i < gpu.weights().layers.size(); ++i) {  // to_device moves base tensors only
    auto& dst = gpu.weights().layers[i].lora;
    dst = cpu.weights().layers[i].lora;
    for (at::Tensor* t : {&dst.q_a, &dst.q_b, &dst.k_a, &dst.k_b, &dst.v_a, &dst.v_b, &dst.o_a, &dst.o_b, &dst.pool_a,
                          &dst.pool_b, &dst.unpool_a, &dst.unpool_b, &dst.gate_a, &dst.gate_b, &dst.up_a, &dst.up_b,
                          &dst.down_a, &dst.down_b})
      if (t->defined()) *t = t->to(at::kCUDA, at::kBFloat16);
  }
  std::vector<std::vector<int64_t>> seqs = {{1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41}, {2, 4, 6}};
  at::Tensor a = score(gpu, seqs), b = score(cpu, seqs);
  // The grouped-GEMM adapters against the per-expert loop, both bf16 on the GPU: the LoRA paths
  // agree to GEMM rounding; against fp32 on the CPU, bf16 noise of a model with large adapters.
  model::ForwardOptions loop;
  loop.kernel_path = model::KernelPath::kLoop;
  model::PackedBatch lb = model::PackedBatch::from_sequences(seqs, at::kCUDA);
  loop.targets = (lb.tokens * 7 + 3).remainder(cfg.vocab_size);
  // The grouped path's routing, replayed: with adapters this large a near tie that the two paths'
  // bf16 roundings break differently moves a token's experts, which says nothing about the GEMMs.
  model::ForwardOptions replayed = loop;
  replayed.replay_routing = gpu.forward(lb, model::ForwardOptions{}).routing;
  at::Tensor c = gpu.forward(lb, replayed).logprobs.cpu().to(at::kDouble);
  const double d = (a - b).abs().mean().item<double>(), gl = (a - c).abs().mean().item<double>();
  std::printf("LoRA bf16 GPU: grouped GEMM vs per-expert loop mean |dlp| %.3e; vs fp32 CPU %.3e\n", gl, d);
  EXPECT_LT(gl, 2e-2);
  EXPECT_LT(d, 0.1);
  // Gradients reach every adapter through the grouped GEMMs; the base gets none.
  gpu.set_requires_grad(false);
  for (auto& [n, t] : model::lora_parameters(gpu)) t.requires_grad_(true);
  model::ForwardOptions o;
  model::PackedBatch pb = model::PackedBatch::from_sequences(seqs, at::kCUDA);
  o.targets = (pb.tokens * 7 + 3).remainder(cfg.vocab_size);
  gpu.forward(pb, o).logprobs.sum().backward();
  for (auto& [n, t] : model::lora_parameters(gpu)) EXPECT_TRUE(t.grad().defined()) << n;
  // An NVFP4 rollout with these adapters: torch's grouped GEMMs take the expert adapters on the
  // NVFP4 base too, so nothing syncs with the host and decode runs as CUDA graphs. Its decode
  // agrees with its own rescoring, and its grouped adapters with its per-expert loop.
  at::NoGradGuard g;
  rollout::EngineConfig ec;
  ec.quantization = rollout::Quantization::kNvfp4;
  ec.kv_cache_bytes = 4 << 20;
  rollout::Engine engine(gpu, ec);
  std::vector<rollout::Request> reqs(2);
  for (int64_t i = 0; i < 2; ++i) {
    reqs[i].prompt = {1 + i, 2, 3, 4 + 5 * i};
    reqs[i].params.n = 3;
    reqs[i].params.max_tokens = 6;
    reqs[i].params.seed = uint64_t(i);
  }
  const double rescore = decode_vs_rescoring(engine, reqs);
  EXPECT_GT(engine.stats().graph_steps, 0);
  at::Tensor ng = score(engine.model(), seqs);
  const double nl = (engine.model().forward(lb, loop).logprobs.cpu().to(at::kDouble) - ng).abs().mean().item<double>();
  const double nd = (ng - a).abs().mean().item<double>();
  std::printf("LoRA over an NVFP4 rollout base (graphs): decode vs rescoring mean |dlp| %.3e; grouped vs loop "
              "%.3e; vs the bf16 trainer %.3e\n", rescore, nl, nd);
  EXPECT_LT(rescore, 4e-2);
  EXPECT_LT(nl, 2e-2);
  EXPECT_LT(nd, 0.5);
}

}  // namespace
}  // namespace kiln
