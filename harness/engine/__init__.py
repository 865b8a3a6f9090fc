"""The engine: one real MLX model over a paged KV arena, stepped by a scheduling policy.

builder        build_engine: sizes the arena, builds allocators, policy and engine
llm_engine     LLMEngine: the step loop (schedule, move blocks, run, update, outputs)
intake         a request checked before it is queued (RequestError)
outputs        tokens in, stop conditions, finished requests, RequestOutputs
forks          parallel sampling's completions and beam search's rounds
pipeline       steps pipelined one deep
kv_files       KV save and restore hooks, host copies; persistence: the file format
request        a request's state (Sequence) and the outputs returned to callers
model_runner   the Runner seam; ModelRunner runs an unmodified mlx_lm model over the arena
kv_cache       the KV arena and the paged cache view mlx_lm attends through
window         sliding-window layers' arena and ring layout
sampling       SamplingParams and the batched sampler
beam_search    BeamSearchParams and a search's rounds
speculative    the ways of drafting, the draft-model proposer, Leviathan et al.'s rule
ngram          prompt-lookup drafting (vLLM's ngram proposer): no draft model
recorder       the step and request rows a run's figures are computed from
clock          virtual and wall clocks
"""

from harness.engine.builder import build_engine
from harness.engine.intake import RequestError
from harness.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine", "RequestError", "build_engine"]
