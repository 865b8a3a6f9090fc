"""The engine: one real MLX model over a paged KV arena, stepped by a scheduling policy.

builder        build_engine: sizes the arena, builds allocators, policy and engine
llm_engine     LLMEngine: the step loop (schedule, move blocks, run, sample, update, outputs),
               composed of the parts below, each the one writer of its own state
request_table  live sequences, completions (n > 1), beam searches, outputs owed
intake         a request checked (RequestError), made and queued
host_kv        block moves, host copies of KV, save targets, KV files; persistence: the format
tier_kv        the lower KV tiers' bytes (kv_tier): host copies and disk files of blocks
step_sampler   a step's logits into its tokens: verification, forks, beams' candidates
step_state     what one step gathers as it goes
outputs        logprobs in, RequestOutputs out
forks          parallel sampling's completions and beam search's rounds
pipeline       steps pipelined one deep
request        a sequence's state (Seq) and the outputs returned to callers
model_runner   the Runner seam; ModelRunner runs an unmodified mlx_lm model over the arena
kv_cache       the KV arena and the paged cache view mlx_lm attends through
window         sliding-window layers' arena and ring layout
sampling_params  SamplingParams, logprobs records, a request's generator
sampling       the batched sampler
beam_search    BeamSearchParams and a search's rounds (BeamGroup)
speculative    the ways of drafting, the draft-model proposer, Leviathan et al.'s rule
ngram          prompt-lookup drafting (vLLM's ngram proposer): no draft model
modelled       engine.clock=model: the model clock, a runner and a proposer without a model
recorder       the step and request rows a run's figures are computed from
clock          virtual and wall clocks
"""

from harness.engine.builder import build_engine
from harness.engine.intake import RequestError
from harness.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine", "RequestError", "build_engine"]
