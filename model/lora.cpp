// LoRA adapters: the adapted-linear table, seeded init, merging, and the PEFT file layout.
#include "model/lora.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "core/safetensors.h"
#include "model/names.h"

namespace kiln::model {
using namespace detail;
namespace {

// (out, in) of a slot's weight (one expert's), from the dense weight, its NVFP4 copy or, for a
// placeholder (a ZeRO-3 share, parallel/zero3.h), the config's shapes.
std::pair<int64_t, int64_t> out_in(const ModelConfig& cfg, const LayerWeights& l, int64_t layer, const LinearSlot& s) {
  const at::Tensor& d = l.*s.dense;
  if (d.defined() && d.dim() >= 2) return {d.size(-2), d.size(-1)};
  const kernels::Nvfp4Tensor& q = l.nvfp4.*s.q;
  if (q.packed.defined()) return {q.rows(), q.cols()};
  KILN_CHECK(d.defined(), "lora: layer ", layer, " ", s.module, " has no weights");
  for (const auto& [suffix, shape] : layer_shapes(cfg))
    if (suffix == std::string(s.module) + ".weight") return {shape[shape.size() - 2], shape.back()};
  KILN_FAIL("lora: no shape for ", s.module);
}

bool targeted(const std::vector<std::string>& targets, const LinearSlot& s) {
  return std::find(targets.begin(), targets.end(), s.kind) != targets.end();
}

}  // namespace

int64_t lora_parameter_count(const ModelConfig& model, const LoraConfig& cfg) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [suffix, shape] : layer_shapes(model)) shapes[suffix] = shape;
  int64_t per_layer = 0;
  for (const LinearSlot& s : linear_slots()) {
    if (!targeted(cfg.targets, s)) continue;
    const std::vector<int64_t>& shape = shapes.at(std::string(s.module) + ".weight");  // [E,] out, in
    const int64_t out = shape[shape.size() - 2], in = shape.back();
    per_layer += cfg.rank * (in + out) * (s.expert ? model.num_experts : 1);
  }
  return per_layer * model.num_layers;
}

void LoraConfig::validate() const {
  KILN_CHECK(rank >= 1, "lora: rank must be at least 1 (got ", rank, "); without adapters there is no LoraConfig");
  KILN_CHECK(alpha > 0, "lora: alpha must be positive (got ", alpha, ")");
  KILN_CHECK(!targets.empty(), "lora: targets must name at least one module kind");
  for (const std::string& t : targets) {
    bool known = false;
    for (const LinearSlot& s : linear_slots()) known |= t == s.kind;
    KILN_CHECK(known, "lora: unknown target '", t,
               "'; use q_proj, k_proj, v_proj, o_proj, pooler, unpooler, gate_proj, up_proj, down_proj");
  }
}

void add_lora(Muse& m, const LoraConfig& cfg, uint64_t seed, int64_t first_expert) {
  cfg.validate();
  at::NoGradGuard g;
  const int64_t r = cfg.rank;
  auto opts = at::TensorOptions().dtype(m.dtype()).device(m.device());
  for (int64_t i = 0; i < int64_t(m.weights().layers.size()); ++i) {
    LayerWeights& l = m.weights().layers[size_t(i)];
    l.lora = LayerWeights::Lora();
    l.lora.scale = cfg.scale();
    for (const LinearSlot& s : linear_slots()) {
      if (!targeted(cfg.targets, s)) continue;
      auto [out, in] = out_in(m.config(), l, i, s);
      // The experts this model holds: a stack of its own, else (placeholders) every one.
      const at::Tensor& d = l.*s.dense;
      const int64_t E = !s.expert ? 1 : d.defined() && d.dim() == 3 ? d.size(0) : m.config().num_experts;
      KILN_CHECK(first_expert + E <= m.config().num_experts, "lora: experts [", first_expert, ", ", first_expert + E,
                 ") are not among the model's ", m.config().num_experts);
      std::vector<at::Tensor> as;
      for (int64_t e = 0; e < E; ++e) {
        // PEFT's init: Kaiming-uniform with a = sqrt(5), i.e. bound 1 / sqrt(in); B = 0.
        const std::string name = linear_module(i, s, s.expert ? first_expert + e : e) + ".lora_A";
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(stream_seed(seed, name));
        const double bound = 1.0 / std::sqrt(double(in));
        as.push_back(at::empty({r, in}, at::kFloat).uniform_(-bound, bound, gen));
      }
      at::Tensor a = s.expert ? at::stack(as) : as[0];
      l.lora.*s.a = a.to(opts).contiguous();
      l.lora.*s.b = at::zeros(s.expert ? std::vector<int64_t>{E, out, r} : std::vector<int64_t>{out, r}, opts);
    }
  }
}

