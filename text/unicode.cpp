// UTF-8 validation and repair, Unicode properties, normal forms (utf8proc) and the byte-level
// alphabet used by the tokenizers.
#include "text/unicode.h"

#include <utf8proc.h>

#include <array>
#include <cstdlib>

#include "core/error.h"

namespace kiln::text::unicode {
namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// One step of UTF-8 decoding at p[0] with `avail` bytes left (Unicode table 3-7).
struct Step {
  int length;      // bytes of the well-formed character, 0 if there is none here
  int subpart;     // when length == 0: bytes of the maximal ill-formed subpart (>= 1)
  bool truncated;  // when length == 0: the subpart ran into the end of the input
};

inline Step step_at(const unsigned char* p, size_t avail) {
  const unsigned char c = p[0];
  if (c < 0x80) return {1, 0, false};
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c == 0xE0) {
    need = 2, lo = 0xA0;
  } else if (c >= 0xE1 && c <= 0xEC) {
    need = 2;
  } else if (c == 0xED) {
    need = 2, hi = 0x9F;  // no surrogates
  } else if (c >= 0xEE && c <= 0xEF) {
    need = 2;
  } else if (c == 0xF0) {
    need = 3, lo = 0x90;  // no overlongs
  } else if (c >= 0xF1 && c <= 0xF3) {
    need = 3;
  } else if (c == 0xF4) {
    need = 3, hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {0, 1, false};  // 80..C1, F5..FF never start a character
  }
  for (int k = 1; k <= need; ++k) {
    if (size_t(k) >= avail) return {0, k, true};
    const unsigned char b = p[k];
    if (b < lo || b > hi) return {0, k, false};
    lo = 0x80, hi = 0xBF;
  }
  return {need + 1, 0, false};
}

// Appends s[0, n) converted lossily; stops before a truncated tail when `keep_tail`.
size_t convert(std::string_view s, std::string& out, bool keep_tail) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0, run = 0;  // [run, i) is valid and not yet copied
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const Step st = step_at(p + i, n - i);
    if (st.length > 0) {
      i += size_t(st.length);
      continue;
    }
    out.append(s.data() + run, i - run);
    if (st.truncated && keep_tail) return i;
    out += kReplacement;
    i += size_t(st.subpart);
    run = i;
  }
  out.append(s.data() + run, n - run);
  return n;
}

struct ByteLevelTables {
  std::array<std::string, 256> chars;
  std::array<int16_t, 512> bytes;  // code point -> byte; the alphabet lies below U+0200
  ByteLevelTables() {
    bytes.fill(-1);
    // Printable Latin-1 bytes stand for themselves; the others map to U+0100 upwards in byte order.
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const int cp = printable ? b : next++;
      append_utf8(chars[size_t(b)], char32_t(cp));
      bytes[size_t(cp)] = int16_t(b);
    }
  }
};

const ByteLevelTables& byte_level_tables() {
  static const ByteLevelTables tables;
  return tables;
}

}  // namespace

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const Step st = step_at(p + i, n - i);
    if (st.length == 0) return false;
    i += size_t(st.length);
  }
  return true;
}

void append_lossy(std::string_view s, std::string& out) { convert(s, out, false); }

std::string to_valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  convert(s, out, false);
  return out;
}

size_t append_complete(std::string_view s, std::string& out) { return convert(s, out, true); }

