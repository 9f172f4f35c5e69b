// NVFP4 Muse models: the quantised-linear table, quantise / re-quantise / dequantise, activation
// calibration through the forward's observer, and the ModelOpt checkpoint format.
#include "model/nvfp4_model.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/names.h"

namespace kiln::model {
using namespace detail;
namespace {

constexpr float kFp4TimesFp8Max = 6.0f * 448.0f;

bool quantized(const ModelConfig& cfg, int64_t layer, const LinearSlot& s) {
  return !s.expert || experts_quantized(cfg, layer);
}

// The slot stored under a layer-tensor suffix such as "self_attn.q_proj.weight", or nullptr.
const LinearSlot* slot_of(const std::string& suffix) {
  for (const LinearSlot& s : linear_slots())
    if (suffix == std::string(s.module) + ".weight") return &s;
  return nullptr;
}

kernels::Nvfp4Tensor quantize_dense(const at::Tensor& dense, bool kernel_layout) {
  return kernels::nvfp4_quantize(dense.detach(), kernel_layout);
}

nlohmann::ordered_json quant_section(const ModelConfig& cfg) {
  nlohmann::ordered_json q;
  q["quant_algo"] = "NVFP4";
  q["kv_cache_quant_algo"] = nullptr;
  q["group_size"] = kernels::kNvfp4Block;
  q["exclude_modules"] = nvfp4_exclude_modules(cfg);
  return q;
}

// Parses hf_quant_config.json and checks that it describes the NVFP4 this code reads; returns the
// layers whose experts exclude_modules keeps out of quantisation ("model.layers.<i>.mlp.experts*").
std::vector<int64_t> check_quant_config(const std::string& path) {
  nlohmann::json j = read_json_file(path, "nvfp4 checkpoint", "an NVFP4 checkpoint needs hf_quant_config.json");
  KILN_CHECK(j.contains("quantization") && j["quantization"].is_object(), "nvfp4 checkpoint: ", path,
             ": missing object \"quantization\"");
  const auto& q = j["quantization"];
  KILN_CHECK(q.contains("quant_algo") && q["quant_algo"] == "NVFP4", "nvfp4 checkpoint: ", path,
             ": quantization.quant_algo must be \"NVFP4\" (got ", q.contains("quant_algo") ? q["quant_algo"].dump() : "nothing", ")");
  KILN_CHECK(!q.contains("group_size") || q["group_size"] == kernels::kNvfp4Block, "nvfp4 checkpoint: ", path,
             ": quantization.group_size must be ", kernels::kNvfp4Block, " (got ", q["group_size"].dump(), ")");
  std::vector<int64_t> bf16_layers;
  if (!q.contains("exclude_modules")) return bf16_layers;
  KILN_CHECK(q["exclude_modules"].is_array(), "nvfp4 checkpoint: ", path, ": quantization.exclude_modules must be a list");
  const std::string head = "model.layers.", tail = ".mlp.experts";
  for (const auto& v : q["exclude_modules"]) {
    KILN_CHECK(v.is_string(), "nvfp4 checkpoint: ", path, ": exclude_modules holds a non-string ", v.dump());
    const std::string m = v.get<std::string>();
    const size_t at = m.find(tail);
    if (m.rfind(head, 0) != 0 || at == std::string::npos) continue;
    const std::string idx = m.substr(head.size(), at - head.size());
    if (!idx.empty() && std::all_of(idx.begin(), idx.end(), ::isdigit)) bf16_layers.push_back(std::stoll(idx));
  }
  std::sort(bf16_layers.begin(), bf16_layers.end());
  return bf16_layers;
}


// The values of one quantised linear (on the CPU, once at load): block scales that are E4M3 NaN
// (0x7F, 0xFF) or negative, and tensor or input scales that are not finite and positive, would turn
// every output of the layer into garbage without an error.
void check_scales(const at::Tensor& block, const at::Tensor& tensor_scale, const at::Tensor& input_scale,
                  const std::string& what, const std::string& file) {
  const at::Tensor b = block.view(at::kByte);
  const at::Tensor nan = b.eq(0x7F).logical_or_(b.eq(0xFF)), negative = b.ge(0x81).logical_and_(b.ne(0xFF));
  KILN_CHECK(!nan.any().item<bool>(), "nvfp4 checkpoint ", file, ": ", what, ".weight_scale holds ",
             nan.sum().item<int64_t>(), " NaN block scale(s) (E4M3 0x7F/0xFF)");
  KILN_CHECK(!negative.any().item<bool>(), "nvfp4 checkpoint ", file, ": ", what, ".weight_scale holds ",
             negative.sum().item<int64_t>(), " negative block scale(s); scales are magnitudes");
  auto positive = [&](const at::Tensor& t, const char* name) {
    if (!t.defined()) return;
    const at::Tensor bad = at::isfinite(t).logical_not_().logical_or_(t.le(0)).reshape({-1});
    KILN_CHECK(!bad.any().item<bool>(), "nvfp4 checkpoint ", file, ": ", what, ".", name, " must be finite and > 0 (got ",
               t.reshape({-1})[bad.nonzero()[0][0]].item<double>(), ")");
  };
  positive(tensor_scale, "weight_scale_2");
  positive(input_scale, "input_scale");
}

}  // namespace

bool experts_quantized(const ModelConfig& cfg, int64_t layer) {
  return std::find(cfg.bf16_expert_layers.begin(), cfg.bf16_expert_layers.end(), layer) == cfg.bf16_expert_layers.end();
}

Nvfp4Footprint nvfp4_footprint(const ModelConfig& cfg, bool input_scales) {
  Nvfp4Footprint f;
  std::map<std::string, const LinearSlot*> linear;  // by tensor suffix
  for (const LinearSlot& s : linear_slots()) linear[std::string(s.module) + ".weight"] = &s;
  const int64_t scalar_bytes = input_scales ? 8 : 4;  // weight_scale_2 (and input_scale) per matrix
  auto add_kept = [&](int64_t n, at::ScalarType t) {
    f.kept_params += n;
    f.bytes += n * int64_t(c10::elementSize(t));
  };
  for (int64_t layer = 0; layer < cfg.num_layers; ++layer)
    for (const auto& [suffix, shape] : layer_shapes(cfg)) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      const auto it = linear.find(suffix);
      if (it != linear.end() && (!it->second->expert || experts_quantized(cfg, layer))) {
        f.quantized_params += n;
        f.bytes += n / 2 + n / kernels::kNvfp4Block + (it->second->expert ? cfg.num_experts : 1) * scalar_bytes;
      } else {
        add_kept(n, tensor_dtype(suffix, at::kBFloat16));
      }
    }
  add_kept(2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size, at::kBFloat16);  // embeddings, lm_head, final norm
  return f;
}

