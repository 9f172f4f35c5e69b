// The Optimizer: per-parameter state slots (master, first and second moment), one update routine
// for every placement, and the chunk pipeline that streams host or NVMe state through the device.
#include "optimizers/optimizer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <array>
#include <cstdio>
#include <future>
#include <sstream>

#include "core/error.h"
#include "core/safetensors.h"
#include "kernels/adamw.h"
#include "optimizers/nvme.h"

#if KILN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kiln::optimizers {

const char* placement_name(Placement p) {
  switch (p) {
    case Placement::kDevice: return "device";
    case Placement::kHost: return "cpu";
    case Placement::kHostCpu: return "cpu_update";
    case Placement::kNvme: return "nvme";
  }
  return "?";
}

Placement parse_placement(const std::string& name) {
  for (Placement p : {Placement::kDevice, Placement::kHost, Placement::kHostCpu, Placement::kNvme})
    if (name == placement_name(p)) return p;
  if (name == "gpu") return Placement::kDevice;
  KILN_FAIL("optimizer: unknown state placement '", name, "'; expected device (or gpu), cpu, cpu_update or nvme");
}

void OptimizerConfig::validate() const {
  adamw.validate();
  muon.validate();
  KILN_CHECK(chunk_bytes > 0, "optimizer: chunk_bytes must be positive (got ", chunk_bytes, ")");
  KILN_CHECK(moments == at::kFloat || moments == at::kBFloat16,
             "optimizer: moment dtype must be fp32 or bf16 (got ", moments, ")");
  KILN_CHECK(state != Placement::kNvme || !nvme_dir.empty(),
             "optimizer: state placement nvme needs a directory (optim.nvme_dir)");
}

namespace {
constexpr int kMaster = 0, kM = 1, kV = 2, kSlots = 3;
constexpr int64_t kAlign = 256;  // bytes; slot offsets inside a chunk buffer
using Views = std::array<at::Tensor, kSlots>;

int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Param {
  std::string name;
  at::Tensor p;  // the live parameter
  Kind kind = Kind::kAdamW;
  int64_t numel = 0, unit = 1, units = 0, rows = 0, cols = 0;  // Muon: units are matrices
  std::array<bool, kSlots> used{};
  std::array<at::ScalarType, kSlots> dtype{};
  std::array<at::Tensor, kSlots> state;  // flat; on the device (kDevice) or the CPU (kHost, kHostCpu)
  std::array<uint64_t, kSlots> offset{};  // kNvme: byte offsets in the state file

  const char* slot_name(int s) const {
    return s == kMaster ? "master" : s == kV ? "exp_avg_sq" : kind == Kind::kMuon ? "momentum" : "exp_avg";
  }
  int64_t elem(int s) const { return int64_t(at::elementSize(dtype[s])); }
  // Bytes of the chunk buffer for `units` units, slots aligned.
  int64_t chunk_bytes(int64_t n_units) const {
    int64_t b = 0;
    for (int s = 0; s < kSlots; ++s)
      if (used[s]) b += align_up(n_units * unit * elem(s));
    return b;
  }
};

struct Chunk {
  size_t param;
  int64_t u0, u1;  // units [u0, u1)
};

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

struct Optimizer::Impl {
  OptimizerConfig cfg;
  AdamWConfig adamw;  // with the current lr
  MuonConfig muon;
  std::vector<Param> params;
  std::vector<Chunk> chunks;
  int64_t max_chunk_bytes = 0;
  int64_t step = 0;
  std::unique_ptr<NvmeFile> file;
  std::array<at::Tensor, 2> stage;  // kNvme: host staging buffers
  bool pinned = false;              // host memory is pinned (CUDA parameters)
#if KILN_WITH_CUDA
  struct Cuda {
    c10::cuda::CUDAStream h2d, d2h;
    std::array<at::cuda::CUDAEvent, 2> h2d_done, compute_done, d2h_done;
    std::array<at::Tensor, 2> buf;
  };
  std::unique_ptr<Cuda> cuda;
#endif

