// TensorBoard event files (see tensorboard.h): CRC32C, TFRecord framing and a hand-written encoder for the
// Event, Summary, SummaryMetadata and TensorProto fields kiln writes.
#include "core/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include "core/error.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define KILN_TB_SSE42 1
#else
#define KILN_TB_SSE42 0
#endif

namespace kiln::tensorboard {
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCastagnoliReflected : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

#if KILN_TB_SSE42
// The target attribute lets this one function use SSE4.2 without building all of kiln_core with -msse4.2;
// crc32c calls it only after asking the CPU.
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t size) {
  uint64_t crc = 0xFFFFFFFFu;
  for (; size >= 8; p += 8, size -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // unaligned input is fine through memcpy
    crc = _mm_crc32_u64(crc, word);
  }
  uint32_t crc32 = static_cast<uint32_t>(crc);
  for (; size > 0; ++p, --size) crc32 = _mm_crc32_u8(crc32, *p);
  return crc32 ^ 0xFFFFFFFFu;
}
#endif

// --- protobuf wire format, only what the messages below need ---
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>((v & 0x7F) | 0x80));
  out.push_back(static_cast<char>(v));
}

void put_little_endian(std::string& out, uint64_t bits, int num_bytes) {
  for (int i = 0; i < num_bytes; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
}

void put_key(std::string& out, uint32_t field, Wire wire) { put_varint(out, (uint64_t{field} << 3) | wire); }

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  put_key(out, field, kFixed64);
  put_little_endian(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  put_key(out, field, kFixed32);
  put_little_endian(out, bits, 4);
}

// int64 and enum fields: a negative value is its two's complement as a 10-byte varint.
void put_int(std::string& out, uint32_t field, int64_t v) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(v));
}

// string, bytes and embedded messages.
void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// Field numbers from tensorboard/compat/proto/event.proto, summary.proto, tensor.proto and types.proto.
namespace event {
constexpr uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5;
}
namespace summary {
constexpr uint32_t kValue = 1;  // Summary.value (repeated Summary.Value)
constexpr uint32_t kTag = 1, kSimpleValue = 2, kTensor = 8, kMetadata = 9;  // Summary.Value
constexpr uint32_t kPluginData = 1;                                      // SummaryMetadata
constexpr uint32_t kPluginName = 1;                                      // SummaryMetadata.PluginData
}  // namespace summary
namespace tensor {
constexpr uint32_t kDtype = 1, kTensorShape = 2, kStringVal = 8;
constexpr int64_t kDtString = 7;  // DataType.DT_STRING
}  // namespace tensor

// The Event with everything but its `what` field. Proto3 omits zeros; writing them is valid and simpler.
std::string event_head(double wall_time, int64_t step) {
  std::string out;
  put_double(out, event::kWallTime, wall_time);
  put_int(out, event::kStep, step);
  return out;
}

std::string summary_event(double wall_time, int64_t step, const std::string& value) {
  std::string summary_msg;
  put_bytes(summary_msg, summary::kValue, value);
  std::string out = event_head(wall_time, step);
  put_bytes(out, event::kSummary, summary_msg);
  return out;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double resolve_wall_time(double wall_time) { return wall_time < 0 ? now_seconds() : wall_time; }

// Length of the UTF-8 sequence starting at s[i] (1-4), or 0 when the bytes there are not UTF-8 (RFC 3629: no
// overlong forms, no surrogates, nothing above U+10FFFF), the same rules protobuf's parsers apply.
size_t utf8_length(const std::string& s, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (s.size() - i < n || at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (at(i + k) < 0x80 || at(i + k) > 0xBF) return 0;
  }
  return n;
}

void check_tag(const std::string& tag) {
  KILN_CHECK(!tag.empty(), "tensorboard: a summary tag is empty; name it, e.g. \"train/loss\"");
  for (size_t i = 0; i < tag.size();) {
    const size_t n = utf8_length(tag, i);
    KILN_CHECK(n > 0, "tensorboard: a summary tag is not UTF-8 (tag=", tag, ", bad byte at offset=", i,
               "); TensorBoard cannot read such a tag, so pass UTF-8 text");
    i += n;
  }
}

std::string utf8_or_replacement(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_length(text, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD for one bad byte
      ++i;
    } else {
      out.append(text, i, n);
      i += n;
    }
  }
  return out;
}

// TFRecord: uint64 length, masked CRC of those 8 bytes, the data, masked CRC of the data (little endian).
std::string frame(const std::string& data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_little_endian(out, data.size(), 8);
  put_little_endian(out, mask_crc32c(crc32c(out.data(), 8)), 4);
  out += data;
  put_little_endian(out, mask_crc32c(crc32c(data.data(), data.size())), 4);
  return out;
}

