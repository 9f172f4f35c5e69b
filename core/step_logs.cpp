// Cutting JSON-lines logs and TensorBoard event files back to a step (step_logs.h): find the
// pieces to keep, then leave the file, truncate it, or write the kept pieces beside it and rename.
#include "core/step_logs.h"

#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/checkpoint_dir.h"
#include "core/error.h"
#include "core/tensorboard.h"

namespace kiln {
namespace {

struct Piece {
  uint64_t begin = 0, end = 0;  // bytes [begin, end) of the file
  bool keep = false;
};

bool regular_file(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Copies the kept pieces of `path` to `tmp`, syncs it and renames it over `path`.
void rewrite(const std::string& path, const std::string& tmp, const std::vector<Piece>& pieces) {
  {
    std::ifstream in(path, std::ios::binary);
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    KILN_CHECK(in.good() && out.good(), "resume: cannot rewrite ", path, " through ", tmp, " (", std::strerror(errno),
               "); check the permissions of the run directory");
    std::string buf;
    for (const Piece& p : pieces) {
      if (!p.keep) continue;
      buf.resize(p.end - p.begin);
      in.seekg(std::streamoff(p.begin));
      in.read(buf.data(), std::streamsize(buf.size()));
      out.write(buf.data(), std::streamsize(buf.size()));
    }
    out.flush();
    KILN_CHECK(in.good() && out.good(), "resume: cannot rewrite ", path, " through ", tmp,
               "; check the disk space of the run directory");
  }
  sync_tree(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KILN_CHECK(!ec, "resume: cannot rename ", tmp, " to ", path, " (", ec.message(), ")");
  sync_parent(path);
}

// Applies the cut: `pieces` are the file's complete lines or records in order, and the bytes from
// `complete_size` to the end a torn tail. Nothing to drop: untouched. Only a tail to drop: one
// truncate, so a kill leaves the old length or the new. Else through `tmp` and a rename.
void apply(const std::string& path, const std::string& tmp, const std::vector<Piece>& pieces, uint64_t complete_size,
           uint64_t file_size, LogCut& cut) {
  uint64_t keep_end = 0;
  bool dropped_before_kept = false, dropped = false;
  for (const Piece& p : pieces) {
    if (p.keep) {
      ++cut.kept;
      dropped_before_kept = dropped_before_kept || dropped;
      keep_end = p.end;
    } else {
      ++cut.dropped;
      dropped = true;
    }
  }
  cut.torn_bytes += file_size - complete_size;
  if (!dropped && complete_size == file_size) return;
  if (dropped_before_kept) return rewrite(path, tmp, pieces);
  KILN_CHECK(::truncate(path.c_str(), off_t(keep_end)) == 0, "resume: cannot truncate ", path, " to ", keep_end,
             " bytes (", std::strerror(errno), "); check the permissions of the run directory");
  sync_tree(path);
}

void add(LogCut& total, const LogCut& c) {
  total.kept += c.kept;
  total.dropped += c.dropped;
  total.torn_bytes += c.torn_bytes;
}

}  // namespace

LogCut keep_jsonl_through(const std::string& path, int64_t step) {
  LogCut cut;
  if (!regular_file(path)) return cut;
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "resume: cannot open ", path, " (", std::strerror(errno), "); check its permissions");
  std::vector<Piece> pieces;
  uint64_t pos = 0;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (in.eof()) break;  // no newline: a line cut short, whatever it holds
    Piece p{pos, pos + line.size() + 1, true};
    pos = p.end;
    if (line.find_first_not_of(" \t\r") != std::string::npos) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      const auto s = j.is_object() ? j.find("step") : j.end();
      KILN_CHECK(j.is_object() && s != j.end() && s->is_number_integer(), "resume: ", path, ":", number,
                 " is not a JSON object with an integer \"step\", so it cannot be kept or dropped by the step the "
                 "run resumes from (", step, "); fix or remove that line");
      p.keep = s->get<int64_t>() <= step;
    }
    pieces.push_back(p);
  }
  KILN_CHECK(!in.bad(), "resume: cannot read ", path, " (", std::strerror(errno), ")");
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(path, ec);
  KILN_CHECK(!ec, "resume: cannot read the size of ", path, " (", ec.message(), ")");
  apply(path, path + ".cut.tmp", pieces, pos, size, cut);
  return cut;
}

LogCut keep_events_through(const std::string& dir, int64_t step) {
  LogCut total;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return total;
  // Named without "tfevents", so that TensorBoard never reads a copy left by a kill.
  const std::string tmp = dir + "/kiln-cut.tmp";
  std::filesystem::remove(tmp, ec);
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string p = e.path().string();
    if (e.path().filename().string().find("tfevents") != std::string::npos && regular_file(p)) files.push_back(p);
  }
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    const tensorboard::EventFileScan scan = tensorboard::scan_event_file(f);
    std::vector<Piece> pieces;
    for (const auto& r : scan.records) pieces.push_back({r.offset, r.offset + r.size, r.step <= step});
    LogCut cut;
    apply(f, tmp, pieces, scan.complete_size, scan.file_size, cut);
    add(total, cut);
  }
  return total;
}

}  // namespace kiln
