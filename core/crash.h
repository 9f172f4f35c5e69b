// A report from a crashing process: on SIGSEGV, SIGBUS, SIGFPE or SIGABRT it writes the rank, the
// signal, the faulting instruction and a backtrace to stderr, then dies by the same signal (so
// mpirun still ends the job). The machines that run kiln may have no debugger.
#pragma once

namespace kiln {

// Installs the handlers (call after MPI's own, i.e. after comm::init). `rank` labels the report.
// The faulting instruction is named through dladdr (with the caller, for a call through a null
// pointer) as file+offset, which addr2line turns into a function (tools/gpu_check.sh does); a
// report that hangs is cut short after 10 s, and the calling thread's overflows are reported.
void install_crash_report(int rank);

}  // namespace kiln