std::vector<std::string> nvfp4_exclude_modules(const ModelConfig& cfg) {
  std::vector<std::string> out = {"lm_head", "model.embed_tokens", "model.norm", "model.layers.*.input_layernorm",
                                  "model.layers.*.post_attention_layernorm", "model.layers.*.pre_moe_layernorm",
                                  "model.layers.*.post_moe_layernorm", "model.layers.*.mlp.router",
                                  "model.layers.*.mlp.experts.*.norm"};
  for (int64_t i : cfg.bf16_expert_layers) out.push_back("model.layers." + std::to_string(i) + ".mlp.experts.*");
  return out;
}

void quantize_model(Muse& m, bool kernel_layout, bool drop_dense) {
  at::NoGradGuard g;
  const ModelConfig& cfg = m.config();
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    LayerWeights& l = m.weights().layers[size_t(i)];
    for (const LinearSlot& s : linear_slots()) {
      if (!quantized(cfg, i, s)) continue;
      at::Tensor& dense = l.*s.dense;
      kernels::Nvfp4Tensor& q = l.nvfp4.*s.q;
      if (!q.packed.defined()) {
        KILN_CHECK(dense.defined(), "nvfp4: layer ", i, " ", s.module, " has no weights to quantise");
        q = quantize_dense(dense, kernel_layout);
      } else if (kernel_layout && !q.kernel_layout) {
        q = kernels::nvfp4_to_kernel_layout(q);  // an NVFP4 checkpoint's own codes, kept exactly
      }
      if (drop_dense) dense = at::Tensor();
    }
  }
}

namespace {
// The layer and linear slot a Muse::named_parameters name refers to, or a null slot.
std::pair<int64_t, const LinearSlot*> linear_of(const Muse& m, const std::string& name) {
  const std::string head = "model.layers.";
  if (name.rfind(head, 0) != 0) return {-1, nullptr};
  const size_t dot = name.find('.', head.size());
  int64_t layer = -1;
  try {
    layer = std::stoll(name.substr(head.size(), dot - head.size()));
  } catch (const std::exception&) {
    return {-1, nullptr};  // not a layer tensor name
  }
  const LinearSlot* s = slot_of(name.substr(dot + 1));
  if (!s || layer < 0 || layer >= m.config().num_layers) return {-1, nullptr};
  return {layer, s};
}
}  // namespace

