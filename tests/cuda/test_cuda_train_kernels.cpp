// The fused training kernels against float64 references on odd sizes, in fp32 and bf16, forward
// and backward: RMSNorm (shared weight, per-segment, the gradient by formula), RoPE, SwiGLU, MoE
// dispatch and combine (indices exact), varlen flash attention (queries after earlier keys too, as
// context parallelism reads them), and the whole model fused and not.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>

#include "kernels/flash_varlen.h"
#include "kernels/logprob.h"
#include "kernels/moe_layout.h"
#include "kernels/moe_rows.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "model/checkpoint.h"
#include "model/muse.h"
#include "tests/cuda/cuda_util.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

// ||a - b|| / ||b|| in float64, with ||b|| at least 1e-3 per element's worth (a gradient that is
// zero in exact arithmetic, such as a one-column norm's, is compared absolutely); NaN anywhere
// gives NaN (a failed EXPECT_LT).
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().cpu().to(at::kDouble), y = b.detach().cpu().to(at::kDouble);
  const double floor = 1e-3 * std::sqrt(double(std::max<int64_t>(1, y.numel())));
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), floor);
}

double tol(at::ScalarType dtype) { return dtype == at::kFloat ? 2e-5 : 1.2e-2; }
// Gradients: in fp32 the norm's dx = inv * (g - xhat * mean(g * xhat)) cancels over rows of 8192.
double grad_tol(at::ScalarType dtype) { return dtype == at::kFloat ? 1e-4 : 1.2e-2; }

at::Tensor cuda(const at::Tensor& t, at::ScalarType dtype) { return t.to(at::kCUDA, dtype).detach().requires_grad_(true); }
at::Tensor cpu64(const at::Tensor& t) { return t.detach().cpu().to(at::kDouble).requires_grad_(true); }

TEST(CudaTrainRmsNorm, ForwardAndBackwardMatchFloat64) {
  at::manual_seed(0);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {19, 19}, {111, 111}, {4097, 19}, {19, 4097}, {111, 1024}, {4097, 2048}, {19, 8192}, {3, 8}}) {
      at::Tensor x = at::randn({rows, cols}) * 3, w = at::rand({cols}) + 0.5, dy = at::randn({rows, cols});
      at::Tensor xc = cuda(x, dtype), wc = cuda(w, dtype);
      at::Tensor y = kernels::rms_norm_train_cuda(xc, wc, 1e-6);
      y.backward(dy.to(at::kCUDA, dtype));
      at::Tensor xr = cpu64(x.to(dtype)), wr = cpu64(w.to(dtype));
      at::Tensor yr = kernels::rms_norm_reference(xr, wr, 1e-6);
      yr.backward(dy.to(dtype).to(at::kDouble));
      const std::string what = std::string(c10::toString(dtype)) + " " + std::to_string(rows) + "x" + std::to_string(cols);
      EXPECT_LT(rel_err(y, yr), tol(dtype)) << what;
      EXPECT_LT(rel_err(xc.grad(), xr.grad()), grad_tol(dtype)) << what;
      EXPECT_LT(rel_err(wc.grad(), wr.grad()), grad_tol(dtype)) << what;
      // Deterministic: a second backward gives the same bits.
      at::Tensor g1 = wc.grad().clone();
      wc.mutable_grad() = at::Tensor();
      kernels::rms_norm_train_cuda(xc, wc, 1e-6).backward(dy.to(at::kCUDA, dtype));
      EXPECT_TRUE(test::all_equal(wc.grad().cpu(), g1.cpu())) << what;
    }
  }
}

TEST(CudaTrainRmsNorm, DispatchTakesTheFusedPathWithGrad) {
  at::Tensor x = at::randn({19, 111}, at::kCUDA).requires_grad_(true);
  at::Tensor w = (at::rand({111}, at::kCUDA) + 0.5).requires_grad_(true);
  at::Tensor y = kernels::rms_norm(x, w, 1e-6);
  EXPECT_NE(y.grad_fn()->name().find("RmsNorm"), std::string::npos) << y.grad_fn()->name();
  EXPECT_THROW(kernels::rms_norm_train_cuda(x, w.narrow(0, 0, 110), 1e-6), Error);
}

