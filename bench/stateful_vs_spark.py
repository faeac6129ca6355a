"""weir and Spark side by side on stateful streaming queries, on the same files.

Called by bench/stateful_vs_spark.sh. Input: 2,000,000 JSON order rows in 200 files
(`weir gen --seed 7 --keys 500000`, event times 100 ms apart, up to 60 s late), 20 files
per trigger. Two queries, each with withWatermark(updated_at, 10 minutes):
- dedupe: dropDuplicatesWithinWatermark(order_id) -> Parquet;
- window: count per status and 1-minute tumbling window, output mode update -> Parquet.
Measured as bench/spark_vs_weir.py measures (rows/s over first batch start to last batch
end, median triggerExecution of the data batches, peak RSS of the process tree), median over
alternating rounds. The windowed counts are compared in every round (the newest per window
of all update rows). Which copy of a key a dedupe keeps depends on which files make a batch
and on the order of rows inside it: Spark orders files by mtime alone (files written in one
clock tick tie) and packs a batch's files by size; the dedupe outputs are compared on
their own input where each batch is one file (AGREE: 20 files of 5,000 rows over 20,000 keys,
one per trigger): the same (order_id, updated_at) rows from both.
"""
import argparse
import os
import datetime as dt
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import spark_vs_weir as base

HERE = Path(__file__).resolve().parent
WORKLOAD = dict(files=200, rows_per_file=10_000, keys=500_000, per_trigger=20)
AGREE = dict(files=20, rows_per_file=5_000, keys=20_000, per_trigger=1)


WATERMARK = '[transform]\nwith-watermark = { column = "updated_at", delay = "10 minutes" }\n'
STEPS = {
    "dedupe": WATERMARK + 'drop-duplicates-within-watermark = ["order_id"]',
    "window": WATERMARK + '\n[transform.aggregate]\ngroup-by = ["status"]\n'
              'window = { column = "updated_at", size = "1 minute" }\n'
              'aggregates = ["count(*) AS n"]\noutput-mode = "update"',
}


def outputs(python, out_dir, kind):
    """What the run wrote: dedupe -> row count; window -> sorted final rows."""
    code = f"""
import os, pyarrow.parquet as pq, pyarrow as pa, json
paths = []
for root, _, files in os.walk({str(out_dir)!r}):
    paths += [os.path.join(root, f) for f in files if f.endswith('.parquet')]
tables = [pq.read_table(p) for p in paths]
tables = [t for t in tables if t.num_rows]
if {kind!r} == 'dedupe':
    rows = sorted([r['order_id'], r['updated_at'].replace(tzinfo=None).isoformat()] for t in tables
                  for r in t.select(['order_id', 'updated_at']).to_pylist())
    print(json.dumps(rows))
else:
    final = {{}}
    for t in tables:
        for r in t.select(['status', 'window_start', 'n']).to_pylist():
            k = (r['status'], int(r['window_start'].timestamp()))
            final[k] = max(final.get(k, 0), r['n'])
    print(json.dumps(sorted([list(k) + [v] for k, v in final.items()])))
"""
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True,
                                     text=True).stdout)


