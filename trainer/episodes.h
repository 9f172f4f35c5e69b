// Multi-turn episodes, token in and token out: the engine samples a turn, an environment answers,
// its observation is appended as ids (given, or tokenized once) and the engine continues the
// session on its cached prefix, until the environment ends the episode or a limit does.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "rollout/engine.h"
#include "trainer/dataset.h"
#include "trainer/environment.h"

namespace kiln::text {
class Tokenizer;
}

namespace kiln::trainer {

struct Episode {
  std::vector<int64_t> response;   // after the prompt: every turn and observation, the ids the model saw
  std::vector<uint8_t> sampled;    // per response token: 1 drawn by the policy, 0 an observation
  std::vector<float> logprobs;     // per response token (0 for an observation's)
  at::Tensor routing;              // [prompt + response, L, k] uint8, as the rollout routed each token
  std::vector<EnvTurn> turns;      // each sampled turn with the observation that followed it
  int64_t sampled_tokens = 0;
  bool truncated = false;          // a limit ended it (turns, tokens, the last turn's max_tokens),
                                   // not the environment
  bool bad_observation = false;         // the environment's observation could not be taken: ids outside
                                   // the vocabulary, or text the tokenizer rejects
  EnvStep last;                    // the environment's last answer: the reward, components, failure
};

// The response text a reward or an environment reads: the ids decoded, less a special stop token
// that ended them (<|im_end|>); a textual stop such as the byte tokenizer's '\n' stays.
std::string response_text(const text::Tokenizer& tok, const std::vector<int64_t>& ids, rollout::FinishReason finish);

// Runs every sample of every request as an episode (requests[i] is examples[i]'s first turn;
// keep_cache is set here). Each later turn draws one sample with the request's parameters, its
// max_tokens cut to what the episode has left, from a seed of (request seed, sample, turn). The
// engine must serve a whole model (no expert-sharded rollout: turns differ between ranks).
// Returns result[i][j]: request i's sample j. Every session is ended before it returns.
std::vector<std::vector<Episode>> run_episodes(rollout::Engine& engine, Environment& env, const text::Tokenizer& tok,
                                               const std::vector<const Example*>& examples,
                                               std::vector<rollout::Request> requests);

}  // namespace kiln::trainer