  Impl(std::vector<std::pair<std::string, at::Tensor>> named, OptimizerConfig c)
      : cfg(std::move(c)), adamw(cfg.adamw), muon(cfg.muon) {
    cfg.validate();
    at::NoGradGuard no_grad;
    KILN_CHECK(!named.empty(), "optimizer: no parameters");
    const at::Device device = named.front().second.device();
    for (auto& [name, t] : named) {
      KILN_CHECK(t.device() == device, "optimizer: parameter ", name, " is on ", t.device(), ", the others on ",
                 device, "; one optimizer serves one device");
      KILN_CHECK(t.is_contiguous() && at::isFloatingType(t.scalar_type()), "optimizer: parameter ", name,
                 " must be a contiguous floating-point tensor");
      Param P;
      P.name = name;
      P.p = t;
      P.kind = assign(cfg.rules, cfg.use_muon, name, t);
      P.numel = t.numel();
      if (P.kind == Kind::kMuon) {
        P.rows = t.size(-2), P.cols = t.size(-1);
        P.unit = P.rows * P.cols;
      }
      P.units = P.unit > 0 ? P.numel / P.unit : 0;
      const bool low_precision = t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
      P.used = {cfg.master_weights && low_precision, true, P.kind == Kind::kAdamW};
      P.dtype = {at::kFloat, cfg.moments, cfg.moments};
      params.push_back(std::move(P));
    }
    pinned = device.is_cuda();
    plan_chunks();
    allocate();
  }

  bool chunked() const { return cfg.state != Placement::kDevice; }
  at::Device device() const { return params.front().p.device(); }

  void plan_chunks() {
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& P = params[i];
      // Units per chunk from the unpadded bytes (the 256-byte slot padding is per chunk, not per unit).
      int64_t per_unit = 0;
      for (int s = 0; s < kSlots; ++s)
        if (P.used[s]) per_unit += P.unit * P.elem(s);
      const int64_t step_units = std::max<int64_t>(1, cfg.chunk_bytes / std::max<int64_t>(per_unit, 1));
      for (int64_t u = 0; u < P.units; u += step_units) {
        chunks.push_back({i, u, std::min(P.units, u + step_units)});
        max_chunk_bytes = std::max(max_chunk_bytes, P.chunk_bytes(chunks.back().u1 - u));
      }
    }
  }

