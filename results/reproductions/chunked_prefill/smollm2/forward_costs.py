"""A decode-only forward against the same decodes with a 64-token chunk, on SmolLM2 (or the
tiny random model), kvbench's ModelRunner, interleaved rounds (harness/bench/padding.py):
    python forward_costs.py [REPEATS] [smollm2 | tiny]"""

import sys

import numpy as np

import harness  # noqa: F401
from harness.bench.padding import BLOCK_SIZE, make_rows, time_forwards
from harness.engine.kv_cache import KVArena
from harness.engine.model_runner import ModelRunner
from harness.platform.models import random_model
from harness.platform.smollm2 import load_smollm2

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 7
tiny = len(sys.argv) > 2 and sys.argv[2] == "tiny"
loaded = random_model("llama", "tiny", seed=0) if tiny else load_smollm2(weights="auto", cache=None)
runner = ModelRunner(loaded, KVArena.for_model(loaded, 512, BLOCK_SIZE))
rng = np.random.default_rng(0)
rows = make_rows(
    [(1, 300), (64, 0), (64, 512), (1, 300), (1, 300), (1, 300)], rng, loaded.vocab_size
)
dec, c0, c512, dec4 = rows[:1], rows[1:2], rows[2:3], [rows[0]] + rows[3:]
cases = {
    "decode x1": dec,
    "decode x4": dec4,
    "chunk@0": c0,
    "chunk@512": c512,
    "chunk@0 + decode x1": c0 + dec,
    "chunk@512 + decode x1": c512 + dec,
    "chunk@512 + decode x4": c512 + dec4,
}
times = time_forwards(runner, list(cases.values()), repeats)
for name, t in zip(cases, times, strict=True):
    print(f"{name:<24} {t * 1e3:8.1f} ms")
