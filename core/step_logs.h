// Cutting a run's logs back to the step a resumed run continues from, so that each step it redoes
// appears once: JSON-lines files whose objects carry "step" and a folder of TensorBoard event files.
#pragma once
#include <cstdint>
#include <string>

namespace kiln {

struct LogCut {
  int64_t kept = 0;         // lines or records left
  int64_t dropped = 0;      // lines or records of later steps, removed
  uint64_t torn_bytes = 0;  // a last line or record cut short (a kill mid-write), removed
};

// Keeps the lines of `path` whose "step" is at most `step`, in their order, and drops a last line
// without its newline. Nothing else is touched: a file with nothing to drop stays as it is, one
// whose dropped lines all follow the kept ones is truncated in place (one truncate call), and any
// other is written beside it and renamed over it. A missing path or one that is not a regular
// file is left alone. A complete line that is not a JSON object with an integer "step" is an
// error naming the file and line: whether it belongs before the cut cannot be told.
LogCut keep_jsonl_through(const std::string& path, int64_t step);

// The same for every event file in `dir` (a name holding "tfevents", as TensorBoard reads them):
// the records whose event's step is at most `step` stay, in order, the file_version record
// (step 0) among them; a last record cut short is dropped; a damaged one is an error naming the
// file and offset (tensorboard::scan_event_file). A missing `dir` is left alone.
LogCut keep_events_through(const std::string& dir, int64_t step);

}  // namespace kiln
