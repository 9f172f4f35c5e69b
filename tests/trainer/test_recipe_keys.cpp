// docs/CONFIG.md lists exactly the recipe keys the parser accepts: the parser's keys come from the
// parser (yaml::KeyRecorder, over recipes that enter every section), the documented ones from the
// first cells of the docs' tables.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/yaml_util.h"
#include "tests/test_util.h"
#include "trainer/recipe.h"
#include "trainer/rewards.h"

namespace kiln::trainer {
namespace {

using Keys = std::set<std::string>;

// The first cell of every table row in the docs that is one `key.path` in backticks. Each such
// row must fill its four cells: key, type, default, meaning.
Keys documented_keys() {
  std::ifstream f(test::source_path("docs/CONFIG.md"));
  EXPECT_TRUE(f.good()) << "cannot read docs/CONFIG.md";
  Keys keys;
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("| `", 0) != 0) continue;
    const size_t end = line.find('`', 3);
    if (end == std::string::npos) continue;
    keys.insert(line.substr(3, end - 3));
    std::vector<std::string> cells;
    std::stringstream row(line.substr(1));
    for (std::string cell; std::getline(row, cell, '|');) cells.push_back(cell);
    bool filled = cells.size() >= 4;
    for (size_t i = 0; filled && i < 4; ++i) filled = cells[i].find_first_not_of(' ') != std::string::npos;
    EXPECT_TRUE(filled) << "docs/CONFIG.md: the row of " << line.substr(3, end - 3)
                        << " needs a type, a default and a meaning: " << line;
  }
  return keys;
}

// A reward part of every type the parser knows (its names come from trainer/rewards.h), with the
// keys a type requires: a new type that requires one fails the parse below, naming the key.
std::string every_reward_type() {
  const std::map<std::string, std::string> required = {
      {"regex_format", ", pattern: x"}, {"worker", ", command: [w]"}, {"sum", ", parts: [{type: math}]"}};
  std::string parts;
  for (const std::string& type : reward_type_names()) {
    const auto it = required.find(type);
    parts += (parts.empty() ? "" : ", ") + std::string("{type: ") + type + (it == required.end() ? "" : it->second) + "}";
  }
  return "reward: {type: sum, parts: [" + parts + "]}\n";
}

struct ParserKeys {
  Keys keys;      // every key path asked for, sections included
  Keys sections;  // those with keys under them
};

// Every section a MapReader always enters (model, data, optim, ...) is entered by any recipe; the
// ones entered only when present (grpo.async, lora, reward, environment) and the lists (whose
// entries' keys are read per entry) get a recipe each, one section per recipe so that no check
// across sections refuses them. Each must parse.
ParserKeys parser_keys() {
  const std::string model = "model: {config: tiny.yaml}\n";
  const std::vector<std::string> recipes = {
      model + "optim: {rules: [{optimizer: adamw}]}\nsft: {rules: [{optimizer: adamw}]}\n",
      model + "grpo: {async: {max_staleness: 0}}\n",
      model + "lora: {}\n",
      model + "environment: {command: [w]}\n",
      model + every_reward_type(),
  };
  test::TempDir dir;
  yaml::KeyRecorder recorder;
  for (size_t i = 0; i < recipes.size(); ++i) {
    const std::string path = dir / ("recipe" + std::to_string(i) + ".yaml");
    std::ofstream(path) << recipes[i];
    try {
      (void)Recipe::from_yaml_file(path);
    } catch (const Error& e) {
      ADD_FAILURE() << "the recipe\n" << recipes[i] << "does not parse: " << e.what();
    }
  }
  // A list's entries take the same keys, written "[]"; an empty list would hide them.
  for (const std::string& list : recorder.lists()) {
    bool entered = false;
    for (const std::string& k : recorder.keys()) entered |= k.rfind(list + "[].", 0) == 0;
    EXPECT_TRUE(entered) << list << " is a list no recipe here gives an entry: add one so its keys are seen";
  }
  // A sum's parts are rewards with the reward's keys: "reward.parts[].parts[].weight" is
  // documented once, as "reward.weight".
  ParserKeys out;
  for (std::string k : recorder.keys()) {
    for (size_t at; k.rfind("reward.", 0) == 0 && (at = k.find(".parts[]")) != std::string::npos;) k.erase(at, 8);
    out.keys.insert(k);
  }
  for (const std::string& k : out.keys)
    for (const std::string& other : out.keys)
      if (other.rfind(k + ".", 0) == 0 || other.rfind(k + "[].", 0) == 0) out.sections.insert(k);
  return out;
}

// What differs: keys the parser accepts that the docs lack (sections may go without a row of their
// own: their keys have rows), and documented keys the parser does not accept.
std::vector<std::string> mismatches(const Keys& documented, const ParserKeys& parser) {
  std::vector<std::string> out;
  for (const std::string& k : parser.keys)
    if (!parser.sections.count(k) && !documented.count(k)) out.push_back("not in docs/CONFIG.md: " + k);
  for (const std::string& k : documented)
    if (!parser.keys.count(k)) out.push_back("in docs/CONFIG.md but not a key the parser accepts: " + k);
  return out;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + "\n";
  return s;
}

TEST(RecipeKeys, DocsListExactlyTheKeysTheParserAccepts) {
  const ParserKeys parser = parser_keys();
  // The recorder saw the parser: sections read always, and ones read only when present.
  for (const char* k : {"model.config", "rollout.numerics", "grpo.async.max_staleness", "optim.rules[].match",
                        "reward.pattern", "environment.max_turns", "prompt.template_kwargs"})
    EXPECT_TRUE(parser.keys.count(k)) << k;
  const std::vector<std::string> diff = mismatches(documented_keys(), parser);
  EXPECT_TRUE(diff.empty()) << joined(diff);
}

// The check can fail: a key dropped from the docs, or one the parser does not know, is named.
TEST(RecipeKeys, ComparisonNamesMissingAndUnknownKeys) {
  const ParserKeys parser = parser_keys();
  Keys documented = documented_keys();
  ASSERT_EQ(documented.erase("grpo.async.max_staleness"), 1u);
  documented.insert("grpo.max_tokenz");
  EXPECT_EQ(mismatches(documented, parser),
            (std::vector<std::string>{"not in docs/CONFIG.md: grpo.async.max_staleness",
                                      "in docs/CONFIG.md but not a key the parser accepts: grpo.max_tokenz"}));
}

}  // namespace
}  // namespace kiln::trainer