bool quantize_linear(Muse& m, const std::string& name, bool kernel_layout, bool drop_dense) {
  const auto [layer, s] = linear_of(m, name);
  if (!s || !quantized(m.config(), layer, *s)) return false;
  LayerWeights& l = m.weights().layers[size_t(layer)];
  at::Tensor& dense = l.*s->dense;
  KILN_CHECK(dense.defined() && dense.numel() > 0, "nvfp4: layer ", layer, " ", s->module, " has no weights to quantise");
  at::NoGradGuard g;
  l.nvfp4.*s->q = quantize_dense(dense, kernel_layout);
  if (drop_dense) dense = at::Tensor();
  return true;
}

bool requantize(Muse& m, const std::string& name, const at::Tensor& dense) {
  const auto [layer, s] = linear_of(m, name);
  if (!s) return false;
  LayerWeights& l = m.weights().layers[size_t(layer)];
  kernels::Nvfp4Tensor& q = l.nvfp4.*s->q;
  if ((l.*s->dense).defined() || !q.packed.defined()) return false;  // served dense
  std::vector<int64_t> want(q.packed.sizes().begin(), q.packed.sizes().end());
  want.back() *= 2;
  KILN_CHECK(dense.sizes() == at::IntArrayRef(want), "nvfp4: weight sync of ", name, " has shape ", dense.sizes(),
             ", the NVFP4 weights hold ", at::IntArrayRef(want));
  at::NoGradGuard g;
  kernels::Nvfp4Tensor fresh = quantize_dense(dense.to(q.packed.device()), q.kernel_layout);
  q.packed.copy_(fresh.packed);
  q.block_scale.copy_(fresh.block_scale);
  q.tensor_scale.copy_(fresh.tensor_scale);
  return true;
}

void dequantize_model(Muse& m, at::ScalarType dtype) {
  at::NoGradGuard g;
  for (LayerWeights& l : m.weights().layers)
    for (const LinearSlot& s : linear_slots()) {
      const kernels::Nvfp4Tensor& q = l.nvfp4.*s.q;
      if (q.packed.defined()) l.*s.dense = kernels::nvfp4_dequantize(q, dtype).contiguous();
    }
}

void calibrate_input_scales(Muse& m, const PackedBatch& batch) {
  const ModelConfig& cfg = m.config();
  std::vector<std::map<std::string, float>> amax(size_t(cfg.num_layers));
  ForwardOptions opt;
  opt.kernel_path = KernelPath::kLoop;  // the observer runs the per-expert loop anyway
  opt.load_balance = false;
  opt.skip_head = true;
  opt.observe_linear_input = [&](int64_t layer, const std::string& name, const at::Tensor& x) {
    float& a = amax[size_t(layer)][name];
    a = std::max(a, x.numel() ? x.detach().abs().max().to(at::kFloat).item<float>() : 0.0f);
  };
  {
    at::NoGradGuard g;
    m.forward(batch, opt);
  }
  auto scale = [](float a) { return a > 0 ? a / kFp4TimesFp8Max : 1.0f; };
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    LayerWeights& l = m.weights().layers[size_t(i)];
    const auto& seen = amax[size_t(i)];
    for (const LinearSlot& s : linear_slots()) {
      kernels::Nvfp4Tensor& q = l.nvfp4.*s.q;
      if (!quantized(cfg, i, s)) continue;
      KILN_CHECK(q.packed.defined(), "nvfp4: calibrate layer ", i, " ", s.module, ": quantise the model first");
      at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(q.packed.device());
      if (!s.expert) {
        auto it = seen.find(s.module);
        q.input_scale = at::scalar_tensor(scale(it == seen.end() ? 0.0f : it->second), f32);
        continue;
      }
      const std::string proj = std::string(s.module).substr(std::string("mlp.experts.").size());
      std::vector<float> per(size_t(cfg.num_experts), 0.0f);
      float layer_max = 0;
      for (int64_t e = 0; e < cfg.num_experts; ++e) {
        auto it = seen.find("mlp.experts." + std::to_string(e) + "." + proj);
        if (it != seen.end()) per[size_t(e)] = it->second;
        layer_max = std::max(layer_max, per[size_t(e)]);
      }
      for (float& a : per) a = scale(a > 0 ? a : layer_max);
      q.input_scale = at::tensor(per, f32);
    }
  }
}

