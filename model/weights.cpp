// Muse weights: seeded random init, named parameters, HF-named checkpoint save and load.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#if KILN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#endif

#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/expert_parallel.h"
#include "model/names.h"
#include "model/nvfp4_model.h"

namespace kiln::model {
using namespace detail;
namespace {

// Visits every tensor of the model under its in-memory name. `trainable` is false for buffers.
// W is Weights (fn may replace the tensors) or const Weights.
template <typename W, typename Fn>
void for_each_tensor(W& w, Fn&& fn) {
  fn("model.embed_tokens.weight", w.embed, true);
  for (int64_t i = 0; i < int64_t(w.layers.size()); ++i) {
    auto& l = w.layers[i];
    const std::string p = layer_prefix(i);
    fn(p + "input_layernorm.weight", l.input_norm, true);
    fn(p + "self_attn.q_proj.weight", l.q_proj, true);
    fn(p + "self_attn.k_proj.weight", l.k_proj, true);
    fn(p + "self_attn.v_proj.weight", l.v_proj, true);
    fn(p + "self_attn.o_proj.weight", l.o_proj, true);
    fn(p + "post_attention_layernorm.weight", l.post_attn_norm, true);
    fn(p + "pre_moe_layernorm.weight", l.pre_moe_norm, true);
    fn(p + "mlp.router.weight", l.router, true);
    if (l.router_bias.defined()) fn(p + "mlp.router.e_score_correction_bias", l.router_bias, false);
    fn(p + "mlp.pooler.weight", l.pooler, true);
    fn(p + "mlp.experts.gate_proj.weight", l.expert_gate, true);
    fn(p + "mlp.experts.up_proj.weight", l.expert_up, true);
    fn(p + "mlp.experts.down_proj.weight", l.expert_down, true);
    fn(p + "mlp.experts.norm.weight", l.expert_norm, true);
    fn(p + "mlp.unpooler.weight", l.unpooler, true);
    fn(p + "post_moe_layernorm.weight", l.post_moe_norm, true);
  }
  fn("model.norm.weight", w.final_norm, true);
  fn("lm_head.weight", w.lm_head, true);
}

at::Tensor normal(const std::vector<int64_t>& shape, double std, uint64_t seed, const std::string& name) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(stream_seed(seed, name));
  return at::empty(shape, at::kFloat).normal_(0.0, std, gen);
}

}  // namespace

