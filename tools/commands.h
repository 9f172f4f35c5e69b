// The kiln subcommands: each registers its options on a CLI11 app and runs when chosen.
#pragma once
#include <functional>

namespace CLI {
class App;
}

namespace kiln::tools {

// Each add_* registers one subcommand on `app` and returns the function that runs it.
using Run = std::function<void()>;
Run add_info(CLI::App& app);
Run add_init(CLI::App& app);
Run add_forward(CLI::App& app);
Run add_bench(CLI::App& app);
Run add_train(CLI::App& app);
Run add_sft(CLI::App& app);
Run add_plot(CLI::App& app);
Run add_generate(CLI::App& app);
Run add_mismatch(CLI::App& app);
Run add_quantize(CLI::App& app);
Run add_merge(CLI::App& app);
Run add_plan(CLI::App& app);
Run add_serve(CLI::App& app);  // built with cpp-httplib (KILN_WITH_SERVE)

}  // namespace kiln::tools
