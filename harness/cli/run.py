"""kvbench's main job: build model, allocator, scheduler and engine from the config, replay a
trace, write the result tables and the summary, print the summary.

    kvbench                                      (or python -m harness.cli.run)
    kvbench allocator=radix trace=shared_prefix
    kvbench -m allocator=free_list,radix trace.rate=1,2,4 [hydra/launcher=joblib]

Hydra owns the folders (``conf/config.yaml``: ``results/<experiment_name>/runs/<run_id>`` and
``results/<experiment_name>/multiruns/<sweep_id>/<overrides>``, a sweep job written in
``<sweep_id>/.partial/<overrides>`` and moved into place when it ends). A multirun job whose
folder already holds a summary.json for the same overrides is skipped, so re-running an
interrupted sweep with its ``sweep_id`` completes only the missing jobs.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import secrets
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import mlx.core as mx
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from harness.analysis import results
from harness.analysis.metrics import (
    format_outcome,
    format_summary,
    reachable_hits_recovered,
    requests_frame,
    steps_frame,
    summarize,
)
from harness.cli.config import validate
from harness.cli.replay import check_trace, replay, sampling_params
from harness.engine import LLMEngine
from harness.engine.intake import OutputCutWarning, cut
from harness.engine.sampling_params import SamplingParams, SamplingParamsError
from harness.platform import machine, noise
from harness.platform.collector import collector_paused
from harness.workload.traces import Trace, prefix_hit_bounds

log = logging.getLogger(__name__)

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")
WARMUP_TOKENS = 8  # output tokens per warm-up request: a few decode steps

# conf/hydra/launcher/{ray,submitit_slurm}.yaml keep the plugins' option names, so Hydra
# validates them against the plugins' schemas of the same name and warns that this matching
# is deprecated; it is supported throughout hydra-core 1.3, the range pyproject allows.
warnings.filterwarnings(
    "ignore", message=r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema"
)


def run_id() -> str:
    """A folder name for a run or a sweep: its start time, then 6 random hex digits, so runs
    started in the same second (two shells, a scheduler's array job) never share a folder."""
    return f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{secrets.token_hex(3)}"


# ``${run_id:}`` in conf/config.yaml; cached, so one config resolves it to one value.
OmegaConf.register_new_resolver("run_id", run_id, use_cache=True, replace=True)


class UsageError(Exception):
    """The config or an input it names (trace file, model path, an option's value) is wrong:
    ``kvbench`` prints the message, which names the setting and the fix, and exits 2."""


class SweepMismatchError(RuntimeError):
    """A sweep job's folder holds a finished run of different overrides."""


def run(
    cfg: DictConfig,
    output_dir: str | Path,
    *,
    overrides: Sequence[str] = (),
    choices: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run one experiment and write its files into ``output_dir``; return the summary written.

    The config is validated before anything is built; a wrong setting or input raises
    ``UsageError`` (its cause is the component's own error). If the replay fails or is interrupted,
    the rows recorded so far are still written (requests.parquet, steps.parquet) but no
    summary.json, so the run counts as unfinished and a sweep re-run repeats it.
    """
    out = Path(output_dir)
    try:  # everything here checks input: its errors name the setting, not a code path
        trace, sampling = check(cfg)
        out.mkdir(parents=True, exist_ok=True)
        model = build_component(cfg.model)
        check_trace(trace, model.vocab_size)
        speculative = (
            build_component(cfg.speculative) if cfg.get("speculative") is not None else None
        )
        kv_tier = build_component(cfg.kv_tier)
        if kv_tier.dir is None:  # the disk tier's folder is made inside the run's
            kv_tier = dataclasses.replace(kv_tier, dir=str(out))
        build = partial(
            build_component(cfg.engine),
            model,
            build_component(cfg.allocator),
            build_component(cfg.scheduler),
            speculative=speculative,
            kv_tier=kv_tier,
        )
        engine = build()
    except (ValueError, OSError) as e:
        results.write_failure(out, e)
        raise UsageError(str(e)) from e
    machine.set_mlx_cache_limit(cfg.mlx_cache_limit)
    if cfg.warmup and engine.clock.measures:  # a priced clock has no cold costs to pay
        # First-time costs (allocations, BLAS threads) are the harness's, not the policy's:
        # pay them on a throwaway engine, so the measured one starts with a clean arena,
        # prefix cache and clock. Its buffers go back to MLX's cache for the real one.
        try:
            with _cut_said():
                warm_up(engine, trace, cfg.warmup, sampling)
            engine.close(discard=True)
            del engine
            gc.collect()
            engine = build()
        except BaseException as e:
            results.write_failure(out, e)
            raise
    for line in filter(None, (_clipped(trace), _cut(trace, engine))):
        log.warning(line)
    # the machine's speed before and after the replay: timed figures mean nothing closer
    probes = noise.probe() if engine.clock.measures else []
    with collector_paused() as collector:  # its passes would be the harness's time
        # mlx_peak_bytes is this run's, not an earlier job's (nor its garbage, collected now)
        mx.reset_peak_memory()
        started = time.perf_counter()
        try:
            log.info("replaying %d requests", len(trace))  # in the try: an interrupt keeps rows
            with _cut_said():
                sent = replay(engine, trace, sampling=sampling, progress=cfg.progress)
        except BaseException as e:
            engine.close()
            log.error(
                "replay %s: writing the %d finished requests' rows to %s",
                "interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                engine.recorder.num_requests,
                out,
            )
            results.write_tables(out, *_tables(engine))
            results.write_failure(out, e)
            raise
        wall_time = time.perf_counter() - started
    if collector.cyclic:
        log.warning(
            "the replay left %d objects in reference cycles, freed only now (the cyclic "
            "collector is off while a trace replays): a change made a cycle per request or "
            "step; break it (harness/platform/collector.py)",
            collector.cyclic,
        )
    engine.close()  # the disk tier's folder goes, unless kv_tier.keep
    requests, steps = _tables(engine)
    results.write_tables(out, requests, steps)
    summary = summarize(requests, steps, clock=engine.clock.name)
    probes += noise.probe() if engine.clock.measures else []
    block_size = engine.allocator.block_size
    # over the prompts as sent: a follow-up turn's holds the turns and answers before it
    bound, bound_blocks = prefix_hit_bounds(sent.requests, block_size, sent.answers)
    summary.update(
        wall_time=wall_time,
        num_requests=len(trace),
        max_prefix_hit_rate=bound,
        max_prefix_hit_rate_blocks=bound_blocks,
    )
    summary.update(
        reachable_hits_recovered=reachable_hits_recovered(summary),
        warmup_requests=min(cfg.warmup, len(trace)) if engine.clock.measures else 0,
        timing_noise=noise.spread(probes) if probes else math.nan,
        profile=_profile(engine),
        model_name=model.name,
        num_blocks=engine.allocator.num_blocks,
        block_size=block_size,
        choices=dict(choices or {}),
        overrides=list(overrides),
        trace_metadata=trace.metadata,
        machine=machine.info(),
    )
    results.write_vllm_bench(out, summary)
    results.write_summary(out, summary)  # last: a folder with it is a finished run
    return summary


def _clipped(trace: Trace) -> str | None:
    """One line saying what clipping a public trace to ``trace.max_len`` changed, or None."""
    meta = trace.metadata
    if not meta.get("clipped_requests"):
        return None
    (p0, p1), (o0, o1) = meta["clipped_means"]["prompt"], meta["clipped_means"]["output"]
    return (
        f"trace.max_len={meta['max_len']} clipped {meta['clipped_requests']:,} of "
        f"{len(trace):,} requests, the output first: mean prompt {p0:,.1f} -> {p1:,.1f} "
        f"tokens, mean output {o0:,.1f} -> {o1:,.1f}; raise engine.max_model_len (and the "
        "arena) to replay them whole"
    )


def _cut(trace: Trace, engine: LLMEngine) -> str | None:
    """One line counting the requests whose output the engine's longest sequence cuts short
    (finish_reason 'length'), or None; a trace that lets EOS end answers may stop sooner."""
    limit = engine.scheduler.max_seq_len
    n = sum(cut(len(r.prompt_token_ids), r.max_tokens, limit) for r in trace)
    if not n:
        return None
    will = "are" if all(r.ignore_eos for r in trace) else "may be"
    return (
        f"{n:,} of {len(trace):,} requests ask for more output than fits a sequence of "
        f"{limit} tokens (engine.max_model_len={engine.scheduler.max_model_len}, or what "
        f"the arena holds): their outputs {will} cut to fit (finish_reason=length)"
    )


@contextmanager
def _cut_said() -> Iterator[None]:
    """No ``OutputCutWarning`` per engine: ``_cut`` said it before the replay, with the count."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutputCutWarning)
        yield


def _profile(engine: LLMEngine) -> dict[str, Any] | None:
    """The cost profile that priced a model clock's steps: its file, kind, where it was
    measured (or the device it was derived for) and its model (None on a measuring clock)."""
    profile = getattr(engine.clock, "profile", None)
    if profile is None:
        return None
    data = profile.data
    where = data.get("machine", {})
    return {
        "path": profile.path,
        "kind": profile.kind,
        "model": data["model"].get("name"),
        "fingerprint": data["model"].get("fingerprint"),
        "block_size": data["block_size"],
        "machine": where.get("name") or where.get("cpu"),
        "created": data.get("created"),
        "acceptance": engine.runner.acceptance if engine.proposer is not None else None,
    }


def check(cfg: DictConfig) -> tuple[Trace, Callable[..., SamplingParams]]:
    """What can be checked without a model: ``validate``, the trace built and not empty, the
    sampling values; return the trace and the sampling partial. Raises ``ConfigError``, a
    component's ``ValueError`` or ``OSError`` naming the setting."""
    validate(cfg)
    max_len, model_len = cfg.trace.generator.get("max_len"), cfg.engine.get("max_model_len")
    if isinstance(max_len, int) and isinstance(model_len, int) and max_len > model_len:
        # its longer requests would replay, to be aborted, and be told only at the end
        raise ValueError(
            f"trace.max_len={max_len} is above engine.max_model_len={model_len}: lower "
            f"trace.max_len to {model_len} or less, or raise engine.max_model_len"
        )
    trace = build_component(cfg.trace.generator)
    if not len(trace):
        raise ValueError(f"the trace has no requests ({_empty_trace_knobs(cfg)}): nothing to run")
    if cfg.engine.get("clock") == "model" and not all(r.ignore_eos for r in trace):
        raise ValueError(
            "the trace lets the model's EOS end its answers (a real model's own lengths), and "
            "engine.clock=model runs no model: replay it with engine.clock=virtual"
        )
    sampling = build_component(cfg.sampling)
    try:  # bad values fail now, naming the key (min_tokens against the shortest request)
        sampling(max_tokens=min(r.max_tokens for r in trace), ignore_eos=True)
    except SamplingParamsError as e:
        field = str(e).split(".", 1)[1]  # "SamplingParams.top_p=..." -> the config key
        raise ValueError(f"sampling.{field}") from None
    return trace, sampling


def _empty_trace_knobs(cfg: DictConfig) -> str:
    """The knobs that made a trace empty: those set to 0 (trace.num_requests=0; a seed is not
    a size), else every knob of the trace option (trace.path='empty.jsonl')."""
    raw = OmegaConf.to_container(cfg.trace, resolve=True)
    knobs = {f"trace.{k}": v for k, v in raw.items() if k != "generator"}
    # a generator parameter set directly, not through a knob's interpolation
    given = OmegaConf.to_container(cfg.trace.generator, resolve=False)
    knobs |= {
        f"trace.generator.{k}": raw["generator"][k]
        for k, v in given.items()
        if k[0] != "_" and not (isinstance(v, str) and "${" in v)
    }
    zero = [
        f"{k}=0" for k, v in knobs.items() if v == 0 and type(v) is int and not k.endswith("seed")
    ]
    return ", ".join(zero or [f"{k}={v!r}" for k, v in knobs.items() if k.count(".") == 1])


def warm_up(
    engine: LLMEngine, trace: Trace, num_requests: int, sampling: Callable[..., SamplingParams]
) -> None:
    """Run the trace's first ``num_requests`` prompts at once, at most ``WARMUP_TOKENS``
    output tokens each, through ``engine``: batched prefills and decodes of the trace's own
    shapes. The engine is thrown away after."""
    for req in trace.requests[:num_requests]:
        params = replace(
            sampling_params(req, sampling), max_tokens=min(WARMUP_TOKENS, req.max_tokens)
        )
        engine.add_request(f"warmup-{req.request_id}", req.prompt_token_ids, params)
    while engine.has_unfinished_requests():
        engine.step()


def build_component(node: DictConfig) -> Any:
    """``instantiate``, re-raising the component's own error (TraceError, ValueError naming
    the setting) rather than Hydra's wrapper around it."""
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as e:
        if e.__cause__ is None:
            raise
        raise e.__cause__ from None


def _tables(engine: LLMEngine):
    steps = pd.DataFrame(engine.recorder.take_step_columns(), copy=False)  # not copied
    requests = pd.DataFrame(engine.recorder.request_columns(), copy=False)
    return requests_frame(requests), steps_frame(steps)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch scheduler's time limit, ``timeout``) stops a run as Ctrl-C
    does: the finished requests' rows are written first. It also reaches a run started in
    the background by a non-interactive shell, which ignores SIGINT."""


@contextmanager
def _terminable() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` while the job runs (a launcher's worker gets its own
    handler back after; a job run off the main thread, where Python takes no signal
    handler, keeps the default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def _kept(out: Path) -> str:
    """What an interrupted run left in ``out``: the finished requests' rows once the replay
    has begun (``run`` writes them), else nothing."""
    if not (out / results.REQUESTS_FILE).exists():
        return f"stopped before the replay; nothing kept in {out}"
    done = len(results.load_tables(out)[0])
    return (
        f"the {done} finished requests' rows kept in {out / results.REQUESTS_FILE} and "
        f"{results.STEPS_FILE}; no summary.json, so a sweep re-run repeats this run"
    )


def finished_run(output_dir: str | Path, overrides: Sequence[str], ignore: Sequence[str] = ()):
    """The summary of a finished run of the same overrides in ``output_dir``, else None.

    Raises ``SweepMismatchError`` if the folder holds a run of other overrides: skipping it
    would silently report the wrong configuration.
    """
    done = results.read_summary(output_dir)
    if done is None:
        return None

    def key(items: Sequence[str]) -> set[str]:
        return {o for o in items if results.override_key(o) not in ignore}

    if key(done.get("overrides", [])) != key(overrides):
        raise SweepMismatchError(
            f"{output_dir} already holds a finished run of {sorted(done.get('overrides', []))}, "
            f"not {sorted(overrides)}: use a new sweep_id (or delete that folder)"
        )
    return done


PARTIAL = ".partial"  # conf/config.yaml's hydra.sweep.subdir: a sweep job being written


def job_folder(output_dir: Path) -> Path:
    """Where a job's folder goes once it ends: a sweep job written in
    ``<sweep>/.partial/<name>`` goes to ``<sweep>/<name>``; any other folder stays put. A
    name may hold ``/`` (an override whose value is a path, ``engine.profile=results/...``):
    it is then several folders deep under ``.partial``."""
    parts = output_dir.parts
    if PARTIAL not in parts:
        return output_dir
    at = len(parts) - 1 - parts[::-1].index(PARTIAL)
    return Path(*parts[:at], *parts[at + 1 :])


def publish(written: Path, final: Path) -> None:
    """Move a job's folder from where it was written to ``final`` in one rename (a reader
    sees the whole job or none of it), replacing an earlier failed attempt's folder; the
    folders a name with ``/`` made under ``.partial`` go once empty."""
    if written == final or not written.exists():
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    _move(written, final)
    parent = written.parent
    while parent.name != PARTIAL and parent != parent.parent:
        try:
            parent.rmdir()  # an emptied folder of a name's path; stops at one in use
        except OSError:
            break
        parent = parent.parent


def _move(written: Path, final: Path) -> None:
    if final.exists():
        replaced = written.with_name(f"{written.name}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)  # left by a process killed right here
        os.rename(final, replaced)
        os.rename(written, final)
        shutil.rmtree(replaced)
    else:
        os.rename(written, final)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    """The ``kvbench`` console script: one job of a run or of a sweep."""
    hc = HydraConfig.get()
    written = Path(hc.runtime.output_dir)
    out = job_folder(written)
    overrides = list(hc.overrides.task)
    if hc.mode == RunMode.MULTIRUN:
        ignore = list(hc.job.config.override_dirname.exclude_keys)
        try:
            done = finished_run(out, overrides, ignore)
        except results.ResultFileError as e:  # a damaged summary.json: the job cannot be judged
            shutil.rmtree(written, ignore_errors=True)
            print(f"kvbench: error: {e}", file=sys.stderr)
            sys.exit(2)
        except SweepMismatchError:
            shutil.rmtree(written, ignore_errors=True)
            raise
        if done is not None:
            log.info("skipped: %s already holds a finished run", out)
            shutil.rmtree(written, ignore_errors=True)  # only Hydra's config and this log line
            return done
    choices = {g: c for g, c in hc.runtime.choices.items() if not g.startswith("hydra")}
    if "joblib" in hc.launcher.get("_target_", "").lower() and hc.launcher.get("n_jobs") != 1:
        log.warning(
            "hydra/launcher=joblib runs this sweep's jobs in parallel on %s cores: every "
            "measured step includes their contention. For timing figures run jobs one at a "
            "time (the default launcher, or hydra.launcher.n_jobs=1).",
            os.cpu_count(),
        )
    try:
        with _terminable():
            try:
                summary = run(cfg, written, overrides=overrides, choices=choices)
            finally:  # finished or failed, the job's folder goes into place whole
                publish(written, out)
    except UsageError as e:
        # SystemExit passes through Hydra's handler, which would print a traceback.
        print(f"kvbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # what was kept, not where Python happened to be
        terminated = isinstance(e, Terminated)
        stop = "terminated" if terminated else "interrupted"
        print(f"kvbench: {stop}: {_kept(out)}", file=sys.stderr)
        # 128 + the signal, as a shell reports it
        sys.exit(128 + (signal.SIGTERM if terminated else signal.SIGINT))
    if not summary["completed"]:  # every figure would be n/a: say why instead
        print(f"results: {out}")
        outcome = format_outcome(results.load_tables(out)[0])
        print(f"kvbench: error: {outcome}; see abort_reason in {out / results.REQUESTS_FILE}",
              file=sys.stderr)  # fmt: skip
        sys.exit(1)
    print(format_summary(summary))
    if summary["aborted"]:
        print(format_outcome(results.load_tables(out)[0]))
    print(f"results: {out}")
    return summary


if __name__ == "__main__":
    main()
