// The `kiln` command: starts MPI when mpirun or srun launched it, parses the subcommand, runs it,
// and turns any error into one clear line and a non-zero exit (MPI_Abort of the whole job under
// MPI, so no rank hangs waiting for the one that failed).
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "core/comm.h"
#include "core/crash.h"
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

// Edit distance, for "did you mean" on a mistyped command.
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// "kiln trian": name the commands (and the nearest one) instead of CLI11's "A subcommand is required".
std::string unknown_command(const std::string& given, const std::map<std::string, kiln::tools::Run>& runs) {
  std::string names, nearest;
  size_t best = 3;  // suggest only within two edits
  for (const auto& [name, run] : runs) {
    names += (names.empty() ? "" : ", ") + name;
    if (distance(given, name) < best) best = distance(given, name), nearest = name;
  }
  return "unknown command '" + given + "'" + (nearest.empty() ? "" : "; did you mean '" + nearest + "'?") +
         " The commands are " + names + " (kiln --help)";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    kiln::comm::init(&argc, &argv);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  kiln::install_crash_report(kiln::comm::Group::world().rank());  // after MPI's own handlers
  CLI::App app{"kiln: RL training for latent-MoE language models (Muse Spark Open)", "kiln"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kiln 0.1.0");
  // A bad option is one line, like every other kiln error (CLI11's default adds a second line).
  app.failure_message([](const CLI::App*, const CLI::Error& e) { return std::string(e.what()) + " (see --help)\n"; });
  std::map<std::string, kiln::tools::Run> runs = {
      {"info", kiln::tools::add_info(app)},
      {"init", kiln::tools::add_init(app)},
      {"forward", kiln::tools::add_forward(app)},
      {"bench", kiln::tools::add_bench(app)},
      {"train", kiln::tools::add_train(app)},
      {"sft", kiln::tools::add_sft(app)},
      {"plot", kiln::tools::add_plot(app)},
      {"generate", kiln::tools::add_generate(app)},
      {"mismatch", kiln::tools::add_mismatch(app)},
      {"quantize", kiln::tools::add_quantize(app)},
      {"merge", kiln::tools::add_merge(app)},
      {"plan", kiln::tools::add_plan(app)},
#if KILN_WITH_SERVE
      {"serve", kiln::tools::add_serve(app)},
#endif
  };
  if (argc > 1 && argv[1][0] != '-' && !runs.count(argv[1])) return fail(unknown_command(argv[1], runs));
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
  } catch (const c10::Error& e) {  // from libtorch: its message, not its C++ backtrace
    return fail(e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return fail(std::string("out of memory (host allocation failed) in kiln ") + argv[1] +
                "; use a smaller model, batch or chunk, or a machine with more memory");
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  kiln::comm::finalize();
  return 0;
}
