// UTF-8 helpers for the Jinja renderer: code points, Python's whitespace and printable classes,
// and simple case mapping (Latin, Greek, Cyrillic), so str methods index and strip like Python's.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace kiln::text::jinja::unicode {

// Decodes the code point starting at s[i] and moves i past it. A malformed byte b decodes as
// kRawByte + b (one byte) and append writes it back, so any byte string round-trips.
constexpr char32_t kRawByte = 0x110000;
char32_t decode(std::string_view s, size_t& i);
void append(std::string& out, char32_t cp);

std::vector<char32_t> code_points(std::string_view s);
std::string encode(const std::vector<char32_t>& cps, size_t begin, size_t end);
inline std::string encode(const std::vector<char32_t>& cps) { return encode(cps, 0, cps.size()); }
size_t length(std::string_view s);
// Number of code points in s[0, byte_offset).
size_t code_point_index(std::string_view s, size_t byte_offset);

// Python's str.isspace() (and what `\s` and str.split() treat as whitespace).
bool is_space(char32_t c);
// Python's str.isprintable() for the characters chat templates meet: control, format, separator,
// surrogate and private-use code points are not printable; unassigned ones are not detected.
bool is_printable(char32_t c);
bool is_digit(char32_t c);
bool is_alpha(char32_t c);
bool is_cased(char32_t c);
bool is_upper(char32_t c);
bool is_lower(char32_t c);

// Python's str.upper()/lower()/title()/capitalize()/swapcase-free subset. Mapping is simple
// (one code point to one) except U+00DF (upper: "SS"); the Greek final-sigma rule is not applied.
std::string upper(std::string_view s);
std::string lower(std::string_view s);
std::string title(std::string_view s);       // str.title()
std::string capitalize(std::string_view s);  // str.capitalize()

}  // namespace kiln::text::jinja::unicode
