// A clean stop on a scheduler's warning: SIGTERM and SIGUSR1 (what Slurm sends before a time limit
// or a preemption) set a flag that the training loop checks between steps, so the job writes a
// checkpoint and exits instead of dying mid-step. A second signal of the same kind kills at once.
#pragma once

namespace kiln::stop_signal {

// Installs the handlers (idempotent).
void install();
// The signal received since install(), or 0.
int received();
// "SIGTERM", "SIGUSR1" or "signal N".
const char* name(int signal);

}  // namespace kiln::stop_signal
