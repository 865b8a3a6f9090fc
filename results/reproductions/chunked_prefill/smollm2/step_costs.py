"""Step costs (decode-only against chunk-carrying steps, from steps.parquet), decode stalls
and latencies of the SmolLM2 chunked_prefill runs at one rate, or of those whose label (budget,
sweep id or the single run's start time) contains one of SELECT's comma-separated strings:
    python step_costs.py results/chunked_prefill RATE [OUT.csv] [SELECT]
The stall threshold is 5 x the median decode-only step of the selected runs pooled."""

import sys

import numpy as np
import pandas as pd

from harness.analysis import metrics, report, results

folder = sys.argv[1]
rate = sys.argv[2]
out = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
select = sys.argv[4].split(",") if len(sys.argv) > 4 else None
runs = report.runs(folder)
runs = runs[runs["model_name"].str.contains("SmolLM2", case=False)]
runs = runs[runs["trace.rate"].astype(str) == rate]
kind = runs["scheduler"].astype(str).where(runs["scheduler"].astype(str) == "fcfs", "")
runs = runs.assign(
    label=[
        ("prefill-first FCFS" if k == "fcfs" else f"budget {int(float(c))}")
        + f" ({str(sid) if str(sid) != 'nan' else 'run ' + str(d).split('/')[-1][11:16]})"
        for k, c, sid, d in zip(
            kind, runs["scheduler.max_chunk"], runs["sweep_id"], runs["run_dir"], strict=True
        )
    ]
)
if select:
    runs = runs[[any(x in label for x in select) for label in runs["label"]]]
tables = {r.label: results.load_tables(r.run_dir) for r in runs.itertuples()}
decode_only = pd.concat(
    s[(s.decode_tokens > 0) & (s.prefill_tokens == 0)] for _, s in tables.values()
)
tau = 5 * metrics.decode_step_time(decode_only)
print(f"tau = {tau * 1e3:.1f} ms (5 x pooled decode-only median {tau / 5 * 1e3:.1f} ms)")
rows = []
for (label, (req, st)), r in zip(tables.items(), runs.itertuples(), strict=True):
    dec = st[(st.decode_tokens > 0) & (st.prefill_tokens == 0)]
    mix = st[(st.decode_tokens > 0) & (st.prefill_tokens > 0)]
    pre = st[(st.decode_tokens == 0) & (st.prefill_tokens > 0)]
    by_batch = dec.groupby("decode_tokens").duration.median()
    matched = mix.duration / mix.decode_tokens.map(by_batch)
    gaps = metrics.itl_gaps(req)
    stalls = metrics.decode_stalls(req, tau)
    rows.append(
        {
            "run": label,
            "steps": len(st),
            "decode_only_n": len(dec),
            "decode_only_ms": dec.duration.median() * 1e3,
            "decode_batch_p50": dec.batch_size.median(),
            "mixed_n": len(mix),
            "mixed_ms": mix.duration.median() * 1e3,
            "mixed_max_ms": mix.duration.max() * 1e3 if len(mix) else np.nan,
            "mixed_prefill_tok_p50": mix.prefill_tokens.median(),
            "mixed_2groups_frac": (mix.row_groups >= 2).mean() if len(mix) else np.nan,
            "ratio_mixed_over_decode": mix.duration.median() / dec.duration.median(),
            "ratio_matched": matched.median(),
            "matched_n": int(matched.notna().sum()),
            "prefill_only_n": len(pre),
            "prefill_only_ms": pre.duration.median() * 1e3,
            "itl_gaps": len(gaps),
            "stalls": stalls,
            "stall_pct": 100 * stalls / len(gaps),
            "itl_p50_ms": r.itl_p50 * 1e3,
            "itl_p99_ms": r.itl_p99 * 1e3,
            "ttft_p50_ms": r.ttft_p50 * 1e3,
            "ttft_p99_ms": r.ttft_p99 * 1e3,
            "tpot_p50_ms": r.tpot_p50 * 1e3,
            "output_tok_s": r.output_throughput,
            "completed": r.completed,
            "duration_s": r.duration,
        }
    )
t = pd.DataFrame(rows)
pd.set_option("display.width", 250)
pd.set_option("display.max_columns", 40)
print(t.round(2).to_string())
# steps carrying a chunk, by chunk size bucket, per run
for label, (_, st) in tables.items():
    mix = st[(st.decode_tokens > 0) & (st.prefill_tokens > 0)].copy()
    if len(mix):
        mix["bucket"] = pd.cut(mix.prefill_tokens, [0, 32, 64, 128, 256, 512, 2048])
        g = mix.groupby("bucket", observed=True).duration.agg(["count", "median"])
        g["median"] *= 1e3
        print(label, g.round(1).to_dict("index"))
if out:
    t.to_csv(out, index=False)