  void allocate() {
    at::NoGradGuard no_grad;
    uint64_t file_bytes = 0;
    for (Param& P : params) {
      for (int s = 0; s < kSlots; ++s) {
        if (!P.used[s]) continue;
        switch (cfg.state) {
          case Placement::kDevice:
            P.state[s] = at::zeros({P.numel}, P.p.options().dtype(P.dtype[s]));
            break;
          case Placement::kHost:
          case Placement::kHostCpu:
            P.state[s] = at::zeros({P.numel}, at::TensorOptions().dtype(P.dtype[s]).pinned_memory(pinned));
            break;
          case Placement::kNvme:
            P.offset[s] = file_bytes;
            file_bytes += uint64_t(align_up(P.numel * P.elem(s)));
            break;
        }
      }
      if (P.used[kMaster] && cfg.state != Placement::kNvme) P.state[kMaster].copy_(P.p.detach().view(-1));
    }
    if (cfg.state == Placement::kNvme) {
      file = std::make_unique<NvmeFile>(cfg.nvme_dir, "kiln-optimizer-" + cfg.state_tag + ".bin", file_bytes);
      for (auto& b : stage)
        b = at::empty({std::max<int64_t>(max_chunk_bytes, 1)},
                      at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
      reset_nvme_master();
    }
#if KILN_WITH_CUDA
    if (chunked() && device().is_cuda() && cfg.state != Placement::kHostCpu) {
      c10::cuda::CUDAGuard guard(device());
      cuda.reset(new Cuda{c10::cuda::getStreamFromPool(), c10::cuda::getStreamFromPool(), {}, {}, {}, {}});
      for (auto& b : cuda->buf) b = at::empty({max_chunk_bytes}, P0().p.options().dtype(at::kByte));
    }
#endif
  }
  const Param& P0() const { return params.front(); }

  // kNvme: the master slots start as the parameters, written chunk by chunk through the stage.
  void reset_nvme_master() {
    for (const Chunk& c : chunks) {
      const Param& P = params[c.param];
      if (!P.used[kMaster]) continue;
      const int64_t e0 = c.u0 * P.unit, n = (c.u1 - c.u0) * P.unit;
      at::Tensor src = P.p.detach().view(-1).narrow(0, e0, n).to(at::kCPU, at::kFloat).contiguous();
      file->write(P.offset[kMaster] + uint64_t(e0) * 4, src.data_ptr(), uint64_t(n) * 4);
    }
  }

  // Views of chunk `c`'s slots inside a byte buffer (the stage or a device buffer).
  Views buffer_views(const Chunk& c, const at::Tensor& buf) const {
    const Param& P = params[c.param];
    const int64_t n = (c.u1 - c.u0) * P.unit;
    Views v;
    int64_t off = 0;
    for (int s = 0; s < kSlots; ++s) {
      if (!P.used[s]) continue;
      v[s] = buf.narrow(0, off, n * P.elem(s)).view(P.dtype[s]);
      off += align_up(n * P.elem(s));
    }
    return v;
  }

  Views host_views(const Chunk& c, int b) const {
    const Param& P = params[c.param];
    if (cfg.state == Placement::kNvme) return buffer_views(c, stage[b]);
    Views v;
    for (int s = 0; s < kSlots; ++s)
      if (P.used[s]) v[s] = P.state[s].narrow(0, c.u0 * P.unit, (c.u1 - c.u0) * P.unit);
    return v;
  }

  void nvme_io(const Chunk& c, int b, bool write) {
    const Param& P = params[c.param];
    const Views v = buffer_views(c, stage[b]);
    for (int s = 0; s < kSlots; ++s) {
      if (!P.used[s]) continue;
      const uint64_t at = P.offset[s] + uint64_t(c.u0 * P.unit * P.elem(s)), bytes = uint64_t(v[s].nbytes());
      if (write)
        file->write(at, v[s].data_ptr(), bytes);
      else
        file->read(at, v[s].data_ptr(), bytes);
    }
  }

  // The update of chunk `c` with its state in `st` (flat, on the compute device): the multi-tensor
  // CUDA AdamW where it applies, else update_aten. `eigen` uses the fused CPU loop for AdamW (st on
  // the CPU).
  void update(const Chunk& c, const Views& st, bool eigen) {
    std::vector<kernels::AdamWTensors> one;
    if (!eigen && add_fused_adamw(c, st, one)) return kernels::adamw_fused(one, hyper());
    update_aten(c, st, eigen);
  }

  // The same in ATen ops (Muon, AdamW off CUDA or with `fused` off), or the Eigen loop.
  void update_aten(const Chunk& c, Views st, bool eigen) {
    Param& P = params[c.param];
    const int64_t e0 = c.u0 * P.unit, n = (c.u1 - c.u0) * P.unit;
    at::Tensor pflat = P.p.detach().view(-1).narrow(0, e0, n);
    const at::Device dev = st[kM].device();
    at::Tensor g = P.p.grad().reshape(-1).narrow(0, e0, n).to(dev, at::kFloat).contiguous();
    at::Tensor w = P.used[kMaster] ? st[kMaster] : pflat.to(dev, at::kFloat);
    if (P.kind == Kind::kAdamW) {
      if (eigen)
        adamw_update_cpu(w.data_ptr<float>(), g.data_ptr<float>(), st[kM].data_ptr(), st[kV].data_ptr(),
                         P.dtype[kM] == at::kBFloat16, n, adamw, step);
      else
        adamw_update(w, g, st[kM], st[kV], adamw, step);
    } else {
      at::Tensor w3 = w.view({c.u1 - c.u0, P.rows, P.cols});
      muon_update(w3, g, st[kM], muon);
    }
    if (w.data_ptr() != pflat.data_ptr()) pflat.copy_(w);
  }

  kernels::AdamWHyper hyper() const {
    return {adamw.lr, adamw.beta1, adamw.beta2, adamw.eps, adamw.weight_decay, step};
  }

  // Appends chunk c's AdamW update to `batch` when the multi-tensor CUDA kernel takes it (its
  // state `st` on the parameter's GPU); false leaves it to update()'s ATen ops.
  bool add_fused_adamw(const Chunk& c, const Views& st, std::vector<kernels::AdamWTensors>& batch) const {
    const Param& P = params[c.param];
    if (!cfg.fused || P.kind != Kind::kAdamW || !st[kM].is_cuda()) return false;
    const int64_t e0 = c.u0 * P.unit, n = (c.u1 - c.u0) * P.unit;
    at::Tensor pflat = P.p.detach().view(-1).narrow(0, e0, n);
    at::Tensor g = P.p.grad().reshape(-1).narrow(0, e0, n);
    if (g.device() != st[kM].device()) return false;
    kernels::AdamWTensors t{P.used[kMaster] ? st[kMaster] : pflat, g.contiguous(), st[kM], st[kV],
                            P.used[kMaster] ? pflat : at::Tensor()};
    if (!kernels::adamw_fused_supported(t)) return false;
    batch.push_back(std::move(t));
    return true;
  }

  // Every AdamW tensor in one multi-tensor launch where the kernel applies; Muon matrix by stack.
  void step_device() {
    std::vector<kernels::AdamWTensors> fused;
    for (size_t i = 0; i < params.size(); ++i) {
      Param& P = params[i];
      if (!P.p.grad().defined()) continue;
      const Chunk whole{i, 0, P.units};
      if (!add_fused_adamw(whole, P.state, fused)) update_aten(whole, P.state, false);
    }
    kernels::adamw_fused(fused, hyper());
  }

  // Chunk `c` with host-side state `hv`: on the CPU, or streamed through device buffer b.
  void compute_chunk(const Chunk& c, const Views& hv, int b) {
    const bool on_cpu = cfg.state == Placement::kHostCpu || !device().is_cuda();
    if (on_cpu) {
      const bool eigen = cfg.state != Placement::kHost;
      update(c, hv, eigen);
      return;
    }
#if KILN_WITH_CUDA
    Cuda& k = *cuda;
    const Views dv = buffer_views(c, k.buf[b]);
    const Param& P = params[c.param];
    {
      c10::cuda::CUDAStreamGuard guard(k.h2d);
      k.d2h_done[b].block(k.h2d);  // the buffer's previous chunk has gone back to the host
      for (int s = 0; s < kSlots; ++s)
        if (P.used[s]) dv[s].copy_(hv[s], /*non_blocking=*/true);
      k.h2d_done[b].record(k.h2d);
    }
    auto compute = at::cuda::getCurrentCUDAStream();
    k.h2d_done[b].block(compute);
    update(c, dv, false);
    k.compute_done[b].record(compute);
    {
      c10::cuda::CUDAStreamGuard guard(k.d2h);
      k.compute_done[b].block(k.d2h);
      for (int s = 0; s < kSlots; ++s)
        if (P.used[s]) hv[s].copy_(dv[s], /*non_blocking=*/true);
      k.d2h_done[b].record(k.d2h);
    }
#else
    KILN_FAIL("optimizer: CUDA parameters in a build without CUDA");
#endif
  }

  // The host copy of chunk `b`'s state is final (its device-to-host copy is done).
  void wait_host(int b) {
#if KILN_WITH_CUDA
    if (cuda) cuda->d2h_done[b].synchronize();
#endif
  }

  void step_chunked() {
    std::vector<const Chunk*> todo;
    for (const Chunk& c : chunks)
      if (params[c.param].p.grad().defined()) todo.push_back(&c);
    const bool nvme = cfg.state == Placement::kNvme;
    std::array<std::future<void>, 2> reading, writing;
    auto finish = [](std::future<void>& f) {
      if (f.valid()) f.get();
    };
    // Drains the I/O threads even when a chunk throws, so no thread outlives the buffers.
    struct Drain {
      std::array<std::future<void>, 2>& r;
      std::array<std::future<void>, 2>& w;
      ~Drain() {
        for (auto* a : {&r, &w})
          for (auto& f : *a)
            if (f.valid()) f.wait();
      }
    } drain{reading, writing};
    if (nvme && !todo.empty()) reading[0] = std::async(std::launch::async, [&] { nvme_io(*todo[0], 0, false); });
    for (size_t k = 0; k < todo.size(); ++k) {
      const int b = int(k % 2), nb = 1 - b;
      if (nvme) {
        finish(reading[b]);
        if (k + 1 < todo.size()) {
          finish(writing[nb]);  // the other stage is free once its chunk is on disk
          const Chunk* next = todo[k + 1];
          reading[nb] = std::async(std::launch::async, [this, next, nb] { nvme_io(*next, nb, false); });
        }
      }
      compute_chunk(*todo[k], host_views(*todo[k], b), b);
      if (nvme) {
        wait_host(b);
        const Chunk* cur = todo[k];
        writing[b] = std::async(std::launch::async, [this, cur, b] { nvme_io(*cur, b, true); });
      }
    }
    for (auto& f : writing) finish(f);
#if KILN_WITH_CUDA
    if (cuda) cuda->d2h.synchronize();
#endif
  }

  void step_all() {
    at::NoGradGuard no_grad;
    ++step;
    if (chunked())
      step_chunked();
    else
      step_device();
  }

  // --- save and load ---------------------------------------------------------------------------

  std::string fingerprint() const {
    std::ostringstream os;
    for (const Param& P : params) os << P.name << ":" << P.p.sizes() << ":" << kind_name(P.kind) << ";";
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(fnv1a(os.str())));
    return hex;
  }

