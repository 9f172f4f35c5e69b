// Sampling: the fp64 CPU reference (also what the engine runs on CPU) and the binding of the CUDA
// kernel in sampling.cu.
#include "kernels/sampling.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/sampling_cuda.h"
#endif

namespace kiln::kernels {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double stream_uniform(uint64_t stream_seed) { return double(mix64(stream_seed) >> 11) * 0x1p-53; }

std::pair<int64_t, double> sample_row_reference(const float* x, int64_t V, double temperature, uint64_t stream_seed) {
  const int64_t argmax = std::max_element(x, x + V) - x;  // first maximum
  const double mx = x[argmax];
  if (temperature == 0) {
    double z = 0;
    for (int64_t i = 0; i < V; ++i) z += std::exp(double(x[i]) - mx);
    return {argmax, -std::log(z)};
  }
  // Inverse CDF in id order, no sort: compare the draw against running sums of unnormalised
  // weights (u * z < cumsum) so that the CUDA kernel can split the sum into chunks.
  const double u = stream_uniform(stream_seed);
  std::vector<double> w(static_cast<size_t>(V));
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += (w[size_t(i)] = std::exp((double(x[i]) - mx) / temperature));
  const double target = u * z;
  double c = 0;
  for (int64_t i = 0; i < V; ++i) {
    c += w[size_t(i)];
    if (target < c) return {i, std::log(w[size_t(i)] / z)};
  }
  return {argmax, -std::log(z)};  // only when rounding leaves the draw past the total
}

namespace {
void check_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& seeds) {
  KILN_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
             "sample_rows: logits must be fp32 [rows, V>0] (got ", logits.sizes(), " ", logits.scalar_type(), ")");
  const int64_t n = logits.size(0);
  KILN_CHECK(temperature.dim() == 1 && temperature.size(0) == n && temperature.scalar_type() == at::kDouble,
             "sample_rows: temperature must be fp64 [", n, "] (got ", temperature.sizes(), " ",
             temperature.scalar_type(), ")");
  KILN_CHECK(seeds.dim() == 1 && seeds.size(0) == n && seeds.scalar_type() == at::kLong,
             "sample_rows: stream_seed must be int64 [", n, "] (got ", seeds.sizes(), " ", seeds.scalar_type(), ")");
}
}  // namespace

std::pair<at::Tensor, at::Tensor> sample_rows_reference(const at::Tensor& logits, const at::Tensor& temperature,
                                                        const at::Tensor& stream_seed) {
  check_rows(logits, temperature, stream_seed);
  at::Tensor l = logits.cpu().contiguous(), t = temperature.cpu().contiguous(), s = stream_seed.cpu().contiguous();
  const int64_t n = l.size(0), V = l.size(1);
  at::Tensor ids = at::empty({n}, at::kLong), lps = at::empty({n}, at::kFloat);
  for (int64_t r = 0; r < n; ++r) {
    auto [id, lp] = sample_row_reference(l.data_ptr<float>() + r * V, V, t.data_ptr<double>()[r],
                                         uint64_t(s.data_ptr<int64_t>()[r]));
    ids.data_ptr<int64_t>()[r] = id;
    lps.data_ptr<float>()[r] = float(lp);
  }
  return {ids.to(logits.device()), lps.to(logits.device())};
}

std::pair<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                                              const at::Tensor& stream_seed) {
#if KILN_WITH_CUDA
  if (logits.is_cuda()) return sample_rows_cuda(logits, temperature, stream_seed);
#endif
  return sample_rows_reference(logits, temperature, stream_seed);
}

std::pair<at::Tensor, at::Tensor> sample_rows_cuda(const at::Tensor& logits, const at::Tensor& temperature,
                                                   const at::Tensor& stream_seed) {
#if KILN_WITH_CUDA
  check_rows(logits, temperature, stream_seed);
  KILN_CHECK(logits.is_cuda() && temperature.device() == logits.device() && stream_seed.device() == logits.device(),
             "sample_rows_cuda: logits, temperature and stream_seed must be on one CUDA device (got ",
             logits.device(), ", ", temperature.device(), ", ", stream_seed.device(), ")");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor l = logits.contiguous(), t = temperature.contiguous(), s = stream_seed.contiguous();
  const int64_t n = l.size(0);
  at::Tensor ids = at::empty({n}, l.options().dtype(at::kLong));
  at::Tensor lps = at::empty({n}, l.options());
  const cudaError_t err = launch_sample_rows(l.data_ptr<float>(), n, l.size(1), t.data_ptr<double>(),
                                             reinterpret_cast<const uint64_t*>(s.data_ptr<int64_t>()),
                                             ids.data_ptr<int64_t>(), lps.data_ptr<float>(),
                                             c10::cuda::getCurrentCUDAStream());
  KILN_CHECK(err == cudaSuccess, "sample_rows_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return {ids, lps};
#else
  KILN_FAIL("sample_rows_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

}  // namespace kiln::kernels
