// RL datasets: JSONL examples with configurable keys, the split, the prompt stream and the prompt
// format (chat template + tokenizer, over-long prompts dropped).
#include "trainer/dataset.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <numeric>
#include <unordered_map>

#include "core/error.h"
#include "core/files.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "trainer/rng.h"

namespace kiln::trainer {
namespace {

// ordered: a chat keeps its keys in file order, which tojson in a template prints.
using json = nlohmann::ordered_json;

// Integral numbers print without a fraction ("46", not "46.0"); others as JSON writes them.
std::string number_text(const json& j) {
  if (j.is_number_float()) {
    const double v = j.get<double>();
    if (std::isfinite(v) && v == std::trunc(v) && std::fabs(v) < 9.0e18) return std::to_string(int64_t(v));
  }
  return j.dump();
}

// The value at a dotted key path, or nullptr when a step is missing.
const json* find_path(const json& j, const std::string& path) {
  const json* at = &j;
  size_t begin = 0;
  for (;;) {
    const size_t dot = path.find('.', begin);
    const std::string key = path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin);
    if (!at->is_object()) return nullptr;
    auto it = at->find(key);
    if (it == at->end()) return nullptr;
    at = &*it;
    if (dot == std::string::npos) return at;
    begin = dot + 1;
  }
}

// A line that cannot become an example: the reason, to raise or to count.
struct BadLine {
  std::string why;
};

void check_messages(const json& m, const std::string& key) {
  if (!m.is_array() || m.empty())
    throw BadLine{"\"" + key + "\" must be a string or a non-empty list of chat messages"};
  for (size_t i = 0; i < m.size(); ++i) {
    const json& msg = m[i];
    const std::string at = str_cat("\"", key, "\"[", i, "]");
    if (!msg.is_object()) throw BadLine{at + " is a " + msg.type_name() + "; a message is {\"role\", \"content\"}"};
    auto role = msg.find("role");
    if (role == msg.end() || !role->is_string()) throw BadLine{at + " has no string \"role\""};
    auto content = msg.find("content");
    if (content != msg.end() && !content->is_string() && !content->is_null() && !content->is_array())
      throw BadLine{at + ".content is a " + std::string(content->type_name()) + "; make it a string"};
  }
}

Example parse_line(const std::string& line, const JsonlOptions& o) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::parse_error& e) {
    // nlohmann's own "line 1, column N" prefix would contradict our file line; keep its reason.
    const std::string what = e.what();
    const size_t colon = what.find(": ", what.find("column"));
    throw BadLine{str_cat("bad JSON at column ", e.byte, " (",
                          colon == std::string::npos ? what : what.substr(colon + 2), ")")};
  } catch (const json::exception& e) {  // out_of_range: a number past double's range
    throw BadLine{str_cat("bad JSON (", e.what(), ")")};
  }
  if (!j.is_object()) throw BadLine{str_cat("expected a JSON object, got ", j.type_name())};
  Example ex;
  const json* p = find_path(j, o.keys.prompt);
  if (!p) throw BadLine{"missing key \"" + o.keys.prompt + "\" (the prompt)"};
  if (p->is_string()) {
    ex.prompt = p->get<std::string>();
    if (ex.prompt.empty()) throw BadLine{"\"" + o.keys.prompt + "\" is empty"};
  } else {
    check_messages(*p, o.keys.prompt);
    ex.messages = p->dump();
  }
  if (!o.keys.label.empty()) {
    const json* l = find_path(j, o.keys.label);
    if (!l && o.require_label) throw BadLine{"missing key \"" + o.keys.label + "\" (the label)"};
    if (l) ex.label = l->is_string() ? l->get<std::string>() : l->is_number() ? number_text(*l) : l->dump();
  }
  ex.data_source = o.data_source;
  if (!o.keys.data_source.empty()) {
    if (const json* d = find_path(j, o.keys.data_source)) {
      if (!d->is_string()) throw BadLine{"\"" + o.keys.data_source + "\" must be a string"};
      ex.data_source = d->get<std::string>();
    }
  }
  ex.metadata = "{}";
  if (!o.keys.metadata.empty()) {
    if (const json* m = find_path(j, o.keys.metadata)) {
      if (!m->is_object()) throw BadLine{"\"" + o.keys.metadata + "\" must be a JSON object"};
      ex.metadata = m->dump();
    }
  }
  return ex;
}