def run(engine, a, data, runs, kind, i, w=WORKLOAD):
    work = runs / f"{engine}-{kind}-{i}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    if engine == "weir":
        toml = work / "pipeline.toml"
        toml.write_text(base.PIPELINE.format(name=kind, work=work, input=data,
                                             per_trigger=w["per_trigger"],
                                             transform=STEPS[kind]))
        cmd = [a.weir, "run", toml, "--quiet", "--progress", progress]
    else:
        cmd = [a.python, HERE / "spark_stateful_job.py", kind, data, work,
               str(w["per_trigger"]), progress]
    launch, wall, rss = base.run_measured(cmd, work / "log.txt")
    f = base.figures(progress, launch, w["files"] * w["rows_per_file"])
    return dict(f, wall_s=wall, peak_rss_mb=rss), outputs(a.python, work / "out", kind)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weir", required=True)
    ap.add_argument("--python", required=True, help="the virtualenv's python with pyspark")
    ap.add_argument("--work", default="/tmp/weir-spark-stateful-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", help="write the results to this Markdown file")
    ap.add_argument("--command", default="bench/stateful_vs_spark.sh")
    a = ap.parse_args()
    work = Path(a.work)
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    data = base.generate(a.weir, work / "data", "stateful", WORKLOAD)
    results = {(e, k): [] for e in ("weir", "spark") for k in STEPS}
    agree = []
    small = base.generate(a.weir, work / "data", "agree", AGREE)
    # Files written within one clock tick share an mtime, and Spark orders files by mtime
    # alone: give them distinct ones, in name order, so both engines take the same files.
    for n, f in enumerate(sorted(small.glob("*.json"))):
        os.utime(f, (1_700_000_000 + n, 1_700_000_000 + n))
    outs = {e: run(e, a, small, runs, "dedupe", "agree", AGREE)[1] for e in ("weir", "spark")}
    if outs["weir"] != outs["spark"]:
        only_w = [r for r in outs["weir"] if r not in outs["spark"]][:5]
        only_s = [r for r in outs["spark"] if r not in outs["weir"]][:5]
        sys.exit(f"dedupe, one file per batch: weir passed {len(outs['weir'])} rows, Spark "
                 f"{len(outs['spark'])}; only weir: {only_w}; only Spark: {only_s}")
    agree.append(f"dedupe, one file per batch: the same {len(outs['weir']):,} rows from both")
    for i in range(a.rounds):
        for kind in STEPS:
            outs = {}
            for engine in ("weir", "spark"):
                t = time.time()
                r, outs[engine] = run(engine, a, data, runs, kind, i)
                results[(engine, kind)].append(r)
                print(f"round {i + 1} {engine:5} {kind:6} {time.time() - t:6.1f} s  "
                      + json.dumps({k: round(v, 2) for k, v in r.items()}), flush=True)
            if kind == "dedupe":
                agree.append(f"dedupe, 20 files per batch: weir passed {len(outs['weir']):,} "
                             f"rows, Spark {len(outs['spark']):,}")
                continue
            if outs["weir"] != outs["spark"]:
                sys.exit(f"{kind}: weir and Spark disagree: "
                         f"{str(outs['weir'])[:300]} vs {str(outs['spark'])[:300]}")
            agree.append(f"window: {len(outs['weir']):,} windows, equal final counts")

    def pair(kind, key):
        return (base.median_of(results[("weir", kind)], key),
                base.median_of(results[("spark", kind)], key))

    rows = []
    for kind, label in (("dedupe", "dropDuplicatesWithinWatermark(order_id)"),
                        ("window", "count per status and 1-minute window, update mode")):
        rows += [
            (f"{label}: rows/s", pair(kind, "rows_per_s"), "{:,.0f}"),
            (f"{label}: median triggerExecution, 200,000-row batches (ms)",
             pair(kind, "median_trigger_ms"), "{:.0f}"),
            (f"{label}: peak RSS (MB, process tree)", pair(kind, "peak_rss_mb"), "{:.0f}"),
        ]
    lines = ["| measure | weir | Spark | weir/Spark |", "|---|---:|---:|---:|"]
    for label, (wv, sv), fmt in rows:
        lines.append(f"| {label} | {fmt.format(wv)} | {fmt.format(sv)} | {wv / sv:.3f} |")
    table = "\n".join(lines)
    print()
    print(table)
    if a.write:
        spark_version = subprocess.run(
            [a.python, "-c", "import pyspark; print(pyspark.__version__)"],
            capture_output=True, text=True).stdout.strip()
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        Path(a.write).write_text(f"""# Stateful benchmarks: weir and Spark side by side

Written by `{a.command}` on {when}; every figure comes from that one run (median of
{a.rounds} alternating rounds per engine). Do not edit the numbers by hand.

- Machine: {base.machine()}.
- weir: release build, `weir run` on the pipeline in `bench/stateful_vs_spark.py`.
- Spark: PySpark {spark_version}, `local[2]`, `spark.sql.shuffle.partitions=2`, UI off,
  default state store; the job is `bench/spark_stateful_job.py`.

Input: 2,000,000 JSON order rows in 200 files (`weir gen --seed 7 --keys 500000`: event
times 100 ms apart, up to 60 s late), 20 files per trigger, watermark delay 10 minutes,
availableNow, output written as Parquet by foreachBatch. Outputs compared (see the script's
docstring for why the dedupe is compared on one file per batch):
{chr(10).join('- ' + x for x in sorted(set(agree)))}

{table}

A ratio below 1 means weir needs less of it (time, memory); for rows/s, above 1 means weir is
faster.
""")
        print(f"\nwrote {a.write}")


if __name__ == "__main__":
    main()
