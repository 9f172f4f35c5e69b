// GRPO's learner in checkpoints: weights or PEFT adapters, the reference, each rank's optimizer
// shard and the state that marks a checkpoint complete; and the checks before a resume.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/bytes.h"
#include "core/checkpoint_dir.h"
#include "core/error.h"
#include "model/checkpoint.h"
#include "model/expert_parallel.h"
#include "model/lora.h"
#include "text/tokenizer.h"
#include "trainer/learner.h"

namespace kiln::trainer {
namespace {
// This rank's shard of the optimizer state in a checkpoint.
std::string optimizer_file(const comm::Group& g) {
  return g.size() == 1 ? "optimizer.safetensors"
                       : str_cat("optimizer-rank", g.rank(), "-of-", g.size(), ".safetensors");
}

// This rank's batches made ahead of the trainer in a checkpoint (grpo.async).
std::string ahead_file(const comm::Group& g) {
  return g.size() == 1 ? "ahead.bin" : str_cat("ahead-rank", g.rank(), "-of-", g.size(), ".bin");
}

void write_ahead_file(const std::string& path, const BatchesAhead& a) {
  ByteWriter w;
  write_ahead(w, a);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(w.bytes().data()), std::streamsize(w.bytes().size()));
  f.close();
  KILN_CHECK(f.good(), "grpo: cannot write ", path, " (", w.bytes().size(), " bytes; is the disk full?)");
}

BatchesAhead read_ahead_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KILN_CHECK(f.good(), "grpo: checkpoint file ", path, " is missing; its state.json says the batches made ahead "
             "(grpo.async) were saved there. Resume from a complete checkpoint");
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ByteReader r(bytes.data(), bytes.size(), path);
  BatchesAhead a = read_ahead(r);
  r.expect_end();
  return a;
}

nlohmann::json read_state(const std::string& dir) {
  std::ifstream f(dir + "/state.json");
  KILN_CHECK(f.good(), "grpo: no checkpoint state at ", dir, "/state.json; expected a directory written by save()");
  nlohmann::json st;
  try {
    f >> st;
  } catch (const nlohmann::json::exception& e) {
    KILN_FAIL("grpo: ", dir, "/state.json: invalid JSON (", e.what(), ")");
  }
  KILN_CHECK(st.contains("step") && st.contains("data_position"), "grpo: ", dir,
             "/state.json lacks step or data_position");
  return st;
}
}  // namespace

// A cheap identity of the frozen base (LoRA checkpoints store the adapters only and check that
// they resume on the same base): the sum of its elements in fp64. Each tensor (each expert) is
// summed by the one rank that writes it and the sums are added in one order, so that a share
// gives what the whole policy gives. Collective.
double Learner::base_fingerprint() const {
  at::NoGradGuard g;
  const int64_t E = trained().config().num_experts, ep = cfg_.parallel.ep;
  const bool first_copy = ep > 1 ? layout_->expert_dp().rank() == 0 : group_.rank() == 0;
  std::vector<at::Tensor> sums;
  for (const auto& [name, t] : trained().named_parameters()) {
    const bool expert = model::is_expert_tensor(name);
    at::Tensor part = at::zeros({expert ? E : 1}, at::kDouble);
    const parallel::Zero3* zero3 = layout_->zero3();
    const parallel::Zero3::Entry* e = zero3 ? zero3->find(name) : nullptr;
    if (e ? zero3->owns(*e) : first_copy) {
      const at::Tensor w = t.detach();
      if (!expert) part.fill_(w.sum(at::kDouble).item<double>());
      else if (w.size(0) == E) part.copy_(w.flatten(1).sum(1, false, at::kDouble).cpu());
      else part.narrow(0, layout_->ep_group().rank() * w.size(0), w.size(0)).copy_(w.flatten(1).sum(1, false, at::kDouble).cpu());
    }
    sums.push_back(part);
  }
  at::Tensor all = at::cat(sums);
  if (group_.size() > 1) group_.all_reduce(all);
  return all.sum().item<double>();
}