std::string error_text(int err) { return err != 0 ? std::strerror(err) : "short write"; }

// --- reading back (scan_event_file) ---

uint64_t get_little_endian(const std::string& b, size_t pos, int num_bytes) {
  uint64_t v = 0;
  for (int i = 0; i < num_bytes; ++i) v |= uint64_t(static_cast<unsigned char>(b[pos + i])) << (8 * i);
  return v;
}

// The varint at b[pos], moving pos past it; false when it runs past the end or beyond 10 bytes.
bool get_varint(const std::string& b, size_t& pos, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 70 && pos < b.size(); shift += 7) {
    const auto byte = static_cast<unsigned char>(b[pos++]);
    v |= uint64_t(byte & 0x7F) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// Event.step of an encoded Event, walking its top-level fields; false when they do not parse.
bool event_step(const std::string& e, int64_t& step) {
  step = 0;
  for (size_t pos = 0; pos < e.size();) {
    uint64_t key = 0, v = 0;
    if (!get_varint(e, pos, key) || (key >> 3) == 0) return false;
    const size_t left = e.size() - pos;
    switch (key & 7) {
      case kVarint:
        if (!get_varint(e, pos, v)) return false;
        if ((key >> 3) == event::kStep) step = static_cast<int64_t>(v);
        break;
      case kFixed64:
        if (left < 8) return false;
        pos += 8;
        break;
      case kFixed32:
        if (left < 4) return false;
        pos += 4;
        break;
      case kLengthDelimited:
        if (!get_varint(e, pos, v) || v > e.size() - pos) return false;
        pos += v;
        break;
      default:
        return false;
    }
    if ((key >> 3) == event::kStep && (key & 7) != kVarint) return false;
  }
  return true;
}

}  // namespace

uint32_t crc32c_table(const void* data, size_t size) {
  const auto& table = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

bool crc32c_uses_hardware() {
#if KILN_TB_SSE42
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

uint32_t crc32c(const void* data, size_t size) {
#if KILN_TB_SSE42
  if (crc32c_uses_hardware()) return crc32c_sse42(static_cast<const unsigned char*>(data), size);
#endif
  return crc32c_table(data, size);
}

uint32_t mask_crc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u; }

EventWriter::EventWriter(const std::string& dir) {
  KILN_CHECK(!dir.empty(), "tensorboard: the log directory is empty; pass the run's directory, e.g. out/tb");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  std::error_code ec_dir;
  KILN_CHECK(!ec && std::filesystem::is_directory(dir, ec_dir), "tensorboard: cannot create the log directory (dir=",
             dir, ", error=", ec ? ec.message() : "not a directory",
             "); check the path and that its parent is a writable directory");

  std::string clean_dir = dir;
  while (clean_dir.size() > 1 && clean_dir.back() == '/') clean_dir.pop_back();
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "unknown");
  std::string hostname = host;
  for (char& c : hostname) {
    if (c == '/') c = '_';
  }
  const std::string base = clean_dir + "/events.out.tfevents." + std::to_string(std::time(nullptr)) + "." + hostname +
                           "." + std::to_string(getpid());
  // O_EXCL: a second writer in the same second takes the next name rather than interleaving records.
  for (int n = 0;; ++n) {
    path_ = base + (n == 0 ? "" : "." + std::to_string(n)) + ".kiln";
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      start(fd);
      return;
    }
    const int err = errno;
    KILN_CHECK(err == EEXIST && n < 1000, "tensorboard: cannot create the event file (path=", path_,
               ", error=", std::strerror(err), "); check that the directory is writable");
  }
}

EventWriter::EventWriter(const std::string& path, ExactPath) : path_(path) {
  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const int err = errno;
  KILN_CHECK(fd >= 0, "tensorboard: cannot open the event file (path=", path_, ", error=", std::strerror(err),
             "); check that its directory exists and is writable");
  start(fd);
}

EventWriter EventWriter::open_file(const std::string& path) { return EventWriter(path, ExactPath{}); }

void EventWriter::start(int fd) {
  file_ = ::fdopen(fd, "ab");
  if (file_ == nullptr) {
    const int err = errno;
    ::close(fd);
    KILN_FAIL("tensorboard: cannot open the event file (path=", path_, ", error=", std::strerror(err),
              "); check the process's open-file limit");
  }
  std::string out = event_head(now_seconds(), 0);
  put_bytes(out, event::kFileVersion, "brain.Event:2");
  write_event(out);
}

EventWriter::EventWriter(EventWriter&& other) noexcept
    : path_(std::move(other.path_)), file_(std::exchange(other.file_, nullptr)), error_(std::move(other.error_)) {}

