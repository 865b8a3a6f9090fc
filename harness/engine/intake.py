"""Request intake checks: a request's prompt as token ids (``tokenize``) and the parameter
combinations this engine cannot run (``check_request``), before ``LLMEngine.add_request``
queues anything.

Every check raises ``RequestError`` naming the request, the field and the fix; nothing is
queued or reserved when one fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.engine.beam_search import BeamSearchParams
from harness.engine.sampling_params import SamplingParams
from harness.platform.models import LoadedModel

Params = SamplingParams | BeamSearchParams  # how a request generates


class RequestError(ValueError):
    """A request is malformed; the message names the field and the fix."""


def tokenize(model: LoadedModel, request_id: str, prompt: str | Sequence[int]) -> list[int]:
    """The prompt's token ids: text through the model's tokenizer, or ids checked against
    its vocabulary."""
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise RequestError(
                f"request {request_id!r}: a text prompt needs a tokenizer and model "
                f"{model.name!r} has none; pass token ids"
            )
        tokens = list(model.tokenizer.encode(prompt))
    else:
        tokens = [int(t) for t in prompt]
    if not tokens:
        raise RequestError(f"request {request_id!r}: the prompt is empty; give >= 1 token")
    vocab = model.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(
            f"request {request_id!r}: prompt token id {bad} is outside the vocabulary [0, {vocab})"
        )
    return tokens


def check_request(
    model: LoadedModel,
    request_id: str,
    params: SamplingParams,
    beam: BeamSearchParams | None,
    *,
    speculative: bool,
    has_window: bool,
    save_kv: str | Path | None,
    restore_kv: str | Path | None,
    logits: bool = True,
) -> None:
    """Combinations this engine cannot run: n > 1 or beams with speculative decoding, KV
    files with beams or with sliding-window layers, stop strings without a tokenizer, and
    what needs logits or KV on an engine without a model (``logits`` False: the model
    clock, harness/engine/modelled.py)."""
    if not logits:
        wants = [
            name
            for name, on in (
                ("beam search", beam is not None),
                ("SamplingParams.logprobs", params.logprobs is not None),
                ("SamplingParams.prompt_logprobs", params.prompt_logprobs is not None),
                ("save_kv", save_kv is not None),
                ("restore_kv", restore_kv is not None),
            )
            if on
        ]
        if wants:
            raise RequestError(
                f"request {request_id!r}: {wants[0]} needs a model's logits or KV, and "
                "engine.clock=model runs none; drop it or use engine.clock=virtual"
            )
    if (params.n > 1 or beam) and speculative:
        what = "beam search" if beam else f"SamplingParams.n={params.n}"
        raise RequestError(
            f"request {request_id!r}: {what} with speculative decoding is not supported; "
            "use n=1 sampling or run without speculative"
        )
    if beam and save_kv is not None:
        raise RequestError(
            f"request {request_id!r}: save_kv with beam search is not supported (which "
            "beam's KV?); save from a sampling request"
        )
    if save_kv is not None and not Path(save_kv).parent.is_dir():
        raise RequestError(
            f"request {request_id!r}: save_kv={str(save_kv)!r} is in no existing folder; "
            "create the folder first"
        )
    if (save_kv is not None or restore_kv is not None) and has_window:
        raise RequestError(
            f"request {request_id!r}: save_kv and restore_kv are not supported for model "
            f"{model.name!r}, which has sliding-window layers; drop them"
        )
    if params.stop and model.tokenizer is None:
        raise RequestError(
            f"request {request_id!r}: SamplingParams.stop needs a tokenizer, and model "
            f"{model.name!r} has none; use stop_token_ids instead"
        )