bool is_nvfp4_checkpoint(const std::string& dir) {
  return std::filesystem::exists(std::filesystem::path(dir) / "hf_quant_config.json");
}

void save_nvfp4_checkpoint(const Muse& m, const std::string& dir, uint64_t max_shard_bytes) {
  const ModelConfig& cfg = m.config();
  Weights rest = m.weights();  // handles: the quantised linears are removed below
  std::vector<safetensors::NamedTensor> quant;
  auto scalar = [](const at::Tensor& t) { return t.detach().to(at::kCPU, at::kFloat).reshape({}).contiguous(); };
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    LayerWeights& l = rest.layers[size_t(i)];
    for (const LinearSlot& s : linear_slots()) {
      if (!quantized(cfg, i, s)) continue;
      kernels::Nvfp4Tensor q = l.nvfp4.*s.q;
      KILN_CHECK(q.packed.defined(), "nvfp4: save layer ", i, " ", s.module, ": quantise the model first");
      if (q.kernel_layout) q = kernels::nvfp4_to_modelopt_layout(q);
      l.*s.dense = at::Tensor();
      const int64_t count = s.expert ? q.packed.size(0) : 1;
      for (int64_t e = 0; e < count; ++e) {
        const std::string base = linear_module(i, s, e);
        auto pick = [&](const at::Tensor& t) { return s.expert ? t[e] : t; };
        quant.push_back({base + ".weight", pick(q.packed).cpu().contiguous()});
        quant.push_back({base + ".weight_scale", pick(q.block_scale).cpu().contiguous().view(at::kByte),
                         safetensors::DType::F8_E4M3});
        quant.push_back({base + ".weight_scale_2", scalar(pick(q.tensor_scale))});
        if (q.input_scale.defined()) quant.push_back({base + ".input_scale", scalar(pick(q.input_scale))});
      }
    }
  }
  std::vector<safetensors::NamedTensor> tensors;
  for (auto& [name, t] : hf_tensors(Muse(cfg, rest))) tensors.push_back({name, t});
  tensors.insert(tensors.end(), quant.begin(), quant.end());
  std::filesystem::create_directories(dir);
  safetensors::write_checkpoint(dir, tensors, max_shard_bytes);
  nlohmann::ordered_json config = nlohmann::ordered_json::parse(cfg.to_json());
  nlohmann::ordered_json qc = quant_section(cfg);
  qc["quant_method"] = "modelopt";
  config["quantization_config"] = qc;
  write_text_atomic(dir + "/config.json", config.dump(2) + "\n");
  nlohmann::ordered_json hf;
  hf["producer"] = {{"name", "kiln"}, {"version", "0.1"}};
  hf["quantization"] = quant_section(cfg);
  write_text_atomic(dir + "/hf_quant_config.json", hf.dump(2) + "\n");
}

