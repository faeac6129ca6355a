"""weir and Spark Structured Streaming side by side, on the same files and the same query.

Called by bench/spark_vs_weir.sh (which makes the virtualenv with pyspark and builds weir).

Two workloads, run alternately (weir, Spark, weir, Spark, ... for --rounds rounds; with
--weir-python also the same job written in Python on the `weir` package, bench/weir_python_job.py):
- fixed-cost: 50 files of 10 rows, maxFilesPerTrigger 1: the per-batch overhead.
- throughput: 2,000,000 rows in 200 files (500,000 order ids), maxFilesPerTrigger 20.
Query: file source (JSON) -> foreachBatch: newest row per order_id by a window -> Parquet.

Measured from outside, the same way for both:
- per-batch fixed cost: median durationMs.triggerExecution of the fixed-cost batches;
- rows/s: input rows / (end of the last batch - start of the first batch), throughput run;
- peak RSS: the largest sum of VmRSS over the process and all its children (the Python
  driver and the JVM for Spark), sampled every 50 ms;
- time to first batch: from launching the process to the end of the first batch
  (timestamp + triggerExecution of batch 0), fixed-cost run.
Each figure is the median over the rounds. Writes the table to stdout and, with --write,
BENCHMARKS.md.
"""
import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKLOADS = {
    "fixed-cost": dict(files=50, rows_per_file=10, keys=100, per_trigger=1),
    "throughput": dict(files=200, rows_per_file=10_000, keys=500_000, per_trigger=20),
}

PIPELINE = """[query]
name = "bench-{name}"
checkpoint = "{work}/checkpoint"
trigger = "available-now"

[source]
type = "files"
path = "{input}"
format = "json"
schema = ["order_id bigint", "status string", "amount double", "updated_at timestamp"]
max-files-per-trigger = {per_trigger}

{transform}

[[sink]]
type = "parquet"
path = "{work}/out"
"""

NEWEST_PER_ORDER = (
    '[transform]\nsql = "SELECT order_id, status, amount, updated_at FROM (SELECT *, '
    'row_number() OVER (PARTITION BY order_id ORDER BY updated_at DESC) AS rn FROM batch) '
    'WHERE rn = 1"'
)