TEST(CudaTrainRmsNorm, SegmentsMatchFloat64IncludingEmptyOnes) {
  at::manual_seed(1);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 19}, {19, 111}, {111, 4097}, {4097, 1024}}) {
      const int64_t S = 7;
      // Sorted ends with empty segments (repeated ends), the last at rows.
      at::Tensor cuts = std::get<0>(at::sort(at::randint(0, rows + 1, {S - 1})));
      at::Tensor ends = at::cat({cuts, at::full({1}, rows, at::kLong)}).to(at::kInt);
      ends[2] = ends[1];
      at::Tensor x = at::randn({rows, cols}) * 2, w = at::rand({S, cols}) + 0.5, dy = at::randn({rows, cols});
      at::Tensor xc = cuda(x, dtype), wc = cuda(w, dtype);
      at::Tensor y = kernels::segment_rms_norm(xc, wc, ends.cuda(), 1e-6);
      y.backward(dy.to(at::kCUDA, dtype));
      at::Tensor xr = cpu64(x.to(dtype)), wr = cpu64(w.to(dtype));
      at::Tensor yr = kernels::segment_rms_norm_reference(xr, wr, ends, 1e-6);
      yr.backward(dy.to(dtype).to(at::kDouble));
      const std::string what = std::string(c10::toString(dtype)) + " " + std::to_string(rows) + "x" + std::to_string(cols);
      EXPECT_LT(rel_err(y, yr), tol(dtype)) << what;
      EXPECT_LT(rel_err(xc.grad(), xr.grad()), grad_tol(dtype)) << what;
      EXPECT_LT(rel_err(wc.grad(), wr.grad()), grad_tol(dtype)) << what;
    }
  }
}

// The norm's gradient by its formula (the batch-invariant norms' node): the kernels against the
// fp64 reference, for a shared weight row and one row per row, each gradient alone or both; the
// same bits twice; a zero row (a MoE spare row: eps alone keeps it finite) and a tiny one (eps
// dominates) among them; each row's dx (and per-row dw) the same bits when its first rows run alone.
TEST(CudaTrainRmsNorm, BackwardByFormulaMatchesFloat64) {
  at::manual_seed(4);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (const bool per_row : {false, true})
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
               {1, 19}, {19, 1024}, {111, 111}, {4097, 1024}, {19, 4097}, {3, 8192}}) {
        at::Tensor x = at::randn({rows, cols}) * 2, dy = at::randn({rows, cols});
        x[0].zero_();
        if (rows > 1) x[rows - 1].mul_(1e-4);
        at::Tensor w = at::rand(per_row ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{cols}) + 0.5;
        x = x.to(dtype), dy = dy.to(dtype), w = w.to(dtype);
        const auto [dx, dw] = kernels::rms_norm_backward(x.cuda(), w.cuda(), dy.cuda(), 1e-6, true, true);
        const auto [rx, rw] = kernels::rms_norm_backward_reference(x.to(at::kDouble), w.to(at::kDouble),
                                                                   dy.to(at::kDouble), 1e-6, true, true);
        const std::string what = std::string(c10::toString(dtype)) + (per_row ? " per-row " : " shared ") +
                                 std::to_string(rows) + "x" + std::to_string(cols);
        ASSERT_EQ(dx.scalar_type(), dtype) << what;
        ASSERT_EQ(dw.sizes(), w.sizes()) << what;
        EXPECT_LT(rel_err(dx, rx), grad_tol(dtype)) << what;
        EXPECT_LT(rel_err(dw, rw), grad_tol(dtype)) << what;
        const auto [dx2, dw2] = kernels::rms_norm_backward(x.cuda(), w.cuda(), dy.cuda(), 1e-6, true, true);
        EXPECT_TRUE(test::all_equal(dx2.cpu(), dx.cpu()) && test::all_equal(dw2.cpu(), dw.cpu())) << what;
        // One gradient alone: the same values, the other undefined.
        const auto [ox, nw] = kernels::rms_norm_backward(x.cuda(), w.cuda(), dy.cuda(), 1e-6, true, false);
        const auto [nx, ow] = kernels::rms_norm_backward(x.cuda(), w.cuda(), dy.cuda(), 1e-6, false, true);
        EXPECT_FALSE(nw.defined() || nx.defined()) << what;
        EXPECT_TRUE(test::all_equal(ox.cpu(), dx.cpu()) && test::all_equal(ow.cpu(), dw.cpu())) << what;
        const int64_t k = std::min<int64_t>(rows, 7);
        const at::Tensor wk = per_row ? w.narrow(0, 0, k) : w;
        const auto [kx, kw] = kernels::rms_norm_backward(x.narrow(0, 0, k).cuda(), wk.cuda(), dy.narrow(0, 0, k).cuda(),
                                                         1e-6, true, per_row);
        EXPECT_TRUE(test::all_equal(kx.cpu(), dx.narrow(0, 0, k).cpu())) << what << ": dx depends on the other rows";
        if (per_row) EXPECT_TRUE(test::all_equal(kw.cpu(), dw.narrow(0, 0, k).cpu())) << what << ": dw, likewise";
      }
}

