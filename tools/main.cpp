// The `kiln` command: starts MPI when mpirun or srun launched it, parses the subcommand, runs it,
// and turns any error into one clear line and a non-zero exit (MPI_Abort of the whole job under
// MPI, so no rank hangs waiting for the one that failed).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <string>

#include "core/comm.h"
#include "core/error.h"
#include "tools/commands.h"

namespace {

int fail(const std::string& msg) {
  const kiln::comm::Group& world = kiln::comm::Group::world();
  if (world.size() > 1) std::fprintf(stderr, "kiln: error on rank %d: %s\n", world.rank(), msg.c_str());
  else std::fprintf(stderr, "kiln: error: %s\n", msg.c_str());
  std::fflush(stderr);
  kiln::comm::abort_job(1);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    kiln::comm::init(&argc, &argv);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
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
      {"quantize", kiln::tools::add_quantize(app)},
      {"merge", kiln::tools::add_merge(app)},
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    if (rc != 0) kiln::comm::abort_job(rc);
    kiln::comm::finalize();
    return rc;
  }
  try {
    for (auto* sub : app.get_subcommands()) runs.at(sub->get_name())();
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  kiln::comm::finalize();
  return 0;
}