def process_tree(pid):
    """pid and all its live descendants, each as (pid, start time) so a reused pid is not
    taken for a process seen before."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append((int(d), int(fields[19])))
        except (OSError, IndexError, ValueError):
            pass
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            found.append(c)
            todo.append(c[0])
    return found


def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_measured(cmd, log, env=None):
    """Runs cmd; returns (launch time as epoch seconds, wall seconds, peak tree RSS MB).

    The run ends when the process and every process it started have exited: Spark's JVM
    outlives its Python driver by a few seconds, and the next run must not share the cores
    with its shutdown (nor is a run over before its memory is given back)."""
    launch = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        seen = {}
        peak = 0
        while True:
            alive = proc.poll() is None
            if alive:
                for p, st in process_tree(proc.pid):
                    seen[p] = st
            live = [p for p, st in seen.items() if start_time(p) == st]
            if not alive and not live:
                break
            peak = max(peak, (rss_kb(proc.pid) if alive else 0) + sum(map(rss_kb, live)))
            time.sleep(0.05)
    wall = time.time() - launch
    if proc.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}); see {log}")
    return launch, wall, peak / 1024


def parse_ts(s):
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def figures(progress_file, launch, expected_rows):
    batches = [json.loads(l) for l in open(progress_file) if l.strip()]
    batches = [b for b in batches if b.get("numInputRows", 0) > 0]
    rows = sum(b["numInputRows"] for b in batches)
    if rows != expected_rows:
        sys.exit(f"{progress_file}: {rows} input rows in the progress, expected {expected_rows}")
    starts = [parse_ts(b["timestamp"]) for b in batches]
    ends = [s + b["durationMs"]["triggerExecution"] / 1000 for s, b in zip(starts, batches)]
    return dict(
        batches=len(batches),
        median_trigger_ms=statistics.median(b["durationMs"]["triggerExecution"] for b in batches),
        rows_per_s=rows / max(ends[-1] - starts[0], 1e-3),
        first_batch_s=ends[0] - launch,
    )


def generate(weir, data, name, w):
    d = data / name
    if not d.exists():
        subprocess.run(
            [weir, "gen", "--dir", d, "--files", str(w["files"]), "--rows-per-file",
             str(w["rows_per_file"]), "--keys", str(w["keys"]), "--seed", "7"],
            check=True, stdout=subprocess.DEVNULL)
    return d


def run_weir(weir, data, runs, name, w, i):
    work = runs / f"weir-{name}-{i}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    toml = work / "pipeline.toml"
    toml.write_text(PIPELINE.format(name=name, work=work, input=data / name,
                                    transform=NEWEST_PER_ORDER,
                                    per_trigger=w["per_trigger"]))
    progress = work / "progress.jsonl"
    launch, wall, rss = run_measured(
        [weir, "run", toml, "--quiet", "--progress", progress], work / "log.txt")
    f = figures(progress, launch, w["files"] * w["rows_per_file"])
    return dict(f, wall_s=wall, peak_rss_mb=rss)


def run_python_job(job, python, data, runs, name, w, i):
    """bench/<job>.py (spark_job or weir_python_job) on workload `name`, round i."""
    work = runs / f"{job}-{name}-{i}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    launch, wall, rss = run_measured(
        [python, HERE / f"{job}.py", data / name, work, str(w["per_trigger"]), progress],
        work / "log.txt")
    f = figures(progress, launch, w["files"] * w["rows_per_file"])
    return dict(f, wall_s=wall, peak_rss_mb=rss)


def median_of(results, key):
    return statistics.median(r[key] for r in results)


def machine():
    cpu = "unknown CPU"
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()
    return (f"{os.cpu_count()} cores ({cpu}), {mem_kb / 1024 / 1024:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}; {java[0] if java else 'java ?'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weir", required=True)
    ap.add_argument("--python", required=True, help="the virtualenv's python with pyspark")
    ap.add_argument("--weir-python", help="a python with the weir wheel: also run the Python job")
    ap.add_argument("--work", default="/tmp/weir-spark-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", help="write the results to this Markdown file")
    ap.add_argument("--command", default="bench/spark_vs_weir.sh")
    a = ap.parse_args()
    work = Path(a.work)
    data, runs = work / "data", work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    engines = ["weir"] + (["weir-python"] if a.weir_python else []) + ["spark"]
    results = {(e, n): [] for e in engines for n in WORKLOADS}
    for name, w in WORKLOADS.items():
        generate(a.weir, data, name, w)
    for i in range(a.rounds):
        for name, w in WORKLOADS.items():
            for engine in engines:
                t = time.time()
                if engine == "weir":
                    r = run_weir(a.weir, data, runs, name, w, i)
                elif engine == "weir-python":
                    r = run_python_job("weir_python_job", a.weir_python, data, runs, name, w, i)
                else:
                    r = run_python_job("spark_job", a.python, data, runs, name, w, i)
                results[(engine, name)].append(r)
                print(f"round {i + 1} {engine:11} {name:10} {time.time() - t:6.1f} s  "
                      + json.dumps({k: round(v, 2) for k, v in r.items()}), flush=True)

    def pair(name, key):
        return tuple(median_of(results[(e, name)], key) for e in engines)

    rows = [
        ("per-batch fixed cost: median triggerExecution, 10-row files, 1 per trigger (ms)",
         pair("fixed-cost", "median_trigger_ms"), "{:.0f}"),
        ("rows/s, 2,000,000 rows in 200 files, 20 files per trigger",
         pair("throughput", "rows_per_s"), "{:,.0f}"),
        ("median triggerExecution, 200,000-row batches (ms)",
         pair("throughput", "median_trigger_ms"), "{:.0f}"),
        ("peak RSS, throughput run (MB, process tree)", pair("throughput", "peak_rss_mb"), "{:.0f}"),
        ("peak RSS, fixed-cost run (MB, process tree)", pair("fixed-cost", "peak_rss_mb"), "{:.0f}"),
        ("time to first batch: launch to end of batch 0, fixed-cost run (s)",
         pair("fixed-cost", "first_batch_s"), "{:.2f}"),
        ("wall time of the whole throughput run incl. start-up (s)",
         pair("throughput", "wall_s"), "{:.1f}"),
    ]
    if a.weir_python:
        lines = ["| measure | weir | weir (Python) | Spark | weir/Spark | Python/Spark | Python/weir |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for label, (wv, pv, sv), fmt in rows:
            lines.append(f"| {label} | {fmt.format(wv)} | {fmt.format(pv)} | {fmt.format(sv)} "
                         f"| {wv / sv:.3f} | {pv / sv:.3f} | {pv / wv:.3f} |")
    else:
        lines = ["| measure | weir | Spark | weir/Spark |", "|---|---:|---:|---:|"]
        for label, (wv, sv), fmt in rows:
            lines.append(f"| {label} | {fmt.format(wv)} | {fmt.format(sv)} | {wv / sv:.3f} |")
    table = "\n".join(lines)
    python_note = ""
    if a.weir_python:
        fixed = pair("fixed-cost", "median_trigger_ms")
        big = pair("throughput", "median_trigger_ms")
        # Over the whole fixed-cost run (first batch start to last batch end, 50 batches):
        # finer than the progress report's whole milliseconds.
        per_batch = [WORKLOADS["fixed-cost"]["rows_per_file"] / r * 1000
                     for r in pair("fixed-cost", "rows_per_s")]
        python_note = f"""