  // The whole slot `s` of P as a CPU or device tensor shaped like the parameter.
  at::Tensor slot_tensor(const Param& P, int s) const {
    if (cfg.state != Placement::kNvme) return P.state[s].view(P.p.sizes());
    const auto* base = static_cast<const uint8_t*>(file->map()) + P.offset[s];
    return at::from_blob(const_cast<uint8_t*>(base), P.p.sizes(), at::TensorOptions().dtype(P.dtype[s]));
  }

  void save(const std::string& path) const {
    std::vector<safetensors::NamedTensor> out;
    for (const Param& P : params)
      for (int s = 0; s < kSlots; ++s)
        if (P.used[s]) out.push_back({P.name + "." + P.slot_name(s), slot_tensor(P, s)});
    safetensors::write_file(path, out,
                            {{"format", "kiln-optimizer"}, {"version", "1"}, {"step", std::to_string(step)},
                             {"fingerprint", fingerprint()}, {"placement", placement_name(cfg.state)}});
  }

  void load(const std::string& path) {
    at::NoGradGuard no_grad;
    std::shared_ptr<safetensors::File> f = safetensors::File::open(path);
    const auto& meta = f->metadata();
    auto get = [&](const char* key) {
      auto it = meta.find(key);
      return it == meta.end() ? std::string() : it->second;
    };
    KILN_CHECK(get("format") == "kiln-optimizer", "optimizer: ", path,
               " is not a kiln optimizer state file (metadata format='", get("format"), "', expected 'kiln-optimizer')");
    // Check everything before changing anything.
    for (const Param& P : params)
      for (int s = kM; s < kSlots; ++s) {
        if (!P.used[s]) continue;
        const std::string name = P.name + "." + P.slot_name(s);
        const safetensors::TensorInfo* t = f->find(name);
        KILN_CHECK(t, "optimizer: ", path, " belongs to another model or grouping: it has no tensor '", name,
                   "' (", kind_name(P.kind), " state of a parameter of shape ", P.p.sizes(), ")");
        KILN_CHECK(t->shape == P.p.sizes().vec(), "optimizer: ", path, " belongs to another model: tensor '", name,
                   "' has shape ", at::IntArrayRef(t->shape), ", the parameter ", P.p.sizes());
      }
    KILN_CHECK(get("fingerprint") == fingerprint(), "optimizer: ", path,
               " belongs to another model or grouping (fingerprint ", get("fingerprint"), ", this model ",
               fingerprint(), ")");
    int64_t saved_step = 0;
    try {
      saved_step = std::stoll(get("step"));
    } catch (const std::exception&) {
      KILN_FAIL("optimizer: ", path, " has no valid step in its metadata (got '", get("step"), "')");
    }
    for (const Param& P : params)
      for (int s = 0; s < kSlots; ++s) {
        if (!P.used[s]) continue;
        const std::string name = P.name + "." + P.slot_name(s);
        // A file without master weights (saved from fp32 or without masters) starts them from the parameter.
        at::Tensor src = f->find(name) ? f->view(name) : P.p.detach().to(at::kCPU);
        write_slot(P, s, src.reshape({-1}));
      }
    step = saved_step;
  }