namespace detail {

uint64_t stream_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the name, then mixed with the seed
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  uint64_t z = h ^ (seed + 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The layer-tensor slots by their name suffix, so init and load fill the same fields.
at::Tensor* layer_slot(LayerWeights& l, const std::string& suffix) {
  static const std::vector<std::pair<const char*, at::Tensor LayerWeights::*>> slots = {
      {"input_layernorm.weight", &LayerWeights::input_norm},
      {"self_attn.q_proj.weight", &LayerWeights::q_proj},
      {"self_attn.k_proj.weight", &LayerWeights::k_proj},
      {"self_attn.v_proj.weight", &LayerWeights::v_proj},
      {"self_attn.o_proj.weight", &LayerWeights::o_proj},
      {"post_attention_layernorm.weight", &LayerWeights::post_attn_norm},
      {"pre_moe_layernorm.weight", &LayerWeights::pre_moe_norm},
      {"mlp.router.weight", &LayerWeights::router},
      {"mlp.router.e_score_correction_bias", &LayerWeights::router_bias},
      {"mlp.pooler.weight", &LayerWeights::pooler},
      {"mlp.experts.gate_proj.weight", &LayerWeights::expert_gate},
      {"mlp.experts.up_proj.weight", &LayerWeights::expert_up},
      {"mlp.experts.down_proj.weight", &LayerWeights::expert_down},
      {"mlp.experts.norm.weight", &LayerWeights::expert_norm},
      {"mlp.unpooler.weight", &LayerWeights::unpooler},
      {"post_moe_layernorm.weight", &LayerWeights::post_moe_norm},
  };
  for (const auto& [name, member] : slots)
    if (suffix == name) return &(l.*member);
  return nullptr;
}

bool is_expert_stack(const std::string& suffix) { return suffix.rfind("mlp.experts.", 0) == 0; }

// Shapes of one layer's tensors (experts stacked), by suffix.
std::vector<std::pair<std::string, std::vector<int64_t>>> layer_shapes(const ModelConfig& c) {
  const int64_t d = c.hidden_size, dl = c.latent_size, E = c.num_experts, I = c.expert_ffn_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> s = {
      {"input_layernorm.weight", {d}},
      {"self_attn.q_proj.weight", {c.q_size(), d}},
      {"self_attn.k_proj.weight", {c.kv_size(), d}},
      {"self_attn.v_proj.weight", {c.kv_size(), d}},
      {"self_attn.o_proj.weight", {d, c.q_size()}},
      {"post_attention_layernorm.weight", {d}},
      {"pre_moe_layernorm.weight", {d}},
      {"mlp.router.weight", {E, d}},
      {"mlp.pooler.weight", {dl, d}},
      {"mlp.experts.gate_proj.weight", {E, I, dl}},
      {"mlp.experts.up_proj.weight", {E, I, dl}},
      {"mlp.experts.down_proj.weight", {E, dl, I}},
      {"mlp.experts.norm.weight", {E, dl}},
      {"mlp.unpooler.weight", {d, dl}},
      {"post_moe_layernorm.weight", {d}},
  };
  if (c.router_score == RouterScore::kSigmoid) s.push_back({"mlp.router.e_score_correction_bias", {E}});
  return s;
}

std::string expert_name(const std::string& layer_prefix, int64_t e, const std::string& suffix) {
  // "mlp.experts.gate_proj.weight" -> "<prefix>mlp.experts.<e>.gate_proj.weight"
  return layer_prefix + "mlp.experts." + std::to_string(e) + "." + suffix.substr(std::string("mlp.experts.").size());
}

at::ScalarType tensor_dtype(const std::string& suffix, at::ScalarType dtype) {
  return suffix.rfind("mlp.router.", 0) == 0 ? router_dtype(dtype) : dtype;
}

const std::vector<LinearSlot>& linear_slots() {
  using L = LayerWeights;
  using Q = LayerWeights::Nvfp4;
  using A = LayerWeights::Lora;
  static const std::vector<LinearSlot> s = {
      {"self_attn.q_proj", "q_proj", &L::q_proj, &Q::q_proj, &A::q_a, &A::q_b, false},
      {"self_attn.k_proj", "k_proj", &L::k_proj, &Q::k_proj, &A::k_a, &A::k_b, false},
      {"self_attn.v_proj", "v_proj", &L::v_proj, &Q::v_proj, &A::v_a, &A::v_b, false},
      {"self_attn.o_proj", "o_proj", &L::o_proj, &Q::o_proj, &A::o_a, &A::o_b, false},
      {"mlp.pooler", "pooler", &L::pooler, &Q::pooler, &A::pool_a, &A::pool_b, false},
      {"mlp.unpooler", "unpooler", &L::unpooler, &Q::unpooler, &A::unpool_a, &A::unpool_b, false},
      {"mlp.experts.gate_proj", "gate_proj", &L::expert_gate, &Q::expert_gate, &A::gate_a, &A::gate_b, true},
      {"mlp.experts.up_proj", "up_proj", &L::expert_up, &Q::expert_up, &A::up_a, &A::up_b, true},
      {"mlp.experts.down_proj", "down_proj", &L::expert_down, &Q::expert_down, &A::down_a, &A::down_b, true},
  };
  return s;
}

std::string layer_prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + "."; }

std::string linear_module(int64_t layer, const LinearSlot& s, int64_t e) {
  return s.expert ? expert_name(layer_prefix(layer), e, s.module) : layer_prefix(layer) + s.module;
}

}  // namespace detail

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp32" || name == "float32") return at::kFloat;
  if (name == "fp64" || name == "float64") return at::kDouble;
  KILN_FAIL("dtype: unknown dtype '", name, "'; use bf16, fp32 or fp64");
}

