// UTF-8 decoding, Python character classes and simple case mapping for the Jinja renderer.
#include "text/jinja_unicode.h"

namespace kiln::text::jinja::unicode {

char32_t decode(std::string_view s, size_t& i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  int extra = (c >= 0xF0 && c < 0xF8) ? 3 : (c >= 0xE0 && c < 0xF0) ? 2 : (c >= 0xC0 && c < 0xE0) ? 1 : 0;
  if (c < 0x80) {
    ++i;
    return c;
  }
  if (extra == 0 || i + extra >= s.size()) {
    ++i;
    return kRawByte + c;
  }
  char32_t cp = c & (0x3F >> extra);
  for (int k = 1; k <= extra; ++k) {
    unsigned char d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) {
      ++i;
      return kRawByte + c;
    }
    cp = (cp << 6) | (d & 0x3F);
  }
  i += extra + 1;
  return cp;
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x110000) {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(cp - kRawByte);  // a malformed byte decoded as itself
  }
}

std::vector<char32_t> code_points(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) out.push_back(decode(s, i));
  return out;
}

std::string encode(const std::vector<char32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) append(out, cps[i]);
  return out;
}

size_t length(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) decode(s, i);
  return n;
}

size_t code_point_index(std::string_view s, size_t byte_offset) { return length(s.substr(0, byte_offset)); }

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_printable(char32_t c) {
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x206F) ||
      c == 0x3000 || c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB))
    return false;
  if ((c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD || c == 0x70F || c == 0x180E) return false;
  if ((c >= 0xD800 && c <= 0xF8FF) || c == 0xFFFE || c == 0xFFFF || c >= 0xF0000) return false;
  if (c == 0x110BD || (c >= 0x1D173 && c <= 0x1D17A) || (c >= 0xE0000 && c <= 0xE007F)) return false;
  return true;
}

bool is_digit(char32_t c) {
  return (c >= '0' && c <= '9') || (c >= 0x660 && c <= 0x669) || (c >= 0xFF10 && c <= 0xFF19);
}

namespace {

// Pairs laid out as (upper, lower) alternating within [first, last].
bool in_alternating(char32_t c, char32_t first, char32_t last) { return c >= first && c <= last; }

char32_t upper_simple(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  if (c >= 0xE0 && c <= 0xFE && c != 0xF7) return c - 32;
  if (c == 0xFF) return 0x178;
  if (c == 0xB5) return 0x39C;
  if (c == 0x131) return 'I';
  if (c == 0x17F) return 'S';
  if ((in_alternating(c, 0x100, 0x12F) || in_alternating(c, 0x132, 0x137) || in_alternating(c, 0x14A, 0x177) ||
       in_alternating(c, 0x460, 0x481) || in_alternating(c, 0x48A, 0x4BF) || in_alternating(c, 0x1E00, 0x1E95) ||
       in_alternating(c, 0x1EA0, 0x1EFF)) &&
      (c % 2 == 1))
    return c - 1;
  if ((in_alternating(c, 0x139, 0x148) || in_alternating(c, 0x179, 0x17E)) && (c % 2 == 0)) return c - 1;
  if (c >= 0x3B1 && c <= 0x3C9) return c == 0x3C2 ? 0x3A3 : c - 32;
  if (c == 0x3AC) return 0x386;
  if (c >= 0x3AD && c <= 0x3AF) return c - 37;
  if (c == 0x3CC) return 0x38C;
  if (c == 0x3CD || c == 0x3CE) return c - 63;
  if (c >= 0x430 && c <= 0x44F) return c - 32;
  if (c >= 0x450 && c <= 0x45F) return c - 80;
  if (c >= 0xFF41 && c <= 0xFF5A) return c - 32;
  return c;
}

char32_t lower_simple(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 32;
  if (c == 0x178) return 0xFF;
  if ((in_alternating(c, 0x100, 0x12F) || in_alternating(c, 0x132, 0x137) || in_alternating(c, 0x14A, 0x177) ||
       in_alternating(c, 0x460, 0x481) || in_alternating(c, 0x48A, 0x4BF) || in_alternating(c, 0x1E00, 0x1E95) ||
       in_alternating(c, 0x1EA0, 0x1EFF)) &&
      (c % 2 == 0))
    return c + 1;
  if ((in_alternating(c, 0x139, 0x148) || in_alternating(c, 0x179, 0x17E)) && (c % 2 == 1)) return c + 1;
  if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 32;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 37;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 63;
  if (c >= 0x410 && c <= 0x42F) return c + 32;
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  if (c >= 0xFF21 && c <= 0xFF3A) return c + 32;
  return c;
}

}  // namespace

bool is_upper(char32_t c) { return lower_simple(c) != c; }
bool is_lower(char32_t c) { return upper_simple(c) != c || c == 0xDF; }
bool is_cased(char32_t c) { return is_upper(c) || is_lower(c); }
bool is_alpha(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  // Uncased letters of the common scripts (Hebrew, Arabic, kana, CJK, Hangul) count too.
  return is_cased(c) || (c >= 0x5D0 && c <= 0x5EA) || (c >= 0x620 && c <= 0x64A) || (c >= 0x3041 && c <= 0x30FF) ||
         (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0xAC00 && c <= 0xD7A3);
}

std::string upper(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    char32_t c = decode(s, i);
    if (c == 0xDF) {
      out += "SS";
    } else {
      append(out, upper_simple(c));
    }
  }
  return out;
}

std::string lower(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size();) append(out, lower_simple(decode(s, i)));
  return out;
}

std::string title(std::string_view s) {
  // Python: a cased character after an uncased one starts a word and is upper-cased; the rest lower.
  std::string out;
  bool previous_cased = false;
  for (size_t i = 0; i < s.size();) {
    char32_t c = decode(s, i);
    if (previous_cased) {
      append(out, lower_simple(c));
    } else if (c == 0xDF) {
      out += "Ss";
    } else {
      append(out, upper_simple(c));
    }
    previous_cased = is_cased(c);
  }
  return out;
}

std::string capitalize(std::string_view s) {
  std::string out;
  bool first = true;
  for (size_t i = 0; i < s.size();) {
    char32_t c = decode(s, i);
    if (first && c == 0xDF) {
      out += "Ss";
    } else {
      append(out, first ? upper_simple(c) : lower_simple(c));
    }
    first = false;
  }
  return out;
}

}  // namespace kiln::text::jinja::unicode
