// `--profile` for the benches: runs a function under libtorch's Kineto profiler (CPU ops and CUDA
// kernels) and saves a Chrome trace, which tools/profile_summary.py breaks down by op class.
#include <torch/csrc/autograd/profiler_kineto.h>

#include <set>

#include "core/error.h"
#include "tools/bench_util.h"

namespace kiln::tools {

void profile_to(const std::string& path, at::Device device, const std::function<void()>& fn) {
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  std::set<ActivityType> activities{ActivityType::CPU};
  if (device.is_cuda()) activities.insert(ActivityType::CUDA);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  try {
    fn();
    sync(device);
  } catch (...) {
    torch::autograd::profiler::disableProfiler();
    throw;
  }
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  KILN_CHECK(result, "bench: --profile: the profiler returned no result");
  result->save(path);
}

}  // namespace kiln::tools