at::Device parse_device(const std::string& name, const std::string& where) {
  const bool cuda = name == "cuda" || name.rfind("cuda:", 0) == 0;
  KILN_CHECK(name == "cpu" || cuda, where, ": unknown device '", name, "'; use cpu, cuda or cuda:N");
  if (!cuda) return at::Device(at::kCPU);
  KILN_CHECK(at::hasCUDA(), where, ": device '", name, "' needs CUDA, but this kiln build or machine has none",
             " (a CPU libtorch, or no GPU visible); use cpu");
  int64_t index = -1;
  if (name.size() > 5) {
    const std::string digits = name.substr(5);
    KILN_CHECK(!digits.empty() && digits.size() < 4 && digits.find_first_not_of("0123456789") == std::string::npos,
               where, ": device '", name, "': expected cuda:N with N a GPU index");
    index = std::stoll(digits);
    KILN_CHECK(index < int64_t(at::getNumGPUs()), where, ": device '", name, "': this machine has ", at::getNumGPUs(),
               " GPU(s)");
  }
  return index < 0 ? at::Device(at::kCUDA) : at::Device(at::kCUDA, c10::DeviceIndex(index));
}

int64_t device_for_rank(int64_t local_rank, int64_t visible) {
  KILN_CHECK(visible > 0 && local_rank >= 0, "device: local rank ", local_rank, " sees ", visible,
             " CUDA devices; a GPU rank needs at least one (check CUDA_VISIBLE_DEVICES and the scheduler's GPU request)");
  return local_rank % visible;
}

at::Device rank_device(at::Device device, int64_t local_rank, int64_t ranks) {
  if (!device.is_cuda() || device.has_index() || ranks <= 1) return device;
#if KILN_WITH_CUDA
  device = at::Device(at::kCUDA, c10::DeviceIndex(device_for_rank(local_rank, c10::cuda::device_count())));
  c10::cuda::set_device(device.index());
#else
  (void)local_rank;
#endif
  return device;
}

#if KILN_WITH_CUDA
namespace {
c10::DeviceIndex cuda_index(at::Device d) { return d.has_index() ? d.index() : c10::cuda::current_device(); }
}  // namespace
#endif

void reset_peak_memory(at::Device device) {
#if KILN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_index(device));
#else
  (void)device;
#endif
}

double device_memory_bytes(at::Device device) {
#if KILN_WITH_CUDA
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(cuda_index(device));
    size_t free = 0, total = 0;
    const cudaError_t err = cudaMemGetInfo(&free, &total);
    KILN_CHECK(err == cudaSuccess, "cudaMemGetInfo on ", device, ": ", cudaGetErrorString(err));
    return double(total);
  }
#else
  (void)device;
#endif
  return 0.0;
}

namespace {
// The allocator's allocated-bytes statistic of `device` ([0]: StatType AGGREGATE in every torch
// version), peak or current, in GB; 0 on the CPU.
double allocated_gb(at::Device device, bool peak) {
#if KILN_WITH_CUDA
  if (device.is_cuda()) {
    const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device));
    return double(peak ? st.allocated_bytes[0].peak : st.allocated_bytes[0].current) / 1e9;
  }
#else
  (void)device, (void)peak;
#endif
  return 0.0;
}
}  // namespace

double peak_memory_gb(at::Device device) { return allocated_gb(device, true); }

void synchronize(at::Device device) {
#if KILN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#else
  (void)device;
#endif
}
double current_memory_gb(at::Device device) { return allocated_gb(device, false); }

std::vector<std::pair<std::string, at::Tensor>> Muse::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for_each_tensor(w_, [&](const std::string& n, const at::Tensor& t, bool trainable) {
    if (trainable && t.defined()) out.emplace_back(n, t);  // undefined: served from NVFP4
  });
  return out;
}

