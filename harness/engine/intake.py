"""Request intake: ``add_request`` checks a request's prompt and parameters, reserves its
ids and queues it with the scheduler; ``abort_request`` stops one in any state.

Every check raises ``RequestError`` naming the request, the field and the fix; nothing is
queued or reserved when one fails.

``Intake`` is a part of ``LLMEngine`` (harness/engine/llm_engine.py); it owns the table of
live requests (``_requests``) and the count of sequences added (``_num_added``, which
seeds them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.engine.beam_search import BeamGroup, BeamSearchParams
from harness.engine.pipeline import INFLIGHT
from harness.engine.request import Sequence as Seq
from harness.engine.sampling_params import SamplingParams, make_rng
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


class Intake:
    """Requests in (checked, seeded, queued) and aborted."""

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: Params | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        *,
        ttft_slo: float | None = None,
        tpot_slo: float | None = None,
        save_kv: str | Path | None = None,
        restore_kv: str | Path | None = None,
    ) -> None:
        """Queue a request. A prompt is token ids, or text when the model has a tokenizer.
        ``BeamSearchParams`` run a beam search (harness/engine/beam_search.py): the request's
        one output, when it finishes, holds the best ``beam_width`` beams.

        ``save_kv``: a file the request's KV (prompt and output but the last token) is
        saved to when it finishes. ``restore_kv``: such a file; the KV of the longest prefix
        of this prompt it holds is written back at admission instead of computed. A file
        that cannot be used (unreadable, corrupted, another model or block size) or shares
        no prefix warns (``KVRestoreWarning``, one line naming it) and the prompt is
        computed (harness/engine/persistence.py)."""
        # Arrival is when the caller hands the request over, not when the lock is free.
        arrived = self.clock.now() if arrival_time is None else arrival_time
        params = sampling_params or SamplingParams()
        beam = params if isinstance(params, BeamSearchParams) else None
        if beam is not None:
            params = beam.beam_params()
        tokens = tokenize(self.model, request_id, prompt)
        check_request(
            self.model,
            request_id,
            params,
            beam,
            speculative=self.proposer is not None,
            has_window=self.window is not None,
            save_kv=save_kv,
            restore_kv=restore_kv,
            logits=self.runner.computes_logits,
        )
        restored = self._restorable(request_id, restore_kv, tokens, params) if restore_kv else None
        with self._lock:
            if taken := self._ids_taken(request_id, params.n, beam is not None):
                raise RequestError(
                    f"request_id {request_id!r} is already in use ({taken[0]!r}): pick a new one"
                )
            seed = self.seed * 1_000_003 + self._num_added
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
            self._num_added += params.n  # completion i falls back to seed + i: no overlap
            self._requests[request_id] = seq
            if params.n > 1:
                self._groups[request_id] = [seq]
            if beam is not None:
                self._beams[request_id] = BeamGroup(beam, self.model.eos_token_ids, seq)
            if save_kv is not None:
                self._save_to[request_id] = Path(save_kv)
            num_restored = 0
            if restored is not None:
                num_restored, self._host[request_id] = restored
            self.scheduler.add(seq, restored=num_restored)

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state; its blocks are free when this returns."""
        with self._lock:
            if request_id in self._beams:
                self._pending += self._end_beams(
                    self._beams[request_id], "abort", self.clock.now(), "aborted by the user"
                )
                return
            if request_id.rpartition("/")[0] in self._beams:
                return  # a beam's own id: the engine's, not a request (vLLM ignores those)
            group = self._groups.get(request_id)
            ids = [s.request_id for s in group if not s.finished] if group else [request_id]
            for rid in ids:
                seq = self.scheduler.abort(rid) or self._released_early(rid)
                if seq is None:
                    continue
                if seq.token_ids[-1] == INFLIGHT:  # its pending token is never emitted
                    seq.token_ids.pop()
                self._finish(seq, "abort", self.clock.now(), abort_reason="aborted by the user")
                self._pending.append(self._output(seq))