  // Copies `src` (flat, any dtype, CPU) into slot s, converting chunk by chunk.
  void write_slot(const Param& P, int s, const at::Tensor& src) {
    const int64_t piece = std::max<int64_t>(1, cfg.chunk_bytes / 4);
    for (int64_t e = 0; e < P.numel; e += piece) {
      const int64_t n = std::min(piece, P.numel - e);
      at::Tensor part = src.narrow(0, e, n).to(P.dtype[s]).contiguous();
      if (cfg.state == Placement::kNvme)
        file->write(P.offset[s] + uint64_t(e * P.elem(s)), part.data_ptr(), uint64_t(part.nbytes()));
      else
        P.state[s].narrow(0, e, n).copy_(part);
    }
  }
};

Optimizer::Optimizer(std::vector<std::pair<std::string, at::Tensor>> params, OptimizerConfig config)
    : impl_(std::make_unique<Impl>(std::move(params), std::move(config))) {}
Optimizer::~Optimizer() = default;
void Optimizer::step() { impl_->step_all(); }
void Optimizer::zero_grad() {
  for (Param& P : impl_->params) P.p.mutable_grad().reset();
}
void Optimizer::set_lr_factor(double factor) {
  impl_->adamw.lr = impl_->cfg.adamw.lr * factor;
  impl_->muon.lr = impl_->cfg.muon.lr * factor;
}
int64_t Optimizer::steps() const { return impl_->step; }
const OptimizerConfig& Optimizer::config() const { return impl_->cfg; }

