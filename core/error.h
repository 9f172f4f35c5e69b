// kiln::Error and KILN_CHECK: the one way library code reports bad input or a broken invariant.
// Messages read "component: what is wrong (name=value, ...); what to do" and carry file:line.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
template <typename... Args>
[[noreturn]] void fail(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  os << " [" << file << ":" << line << "]";
  throw Error(os.str());
}
}  // namespace detail

// Concatenates the arguments with operator<< into one string.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  return os.str();
}

}  // namespace kiln

#define KILN_CHECK(cond, ...)                                        \
  do {                                                               \
    if (!(cond)) ::kiln::detail::fail(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#define KILN_FAIL(...) ::kiln::detail::fail(__FILE__, __LINE__, __VA_ARGS__)