void copy_adapters(Muse& m) {
  at::NoGradGuard g;
  for (LayerWeights& l : m.weights().layers)
    for (const LinearSlot& s : linear_slots())
      for (at::Tensor* t : {&(l.lora.*s.a), &(l.lora.*s.b)})
        if (t->defined()) *t = t->detach().clone();
}

std::vector<std::pair<std::string, at::Tensor>> lora_parameters(const Muse& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int64_t i = 0; i < int64_t(m.weights().layers.size()); ++i) {
    const LayerWeights& l = m.weights().layers[size_t(i)];
    for (const LinearSlot& s : linear_slots()) {
      if (!(l.lora.*s.a).defined()) continue;
      out.emplace_back(layer_prefix(i) + s.module + ".lora_A", l.lora.*s.a);
      out.emplace_back(layer_prefix(i) + s.module + ".lora_B", l.lora.*s.b);
    }
  }
  return out;
}

int64_t lora_rank(const Muse& m) {
  for (const LayerWeights& l : m.weights().layers)
    for (const LinearSlot& s : linear_slots())
      if ((l.lora.*s.a).defined()) return (l.lora.*s.a).size(-2);
  return 0;
}

void merge_lora(Muse& m) {
  at::NoGradGuard g;
  for (int64_t i = 0; i < int64_t(m.weights().layers.size()); ++i) {
    LayerWeights& l = m.weights().layers[size_t(i)];
    for (const LinearSlot& s : linear_slots()) {
      const at::Tensor& a = l.lora.*s.a;
      if (!a.defined()) continue;
      at::Tensor& w = l.*s.dense;
      KILN_CHECK(w.defined(), "lora: merge layer ", i, " ", s.module, ": the base is NVFP4 only; dequantise it first");
      at::Tensor delta = at::matmul((l.lora.*s.b).to(at::kFloat), a.to(at::kFloat)) * l.lora.scale;
      w = (w.to(at::kFloat) + delta).to(w.scalar_type()).contiguous();
      l.nvfp4.*s.q = kernels::Nvfp4Tensor();  // the base's NVFP4 codes no longer describe it
    }
    l.lora = LayerWeights::Lora();
  }
}

void save_peft_adapter(const Muse& m, const std::string& dir) {
  const int64_t r = lora_rank(m);
  KILN_CHECK(r > 0, "lora: the model has no adapters to save");
  std::vector<safetensors::NamedTensor> tensors;
  std::set<std::string> kinds;
  double scale = 0;
  for (int64_t i = 0; i < int64_t(m.weights().layers.size()); ++i) {
    const LayerWeights& l = m.weights().layers[size_t(i)];
    for (const LinearSlot& s : linear_slots()) {
      const at::Tensor& a = l.lora.*s.a;
      if (!a.defined()) continue;
      kinds.insert(s.kind);
      scale = l.lora.scale;
      const at::Tensor& b = l.lora.*s.b;
      for (int64_t e = 0; e < (s.expert ? a.size(0) : 1); ++e) {
        const std::string key = "base_model.model." + linear_module(i, s, e);
        tensors.push_back({key + ".lora_A.weight", (s.expert ? a[e] : a).detach().cpu().contiguous()});
        tensors.push_back({key + ".lora_B.weight", (s.expert ? b[e] : b).detach().cpu().contiguous()});
      }
    }
  }
  std::filesystem::create_directories(dir);
  safetensors::write_file(dir + "/adapter_model.safetensors", tensors);
  nlohmann::ordered_json c;
  c["peft_type"] = "LORA";
  c["task_type"] = "CAUSAL_LM";
  c["base_model_name_or_path"] = m.config().name;
  c["r"] = r;
  c["lora_alpha"] = scale * double(r);
  c["lora_dropout"] = 0.0;
  c["bias"] = "none";
  c["fan_in_fan_out"] = false;
  c["inference_mode"] = true;
  c["target_modules"] = std::vector<std::string>(kinds.begin(), kinds.end());
  write_text_atomic(dir + "/adapter_config.json", c.dump(2) + "\n");
}

