// TensorBoard event files written by kiln itself: scalars and text, in TFRecord framing with CRC32C,
// the few Event/Summary protos encoded by hand so kiln needs neither TensorFlow nor a protobuf library.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace kiln::tensorboard {

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of TFRecord framing. Runs on the
// SSE4.2 crc32 instruction when this CPU has it, otherwise on crc32c_table.
uint32_t crc32c(const void* data, size_t size);
// Byte-at-a-time table version: the reference the fast path is tested against.
uint32_t crc32c_table(const void* data, size_t size);
// Whether crc32c uses the SSE4.2 instruction on this machine (tests say what they compared).
bool crc32c_uses_hardware();
// TFRecord stores CRCs masked (rotate right by 15, add 0xa282ead8 mod 2^32), because a CRC computed over
// data that itself holds CRCs is weak.
uint32_t mask_crc32c(uint32_t crc);

// Appends TensorBoard events to <dir>/events.out.tfevents.<unix seconds>.<hostname>.<pid>.kiln; TensorBoard
// reads every file in a run directory whose name contains "tfevents". The first record is the file_version
// event ("brain.Event:2"). A second writer that would get the same name (same directory, second and process)
// gets ".<n>" before ".kiln" instead of sharing the file; one writer per run directory is the intended use.
//
// Records go through a stdio buffer: they reach the file when it fills, at flush() and at close(). Call
// flush() once per training step so a crash loses at most one step. Every write is checked: a full disk or a
// closed file throws kiln::Error naming the file, and after a failed write the writer is closed, since records
// after a torn one would be unreadable. The destructor flushes and closes but cannot throw: call close() to see
// a last error as an exception.
class EventWriter {
 public:
  // Creates `dir` (and its parents) if needed; errors name the path.
  explicit EventWriter(const std::string& dir);
  // Appends to exactly `path` (created if missing), starting with a file_version event. For tests and tools
  // that need a fixed name; /dev/full makes every flush fail.
  static EventWriter open_file(const std::string& path);
  ~EventWriter();
  EventWriter(EventWriter&& other) noexcept;
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;
  EventWriter& operator=(EventWriter&&) = delete;

  // A scalar (Summary.Value.simple_value, a float32: values round to float, beyond +-3.4e38 they become
  // +-inf). NaN and inf are written as they are and TensorBoard shows them; whether a non-finite loss is an
  // error is the caller's decision. `tag` must be non-empty UTF-8 (TensorBoard's reader rejects other bytes in
  // a string field). wall_time < 0 means now (seconds since the Unix epoch).
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time = -1);
  // Text for TensorBoard's text plugin (rendered as Markdown): a scalar DT_STRING tensor with plugin_data
  // {plugin_name: "text"}. Bytes of `text` that are not UTF-8 become U+FFFD, so that a sample cut inside a
  // multi-byte character still logs.
  void add_text(const std::string& tag, const std::string& text, int64_t step, double wall_time = -1);
  // Hands buffered records to the OS (fflush) and checks that it took them.
  void flush();
  // Flushes and closes the file; later writes are errors. A second close does nothing.
  void close();
  const std::string& path() const { return path_; }

 private:
  struct ExactPath {};
  EventWriter(const std::string& path, ExactPath);
  void start(int fd);
  void check_open() const;
  void write_event(const std::string& event);
  [[noreturn]] void fail_write(const char* what, int err);

  std::string path_;
  std::FILE* file_ = nullptr;
  std::string error_;  // why a failed write closed the file, repeated by later calls
};

// Where the records of an event file lie and the step of each one's event: what a resumed run needs
// to cut the events of the steps it redoes (core/step_logs.h). Any TFRecord file of Event protos
// reads, not only kiln's.
struct EventRecordSpan {
  uint64_t offset = 0, size = 0;  // the whole record: its framing and its event
  int64_t step = 0;               // Event.step (0 where absent, as proto3 reads it)
};
struct EventFileScan {
  std::vector<EventRecordSpan> records;  // the complete records, in file order
  uint64_t complete_size = 0;            // where the complete records end
  uint64_t file_size = 0;                // beyond complete_size: a record cut short (a writer killed mid-record)
};
// Reads `path` record by record. A record cut short by the end of the file ends the scan (a kill
// leaves that, and nothing after it); a length or data CRC that does not match, or an event that
// is not an Event proto, is an error naming the file and the record's offset.
EventFileScan scan_event_file(const std::string& path);

}  // namespace kiln::tensorboard