weir (Python) is the same job written with the `weir` Python package
(`bench/weir_python_job.py`: `batch.sql(...)` for the newest row per order, then
`weir.sinks.ParquetSink`), release wheel. The Python layer's cost per batch (weir (Python)
minus weir): {fixed[1] - fixed[0]:+.1f} ms in the median triggerExecution of a 10-row batch
(the report counts whole ms); over the fixed-cost run, {per_batch[1]:.2f} ms per batch for
Python against {per_batch[0]:.2f} for weir ({per_batch[1] - per_batch[0]:+.2f} ms); on a
200,000-row batch, {big[1] - big[0]:+.0f} ms.
"""
    print()
    print(table)
    if a.write:
        spark_version = subprocess.run(
            [a.python, "-c", "import pyspark; print(pyspark.__version__)"],
            capture_output=True, text=True).stdout.strip()
        weir_version = subprocess.run([a.weir, "--version"], capture_output=True,
                                      text=True).stdout.strip()
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        Path(a.write).write_text(f"""# Benchmarks: weir and Spark side by side

Written by `{a.command}` on {when}; every figure below comes from that one run
(median of {a.rounds} alternating rounds per engine). Do not edit the numbers by hand: run the
script again.

- Machine: {machine()}.
- weir: `{weir_version}`, release build, `weir run` on a generated pipeline file.{" The `weir` Python package: release wheel." if a.weir_python else ""}
- Spark: PySpark {spark_version} from PyPI in a virtualenv, `local[2]`,
  `spark.sql.shuffle.partitions=2` (the default 200 would make every batch run 200 tasks on 2
  cores), UI off.

Same input for both (`weir gen --seed 7`: JSON order lines `order_id, status, amount,
updated_at`), same query: file source with `maxFilesPerTrigger`, availableNow trigger,
foreachBatch keeping the newest row per `order_id` with a `row_number()` window, written as
Parquet. Spark's job is `bench/spark_job.py`; weir's pipeline is in `bench/spark_vs_weir.py`.
Times per batch come from each engine's own progress reports (`durationMs.triggerExecution`);
rows/s is input rows over first batch start to last batch end; RSS is sampled from `/proc`
for the whole process tree (for Spark: the Python driver and the JVM).

{table}

A ratio below 1 means weir needs less of it (time, memory); for rows/s, above 1 means weir is
faster.
{python_note}""")
        print(f"\nwrote {a.write}")


if __name__ == "__main__":
    main()