// The trained adapters of the whole model (collective): under expert parallelism every rank's
// expert adapters gathered, in a view that shares everything else.
model::Muse Learner::whole_adapters() const {
  model::Weights w = trained().weights();
  if (cfg_.parallel.ep > 1)
    for (model::LayerWeights& l : w.layers)
      for (at::Tensor* t : {&l.lora.gate_a, &l.lora.gate_b, &l.lora.up_a, &l.lora.up_b, &l.lora.down_a, &l.lora.down_b})
        if (t->defined()) *t = layout_->ep_group().all_gather(t->detach());
  return model::Muse(trained().config(), std::move(w));
}

// Before a sharded save (collective): LoRA's base is frozen, so only full-parameter runs check.
void Learner::check_finite(const std::string& dir, int64_t step) const {
  if (!lora()) layout_->check_finite(str_cat("step ", step, " into ", dir));
}

// The trained weights into `out` (collective): with LoRA the PEFT adapter (rank 0), otherwise
// the weights and the tokenizer's files, so that the folder loads on its own.
void Learner::write_model(const std::string& out) const {
  if (lora()) {
    const model::Muse adapters = whole_adapters();
    if (group_.rank() == 0) model::save_peft_adapter(adapters, out);
    return;
  }
  layout_->write(trained(), layout_->zero3(), out);
  if (group_.rank() == 0 && !tokenizer_files_.empty()) text::copy_tokenizer_files(tokenizer_files_, out);
}

// The adapters of `dir`/adapter into the trained ones in place (the optimizer holds them); an
// expert shard takes its slice.
void Learner::restore_adapters(const std::string& dir) {
  KILN_CHECK(std::filesystem::exists(dir + "/adapter/adapter_config.json"), "grpo: checkpoint ", dir,
             " has no adapter/ but the recipe trains LoRA adapters; resume with the recipe the run was started with");
  model::Muse saved(trained().config(), trained().weights());  // a view: load_peft_adapter replaces its adapters
  model::load_peft_adapter(saved, dir + "/adapter");
  auto mine = model::lora_parameters(trained()), theirs = model::lora_parameters(saved);
  KILN_CHECK(mine.size() == theirs.size(), "grpo: checkpoint ", dir, "/adapter holds ", theirs.size(),
             " adapters, the run trains ", mine.size());
  at::NoGradGuard g;
  for (size_t i = 0; i < mine.size(); ++i) {
    at::Tensor t = theirs[i].second;
    if (model::is_expert_tensor(mine[i].first) && t.size(0) != mine[i].second.size(0))  // this rank's experts
      t = t.narrow(0, layout_->ep_group().rank() * mine[i].second.size(0), mine[i].second.size(0));
    KILN_CHECK(mine[i].first == theirs[i].first && mine[i].second.sizes() == t.sizes(), "grpo: checkpoint ", dir,
               "/adapter: ", theirs[i].first, " ", t.sizes(), " does not fit ", mine[i].first, " ",
               mine[i].second.sizes());
    mine[i].second.copy_(t);
  }
}

void Learner::save(const std::string& dir, int64_t step, uint64_t data_position, const BatchesAhead* ahead) const {
  const comm::Group& g = group_;
  const CheckpointDir ck(dir);  // written as dir.tmp, state.json last, then swapped in
  const std::string tmp = ck.tmp();
  check_finite(dir, step);
  const double fingerprint = lora() ? base_fingerprint() : 0.0;
  if (g.rank() == 0) ck.begin();
  g.barrier();  // dir.tmp exists for every rank's files
  // LoRA: the frozen base is the recipe's; only its fingerprint goes with the adapters.
  write_model(tmp + (lora() ? "/adapter" : "/model"));
  if (reference_) layout_->write(*reference_, ref_zero3_.get(), tmp + "/reference");
  g.barrier();
  if (auto* opt = zero_->optimizer()) opt->save(tmp + "/" + optimizer_file(g));  // each rank its own shard
  if (ahead) write_ahead_file(tmp + "/" + ahead_file(g), *ahead);
  g.barrier();
  // state.json last: it marks the checkpoint complete; the old one goes only once the new one is in place.
  if (g.rank() == 0) {
    ck.write_marker(nlohmann::json{{"step", step},
                                   {"data_position", data_position},
                                   {"ahead", ahead != nullptr},
                                   {"seed", cfg_.seed},
                                   {"world", g.size()},
                                   {"ep", cfg_.parallel.ep},
                                   {"lora_rank", cfg_.lora ? cfg_.lora->rank : 0},  // 0: no adapters
                                   {"lora_alpha", cfg_.lora.value_or(model::LoraConfig{}).alpha},
                                   {"base_fingerprint", fingerprint}}
                        .dump(2) + "\n");
    ck.commit();
  }
  g.barrier();
}

