"""The engine: one real MLX model over a paged KV arena, stepped by a scheduling policy.

llm_engine     LLMEngine: the step loop (schedule, move blocks, forward, sample, record)
request        a request's state (Sequence) and the outputs returned to callers
model_runner   runs an unmodified mlx_lm model over the arena; groups rows by shape
kv_cache       the KV arena and the paged cache view mlx_lm attends through
sampling       SamplingParams and the batched sampler
speculative    the draft proposer and Leviathan et al.'s acceptance rule
recorder       the step and request rows a run's figures are computed from
clock          virtual and wall clocks
"""

from harness.engine.llm_engine import LLMEngine, RequestError

__all__ = ["LLMEngine", "RequestError"]
