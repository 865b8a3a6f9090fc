"""Request intake (``LLMEngine.add_request``): a request's prompt as token ids
(``tokenize``), the parameter combinations this engine cannot run (``check_request``), then
its sequence made, seeded and queued (``Intake``).

Every check raises ``RequestError`` naming the request, the field and the fix; nothing is
queued or reserved when one fails.
"""

from __future__ import annotations

import threading
import warnings
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from harness.engine.beam_search import BeamGroup, BeamSearchParams
from harness.engine.host_kv import HostKV
from harness.engine.request import Seq
from harness.engine.request_table import RequestTable
from harness.engine.sampling_params import SamplingParams, make_rng
from harness.platform.models import LoadedModel
from schedulers.base import Scheduler

Params = SamplingParams | BeamSearchParams  # how a request generates


class RequestError(ValueError):
    """A request is malformed; the message names the field and the fix."""


class OutputCutWarning(UserWarning):
    """A request asks for more output than the engine's longest sequence leaves after its
    prompt: its output is cut there (finish_reason 'length')."""


def cut(num_prompt_tokens: int, max_tokens: int, max_seq_len: int) -> bool:
    """Whether a request's output is cut short of ``max_tokens`` by ``max_seq_len`` (the
    scheduler's: max_model_len, or what one sequence can hold); a longer prompt is aborted
    instead; a prompt of exactly ``max_seq_len`` still gets its first token."""
    return num_prompt_tokens <= max_seq_len and max(1, max_seq_len - num_prompt_tokens) < max_tokens


_INT_TYPECODES = frozenset("bBhHiIlLqQ")


def tokenize(model: LoadedModel, request_id: str, prompt: str | Sequence[int]) -> Sequence[int]:
    """The prompt's token ids, checked against the vocabulary: text through the model's
    tokenizer, a tuple or a trace's compact ``array`` of ids as given (no copy of a long
    prompt a saturated queue holds), any other sequence as a tuple of Python ints."""
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise RequestError(
                f"request {request_id!r}: a text prompt needs a tokenizer and model "
                f"{model.name!r} has none; pass token ids"
            )
        tokens = tuple(model.tokenizer.encode(prompt))
    else:
        compact = isinstance(prompt, array) and prompt.typecode in _INT_TYPECODES
        tokens = prompt if compact else tuple(prompt)  # a tuple's own object: no copy
        if not compact and not set(map(type, tokens)) <= {int}:  # numpy ints, say
            tokens = tuple(int(t) for t in tokens)
    if not tokens:
        raise RequestError(f"request {request_id!r}: the prompt is empty; give >= 1 token")
    vocab = model.vocab_size
    if isinstance(tokens, array):  # its range by numpy over its buffer, no int per element
        ids = np.frombuffer(tokens, dtype=tokens.typecode)
        low, high = int(ids.min()), int(ids.max())
    else:
        low, high = min(tokens), max(tokens)
    if low < 0 or high >= vocab:  # at C speed; then find the first bad one
        bad = next(t for t in tokens if not 0 <= t < vocab)
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


class Intake:
    """Requests in: checked (nothing is queued when a check fails), their ids reserved, their
    sequence made and seeded, queued with the scheduler, a KV file's prefix held on the host."""

    def __init__(
        self,
        model: LoadedModel,
        requests: RequestTable,
        host: HostKV,
        scheduler: Scheduler,
        lock: threading.RLock,
        *,
        seed: int,
        speculative: bool,
        has_window: bool,
        logits: bool,
    ) -> None:
        self.model = model
        self.requests = requests
        self.host = host
        self.scheduler = scheduler
        self.lock = lock  # the engine's: the checks run outside it, the queueing inside
        self.seed = seed
        self.speculative = speculative
        self.has_window = has_window
        self.logits = logits
        self.warned_cut = False  # OutputCutWarning is said once per engine

    def add(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: Params,
        arrived: float,
        priority: int,
        *,
        ttft_slo: float | None,
        tpot_slo: float | None,
        save_kv: str | Path | None,
        restore_kv: str | Path | None,
    ) -> None:
        """Queue a request (``LLMEngine.add_request``, which says what each argument is)."""
        beam = params if isinstance(params, BeamSearchParams) else None
        if beam is not None:
            params = beam.beam_params()
        tokens = tokenize(self.model, request_id, prompt)
        check_request(
            self.model,
            request_id,
            params,
            beam,
            speculative=self.speculative,
            has_window=self.has_window,
            save_kv=save_kv,
            restore_kv=restore_kv,
            logits=self.logits,
        )
        if not self.warned_cut:
            self._warn_if_cut(request_id, len(tokens), params.max_tokens)
        restored = None
        if restore_kv:
            restored = self.host.restorable(request_id, restore_kv, tokens, params)
        with self.lock:
            if taken := self.requests.ids_taken(request_id, params.n, beam is not None):
                raise RequestError(
                    f"request_id {request_id!r} is already in use ({taken[0]!r}): pick a new one"
                )
            seed = self.requests.reserve_seed(params.n, self.seed)
            seq = Seq(
                request_id=request_id,
                token_ids=tokens,
                params=params,
                arrival_time=arrived,
                priority=priority,
                rng=make_rng(params, seed),
                seed=params.seed if params.seed is not None else seed,
                ttft_slo=ttft_slo,
                tpot_slo=tpot_slo,
            )
            group = BeamGroup(beam, self.model.eos_token_ids, seq) if beam is not None else None
            self.requests.add(seq, group)
            if save_kv is not None:
                self.host.save_at_finish(request_id, Path(save_kv))
            num_restored = 0
            if restored is not None:
                num_restored, blocks = restored
                self.host.keep(request_id, blocks)
            self.scheduler.add(seq, restored=num_restored, keep_kv=save_kv is not None)

    def _warn_if_cut(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.scheduler.max_seq_len
        if not cut(num_prompt_tokens, max_tokens, limit):
            return
        self.warned_cut = True
        model_len = self.scheduler.max_model_len
        what, left = f"max_model_len={model_len}", max(1, limit - num_prompt_tokens)
        if limit < model_len:
            what = f"the {limit} tokens one sequence can hold in the arena (below {what})"
        warnings.warn(
            f"request {request_id!r}: max_tokens={max_tokens} does not fit {what} after its "
            f"{num_prompt_tokens}-token prompt: its output stops at {left} "
            "tokens (finish_reason='length'); said once, for this engine's first such request",
            OutputCutWarning,
            stacklevel=4,
        )