EventWriter::~EventWriter() {
  if (file_ == nullptr) return;
  // A destructor cannot throw; say what was lost rather than lose it silently.
  int err = 0;
  if (std::fflush(file_) != 0) err = errno;
  if (std::fclose(file_) != 0 && err == 0) err = errno;
  if (err != 0) {
    std::fprintf(stderr, "kiln: tensorboard: cannot finish the event file (path=%s, error=%s); its last events may be "
                 "lost; call close() to get this as an error\n", path_.c_str(), std::strerror(err));
  }
}

void EventWriter::add_scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  check_tag(tag);
  std::string v;
  put_bytes(v, summary::kTag, tag);
  put_float(v, summary::kSimpleValue, static_cast<float>(value));
  write_event(summary_event(resolve_wall_time(wall_time), step, v));
}

void EventWriter::add_text(const std::string& tag, const std::string& text, int64_t step, double wall_time) {
  check_tag(tag);
  std::string t;
  put_int(t, tensor::kDtype, tensor::kDtString);
  put_bytes(t, tensor::kTensorShape, "");  // present and empty: a scalar (rank 0)
  put_bytes(t, tensor::kStringVal, utf8_or_replacement(text));
  // PluginData.content stays empty: the text plugin's TextPluginData{version: 0} serializes to no bytes.
  std::string plugin_data;
  put_bytes(plugin_data, summary::kPluginName, "text");
  std::string metadata;
  put_bytes(metadata, summary::kPluginData, plugin_data);
  std::string v;
  put_bytes(v, summary::kTag, tag);
  put_bytes(v, summary::kTensor, t);
  put_bytes(v, summary::kMetadata, metadata);
  write_event(summary_event(resolve_wall_time(wall_time), step, v));
}

void EventWriter::check_open() const {
  KILN_CHECK(error_.empty(), "tensorboard: the event file was closed after a failed write (path=", path_,
             ", first error: ", error_, "); free disk space and open a new EventWriter");
  KILN_CHECK(file_ != nullptr, "tensorboard: the event file is closed (path=", path_,
             "); write before close(), or open a new EventWriter");
}

void EventWriter::write_event(const std::string& event) {
  check_open();
  const std::string record = frame(event);
  errno = 0;
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) fail_write("write", errno);
}

void EventWriter::flush() {
  check_open();
  errno = 0;
  if (std::fflush(file_) != 0) fail_write("flush", errno);
}

void EventWriter::close() {
  if (file_ == nullptr) return;
  flush();
  std::FILE* f = std::exchange(file_, nullptr);
  errno = 0;
  if (std::fclose(f) != 0) {
    error_ = error_text(errno);
    KILN_FAIL("tensorboard: cannot close the event file (path=", path_, ", error=", error_,
              "); check free disk space; its last events may be lost");
  }
}

void EventWriter::fail_write(const char* what, int err) {
  error_ = error_text(err);
  // Records after a torn one could not be read, so the file is closed; later calls repeat this error.
  std::fclose(std::exchange(file_, nullptr));
  KILN_FAIL("tensorboard: cannot ", what, " the event file (path=", path_, ", error=", error_,
            "); check free disk space and that the file is still writable");
}

EventFileScan scan_event_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "tensorboard: cannot open the event file (path=", path, ", error=", std::strerror(errno),
             ") to read it back; check its permissions");
  const std::string b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KILN_CHECK(!in.bad(), "tensorboard: cannot read the event file (path=", path, ")");
  EventFileScan scan;
  scan.file_size = b.size();
  constexpr uint64_t kHead = 12, kTail = 4;  // length and its CRC; the data's CRC
  const char* hint = "; the file is damaged (a kill leaves only a record cut short at the end), so move it out "
                     "of the run's tensorboard folder";
  size_t pos = 0;
  while (b.size() - pos >= kHead) {
    const uint64_t len = get_little_endian(b, pos, 8);
    KILN_CHECK(get_little_endian(b, pos + 8, 4) == mask_crc32c(crc32c(b.data() + pos, 8)),
               "tensorboard: the record at offset ", pos, " of ", path, " fails its length CRC", hint);
    const uint64_t left = b.size() - pos - kHead;
    if (left < kTail || len > left - kTail) break;  // cut short
    const std::string event = b.substr(pos + kHead, len);
    KILN_CHECK(get_little_endian(b, pos + kHead + len, 4) == mask_crc32c(crc32c(event.data(), event.size())),
               "tensorboard: the record at offset ", pos, " of ", path, " fails its data CRC", hint);
    EventRecordSpan r;
    r.offset = pos;
    r.size = kHead + len + kTail;
    KILN_CHECK(event_step(event, r.step), "tensorboard: the record at offset ", pos, " of ", path,
               " is not an Event proto", hint);
    scan.records.push_back(r);
    pos += r.size;
  }
  scan.complete_size = pos;
  return scan;
}

}  // namespace kiln::tensorboard
