// Multi-turn episodes: the turn loop over the engine's sessions and the environment, the limits,
// and the per-token bookkeeping (drawn or observed, log-prob, routing) the trainer packs.
#include "trainer/episodes.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "core/error.h"
#include "text/tokenizer.h"

namespace kiln::trainer {
namespace {

// A later turn's seed: distinct per (request seed, sample, turn), so turns draw fresh streams.
uint64_t turn_seed(uint64_t seed, int64_t sample, int64_t turn) {
  uint64_t x = seed ^ (0x9E3779B97F4A7C15ull * uint64_t(sample + 1)) ^ (0xC2B2AE3D27D4EB4Full * uint64_t(turn));
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

struct Live {
  size_t request = 0, sample = 0;
  int64_t session = -1;
};

// Appends a turn just drawn to its episode, and the request that asks the environment about it.
EnvRequest record_turn(Episode& e, const Example& ex, const rollout::Sample& s, int64_t turn, int64_t id,
                       const text::Tokenizer& tok) {
  e.response.insert(e.response.end(), s.tokens.begin(), s.tokens.end());
  e.sampled.insert(e.sampled.end(), s.tokens.size(), 1);
  e.logprobs.insert(e.logprobs.end(), s.logprobs.begin(), s.logprobs.end());
  e.sampled_tokens += int64_t(s.tokens.size());
  e.routing = s.routing;
  EnvRequest q;
  q.id = id;
  q.turn = turn;
  q.prompt = ex.prompt_text;
  q.label = ex.label;
  q.data_source = ex.data_source;
  q.metadata = ex.metadata;
  q.history = e.turns;
  q.response = response_text(tok, s.tokens, s.finish);
  q.response_ids = s.tokens;
  q.truncated = s.finish == rollout::FinishReason::kLength;
  e.turns.push_back({q.response, "", s.tokens, {}});
  return q;
}

// Takes the environment's answer to an episode's turn: the observation that continues the episode, or
// nothing when it ends here (done, a limit reached, or an observation the model cannot take).
std::optional<std::vector<int64_t>> take_answer(Episode& e, const EnvStep& answer, rollout::FinishReason finish,
                                                int64_t turn, const std::string& origin, const EnvironmentSpec& spec,
                                                const text::Tokenizer& tok, int64_t vocab) {
  e.last = answer;
  bool go_on = !e.last.done;
  // An observation the model cannot take (ids outside its vocabulary, text the tokenizer
  // rejects) is the environment's failure: under on_failure: stop the run ends, naming it.
  auto reject = [&](const std::string& what) {
    const std::string why = str_cat("environment: ", what, " (turn ", turn, " of ", origin, ")");
    KILN_CHECK(spec.worker.on_failure == OnFailure::kZero, why, "; fix the environment, or set on_failure: zero");
    e.last = EnvStep();
    e.last.done = e.last.failed = e.bad_observation = true;
    e.last.error = why;
    go_on = false;
  };
  std::vector<int64_t> obs;
  if (go_on && e.last.has_ids) {
    const auto bad = std::find_if(e.last.observation_ids.begin(), e.last.observation_ids.end(),
                                  [&](int64_t id) { return id >= vocab; });
    if (bad != e.last.observation_ids.end())
      reject(str_cat("observation_ids holds ", *bad, ", outside the vocabulary (", vocab, " ids)"));
    else
      obs = e.last.observation_ids;
  } else if (go_on) {
    try {
      obs = tok.encode(e.last.observation);
    } catch (const Error& err) {
      reject(str_cat("the tokenizer rejects the observation: ", err.what()));
    }
  }
  const int64_t left = spec.max_episode_tokens - int64_t(e.response.size()) - int64_t(obs.size());
  if (go_on && (turn + 1 >= spec.max_turns || obs.empty() || int64_t(obs.size()) > spec.max_observation_tokens ||
                left < 1)) {
    go_on = false;
    e.truncated = true;
  }
  if (!go_on) {
    // A last turn cut by max_tokens is truncated too, unless the environment ended the episode.
    if (!e.last.done && finish == rollout::FinishReason::kLength) e.truncated = true;
    return std::nullopt;
  }
  e.turns.back().observation = e.last.has_ids ? tok.decode(obs) : e.last.observation;
  e.turns.back().observation_ids = obs;
  return obs;
}

}  // namespace

std::string response_text(const text::Tokenizer& tok, const std::vector<int64_t>& ids, rollout::FinishReason finish) {
  if (finish == rollout::FinishReason::kStop && !ids.empty() && tok.is_special(ids.back()))
    return tok.decode(std::vector<int64_t>(ids.begin(), ids.end() - 1));
  return tok.decode(ids);
}

std::vector<std::vector<Episode>> run_episodes(rollout::Engine& engine, Environment& env, const text::Tokenizer& tok,
                                               const std::vector<const Example*>& examples,
                                               std::vector<rollout::Request> requests) {
  KILN_CHECK(examples.size() == requests.size(), "episodes: ", examples.size(), " examples for ", requests.size(),
             " requests");
  const EnvironmentSpec& spec = env.spec();
  const int64_t vocab = engine.model().config().vocab_size;
  std::vector<std::vector<Episode>> eps(requests.size());
  for (auto& r : requests) {
    r.keep_cache = true;
    r.params.max_tokens = std::min(r.params.max_tokens, spec.max_episode_tokens);  // the first turn counts too
  }
  // Sessions the engine holds for these episodes. Whatever ends this call (an environment that
  // stops the run, a bad id), none is left behind: queued turns run out, then every session ends.
  std::set<int64_t> held;
  struct Release {
    rollout::Engine& engine;
    std::set<int64_t>& held;
    ~Release() {
      try {
        while (engine.has_unfinished()) engine.step();
        for (int64_t s : held) engine.end_session(s);
      } catch (...) {  // already unwinding from the error that matters
      }
    }
  } release{engine, held};
  // The first turn: every request at once, as a single-turn rollout would run.
  std::map<int64_t, Live> running;  // engine request id -> the episode it continues
  std::vector<std::pair<Live, rollout::Sample>> drawn;
  {
    std::vector<rollout::RequestOutput> outs = engine.generate(requests);
    for (size_t i = 0; i < outs.size(); ++i) {
      eps[i].resize(outs[i].samples.size());
      for (size_t j = 0; j < outs[i].samples.size(); ++j) {
        held.insert(outs[i].samples[j].session);
        drawn.push_back({Live{i, j, outs[i].samples[j].session}, std::move(outs[i].samples[j])});
      }
    }
  }
  for (int64_t turn = 0; !drawn.empty(); ++turn) {
    // Append each turn just drawn and ask the environment about it.
    std::vector<EnvRequest> asks;
    for (auto& [live, s] : drawn) {
      asks.push_back(record_turn(eps[live.request][live.sample], *examples[live.request], s, turn,
                                 int64_t(asks.size()), tok));
    }
    const std::vector<EnvStep> answers = env.step(asks);
    // Each episode ends here or gets its observation and a next turn.
    std::vector<std::pair<Live, std::vector<int64_t>>> next;
    for (size_t a = 0; a < answers.size(); ++a) {
      const Live live = drawn[a].first;
      Episode& e = eps[live.request][live.sample];
      std::optional<std::vector<int64_t>> obs = take_answer(e, answers[a], drawn[a].second.finish, turn,
                                                            examples[live.request]->origin, spec, tok, vocab);
      if (!obs) {
        engine.end_session(live.session);
        held.erase(live.session);
        continue;
      }
      next.push_back({live, std::move(*obs)});
    }
    drawn.clear();
    running.clear();
    for (auto& [live, obs] : next) {
      Episode& e = eps[live.request][live.sample];
      const int64_t left = spec.max_episode_tokens - int64_t(e.response.size()) - int64_t(obs.size());
      e.response.insert(e.response.end(), obs.begin(), obs.end());
      e.sampled.insert(e.sampled.end(), obs.size(), 0);
      e.logprobs.insert(e.logprobs.end(), obs.size(), 0.0f);
      rollout::SamplingParams p = requests[live.request].params;
      p.n = 1;
      p.max_tokens = std::min(p.max_tokens, left);
      p.seed = turn_seed(p.seed, int64_t(live.sample), turn + 1);
      running[engine.continue_session(live.session, obs, p)] = live;
    }
    while (engine.has_unfinished())
      for (rollout::RequestOutput& o : engine.step()) {
        const auto it = running.find(o.request_id);
        KILN_CHECK(it != running.end() && o.samples.size() == 1, "episodes: the engine finished request ", o.request_id,
                   ", which no episode continues");
        drawn.push_back({it->second, std::move(o.samples[0])});
      }
    // Episodes in a fixed order whatever the engine's finishing order: the environment sees the
    // same requests run to run.
    std::sort(drawn.begin(), drawn.end(), [](const auto& a, const auto& b) {
      return std::make_pair(a.first.request, a.first.sample) < std::make_pair(b.first.request, b.first.sample);
    });
  }
  return eps;
}

}  // namespace kiln::trainer
