// File-system helpers that kiln needs beyond <filesystem>.
#pragma once
#include <string>
#include <vector>

namespace kiln {

// Removes `path` and everything below it, if it exists. Uses nftw rather than
// std::filesystem::remove_all, which torch 2.11's libtorch.so interposes with a copy that crashes
// (seen on a GPU machine).
void remove_tree(const std::string& path);

// Writes `text` to `path` through a temporary file beside it and a rename, so a reader sees the old
// file or the whole new one. Errors name the file.
void write_text_atomic(const std::string& path, const std::string& text);

// Throws unless `path` names a file that can be opened for reading (not missing, not a folder):
// "<what>: <path> is a directory; <hint>". Reading a folder through an ifstream fails later with
// libstdc++'s "basic_filebuf::underflow", which names neither the file nor the option.
void check_input_file(const std::string& path, const std::string& what, const std::string& hint);

// Throws when the folder `out` is one of `inputs` (the same place after links and ".."): writing
// it would overwrite what is being read. `what` names the command in the message.
void check_distinct_output(const std::string& out, const std::vector<std::string>& inputs, const std::string& what);

}  // namespace kiln