Kind Optimizer::kind_of(const std::string& name) const {
  for (const Param& P : impl_->params)
    if (P.name == name) return P.kind;
  KILN_FAIL("optimizer: no parameter named ", name);
}

int64_t Optimizer::state_bytes() const {
  int64_t b = 0;
  for (const Param& P : impl_->params)
    for (int s = 0; s < kSlots; ++s)
      if (P.used[s]) b += P.numel * P.elem(s);
  return b;
}

std::string Optimizer::summary() const {
  int64_t n[2] = {0, 0}, t[2] = {0, 0};
  for (const Param& P : impl_->params) {
    n[int(P.kind)] += P.numel;
    ++t[int(P.kind)];
  }
  std::ostringstream os;
  os << "muon " << t[1] << " tensors (" << n[1] << " params), adamw " << t[0] << " tensors (" << n[0]
     << " params); state " << placement_name(impl_->cfg.state) << ", " << state_bytes() / (1 << 20) << " MiB";
  if (impl_->chunked()) os << " in " << impl_->chunks.size() << " chunks of <= " << impl_->max_chunk_bytes << " B";
  return os.str();
}

void Optimizer::save(const std::string& path) const { impl_->save(path); }
void Optimizer::load(const std::string& path) { impl_->load(path); }

}  // namespace kiln::optimizers