bool blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; });
}

}  // namespace

std::vector<Example> load_jsonl(const std::string& path, const JsonlOptions& options, LoadReport* report) {
  KILN_CHECK(!options.keys.prompt.empty(), "load_jsonl: the prompt key is empty; name the key that holds the prompt");
  check_input_file(path, "load_jsonl", "give a JSONL file, one example per line");
  std::ifstream in(path);
  KILN_CHECK(in.good(), "load_jsonl: cannot open file (path=", path, "); check the path");
  LoadReport local;
  LoadReport& r = report ? *report : local;
  r = LoadReport{};
  std::vector<Example> out;
  std::string line;
  for (int64_t num = 1; std::getline(in, line); ++num) {
    if (blank(line)) continue;
    ++r.lines;
    const std::string where = str_cat(path, ":", num);
    try {
      Example ex = parse_line(line, options);
      ex.origin = where;
      out.push_back(std::move(ex));
      ++r.loaded;
    } catch (const BadLine& bad) {
      KILN_CHECK(options.bad_lines == BadLines::kSkip, "load_jsonl: ", where, ": ", bad.why,
                 "; fix the line, or set data.bad_lines: skip to skip and count such lines");
      ++r.skipped;
      if (r.examples.size() < 5) r.examples.push_back(where + ": " + bad.why);
    }
  }
  KILN_CHECK(!in.bad(), "load_jsonl: read error (path=", path, "); check the file");
  KILN_CHECK(!out.empty(), "load_jsonl: no usable lines in ", path, " (", r.lines, " lines, ", r.skipped,
             " skipped); write one {\"", options.keys.prompt, "\": ..., \"", options.keys.label, "\": ...} object per line");
  return out;
}

