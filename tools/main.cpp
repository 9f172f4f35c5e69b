// The `kiln` command: parses the subcommand, runs it, and turns any error into one clear line
// and a non-zero exit (MPI_Abort when running under MPI, so no rank hangs).
#include <CLI/CLI.hpp>
#include <mpi.h>

#include <cstdio>
#include <map>
#include <string>

#include "core/error.h"
#include "tools/commands.h"

namespace {

int fail(const std::string& msg) {
  int initialized = 0, finalized = 0, rank = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  if (size > 1) std::fprintf(stderr, "kiln: error on rank %d: %s\n", rank, msg.c_str());
  else std::fprintf(stderr, "kiln: error: %s\n", msg.c_str());
  std::fflush(stderr);
  if (initialized && !finalized && size > 1) MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kiln: RL training for latent-MoE language models (Muse Spark Open)", "kiln"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kiln 0.1.0");
  std::map<std::string, kiln::tools::Run> runs = {
      {"info", kiln::tools::add_info(app)},
      {"init", kiln::tools::add_init(app)},
      {"forward", kiln::tools::add_forward(app)},
      {"bench", kiln::tools::add_bench(app)},
      {"train", kiln::tools::add_train(app)},
      {"sft", kiln::tools::add_sft(app)},
      {"plot", kiln::tools::add_plot(app)},
      {"generate", kiln::tools::add_generate(app)},
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto* sub : app.get_subcommands()) runs.at(sub->get_name())();
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  return 0;
}