Muse load_nvfp4_checkpoint(const std::string& dir, at::ScalarType dtype, at::Device device, int rank, int size) {
  const std::vector<int64_t> excluded = check_quant_config(dir + "/hf_quant_config.json");
  ModelConfig cfg = ModelConfig::from_json_file(dir + "/config.json");
  // Which layers keep BF16 experts: config.json's bf16_expert_layers, or else exclude_modules.
  std::vector<int64_t> declared = cfg.bf16_expert_layers;
  std::sort(declared.begin(), declared.end());
  if (declared.empty()) cfg.bf16_expert_layers = excluded;
  KILN_CHECK(declared.empty() || excluded.empty() || declared == excluded, "nvfp4 checkpoint ", dir,
             ": config.json's bf16_expert_layers ", at::IntArrayRef(declared), " disagree with hf_quant_config.json's ",
             "exclude_modules, which keep the experts of layers ", at::IntArrayRef(excluded), " out of NVFP4");
  safetensors::Checkpoint ckpt = safetensors::Checkpoint::open(dir);
  // Every quantised linear brings .weight, .weight_scale and .weight_scale_2; .input_scale is optional
  // but then present for all of them or none.
  auto skip = [&](int64_t layer, const std::string& suffix) {
    const LinearSlot* s = slot_of(suffix);
    return s && quantized(cfg, layer, *s);
  };
  std::set<std::string> extra;
  bool any_input = false, all_input = true;
  for (int64_t i = 0; i < cfg.num_layers; ++i)
    for (const LinearSlot& s : linear_slots()) {
      if (!quantized(cfg, i, s)) continue;
      for (int64_t e = 0; e < (s.expert ? cfg.num_experts : 1); ++e) {
        const std::string base = linear_module(i, s, e);
        for (const char* part : {".weight", ".weight_scale", ".weight_scale_2"}) extra.insert(base + part);
        const bool has = ckpt.contains(base + ".input_scale");
        any_input |= has;
        all_input &= has;
      }
    }
  KILN_CHECK(!any_input || all_input, "nvfp4 checkpoint ", ckpt.path(),
             ": some quantised linears have an input_scale and some do not; calibrate all or none");
  if (any_input)
    for (const std::string& n : std::set<std::string>(extra))
      if (n.size() > 13 && n.compare(n.size() - 13, 13, ".weight_scale") == 0)
        extra.insert(n.substr(0, n.size() - 13) + ".input_scale");
  const ExpertRange range = expert_shard(cfg, rank, size);
  Muse m = load_tensors(cfg, ckpt, dtype, device, skip, extra, range);

  auto raw = [&](const std::string& name, safetensors::DType want_dtype, const std::vector<int64_t>& shape) {
    const auto& info = ckpt.info(name);
    KILN_CHECK(info.dtype == want_dtype, "nvfp4 checkpoint ", ckpt.path(), ": tensor ", name, " has dtype ",
               safetensors::dtype_name(info.dtype), ", expected ", safetensors::dtype_name(want_dtype));
    const bool scalar = shape.empty() && info.numel() == 1;  // [] or [1]
    KILN_CHECK(scalar || info.shape == shape, "nvfp4 checkpoint ", ckpt.path(), ": tensor ", name, " has shape ",
               at::IntArrayRef(info.shape), ", expected ", at::IntArrayRef(shape));
    at::Tensor t = ckpt.load(name);
    return scalar ? t.reshape({}) : t;
  };
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [suffix, shape] : layer_shapes(cfg)) shapes[suffix] = shape;
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    LayerWeights& l = m.weights().layers[size_t(i)];
    for (const LinearSlot& s : linear_slots()) {
      if (!quantized(cfg, i, s)) continue;
      std::vector<int64_t> shape = shapes.at(std::string(s.module) + ".weight");
      if (s.expert) shape.erase(shape.begin());
      const int64_t N = shape[0], K = shape[1];
      KILN_CHECK(K % kernels::kNvfp4Block == 0, "nvfp4 checkpoint ", ckpt.path(), ": ", linear_module(i, s, 0), " has K = ",
                 K, ", which is not a multiple of ", kernels::kNvfp4Block);
      std::vector<at::Tensor> packed, block, s2, in;
      const int64_t e0 = s.expert ? range.first : 0, e1 = s.expert ? range.first + range.size(cfg) : 1;
      for (int64_t e = e0; e < e1; ++e) {  // the rank's experts only: the others stay on disk
        const std::string base = linear_module(i, s, e);
        packed.push_back(raw(base + ".weight", safetensors::DType::U8, {N, K / 2}));
        block.push_back(raw(base + ".weight_scale", safetensors::DType::F8_E4M3, {N, K / kernels::kNvfp4Block})
                            .view(at::kByte));
        s2.push_back(raw(base + ".weight_scale_2", safetensors::DType::F32, {}));
        if (any_input) in.push_back(raw(base + ".input_scale", safetensors::DType::F32, {}));
        check_scales(block.back(), s2.back(), any_input ? in.back() : at::Tensor(), base, ckpt.path());
      }
      kernels::Nvfp4Tensor q;
      q.packed = s.expert ? at::stack(packed) : packed[0];
      q.block_scale = s.expert ? at::stack(block) : block[0];
      q.tensor_scale = s.expert ? at::stack(s2) : s2[0];
      if (any_input) q.input_scale = s.expert ? at::stack(in) : in[0];
      kernels::nvfp4_check(q, linear_module(i, s, 0).c_str());
      l.nvfp4.*s.q = q.to(device);
    }
  }
  dequantize_model(m, dtype);
  return m;
}

}  // namespace kiln::model