TEST(CudaTrainRope, BackwardMatchesFloat64) {
  at::manual_seed(2);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (auto [T, H, hd] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 2}, {19, 3, 38}, {111, 4, 128}, {4097, 2, 64}}) {
      auto [cos, sin] = model::rope_tables(at::arange(T), hd, 10000.0, at::kDouble);
      at::Tensor x = at::randn({T, H, hd}), dy = at::randn({T, H, hd});
      at::Tensor xc = cuda(x, dtype);
      at::Tensor y = kernels::apply_rope(xc, cos.to(at::kCUDA, dtype), sin.to(at::kCUDA, dtype));
      y.backward(dy.to(at::kCUDA, dtype));
      at::Tensor xr = cpu64(x.to(dtype));
      kernels::apply_rope_reference(xr, cos.to(dtype).to(at::kDouble), sin.to(dtype).to(at::kDouble))
          .backward(dy.to(dtype).to(at::kDouble));
      EXPECT_LT(rel_err(xc.grad(), xr.grad()), tol(dtype)) << T << " " << H << " " << hd;
    }
  }
}

TEST(CudaTrainSwiglu, ForwardAndBackwardMatchFloat64) {
  at::manual_seed(3);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {19, 19}, {111, 111}, {4097, 48}, {3, 4097}}) {
      at::Tensor g = at::randn({rows, cols}) * 3, u = at::randn({rows, cols}), da = at::randn({rows, cols});
      at::Tensor gc = cuda(g, dtype), uc = cuda(u, dtype);
      at::Tensor a = kernels::swiglu(gc, uc);
      a.backward(da.to(at::kCUDA, dtype));
      at::Tensor gr = cpu64(g.to(dtype)), ur = cpu64(u.to(dtype));
      at::Tensor ar = kernels::swiglu_reference(gr, ur);
      ar.backward(da.to(dtype).to(at::kDouble));
      const std::string what = std::string(c10::toString(dtype)) + " " + std::to_string(rows) + "x" + std::to_string(cols);
      EXPECT_LT(rel_err(a, ar), tol(dtype)) << what;
      EXPECT_LT(rel_err(gc.grad(), gr.grad()), tol(dtype)) << what;
      EXPECT_LT(rel_err(uc.grad(), ur.grad()), tol(dtype)) << what;
    }
  }
}

