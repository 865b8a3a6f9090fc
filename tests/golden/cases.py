"""The golden replays: small configs over every allocator, policy and feature, whose
``requests.parquet`` and ``steps.parquet`` a redesign must leave identical column by column
(tests/golden/test_golden_tables.py). ``python tests/golden/cases.py`` rewrites the goldens:
only for an intended change of a figure, named in the same commit with its size and cause.

Model-clock cases are deterministic in every column (``sliding_window_model`` prices a window
model's steps with a roofline of its own, kept beside the goldens). Cases that need the model
(beam search, kv_bits 4) run offline (every request at t=0, so no schedule depends on a measured
duration) and are compared without the measured columns (``MEASURED``).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROFILE = str(ROOT / "results/baselines/profile-llama-tiny.json")
# tiny_gemma3's roofline on an M4 Max, kept here so that a device sheet's edit does not move
# the window model's golden: save(derive(random_model("gemma3_text", "tiny", seed=0,
# dtype="float32").shape(), "m4-max", block_size=16), path) (harness/costmodel/roofline.py).
GEMMA3_PROFILE = str(HERE / "profile-tiny-gemma3-m4-max.json")
# The tiny Llama's, made the same way: a roofline prices disk loads (a measured profile has no
# disk bandwidth), so the disk tier's case runs on it.
LLAMA_ROOFLINE = str(HERE / "profile-tiny-llama-m4-max.json")


def model_clock(profile: str) -> tuple[str, ...]:
    """A replay on the model clock, priced by ``profile``."""
    return ("engine.clock=model", f"engine.profile={profile}", "warmup=0", "progress=false")


MODEL = model_clock(PROFILE)
REAL = ("trace=offline", "trace.num_requests=12", "warmup=0", "progress=false")
SMALL = ("engine.num_blocks=48",)  # an arena that preempts
# One token in 20 stops a request (stop_token_ids): most stop before their max_tokens.
STOPS = ("+sampling.stop_token_ids=[" + ",".join(map(str, range(3, 1024, 20))) + "]",)
# The prefix cache on a multi-turn trace in an arena that evicts, its blocks kept below it.
TIERED = ("allocator=radix", "trace=multi_turn", "trace.num_conversations=12",
          "engine.num_blocks=64")  # fmt: skip
TIERS = (*MODEL, *TIERED, "kv_tier=host", "kv_tier.host_blocks=24")

# name -> overrides (applied after tests/support.py's TINY ones)
CASES: dict[str, tuple[str, ...]] = {
    **{
        f"alloc_{a}": (*MODEL, f"allocator={a}", "trace=shared_prefix", "trace.users_per_prompt=6")
        for a in (
            "free_list", "contiguous", "contiguous_max_len", "contiguous_oracle",
            "contiguous_pow2", "buddy", "radix",
        )
    },  # fmt: skip
    "fcfs_poisson": (*MODEL, *SMALL, "trace=poisson", "trace.num_requests=40"),
    "priority_recompute": (*MODEL, *SMALL, "scheduler=priority", "trace=poisson",
                           "trace.num_requests=40"),
    "priority_swap": (*MODEL, *SMALL, "scheduler=priority", "scheduler.preemption_mode=swap",
                      "trace=poisson", "trace.num_requests=40"),
    "chunked_prefill": (*MODEL, *SMALL, "scheduler=chunked_prefill", "scheduler.max_chunk=32",
                        "trace=poisson", "trace.num_requests=40", "allocator=radix"),
    "spec_draft": (*MODEL, "speculative=draft", "trace=poisson", "trace.num_requests=16"),
    "spec_layerskip": (*REAL, "speculative=layerskip"),
    "spec_ngram": (*REAL, "speculative=ngram"),
    "n2": (*MODEL, "sampling.n=2", "allocator=radix", "trace=poisson", "trace.num_requests=16"),
    "n2_small_arena": (*MODEL, *SMALL, "sampling.n=2", "trace=poisson", "trace.num_requests=24"),
    "multi_turn_radix": (*MODEL, "allocator=radix", "trace=multi_turn",
                         "trace.num_conversations=8"),
    "azure_like": (*MODEL, "trace=azure_like", "trace.num_requests=60", "engine.num_blocks=512"),
    "mooncake_like": (*MODEL, "allocator=radix", "trace=mooncake_like",
                      "trace.num_requests=30", "engine.num_blocks=512"),
    "beam": (*REAL, "sampling=beam", "allocator=radix"),
    "beam_small_arena": (*REAL, *SMALL, "sampling=beam", "trace.num_requests=8"),
    "kv_bits4": (*REAL, "engine.kv_bits=4", "engine.kv_group_size=32", "allocator=buddy"),
    "sliding_window": (*REAL, "model=tiny_gemma3", "allocator=radix"),
    "sliding_window_model": ("engine.clock=model", f"engine.profile={GEMMA3_PROFILE}",
                             *REAL, *SMALL, "model=tiny_gemma3", "scheduler=priority",
                             "scheduler.preemption_mode=swap"),
    "swap_real": (*REAL, *SMALL, "scheduler=priority", "scheduler.preemption_mode=swap"),
    "tiers_host": TIERS,
    "tiers_write_through": (*TIERS, "kv_tier.write_policy=write_through"),
    # Every lower-tier hit loaded (min_load_ratio 0: recomputing the tiny model is cheaper).
    "tiers_host_disk": (*model_clock(LLAMA_ROOFLINE), *TIERED, "kv_tier=host_disk",
                        "kv_tier.host_blocks=8", "kv_tier.disk_blocks=1024",
                        "kv_tier.min_load_ratio=0.0"),
    "stops_model": (*MODEL, *SMALL, "trace=poisson", "trace.num_requests=40", *STOPS),
    "pipeline_real": (*REAL, "engine.pipeline=true"),
    "stops_pipeline": (*REAL, "engine.pipeline=true", *STOPS),
}  # fmt: skip

# Columns a measuring clock fills from timings: left out where the case runs the model.
MEASURED = {
    "requests": ("first_scheduled_time", "first_token_time", "finish_time", "token_times"),
    "steps": ("start_time", "duration", "forward_time", "build_time", "swap_time", "tier_time",
              "mlx_active_bytes", "mlx_peak_bytes"),
}  # fmt: skip


def measured(name: str) -> bool:
    """The case runs the model (a measuring clock)."""
    return "engine.clock=model" not in CASES[name]


def run_case(name: str, out: Path) -> dict:
    """Run case ``name`` into ``out``; returns its tables by name (pandas frames)."""
    import pandas as pd
    from support import compose_config

    from harness.cli.run import run

    run(compose_config(CASES[name]), out)
    tables = {t: pd.read_parquet(out / f"{t}.parquet") for t in ("requests", "steps")}
    if measured(name):
        tables = {t: df.drop(columns=list(MEASURED[t])) for t, df in tables.items()}
    return tables


def main(names: list[str]) -> None:
    import tempfile

    for name in names or list(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            tables = run_case(name, Path(tmp))
        for t, df in tables.items():
            df.to_parquet(HERE / f"{name}.{t}.parquet")
        print(name, {t: len(df) for t, df in tables.items()})


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    import os

    os.environ.setdefault("MKL_NUM_THREADS", "1")
    main(sys.argv[1:])