char32_t next_code_point(std::string_view s, size_t& i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const unsigned char c = p[i];
  if (c < 0x80) return char32_t(p[i++]);
  if (c < 0xE0) {
    const char32_t cp = (char32_t(c & 0x1F) << 6) | (p[i + 1] & 0x3F);
    i += 2;
    return cp;
  }
  if (c < 0xF0) {
    const char32_t cp = (char32_t(c & 0x0F) << 12) | (char32_t(p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F);
    i += 3;
    return cp;
  }
  const char32_t cp = (char32_t(c & 0x07) << 18) | (char32_t(p[i + 1] & 0x3F) << 12) |
                      (char32_t(p[i + 2] & 0x3F) << 6) | (p[i + 3] & 0x3F);
  i += 4;
  return cp;
}

char32_t prev_code_point(std::string_view s, size_t& end) {
  size_t start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  size_t i = start;
  const char32_t cp = next_code_point(s, i);
  end = start;
  return cp;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

bool is_white_space(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_word_char(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D) return true;  // Join_Control
  // Other_Alphabetic symbols (circled and squared Latin letters).
  if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) || (c >= 0x1F150 && c <= 0x1F169) ||
      (c >= 0x1F170 && c <= 0x1F189))
    return true;
  switch (utf8proc_category(utf8proc_int32_t(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

namespace {

std::string map_form(std::string_view s, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          utf8proc_ssize_t(s.size()), &dst, utf8proc_option_t(options));
  KILN_CHECK(n >= 0, "tokenizer: Unicode normalisation failed (error=", utf8proc_errmsg(n), ", bytes=", s.size(),
             "); the text must be valid UTF-8");
  std::string result(reinterpret_cast<const char*>(dst), size_t(n));
  std::free(dst);
  return result;
}

// True when NFC may cut the text before `c` without changing it: a starter that has no canonical
// decomposition and never composes with a character before it (ICU's "boundary before"). Such a
// character is its own NFC, so only the stretches around the other characters need utf8proc.
bool nfc_boundary(char32_t c) {
  if (c < 0x300) return true;
  if ((c >= 0x1161 && c <= 0x1175) || (c >= 0x11A8 && c <= 0x11C2)) return false;  // Hangul V and T jamo
  const utf8proc_property_t* p = utf8proc_get_property(utf8proc_int32_t(c));
  if (p->combining_class != 0) return false;
  if (p->comb_index != UINT16_MAX && p->comb_index >= 0x8000) return false;   // composes with what precedes
  if (p->decomp_seqindex != UINT16_MAX && p->decomp_type == 0) return false;  // canonical decomposition
  return true;
}

}  // namespace

bool normalize(std::string_view s, NormalForm form, std::string& out) {
  // Code points below U+0300 are NFC boundaries (lead bytes below 0xCC); the other forms change
  // only non-ASCII text.
  const unsigned char limit = form == NormalForm::kNFC ? 0xCC : 0x80;
  size_t first = 0;
  while (first < s.size() && static_cast<unsigned char>(s[first]) < limit) ++first;
  if (first == s.size()) return false;
  if (form != NormalForm::kNFC) {
    std::string result = map_form(s, form);
    if (result == s) return false;
    out = std::move(result);
    return true;
  }
  // NFC: copy the text between boundaries as it is; give utf8proc each stretch from the last
  // boundary before a non-boundary character to the next boundary after it.
  std::string result;
  bool changed = false;
  // Everything before `first` is below U+0300, so the character just before it is a boundary.
  size_t copied = 0, last_boundary = first, i = first;
  if (first > 0) prev_code_point(s, last_boundary);
  while (i < s.size()) {
    const size_t at = i;
    const char32_t c = next_code_point(s, i);
    if (nfc_boundary(c)) {
      last_boundary = at;
      continue;
    }
    size_t end = i;  // the stretch runs to the next boundary
    while (end < s.size()) {
      size_t j = end;
      if (nfc_boundary(next_code_point(s, j))) break;
      end = j;
    }
    const std::string_view stretch = s.substr(last_boundary, end - last_boundary);
    const std::string normal = map_form(stretch, form);
    if (normal != stretch) {
      if (!changed) result.reserve(s.size() + 16);
      result.append(s.data() + copied, last_boundary - copied);
      result += normal;
      copied = end;
      changed = true;
    }
    i = end;
    last_boundary = end;
  }
  if (!changed) return false;
  result.append(s.data() + copied, s.size() - copied);
  out = std::move(result);
  return true;
}

std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      out += char(b >= 'A' && b <= 'Z' ? b + 32 : b);
      ++i;
      continue;
    }
    const char32_t c = next_code_point(s, i);
    if (c == 0x130) {  // the one unconditional multi-character lowercase mapping
      out += "i\xCC\x87";
      continue;
    }
    append_utf8(out, char32_t(utf8proc_tolower(utf8proc_int32_t(c))));
  }
  return out;
}

const std::string& byte_level_char(uint8_t byte) { return byte_level_tables().chars[byte]; }

int byte_level_byte(char32_t c) { return c < 512 ? byte_level_tables().bytes[c] : -1; }

bool byte_level_decode(std::string_view token, std::string& out) {
  const size_t mark = out.size();
  size_t i = 0;
  while (i < token.size()) {
    const int b = byte_level_byte(next_code_point(token, i));
    if (b < 0) {
      out.resize(mark);
      return false;
    }
    out += char(b);
  }
  return true;
}

std::string byte_level_encode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char b : bytes) out += byte_level_char(static_cast<uint8_t>(b));
  return out;
}

}  // namespace kiln::text::unicode