Dataset split(std::vector<Example> examples, double test_fraction, uint64_t seed) {
  KILN_CHECK(std::isfinite(test_fraction) && test_fraction >= 0.0 && test_fraction < 1.0,
             "split: test_fraction outside [0, 1) (test_fraction=", test_fraction,
             "); give the fraction of prompts held out for evaluation");
  // Group by prompt, in first-seen order, so duplicates cannot straddle train and test.
  std::unordered_map<std::string, size_t> group_of;
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < examples.size(); ++i) {
    auto [it, fresh] = group_of.emplace(examples[i].prompt + '\x1f' + examples[i].messages, groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  rng::Rng(rng::mix(seed, rng::kSaltSplit)).shuffle(groups);
  const size_t num_groups = groups.size();
  size_t num_test = size_t(std::llround(test_fraction * double(num_groups)));
  if (num_groups > 0) num_test = std::min(num_test, num_groups - 1);
  Dataset d;
  for (size_t g = 0; g < num_groups; ++g) {
    auto& side = g < num_test ? d.test : d.train;
    for (size_t i : groups[g]) side.push_back(std::move(examples[i]));
  }
  return d;
}

// ---- training stream ----

DataStream::DataStream(std::vector<Example> examples, uint64_t seed) : examples_(std::move(examples)), seed_(seed) {
  KILN_CHECK(!examples_.empty(), "DataStream: no examples; give at least one training example");
}

const std::vector<int64_t>& DataStream::order(uint64_t epoch) {
  if (epoch != cached_epoch_) {
    cached_order_.resize(examples_.size());
    std::iota(cached_order_.begin(), cached_order_.end(), int64_t(0));
    rng::Rng(rng::mix(seed_ ^ rng::kSaltStream, epoch)).shuffle(cached_order_);
    cached_epoch_ = epoch;
  }
  return cached_order_;
}

std::vector<Example> DataStream::next(int64_t n) {
  KILN_CHECK(n >= 0, "DataStream: negative batch size (n=", n, "); ask for n >= 0 examples");
  std::vector<Example> batch;
  batch.reserve(size_t(n));
  const uint64_t size = examples_.size();
  for (int64_t i = 0; i < n; ++i, ++position_) {
    batch.push_back(examples_[size_t(order(position_ / size)[size_t(position_ % size)])]);
  }
  return batch;
}

// ---- prompt format ----

void PromptFormat::validate() const {
  if (max_prompt_tokens) {
    KILN_CHECK(*max_prompt_tokens >= 0, "prompt: max_prompt_tokens must be >= 0 (got ", *max_prompt_tokens,
               "); 0 means no limit");
    KILN_CHECK(*max_prompt_tokens > 0, "prompt: max_prompt_tokens must be positive when set (got 0); leave it ",
               "unset for no limit");
  }
  json kw;
  try {
    kw = json::parse(template_kwargs);
  } catch (const json::exception& e) {
    KILN_FAIL("prompt: template_kwargs is not JSON (", e.what(), "); give an object such as {\"enable_thinking\": false}");
  }
  KILN_CHECK(kw.is_object(), "prompt: template_kwargs must be a JSON object (got ", kw.type_name(), ")");
}

namespace {
json chat_of(const Example& example, const PromptFormat& format) {
  json msgs = example.messages.empty() ? json::array({{{"role", "user"}, {"content", example.prompt}}})
                                       : json::parse(example.messages);
  const bool has_system = !msgs.empty() && msgs[0].value("role", "") == "system";
  if (!format.system_prompt.empty() && !has_system)
    msgs.insert(msgs.begin(), json{{"role", "system"}, {"content", format.system_prompt}});
  return msgs;
}
}  // namespace

std::string chat_messages(const Example& example, const PromptFormat& format) {
  return chat_of(example, format).dump();
}

PrepareReport prepare_prompts(std::vector<Example>& examples, const text::Tokenizer& tokenizer,
                              const PromptFormat& format) {
  format.validate();
  std::unique_ptr<text::ChatTemplate> tmpl;
  auto chat_template = [&]() -> const text::ChatTemplate& {
    if (!tmpl) {
      KILN_CHECK(!tokenizer.chat_template().empty(), "prompt: the tokenizer ", tokenizer.name(),
                 " has no chat template, but the data holds chats (or prompt.chat is always); give a tokenizer with "
                 "a chat_template, or plain-text prompts with prompt.chat: auto");
      tmpl = std::make_unique<text::ChatTemplate>(tokenizer.chat_template(), tokenizer.name());
    }
    return *tmpl;
  };
  text::ChatOptions options;
  options.add_generation_prompt = format.add_generation_prompt;
  options.extra = json::parse(format.template_kwargs);
  options.bos_token = tokenizer.bos_token();
  options.eos_token = tokenizer.eos_token();
  PrepareReport r;
  double total = 0;
  std::vector<Example> kept;
  kept.reserve(examples.size());
  for (Example& ex : examples) {
    const bool chat = !ex.messages.empty() || format.chat == ChatMode::kAlways;
    KILN_CHECK(!chat || format.chat != ChatMode::kNever, "prompt: ", ex.origin,
               " holds chat messages but prompt.chat is never; set it to auto or give text prompts");
    if (chat) {
      ex.prompt_text = text::apply_chat_template(chat_template(), chat_of(ex, format), options);
      ex.prompt_ids = tokenizer.encode(ex.prompt_text, /*add_special_tokens=*/false);
    } else {
      ex.prompt_text = ex.prompt;
      ex.prompt_ids = tokenizer.encode(ex.prompt_text, /*add_special_tokens=*/true);
    }
    KILN_CHECK(!ex.prompt_ids.empty(), "prompt: ", ex.origin, " encodes to no tokens; give a non-empty prompt");
    const int64_t n = int64_t(ex.prompt_ids.size());
    if (format.max_prompt_tokens && n > *format.max_prompt_tokens) {
      ++r.too_long;
      continue;
    }
    r.max_tokens = std::max(r.max_tokens, n);
    total += double(n);
    kept.push_back(std::move(ex));
  }
  r.kept = int64_t(kept.size());
  r.mean_tokens = r.kept > 0 ? total / double(r.kept) : 0.0;
  examples = std::move(kept);
  return r;
}

}  // namespace kiln::trainer