Muse Muse::clone(const std::function<bool(const std::string&)>& keep) const {
  at::NoGradGuard g;
  Weights w = w_;
  for_each_tensor(w, [&](const std::string& name, at::Tensor& t, bool trainable) {
    if (!t.defined()) return;
    t = !trainable || !keep || keep(name) ? t.detach().clone() : at::empty({0}, t.options());
  });
  // The NVFP4 copies and the adapters too.
  for (LayerWeights& l : w.layers)
    for (const LinearSlot& s : linear_slots()) {
      kernels::Nvfp4Tensor& q = l.nvfp4.*s.q;
      for (at::Tensor* t : {&q.packed, &q.block_scale, &q.tensor_scale, &q.input_scale, &(l.lora.*s.a), &(l.lora.*s.b)})
        if (t->defined()) *t = t->detach().clone();
    }
  return Muse(cfg_, std::move(w));
}

void Muse::set_requires_grad(bool on) {
  for (auto [name, t] : named_parameters()) t.requires_grad_(on);  // handles share the weights
}

namespace {

// The weights of `cfg` at init: norms one, the router bias zero, every matrix from
// draw(shape, std, name, suffix) (an expert stack [num_experts_held, ...] whole: all E, or a
// rank's shard), in its dtype on `device`.
template <typename Draw>
Muse build(const ModelConfig& cfg, at::ScalarType dtype, at::Device device, const Draw& draw,
           int64_t num_experts_held, const std::function<bool(const std::string&)>& keep = {}) {
  cfg.validate();
  const double std = cfg.init_std;
  const double out_std = std / std::sqrt(2.0 * double(cfg.num_layers));  // residual-writing matrices
  auto finish = [&](at::Tensor t, const std::string& suffix) {
    return t.to(device, tensor_dtype(suffix, dtype)).contiguous();
  };
  // A tensor `keep` leaves out is an empty placeholder of its dtype, drawn from no stream.
  auto held = [&](const std::string& name) { return !keep || keep(name); };
  auto placeholder = [&](const std::string& suffix) {
    return at::empty({0}, at::TensorOptions().device(device).dtype(tensor_dtype(suffix, dtype)));
  };
  Weights w;
  const std::vector<int64_t> vd{cfg.vocab_size, cfg.hidden_size};
  w.embed = held("model.embed_tokens.weight") ? finish(draw(vd, std, "model.embed_tokens.weight", ""), "")
                                              : placeholder("");
  w.lm_head = held("lm_head.weight") ? finish(draw(vd, std, "lm_head.weight", ""), "") : placeholder("");
  w.final_norm = held("model.norm.weight") ? finish(at::ones({cfg.hidden_size}, at::TensorOptions().device(device)), "")
                                           : placeholder("");
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    LayerWeights l;
    const std::string prefix = layer_prefix(i);
    for (auto [suffix, shape] : layer_shapes(cfg)) {
      if (is_expert_stack(suffix)) shape[0] = num_experts_held;  // a shard holds its experts only
      if (suffix != "mlp.router.e_score_correction_bias" && !held(prefix + suffix)) {  // a buffer stays whole
        *layer_slot(l, suffix) = placeholder(suffix);
        continue;
      }
      at::Tensor t;
      const bool residual_out = suffix == "self_attn.o_proj.weight" || suffix == "mlp.experts.down_proj.weight" ||
                                suffix == "mlp.unpooler.weight";
      if (suffix.find("norm") != std::string::npos) {
        t = at::ones(shape, at::TensorOptions().device(device));
      } else if (suffix == "mlp.router.e_score_correction_bias") {
        t = at::zeros(shape, at::TensorOptions().device(device));
      } else {
        t = draw(shape, residual_out ? out_std : std, prefix, suffix);
      }
      *layer_slot(l, suffix) = finish(t, suffix);
    }
    w.layers.push_back(std::move(l));
  }
  return Muse(cfg, std::move(w));
}

}  // namespace

Muse Muse::init(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device) {
  return init_shard(cfg, seed, dtype, device, 0, 1);
}

