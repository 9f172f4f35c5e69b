// UTF-8 and Unicode helpers for the tokenizers: validation and lossy repair (maximal subparts to
// U+FFFD), White_Space and word characters, normal forms and lowercase (utf8proc), and the GPT-2
// byte-level alphabet (bytes_to_unicode).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::text::unicode {

// True if `s` is well-formed UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
bool is_valid_utf8(std::string_view s);
// Appends `s` with each maximal invalid subsequence replaced by one U+FFFD: the Unicode-recommended
// practice that Rust's String::from_utf8_lossy and the WHATWG TextDecoder (Node's
// Buffer.toString) both follow, so kiln, HF tokenizers and a JS caller agree on the characters.
void append_lossy(std::string_view s, std::string& out);
std::string to_valid_utf8(std::string_view s);
// For streaming: appends (as append_lossy) the part of `s` that no later byte can change and
// returns how many bytes of `s` that was; an unfinished character at the end stays unconsumed.
size_t append_complete(std::string_view s, std::string& out);

// The code point starting at s[i] of valid UTF-8; advances i past it.
char32_t next_code_point(std::string_view s, size_t& i);
// The code point ending at s[end] of valid UTF-8 (end > 0); moves end back to its first byte.
char32_t prev_code_point(std::string_view s, size_t& end);
void append_utf8(std::string& out, char32_t c);

// The White_Space property (Rust's char::is_whitespace and regex \s).
bool is_white_space(char32_t c);
// Rust regex's \w: Alphabetic, marks, decimal digits, connector punctuation, Join_Control
// (Alphabetic approximated by letters, letter numbers and the circled/squared letter symbols).
bool is_word_char(char32_t c);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
// Normalises valid UTF-8 `s`; returns false and leaves `out` alone when `s` is already normal
// (found by a quick scan, e.g. NFC of text below U+0300), so the caller can keep its view.
bool normalize(std::string_view s, NormalForm form, std::string& out);
// Full lowercase mapping per character, as Rust's char::to_lowercase (U+0130 -> "i\u0307").
std::string lowercase(std::string_view s);

// The GPT-2 byte-level alphabet: each byte stands for one printable character.
const std::string& byte_level_char(uint8_t byte);  // the UTF-8 of the character for `byte`
int byte_level_byte(char32_t c);                   // the byte `c` stands for, -1 if none
// A byte-level token string to its bytes; false (out unchanged) if a character is not in the
// alphabet.
bool byte_level_decode(std::string_view token, std::string& out);
std::string byte_level_encode(std::string_view bytes);

}  // namespace kiln::text::unicode