TEST(CudaTrainMoeRows, DispatchAndCombineMatchFloat64) {
  at::manual_seed(4);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (auto [T, k, C] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {1, 1, 1}, {19, 2, 19}, {111, 8, 111}, {4097, 8, 64}, {19, 16, 4097}, {111, 3, 1024}}) {
      const int64_t E = 8;
      at::Tensor ids = std::get<1>(at::rand({T, E}).topk(std::min(k, E), -1));
      if (k > E) ids = at::randint(0, E, {T, k});  // k > E: repeated experts are still valid slots
      at::Tensor flat = ids.reshape(-1).cuda();
      kernels::MoeLayout l = kernels::moe_layout(flat, E, k, 16);
      const std::string what = std::string(c10::toString(dtype)) + " T=" + std::to_string(T) + " k=" + std::to_string(k) +
                               " C=" + std::to_string(C);
      // Dispatch: a copy, so bitwise equal to the reference; its gradient sums k rows.
      at::Tensor z = at::randn({T, C}), dzp = at::randn({l.bound, C});
      at::Tensor zc = cuda(z, dtype);
      at::Tensor zp = kernels::moe_dispatch(zc, l.slot_row, k, l.bound);
      EXPECT_TRUE(test::all_equal(zp.cpu(), kernels::moe_dispatch_reference(z.to(dtype), l.slot_row.cpu(), k, l.bound)))
          << what;
      zp.backward(dzp.to(at::kCUDA, dtype));
      at::Tensor zr = cpu64(z.to(dtype));
      kernels::moe_dispatch_reference(zr, l.slot_row.cpu(), k, l.bound).backward(dzp.to(dtype).to(at::kDouble));
      EXPECT_LT(rel_err(zc.grad(), zr.grad()), tol(dtype)) << what;
      // Combine: fp32 weighted sums; gradients to the rows and to the weights.
      at::Tensor y = at::randn({l.bound, C}), w = at::rand({T, k}), dm = at::randn({T, C});
      at::Tensor yc = cuda(y, dtype), wc = w.cuda().requires_grad_(true);
      at::Tensor m = kernels::moe_combine(yc, wc, l.slot_row);
      m.backward(dm.to(at::kCUDA, dtype));
      at::Tensor yr = cpu64(y.to(dtype)), wr = cpu64(w);
      at::Tensor mr = kernels::moe_combine_reference(yr, wr, l.slot_row.cpu());
      mr.backward(dm.to(dtype).to(at::kDouble));
      EXPECT_LT(rel_err(m, mr), tol(dtype)) << what;
      EXPECT_LT(rel_err(yc.grad(), yr.grad()), tol(dtype)) << what;
      EXPECT_LT(rel_err(wc.grad(), wr.grad()), tol(dtype)) << what;
    }
  }
}

// Flash's output `o` (its backward already run with `dout`) against the float64 reference `ref` of
// the same bf16-rounded inputs: the output, and the gradients of q, k and v (`got` against `want`).
void expect_flash_matches(const at::Tensor& o, const at::Tensor& ref, const at::Tensor& dout,
                          const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, int64_t window) {
  ref.backward(dout.to(at::kBFloat16).to(at::kDouble));
  EXPECT_LT(rel_err(o, ref), 1.2e-2) << "window " << window;
  const char* names[] = {"q", "k", "v"};
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LT(rel_err(got[i].grad(), want[i].grad()), 2e-2) << names[i] << " gradient, window " << window;
}

TEST(CudaTrainFlash, VarlenMatchesFloat64WithWindowsAndGqa) {
  if (!kernels::flash_varlen_available(at::Device(at::kCUDA), at::kBFloat16, 64))
    GTEST_SKIP() << "this libtorch has no usable _flash_attention_forward; the padded attention serves";
  at::manual_seed(5);
  const std::vector<int64_t> lens = {1, 19, 111, 300, 7};
  const int64_t Hq = 4, Hkv = 2, hd = 64;
  std::vector<int32_t> cu = {0};
  for (int64_t n : lens) cu.push_back(cu.back() + int32_t(n));
  const int64_t T = cu.back();
  for (int64_t window : {0, 7, 64}) {
    at::Tensor q = at::randn({T, Hq, hd}), k = at::randn({T, Hkv, hd}), v = at::randn({T, Hkv, hd}), dout = at::randn({T, Hq, hd});
    at::Tensor qc = cuda(q, at::kBFloat16), kc = cuda(k, at::kBFloat16), vc = cuda(v, at::kBFloat16);
    at::Tensor o = kernels::flash_varlen_attention(qc, kc, vc, at::tensor(cu, at::kInt).cuda(), 300, window);
    o.backward(dout.to(at::kCUDA, at::kBFloat16));
    at::Tensor qr = cpu64(q.to(at::kBFloat16)), kr = cpu64(k.to(at::kBFloat16)), vr = cpu64(v.to(at::kBFloat16));
    std::vector<at::Tensor> outs;
    for (size_t s = 0; s < lens.size(); ++s) {
      auto part = [&](const at::Tensor& t) { return t.narrow(0, cu[s], lens[s]).transpose(0, 1); };
      outs.push_back(model::sequence_attention(part(qr), model::expand_kv_heads(part(kr), Hq / Hkv),
                                               model::expand_kv_heads(part(vr), Hq / Hkv), window == 0, window)
                         .transpose(0, 1));
    }
    expect_flash_matches(o, at::cat(outs, 0), dout, {qc, kc, vc}, {qr, kr, vr}, window);
  }
}

