// Fuzz target for text/tokenizer.h. An input whose first byte is even is a tokenizer.json to load;
// otherwise the rest is text for a fixed byte-level BPE tokenizer (GPT-2 style regex, merges, two
// added tokens), which must round-trip exactly when the text is valid UTF-8 and must decode to the
// same text whether decoded at once or streamed id by id. Only kiln::Error may come out of loading.
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "fuzz/fuzz_input.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

namespace {

using nlohmann::json;

std::unique_ptr<kiln::text::Tokenizer> fixed_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[kiln::text::unicode::byte_level_char(uint8_t(b))] = b;
  json merges = json::array();
  int64_t next = 256;
  for (const char* pair : {"t h", "th e", "\xC4\xA0 t", "\xC4\xA0t h", "\xC4\xA0th e", "i n", "e r", "1 2", "\xC3\xA4 \xC3\xB6"}) {
    const std::string p = pair, joined = p.substr(0, p.find(' ')) + p.substr(p.find(' ') + 1);
    if (!vocab.contains(joined)) vocab[joined] = next++;
    merges.push_back(p);
  }
  const json t = {
      {"version", "1.0"},
      {"added_tokens", json::array({{{"id", next}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}},
                                    // not lstrip: HF's lstrip swallows the spaces before the token, so
                                    // "  <tool>" would not round-trip (lossy by design, not a finding)
                                    {{"id", next + 1}, {"content", " <tool>"}, {"special", false},
                                     {"normalized", false}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
  const std::string text = t.dump();
  const std::string path = kiln::fuzz::write_input("fixed-tokenizer.json", reinterpret_cast<const uint8_t*>(text.data()),
                                                   text.size());
  return kiln::text::load_tokenizer(path);
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    kiln::fuzz::write_input("tokenizer.json", data + 1, size - 1);
    try {
      auto t = kiln::text::load_tokenizer(kiln::fuzz::scratch_dir() + "/tokenizer.json");
      (void)t->decode(t->encode("Hello wörld 123 <|end|>!", true));
    } catch (const kiln::Error&) {
    }
    return 0;
  }
  static const std::unique_ptr<kiln::text::Tokenizer> tok = fixed_tokenizer();
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::vector<int64_t> ids = tok->encode(text);
  const std::string back = tok->decode(ids);
  if (valid_utf8(text) && back != text) std::abort();  // exact round trip of valid text
  if (!valid_utf8(back)) std::abort();                 // decode always gives valid UTF-8
  kiln::text::StreamDecoder stream(*tok);
  std::string streamed;
  for (int64_t id : ids) streamed += stream.push(id);
  streamed += stream.flush();
  if (streamed != back) std::abort();  // streaming never splits or changes a character
  return 0;
}