Muse Muse::init_shard(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device, int rank,
                      int size) {
  return init_owned(cfg, seed, dtype, device, rank, size, {});
}

Muse Muse::shapes(const ModelConfig& cfg, at::ScalarType dtype, int64_t experts) {
  return build(cfg, dtype, at::kMeta, [](const std::vector<int64_t>& shape, double, const std::string&,
                                         const std::string&) { return at::empty(shape, at::kMeta); },
               experts < 0 ? cfg.num_experts : experts);
}

Muse Muse::init_owned(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device, int rank,
                      int size, const std::function<bool(const std::string&)>& keep) {
  const detail::ExpertRange r = detail::expert_shard(cfg, rank, size);
  // Each tensor, each expert on its own, from the CPU stream of (seed, its name): a shard draws
  // exactly the values the whole model has there.
  return build(cfg, dtype, device, [&](const std::vector<int64_t>& shape, double std, const std::string& prefix,
                                       const std::string& suffix) {
    if (!is_expert_stack(suffix)) return normal(shape, std, seed, prefix + suffix);
    std::vector<at::Tensor> experts;
    const std::vector<int64_t> one(shape.begin() + 1, shape.end());
    for (int64_t e = r.first; e < r.first + r.size(cfg); ++e)
      experts.push_back(normal(one, std, seed, expert_name(prefix, e, suffix)));
    return at::stack(experts, 0);
  }, r.size(cfg), keep);
}

Muse Muse::init_on_device(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device) {
  at::Generator gen = device.is_cuda() ? at::Generator() : at::make_generator<at::CPUGeneratorImpl>(seed);
  if (device.is_cuda()) at::manual_seed(seed);
  return build(cfg, dtype, device, [&](const std::vector<int64_t>& shape, double std, const std::string&,
                                       const std::string& suffix) {
    const auto opt = at::TensorOptions().device(device).dtype(tensor_dtype(suffix, dtype));
    return (device.is_cuda() ? at::randn(shape, opt) : at::randn(shape, gen, opt)).mul_(std);
  }, cfg.num_experts);
}

std::vector<std::pair<std::string, at::Tensor>> hf_tensors(const Muse& model, int64_t first_expert, bool dense,
                                                           const std::function<bool(const std::string&)>& keep) {
  const ModelConfig& cfg = model.config();
  const at::ScalarType store = parse_dtype(cfg.dtype);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for_each_tensor(model.weights(), [&](const std::string& name, const at::Tensor& t, bool) {
    if (!t.defined()) return;  // a linear served from its NVFP4 copy only
    if (keep && !keep(name)) return;
    const bool router = name.find(".mlp.router.") != std::string::npos;
    at::Tensor v = t.detach().to(router ? at::kFloat : store);
    const std::string marker = ".mlp.experts.";
    const size_t at_pos = name.find(marker);
    if (at_pos == std::string::npos) {
      if (dense) out.emplace_back(name, v);
      return;
    }
    const std::string prefix = name.substr(0, at_pos + 1), suffix = name.substr(at_pos + 1);
    for (int64_t e = 0; e < v.size(0); ++e) out.emplace_back(expert_name(prefix, first_expert + e, suffix), v[e]);
  });
  return out;
}

namespace {
// The tensors to write, refused when one holds NaN or inf: a diverged model must not replace a
// good checkpoint.
std::vector<safetensors::NamedTensor> finite_tensors(std::vector<std::pair<std::string, at::Tensor>> named,
                                                     const std::string& dir) {
  std::vector<safetensors::NamedTensor> tensors;
  for (auto& [name, t] : named) {
    const at::Tensor bad = at::isfinite(t).logical_not_();
    KILN_CHECK(!bad.any().item<bool>(), "checkpoint: refusing to write ", dir, ": tensor ", name, " holds ",
               bad.sum().item<int64_t>(), " NaN/inf value(s); the model has diverged");
    tensors.push_back({name, t});
  }
  return tensors;
}
}  // namespace