// Context parallelism's form: each piece's queries are the last of its keys' positions (a query
// block after earlier keys, as a cp rank's pieces read their sequence's gathered keys). Against
// the float64 reference at the same absolute positions; fp32 does not take this path.
TEST(CudaTrainFlash, QueriesAfterEarlierKeysMatchFloat64) {
  EXPECT_FALSE(kernels::flash_varlen_offsets_available(at::Device(at::kCUDA), at::kFloat, 64))
      << "fp32 must keep the reference attention";
  if (!kernels::flash_varlen_offsets_available(at::Device(at::kCUDA), at::kBFloat16, 64))
    GTEST_SKIP() << "this libtorch's flash attention does not align queries after earlier keys";
  at::manual_seed(15);
  // (queries, keys): one token, a back chunk, a piece after a long prefix, queries = keys.
  const std::vector<std::pair<int64_t, int64_t>> pieces = {{1, 1}, {19, 40}, {111, 4097}, {19, 19}, {1, 111}};
  const int64_t Hq = 4, Hkv = 2, hd = 64;
  std::vector<int32_t> cu_q = {0}, cu_k = {0};
  int64_t max_q = 0, max_k = 0;
  for (auto [n, m] : pieces) {
    cu_q.push_back(cu_q.back() + int32_t(n));
    cu_k.push_back(cu_k.back() + int32_t(m));
    max_q = std::max(max_q, n);
    max_k = std::max(max_k, m);
  }
  for (int64_t window : {0, 7, 64}) {
    at::Tensor q = at::randn({cu_q.back(), Hq, hd}), k = at::randn({cu_k.back(), Hkv, hd}),
               v = at::randn({cu_k.back(), Hkv, hd}), dout = at::randn({cu_q.back(), Hq, hd});
    at::Tensor qc = cuda(q, at::kBFloat16), kc = cuda(k, at::kBFloat16), vc = cuda(v, at::kBFloat16);
    at::Tensor o = kernels::flash_varlen_attention(qc, kc, vc, at::tensor(cu_q, at::kInt).cuda(),
                                                   at::tensor(cu_k, at::kInt).cuda(), max_q, max_k, window);
    o.backward(dout.to(at::kCUDA, at::kBFloat16));
    at::Tensor qr = cpu64(q.to(at::kBFloat16)), kr = cpu64(k.to(at::kBFloat16)), vr = cpu64(v.to(at::kBFloat16));
    std::vector<at::Tensor> outs;
    for (size_t s = 0; s < pieces.size(); ++s) {
      const auto [n, m] = pieces[s];
      auto keys = [&](const at::Tensor& t) {
        return model::expand_kv_heads(t.narrow(0, cu_k[s], m).transpose(0, 1), Hq / Hkv);
      };
      // The keys at positions 0..m-1 of the sequence, the queries at m-n..m-1.
      outs.push_back(model::sequence_attention(qr.narrow(0, cu_q[s], n).transpose(0, 1), keys(kr), keys(vr),
                                               window == 0, window, m - n, 0)
                         .transpose(0, 1));
    }
    expect_flash_matches(o, at::cat(outs, 0), dout, {qc, kc, vc}, {qr, kr, vr}, window);
  }
}

