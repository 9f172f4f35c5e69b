// `kiln serve`: a checkpoint behind the OpenAI API (serve/server.h). SIGTERM or SIGINT stops
// taking requests, finishes those under way and exits 0.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <csignal>
#include <filesystem>
#include <thread>

#include "core/error.h"
#include "core/stop_signal.h"
#include "model/checkpoint.h"
#include "rollout/engine.h"
#include "serve/server.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "tools/commands.h"

namespace kiln::tools {
namespace {

struct ServeArgs {
  std::string model, tokenizer, name, dtype = "fp32", device = "cpu", quantization = "none", numerics = "standard";
  serve::ServeOptions http;
  int64_t kv_cache_mb = 256, max_num_seqs = 64, max_model_len = 0;
};

}  // namespace

Run add_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve",
                                 "Serve a checkpoint through the OpenAI API: POST /v1/chat/completions and "
                                 "/v1/completions, GET /v1/models and /health (docs/SERVE.md)");
  auto a = std::make_shared<ServeArgs>();
  cmd->add_option("model", a->model, "Checkpoint directory (config.json + safetensors)")->required();
  cmd->add_option("--tokenizer", a->tokenizer,
                  "Tokenizer (a folder or tokenizer.json / *.tiktoken); default: the checkpoint's files, else bytes");
  cmd->add_option("--model-name", a->name, "The model's name in the API (default: the checkpoint folder's name)");
  cmd->add_option("--host", a->http.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", a->http.port, "Port (0: any free one, printed)")->check(CLI::Range(0, 65535))->capture_default_str();
  cmd->add_option("--api-key", a->http.api_key, "Require 'Authorization: Bearer <key>' on every API call");
  cmd->add_option("--dtype", a->dtype, "Compute dtype: fp32, bf16 or fp64")->capture_default_str();
  cmd->add_option("--device", a->device, "cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--quantization", a->quantization, "Served weights: none, nvfp4 (W4A16) or w4a4")->capture_default_str();
  cmd->add_option("--numerics", a->numerics, "standard or bitwise (the trainer's forward, bit for bit)")->capture_default_str();
  cmd->add_option("--kv-cache-mb", a->kv_cache_mb, "KV-cache budget in MiB")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--max-num-seqs", a->max_num_seqs, "Sequences sampled at once over all requests")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--max-model-len", a->max_model_len,
                  "Longest prompt + completion served (default: the model's max_position_embeddings)")
      ->check(CLI::NonNegativeNumber);
  return [a] {
    std::unique_ptr<text::Tokenizer> tok;
    if (!a->tokenizer.empty()) tok = text::load_tokenizer(a->tokenizer);
    else if (text::has_tokenizer_files(a->model)) tok = text::load_tokenizer(a->model);
    else tok = text::make_byte_tokenizer(256);
    std::unique_ptr<text::ChatTemplate> chat;
    if (!tok->chat_template().empty()) chat = std::make_unique<text::ChatTemplate>(tok->chat_template(), tok->name());

    at::NoGradGuard no_grad;
    const at::Device device = model::parse_device(a->device, "serve: --device");
    const model::Muse m = model::load_checkpoint(a->model, model::parse_dtype(a->dtype), device);
    rollout::EngineConfig ec;
    ec.quantization = rollout::parse_quantization(a->quantization);
    ec.numerics = model::parse_numerics(a->numerics);
    ec.kv_cache_bytes = a->kv_cache_mb << 20;
    ec.max_num_seqs = a->max_num_seqs;
    ec.validate();
    rollout::Engine engine(m, ec);

    serve::ServedModel served;
    served.name = !a->name.empty() ? a->name : std::filesystem::path(a->model).lexically_normal().filename().string();
    if (served.name.empty()) served.name = std::filesystem::path(a->model).parent_path().filename().string();
    served.tokenizer = tok.get();
    served.chat = chat.get();
    served.vocab_size = m.config().vocab_size;
    served.context_length = a->max_model_len > 0 ? std::min(a->max_model_len, m.config().max_position_embeddings)
                                                 : m.config().max_position_embeddings;
    serve::Server server(engine, served, a->http);
    const int port = server.bind();
    stop_signal::install();
    std::signal(SIGINT, [](int) { std::raise(SIGTERM); });
    std::thread watcher([&] {  // a signal stops the server; the server's own end stops the watcher
      while (!stop_signal::received()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      server.stop();
    });
    fmt::print("serve: {} as '{}' on http://{}:{}/v1 ({}, {} tokens of context{}{})\n", a->model, served.name,
               a->http.host, port, tok->name(), served.context_length, chat ? ", chat template" : ", no chat template",
               a->http.api_key.empty() ? "" : ", API key required");
    std::fflush(stdout);
    server.run();
    fmt::print("serve: stopped ({})\n", stop_signal::name(stop_signal::received()));
    watcher.join();
  };
}

}  // namespace kiln::tools
