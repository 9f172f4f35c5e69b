// `kiln plot <run_dir>`: a PNG of reward, accuracy (sampled, pass@n, held-out mean@k in all and per
// data_source) and the train-vs-rollout mismatch against step, drawn by gnuplot from the run's
// metrics.jsonl.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <vector>

#include "core/error.h"
#include "tools/commands.h"
#include "tools/gnuplot.h"

namespace kiln::tools {

Run add_plot(CLI::App& app) {
  auto* cmd = app.add_subcommand("plot", "Plot reward, accuracy and mismatch of a run (needs gnuplot)");
  struct Args {
    std::string run, out;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("run_dir", a->run, "Run directory holding metrics.jsonl")->required();
  cmd->add_option("--out", a->out, "PNG to write (default <run_dir>/metrics.png)");
  return [a] {
    const std::string metrics = a->run + "/metrics.jsonl";
    const std::string png = a->out.empty() ? a->run + "/metrics.png" : a->out;
    std::ifstream in(metrics);
    KILN_CHECK(in.good(), "plot: cannot open ", metrics, "; give a run directory written by kiln train");
    const std::string steps_dat = a->run + "/.plot-steps.dat", eval_dat = a->run + "/.plot-eval.dat";
    std::ofstream steps(steps_dat), evals(eval_dat);
    std::string line;
    int64_t n_steps = 0;
    std::map<std::string, std::string> by_source;  // data_source -> "step value" lines
    for (int lineno = 1; std::getline(in, line); ++lineno) {
      if (line.empty()) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        KILN_FAIL("plot: ", metrics, ":", lineno, ": invalid JSON (", e.what(), ")");
      }
      if (j.contains("eval_accuracy")) {
        evals << j["step"].get<int64_t>() << " " << j["eval_accuracy"].get<double>() << "\n";
        if (j.contains("eval_by_source"))
          for (auto it = j["eval_by_source"].begin(); it != j["eval_by_source"].end(); ++it)
            by_source[it.key()] += fmt::format("{} {}\n", j["step"].get<int64_t>(), it.value()["mean_at_k"].get<double>());
      } else if (j.contains("reward")) {
        const double no_replay = j.contains("mismatch_no_replay") ? j["mismatch_no_replay"]["mean_abs_seq"].get<double>()
                                                                   : std::nan("");
        const double pass = j.contains("pass_at_n") ? j["pass_at_n"].get<double>() : std::nan("");
        steps << j["step"].get<int64_t>() << " " << j["reward"].get<double>() << " " << j["accuracy"].get<double>()
              << " " << j["mismatch"]["mean_abs_seq"].get<double>() << " " << no_replay << " " << pass << "\n";
        ++n_steps;
      }
    }
    steps.close();
    evals.close();
    KILN_CHECK(n_steps > 0, "plot: ", metrics, " holds no step lines yet");
    // One dashed line per data_source, when there is more than one.
    std::vector<std::string> files = {steps_dat, eval_dat};
    std::string source_plots;
    if (by_source.size() > 1) {
      for (const auto& [source, rows] : by_source) {
        const std::string f = a->run + "/.plot-eval-" + std::to_string(files.size()) + ".dat";
        std::ofstream(f) << rows;
        files.push_back(f);
        source_plots += ", '" + f + "' u 1:2 w lp pt 6 dt 2 t 'held-out " + source + "'";
      }
    }
    const std::string script = a->run + "/.plot.gp";
    {
      std::ofstream gp(script);
      gp << "set terminal pngcairo noenhanced size 1100,700\nset output '" << png << "'\n"
         << "set multiplot layout 2,1 title 'kiln GRPO: " << a->run << "'\n"
         << "set key outside right\nset grid\nset yrange [0:1]\nset ylabel 'reward / accuracy'\n"
         << "plot '" << steps_dat << "' u 1:2 w l lw 2 t 'reward', '' u 1:3 w l lw 2 t 'sampled accuracy', "
         << "'' u 1:6 w l lw 1 t 'prompts with a right sample (pass@n)', '" << eval_dat << "' u 1:2 w lp pt 7 lw 2 t 'held-out mean@k'"
         << source_plots << "\n"
         << "set autoscale y\nset logscale y\nset xlabel 'step'\nset ylabel 'mean |lp_old - lp_roll|'\n"
         << "plot '" << steps_dat << "' u 1:4 w l lw 2 t 'mismatch (replay as configured)', '' u 1:5 w l lw 2 t "
         << "'mismatch (replay off)'\nunset multiplot\n";
    }
    run_gnuplot(script, files, "plot");
    fmt::print("wrote {} ({} steps)\n", png, n_steps);
  };
}

}  // namespace kiln::tools