void Learner::save_model(const std::string& dir, int64_t step) const {
  check_finite(dir, step);
  layout_->write_folder(dir, [&](const std::string& tmp) { write_model(tmp); });
}

TrainedState Learner::load(const std::string& dir) {
  // Whatever interrupted the last save, the newest complete checkpoint is put in place first.
  int64_t found = 0;
  if (group_.rank() == 0) found = CheckpointDir(dir).recover();
  KILN_CHECK(found >= 0, "grpo: no complete checkpoint at ", dir, " (nor ", dir, ".old or ", dir,
             ".tmp with a state.json); nothing to resume from");
  group_.barrier();
  const nlohmann::json st = read_state(dir);
  KILN_CHECK(st.value("world", 1) == group_.size() && st.value("ep", int64_t(1)) == cfg_.parallel.ep,
             "grpo: checkpoint ", dir, " was written by ", st.value("world", 1), " ranks with ep=",
             st.value("ep", int64_t(1)), "; this run has ", group_.size(), " ranks with ep=", cfg_.parallel.ep,
             ": resume with the same layout (each rank's optimizer shard belongs to it)");
  const int64_t rank = cfg_.lora ? cfg_.lora->rank : 0;  // as the checkpoint spells it
  const double alpha = cfg_.lora.value_or(model::LoraConfig{}).alpha;
  KILN_CHECK(st.value("lora_rank", int64_t(0)) == rank && (!cfg_.lora || st.value("lora_alpha", 0.0) == alpha),
             "grpo: checkpoint ", dir, " was written with lora rank ", st.value("lora_rank", int64_t(0)), " alpha ",
             st.value("lora_alpha", 0.0), "; the recipe says rank ", rank, " alpha ", alpha,
             ": resume with the recipe the run was started with");
  KILN_CHECK(st.value("seed", uint64_t(0)) == cfg_.seed, "grpo: checkpoint ", dir, " was made with seed ",
             st.value("seed", uint64_t(0)), " but the recipe says ", cfg_.seed);
  if (lora()) {
    const double want = st.value("base_fingerprint", 0.0), have = base_fingerprint();
    KILN_CHECK(want == have, "grpo: checkpoint ", dir, " holds adapters for another base (fingerprint ", want,
               ", this model's ", have, "); resume from the base the run started with");
    restore_adapters(dir);
  } else {
    layout_->restore(trained(), dir, "model");
  }
  if (reference_) {
    KILN_CHECK(std::filesystem::exists(dir + "/reference/config.json"), "grpo: checkpoint ", dir,
               " has no reference/ policy but the recipe's kl_coef=", cfg_.loss.kl_coef,
               " needs one; resume with the kl_coef the run was started with");
    layout_->restore(*reference_, dir, "reference");
  }
  // An optimizer file without master weights starts them from the parameters just read.
  if (auto* opt = zero_->optimizer()) opt->load(dir + "/" + optimizer_file(group_));
  TrainedState out{st["step"].get<int64_t>(), st["data_position"].get<uint64_t>(), std::nullopt};
  if (st.value("ahead", false)) out.ahead = read_ahead_file(dir + "/" + ahead_file(group_));
  return out;
}

}  // namespace kiln::trainer