// The whole model: the fused path against the ATen composition it replaces, same routing
// (replayed), log-probs and every parameter's gradient close in bf16.
TEST(CudaTrainModel, FusedPathMatchesTheComposition) {
  at::manual_seed(6);
  model::ModelConfig cfg = test::cuda_config();
  model::Muse m = test::to_device(model::Muse::init(cfg, 11, at::kFloat, at::kCPU), at::kCUDA, at::kBFloat16);
  m.set_requires_grad(true);
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t n : {1, 19, 40, 9}) {
    at::Tensor ids = at::randint(cfg.vocab_size, {n});
    seqs.emplace_back(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
  }
  model::PackedBatch batch = model::PackedBatch::from_sequences(seqs, at::kCUDA);
  auto run = [&](bool fused, const at::Tensor& replay, std::map<std::string, at::Tensor>& grads) {
    model::ForwardOptions opt;
    opt.kernel_path = fused ? model::KernelPath::kFused : model::KernelPath::kGroupedMm;
    opt.targets = batch.tokens.roll(-1);
    opt.replay_routing = replay;
    for (auto& [n, p] : m.named_parameters()) p.mutable_grad() = at::Tensor();
    model::ForwardOutput out = m.forward(batch, opt);
    (-out.logprobs.to(at::kFloat).mean()).backward();
    for (auto& [n, p] : m.named_parameters()) grads[n] = p.grad().defined() ? p.grad().clone() : at::Tensor();
    return out;
  };
  std::map<std::string, at::Tensor> g_ref, g_fused;
  model::ForwardOutput ref = run(false, at::Tensor(), g_ref);
  model::ForwardOutput fused = run(true, ref.routing, g_fused);
  EXPECT_TRUE(test::all_equal(fused.routing.cpu(), ref.routing.cpu()));
  EXPECT_LT(rel_err(fused.logprobs, ref.logprobs), 2e-2);
  for (const auto& [name, g] : g_ref) {
    if (!g.defined()) continue;
    ASSERT_TRUE(g_fused[name].defined()) << name;
    EXPECT_LT(rel_err(g_fused[name], g), 5e-2) << name;
  }
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

TEST(CudaTrainLogprob, ForwardAndBackwardMatchFloat64) {
  at::manual_seed(8);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (auto [n, d, V] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {1, 8, 1}, {19, 19, 111}, {111, 64, 4097}, {4097, 32, 1024}, {7, 128, 65536}}) {
      for (double temperature : {1.0, 0.7}) {
        at::Tensor h = at::randn({n, d}), w = at::randn({V, d}) / std::sqrt(double(d)) * 4;
        at::Tensor t = at::randint(V, {n}), g = at::randn({n});
        at::Tensor hc = cuda(h, dtype), wc = cuda(w, dtype);
        at::Tensor lp = kernels::token_logprobs(hc, wc, t.cuda(), temperature);
        lp.backward(g.cuda());
        // The reference on the same rounded logits: the GEMM in the model's dtype, then float64.
        at::Tensor hr = cpu64(h.to(dtype)), wr = cpu64(w.to(dtype));
        at::Tensor lr = kernels::token_logprobs_reference(hr, wr, t, temperature);
        lr.backward(g.to(at::kDouble));
        const std::string what = std::string(c10::toString(dtype)) + " n=" + std::to_string(n) +
                                 " V=" + std::to_string(V) + " T=" + std::to_string(temperature);
        EXPECT_EQ(lp.scalar_type(), at::kFloat);
        EXPECT_LT(rel_err(lp, lr), dtype == at::kFloat ? 1e-4 : 2e-2) << what;
        EXPECT_LT(rel_err(hc.grad(), hr.grad()), tol(dtype) * 2) << what;
        EXPECT_LT(rel_err(wc.grad(), wr.grad()), tol(dtype) * 2) << what;
      }
    }
  }
}

}  // namespace
}  // namespace kiln
