// `kiln forward --model <dir>`: per-token log-probs (and routing) of given token sequences,
// printed or saved as safetensors or HDF5. Later issues compare rollout and trainer against it.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <torch/csrc/autograd/grad_mode.h>

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/files.h"
#include "core/hdf5_io.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "tools/commands.h"
#include "tools/token_ids.h"

namespace kiln::tools {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

Run add_forward(CLI::App& app) {
  auto* cmd = app.add_subcommand("forward", "Per-token log-probs of token sequences under a checkpoint");
  struct Args {
    std::string model, tokens_file, out, dtype = "fp32", device = "cpu";
    std::vector<std::string> tokens;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "Checkpoint directory (config.json + safetensors)")->required();
  cmd->add_option("--tokens", a->tokens, "A sequence of token ids, e.g. \"1,2,3\"; repeat for more sequences");
  cmd->add_option("--tokens-file", a->tokens_file, "File with one sequence of ids per line");
  cmd->add_option("--out", a->out, "Save tokens, cu_seqlens, logprobs and routing (.safetensors or .h5)");
  cmd->add_option("--dtype", a->dtype, "Compute dtype: fp32, bf16 or fp64")->capture_default_str();
  cmd->add_option("--device", a->device, "cpu or cuda")->capture_default_str();
  return [a] {
    std::vector<std::vector<int64_t>> seqs;
    for (size_t i = 0; i < a->tokens.size(); ++i)
      seqs.push_back(parse_ids(a->tokens[i], "forward", "--tokens #" + std::to_string(i + 1)));
    if (!a->tokens_file.empty()) {
      check_input_file(a->tokens_file, "forward: --tokens-file", "give a file with one sequence of ids per line");
      std::ifstream in(a->tokens_file);
      KILN_CHECK(in.good(), "forward: cannot open --tokens-file ", a->tokens_file);
      std::string line;
      for (int lineno = 1; std::getline(in, line); ++lineno) {
        auto ids = parse_ids(line, "forward", a->tokens_file + ":" + std::to_string(lineno));
        if (!ids.empty()) seqs.push_back(std::move(ids));
      }
    }
    KILN_CHECK(!seqs.empty(), "forward: no tokens given; pass --tokens \"1,2,3\" or --tokens-file FILE");
    for (size_t i = 0; i < seqs.size(); ++i)
      KILN_CHECK(!seqs[i].empty(), "forward: sequence #", i + 1, " is empty");

    at::NoGradGuard no_grad;
    const at::Device device = model::parse_device(a->device, "forward: --device");
    const model::Muse m = model::load_checkpoint(a->model, model::parse_dtype(a->dtype), device);
    const model::PackedBatch batch = model::PackedBatch::from_sequences(seqs, device);
    // Target of token t is token t+1 of the same sequence; the last token of each has none.
    const int64_t T = batch.num_tokens();
    std::vector<int64_t> targets(T, -100);
    std::vector<int64_t> flat;
    for (const auto& s : seqs) flat.insert(flat.end(), s.begin(), s.end());
    for (int64_t s = 0; s < batch.num_sequences(); ++s)
      for (int64_t t = batch.cu_seqlens[s]; t + 1 < batch.cu_seqlens[s + 1]; ++t) targets[t] = flat[t + 1];
    model::ForwardOptions opt;
    opt.targets = at::tensor(targets, at::kLong);
    const model::ForwardOutput out = m.forward(batch, opt);
    // A NaN or inf log-prob is not "no log-prob": the model overflowed (the checkpoint's values
    // were checked on load). Say where, instead of writing it out as data.
    const at::Tensor bad = at::isfinite(out.logprobs).logical_not_().logical_and_(opt.targets.to(out.logprobs.device()).ne(-100));
    if (bad.any().item<bool>()) {
      const int64_t t = bad.nonzero()[0][0].item<int64_t>();
      const auto seq = std::upper_bound(batch.cu_seqlens.begin(), batch.cu_seqlens.end(), t) - batch.cu_seqlens.begin() - 1;
      KILN_FAIL("forward: the log-prob of sequence ", seq, " position ", t + 1 - batch.cu_seqlens[size_t(seq)],
                " is ", out.logprobs[t].item<double>(), " (", bad.sum().item<int64_t>(),
                " non-finite in all); the model overflows on this input in ", a->dtype);
    }

    // logprobs[t] = log p(token t | tokens before it); NaN for each sequence's first token.
    at::Tensor next = out.logprobs.to(at::kCPU, at::kFloat);
    at::Tensor lp = at::full({T}, std::numeric_limits<float>::quiet_NaN(), at::kFloat);
    for (int64_t s = 0; s < batch.num_sequences(); ++s) {
      const int64_t b = batch.cu_seqlens[s], e = batch.cu_seqlens[s + 1];
      if (e - b > 1) lp.narrow(0, b + 1, e - b - 1).copy_(next.narrow(0, b, e - b - 1));
    }
    at::Tensor tokens = batch.tokens.cpu(), routing = out.routing.cpu();
    at::Tensor cu = at::tensor(batch.cu_seqlens, at::kLong);
    if (a->out.empty()) {
      const float* p = lp.data_ptr<float>();
      for (int64_t s = 0; s < batch.num_sequences(); ++s) {
        fmt::print("sequence {}\n  pos  token     logprob\n", s);
        for (int64_t t = batch.cu_seqlens[s]; t < batch.cu_seqlens[s + 1]; ++t)
          fmt::print("{:5d} {:6d} {:>11}\n", t - batch.cu_seqlens[s], flat[t],
                     std::isnan(p[t]) ? std::string("-") : fmt::format("{:.6f}", p[t]));
      }
      return;
    }
    if (ends_with(a->out, ".h5") || ends_with(a->out, ".hdf5")) {
      hdf5::Writer w(a->out);
      w.write("tokens", tokens);
      w.write("cu_seqlens", cu);
      w.write("logprobs", lp);
      w.write("routing", routing);
      w.attribute("model", a->model);
      w.attribute("dtype", a->dtype);
      w.commit();
    } else {
      KILN_CHECK(ends_with(a->out, ".safetensors"), "forward: --out must end in .safetensors, .h5 or .hdf5 (got ",
                 a->out, ")");
      safetensors::write_file(a->out, {{"tokens", tokens}, {"cu_seqlens", cu}, {"logprobs", lp}, {"routing", routing}},
                              {{"format", "pt"}, {"model", a->model}, {"dtype", a->dtype}});
    }
    fmt::print("wrote log-probs of {} tokens in {} sequences to {}\n", T, batch.num_sequences(), a->out);
  };
}

}  // namespace kiln::tools