void load_peft_adapter(Muse& m, const std::string& dir) {
  const std::string cfg_path = dir + "/adapter_config.json";
  nlohmann::json c = read_json_file(cfg_path, "lora", "a PEFT adapter directory needs adapter_config.json");
  auto need = [&](const char* key) -> const nlohmann::json& {
    KILN_CHECK(c.contains(key), "lora: ", cfg_path, ": missing key ", key);
    return c[key];
  };
  KILN_CHECK(!c.contains("peft_type") || c["peft_type"] == "LORA", "lora: ", cfg_path,
             ": peft_type must be \"LORA\" (got ", c["peft_type"].dump(), ")");
  KILN_CHECK(need("r").is_number_integer() && c["r"].get<int64_t>() > 0, "lora: ", cfg_path,
             ": r must be a positive integer (got ", c["r"].dump(), ")");
  KILN_CHECK(need("lora_alpha").is_number() && c["lora_alpha"].get<double>() > 0, "lora: ", cfg_path,
             ": lora_alpha must be a positive number (got ", c["lora_alpha"].dump(), ")");
  LoraConfig lc;
  lc.rank = c["r"].get<int64_t>();
  lc.alpha = c["lora_alpha"].get<double>();
  KILN_CHECK(need("target_modules").is_array(), "lora: ", cfg_path, ": target_modules must be a list of names");
  for (const auto& t : c["target_modules"])
    KILN_CHECK(t.is_string(), "lora: ", cfg_path, ": target_modules holds a non-string ", t.dump());
  lc.targets = c["target_modules"].get<std::vector<std::string>>();
  // Options that would change the arithmetic, which this reader does not implement.
  KILN_CHECK(!c.value("use_rslora", false), "lora: ", cfg_path, ": use_rslora (scale alpha/sqrt(r)) is not supported");
  KILN_CHECK(!c.value("use_dora", false), "lora: ", cfg_path, ": use_dora is not supported");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    KILN_CHECK(!c.contains(key) || c[key].is_null() || c[key].empty(), "lora: ", cfg_path, ": ", key,
               " (per-module ranks or alphas) is not supported");
  KILN_CHECK(!c.contains("layers_to_transform") || c["layers_to_transform"].is_null(), "lora: ", cfg_path,
             ": layers_to_transform is not supported (adapters cover every layer)");
  KILN_CHECK(!c.contains("bias") || c["bias"] == "none", "lora: ", cfg_path, ": bias must be \"none\" (got ",
             c["bias"].dump(), ")");
  lc.validate();

  const std::string st_path = dir + "/adapter_model.safetensors";
  auto file = safetensors::File::open(st_path);
  std::set<std::string> unused;
  for (const auto& t : file->tensors()) unused.insert(t.name);
  auto load = [&](const std::string& key, const std::vector<int64_t>& shape) {
    const safetensors::TensorInfo* info = file->find(key);
    KILN_CHECK(info, "lora: ", st_path, ": missing tensor ", key, " (target_modules lists its kind)");
    KILN_CHECK(info->shape == shape, "lora: ", st_path, ": tensor ", key, " has shape ", at::IntArrayRef(info->shape),
               ", expected ", at::IntArrayRef(shape));
    unused.erase(key);
    return file->load(key, m.dtype());
  };
  const int64_t r = lc.rank;
  for (int64_t i = 0; i < int64_t(m.weights().layers.size()); ++i) {
    LayerWeights& l = m.weights().layers[size_t(i)];
    LayerWeights::Lora lora;
    lora.scale = lc.scale();
    for (const LinearSlot& s : linear_slots()) {
      if (!targeted(lc.targets, s)) continue;
      auto [out, inw] = out_in(m.config(), l, i, s);
      std::vector<at::Tensor> as, bs;
      for (int64_t e = 0; e < (s.expert ? m.config().num_experts : 1); ++e) {
        const std::string key = "base_model.model." + linear_module(i, s, e);
        as.push_back(load(key + ".lora_A.weight", {r, inw}));
        bs.push_back(load(key + ".lora_B.weight", {out, r}));
      }
      lora.*s.a = (s.expert ? at::stack(as) : as[0]).to(m.device()).contiguous();
      lora.*s.b = (s.expert ? at::stack(bs) : bs[0]).to(m.device()).contiguous();
    }
    l.lora = lora;
  }
  KILN_CHECK(unused.empty(), "lora: ", st_path, ": ", unused.size(), " tensors match no adapted module, e.g. ",
             *unused.begin());
}

}  // namespace kiln::model