void save_checkpoint(const Muse& model, const std::string& dir, uint64_t max_shard_bytes) {
  std::vector<safetensors::NamedTensor> tensors = finite_tensors(hf_tensors(model), dir);
  std::filesystem::create_directories(dir);
  safetensors::write_checkpoint(dir, tensors, max_shard_bytes);
  write_text_atomic(dir + "/config.json", model.config().to_json());
}

void save_checkpoint_part(const Muse& shard, const std::string& dir, int rank, int size, bool with_dense,
                          uint64_t max_shard_bytes) {
  const ModelConfig& cfg = shard.config();
  const detail::ExpertRange r = detail::expert_shard(cfg, rank, size);
  KILN_CHECK(shard.weights().layers.empty() || shard.weights().layers[0].expert_gate.size(0) == r.size(cfg),
             "checkpoint: rank ", rank, " of ", size, " writes ", r.size(cfg), " experts per layer but its model holds ",
             shard.weights().layers[0].expert_gate.size(0));
  char stem[48];
  std::snprintf(stem, sizeof(stem), "model-rank%05d-of-%05d", rank, size);
  safetensors::write_checkpoint_part(dir, finite_tensors(hf_tensors(shard, r.first, with_dense), dir), stem,
                                     max_shard_bytes);
  if (with_dense) write_text_atomic(dir + "/config.json", cfg.to_json());
}

void save_checkpoint_owned(const Muse& part, const std::string& dir, int writer, int writers, int64_t first_expert,
                           const std::function<bool(const std::string&)>& keep, bool with_config,
                           uint64_t max_shard_bytes) {
  char stem[48];
  std::snprintf(stem, sizeof(stem), "model-rank%05d-of-%05d", writer, writers);
  safetensors::write_checkpoint_part(dir, finite_tensors(hf_tensors(part, first_expert, true, keep), dir), stem,
                                     max_shard_bytes);
  if (with_config) write_text_atomic(dir + "/config.json", part.config().to_json());
}

namespace {

void check_finite(const at::Tensor& t, const std::string& name, const std::string& file) {
  const at::Tensor bad = at::isfinite(t).logical_not_().reshape({-1});
  if (!bad.any().item<bool>()) return;
  const int64_t at_index = bad.nonzero()[0][0].item<int64_t>();
  KILN_FAIL("checkpoint: tensor ", name, " in ", file, " holds ", bad.sum().item<int64_t>(),
            " NaN/inf value(s) (the first at flat index ", at_index, ", ", t.reshape({-1})[at_index].item<double>(),
            "); the checkpoint was saved from a diverged run or is damaged");
}

}  // namespace

namespace detail {

ExpertRange expert_shard(const ModelConfig& cfg, int rank, int size) {
  KILN_CHECK(size >= 1 && rank >= 0 && rank < size && cfg.num_experts % size == 0, "expert shard: ",
             cfg.num_experts, " experts do not split evenly over ", size, " ranks (rank ", rank, ")");
  const int64_t per = cfg.num_experts / size;
  return {int64_t(rank) * per, per};
}

Muse load_tensors(const ModelConfig& cfg, const safetensors::Checkpoint& ckpt, at::ScalarType dtype, at::Device device,
                  const std::function<bool(int64_t, const std::string&)>& skip, const std::set<std::string>& extra,
                  ExpertRange range, const std::function<bool(const std::string&)>& keep) {
  std::set<std::string> expected = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"};
  expected.insert(extra.begin(), extra.end());
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    const std::string prefix = layer_prefix(i);
    for (const auto& [suffix, shape] : layer_shapes(cfg)) {
      if (skip && skip(i, suffix)) continue;
      if (!is_expert_stack(suffix)) expected.insert(prefix + suffix);
      else
        for (int64_t e = 0; e < cfg.num_experts; ++e) expected.insert(expert_name(prefix, e, suffix));
    }
  }
  ckpt.expect_names(expected);

