"""NVIDIA Dynamo's mocker replaying a Mooncake trace file offline: the ``dynamo`` benchmark's
other side, run as a script by an interpreter that has ``ai-dynamo-runtime`` (so it imports
nothing of kvbench, and nothing kvbench's environment has).

    PYTHON dynamo_replay.py --check                 # prints the runtime's version
    PYTHON dynamo_replay.py TRACE.jsonl ENGINE_JSON

``ENGINE_JSON``: the mocker's engine arguments (``{"block_size": 16, ...}``). Prints one JSON
line: Dynamo's own counts from its summary, among them ``wall_time_ms``, its simulation's
wall time (the file's parsing left out: another 16-19 % of the call at 2,000 azure_like
requests). Dynamo's offline replay is a discrete-event
simulation on its own clock (its timing model prices each step), in Rust; it is called
through ``dynamo._core``, which ``ai-dynamo``'s ``dynamo.replay.api`` wraps (that package
pulls in kubernetes, redis, transformers and more: the runtime wheel alone is enough).
A missing package is one line on stderr and exit status 3.
"""

import json
import sys
from importlib import metadata

PACKAGE = "ai-dynamo-runtime"
# Dynamo's summary keys this script passes on (the rest are its latency percentiles, priced
# by its own timing model: not comparable with kvbench's).
KEYS = ("num_requests", "completed_requests", "total_input_tokens", "total_output_tokens",
        "wall_time_ms")  # fmt: skip


def main(argv: list[str]) -> None:
    try:
        from dynamo._core import run_mocker_trace_replay
    except ImportError as e:
        print(f"{sys.executable} has no {PACKAGE} ({e}): pip install {PACKAGE}==1.6.1 there "
              "(Linux wheels only)", file=sys.stderr)  # fmt: skip
        sys.exit(3)
    if argv == ["--check"]:
        print(json.dumps({"version": metadata.version(PACKAGE)}))
        return
    trace, engine = argv
    args = json.loads(engine)
    result = run_mocker_trace_replay(
        [trace], extra_engine_args={"engine": args}, trace_block_size=args["block_size"]
    )
    print(json.dumps({k: result.summary.get(k) for k in KEYS}))


if __name__ == "__main__":
    main(sys.argv[1:])