  // Every tensor as save_checkpoint writes it: the config's shape and dtype (the router F32), and
  // finite values (one pass each; a NaN weight would only show later as NaN log-probs).
  const at::ScalarType stored = parse_dtype(cfg.dtype);
  auto load = [&](const std::string& name, const std::vector<int64_t>& shape, at::ScalarType t,
                  const std::string& suffix = "") {
    const auto& info = ckpt.info(name);
    KILN_CHECK(info.shape == shape, "checkpoint: tensor ", name, " in ", ckpt.path(), " has shape ",
               at::IntArrayRef(info.shape), " but the config needs ", at::IntArrayRef(shape));
    const safetensors::DType want = safetensors::dtype_of(tensor_dtype(suffix, stored));
    KILN_CHECK(info.dtype == want, "checkpoint: tensor ", name, " in ", ckpt.path(), " is ",
               safetensors::dtype_name(info.dtype), " but config.json's torch_dtype ", cfg.dtype, " needs ",
               safetensors::dtype_name(want));
    at::Tensor loaded = ckpt.load(name, t);
    check_finite(loaded, name, ckpt.path());
    return loaded.to(device);
  };
  // A tensor `keep` leaves out is not read: a zero-element placeholder of its dtype (not buffers).
  auto held = [&](const std::string& name) { return !keep || keep(name); };
  auto placeholder = [&](at::ScalarType t) { return at::empty({0}, at::TensorOptions().device(device).dtype(t)); };
  Weights w;
  const int64_t V = cfg.vocab_size, d = cfg.hidden_size;
  w.embed = held("model.embed_tokens.weight") ? load("model.embed_tokens.weight", {V, d}, dtype) : placeholder(dtype);
  w.lm_head = held("lm_head.weight") ? load("lm_head.weight", {V, d}, dtype) : placeholder(dtype);
  w.final_norm = held("model.norm.weight") ? load("model.norm.weight", {d}, dtype) : placeholder(dtype);
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    LayerWeights l;
    const std::string prefix = layer_prefix(i);
    for (const auto& [suffix, shape] : layer_shapes(cfg)) {
      if (skip && skip(i, suffix)) continue;
      const at::ScalarType t = tensor_dtype(suffix, dtype);
      if (suffix != "mlp.router.e_score_correction_bias" && !held(prefix + suffix)) {
        *layer_slot(l, suffix) = placeholder(t);
        continue;
      }
      if (!is_expert_stack(suffix)) {
        *layer_slot(l, suffix) = load(prefix + suffix, shape, t, suffix);
        continue;
      }
      std::vector<int64_t> one(shape.begin() + 1, shape.end());
      std::vector<at::Tensor> experts;
      for (int64_t e = range.first; e < range.first + range.size(cfg); ++e)
        experts.push_back(load(expert_name(prefix, e, suffix), one, t, suffix));
      *layer_slot(l, suffix) = at::stack(experts, 0);
    }
    w.layers.push_back(std::move(l));
  }
  return Muse(cfg, std::move(w));
}

}  // namespace detail

Muse load_checkpoint(const std::string& dir, at::ScalarType dtype, at::Device device) {
  return load_checkpoint_shard(dir, dtype, device, 0, 1);
}

Muse load_checkpoint_shard(const std::string& dir, at::ScalarType dtype, at::Device device, int rank, int size) {
  return load_checkpoint_owned(dir, dtype, device, rank, size, {});
}

Muse load_checkpoint_owned(const std::string& dir, at::ScalarType dtype, at::Device device, int rank, int size,
                           const std::function<bool(const std::string&)>& keep) {
  if (is_nvfp4_checkpoint(dir)) {
    Muse m = load_nvfp4_checkpoint(dir, dtype, device, rank, size);
    return keep ? m.clone(keep) : m;
  }
  ModelConfig cfg = ModelConfig::from_json_file(dir + "/config.json");
  return load_tensors(cfg, safetensors::Checkpoint::open(dir), dtype, device, {}, {},
                      detail::expert_shard(cfg, rank, size), keep);
}

}  // namespace kiln::model
