"""The Kafka source from Python, and the seed's worked example (examples/orders_upsert.py)
killed at every fault point and at random moments, with both sinks checked."""

import calendar
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time

import pyarrow as pa
from deltalake import DeltaTable

import weir
from conftest import ROOT, newest_by_rule, newest_per_key, orders, produce

EXAMPLE = os.path.join(ROOT, "examples", "orders_upsert.py")


def epoch(text):
    return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))


def test_kafka_batches_respect_max_offsets_per_trigger_and_read_every_record(tmp_path, kafka):
    values = orders(1000, 50, seed=11)
    produce(kafka, "py-orders-limit", values, partitions=3)
    seen = []
    frame = (weir.Session().read_stream.format("kafka")
             .option("kafka.bootstrap.servers", kafka).option("subscribe", "py-orders-limit")
             .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", 300)
             .option("valueFormat", "json")
             .schema("order_id BIGINT, status STRING, amount DOUBLE, updated_at TIMESTAMP").load())
    q = (frame.write_stream.foreach_batch(lambda b, i: seen.append(pa.table(b)))
         .option("checkpointLocation", str(tmp_path / "chk")).trigger(available_now=True).start())
    q.await_termination()
    # Spark splits the limit over the partitions by their backlog, rounding per partition.
    sizes = [t.num_rows for t in seen]
    assert len(sizes) == 4 and all(n <= 300 for n in sizes) and sum(sizes) == 1000, sizes
    got = sorted(pa.concat_tables(seen).column("order_id").to_pylist())
    assert got == sorted(v["order_id"] for v in values)
    src = q.last_progress["sources"][0]
    assert sum(int(o) for o in src["endOffset"]["py-orders-limit"].values()) == 1000


def test_raw_kafka_records_carry_sparks_columns(tmp_path, kafka):
    produce(kafka, "py-raw", [{"order_id": i} for i in range(10)])
    seen = []
    frame = (weir.Session().read_stream.format("kafka").option("kafka.bootstrap.servers", kafka)
             .option("subscribe", "py-raw").load())
    (frame.write_stream.foreach_batch(lambda b, i: seen.append(pa.table(b)))
     .option("checkpointLocation", str(tmp_path / "chk")).trigger(once=True).start()
     .await_termination())
    t = seen[0]
    for c in ("key", "value", "topic", "partition", "offset", "timestamp"):
        assert c in t.column_names
    assert t.column("value").to_pylist()[3] == b'{"order_id": 3}'


def run_example(env, args, fault=None, timeout=120):
    e = dict(env)
    if fault:
        e["WEIR_FAULT"] = fault
    return subprocess.run([sys.executable, EXAMPLE, "--available-now"] + args, env=e,
                          capture_output=True, text=True, timeout=timeout)


def committed(chk):
    d = os.path.join(chk, "commits")
    return len([f for f in os.listdir(d) if f.isdigit()]) if os.path.isdir(d) else 0


def test_the_python_worked_example_survives_kills_at_every_point(tmp_path, kafka, postgres):
    topic = "py-example"
    values = orders(6000, 300, seed=5)
    # Ties: copies of eight orders' newest rows with the same updated_at and another status
    # or amount, some winning by the rule and some losing, each right after the row it ties
    # with (so mostly in its batch, where the example's window must break the tie).
    newest = newest_per_key(values)
    for i, k in enumerate(sorted(newest)[:8]):
        tie = dict(newest[k])
        if i % 2 == 0:
            tie["status"] = "zz tie wins" if tie["status"] < "zz tie wins" else "a tie loses"
        else:
            tie["amount"] = None if tie["amount"] is not None else 1.0
        values.insert(next(j for j, v in enumerate(values) if v is newest[k]) + 1, tie)
    produce(kafka, topic, values[:3000], partitions=3)
    folder = str(tmp_path / "example dir [1]")
    chk = os.path.join(folder, "checkpoint")
    env = dict(os.environ, KAFKA_BOOTSTRAP=kafka, DATABASE_URL=postgres.url)
    args = ["--topic", topic, "--dir", folder, "--max-offsets", "250"]
    # The points a batch passes: the engine's, then the Delta MERGE's, then PostgreSQL's.
    spec = importlib.util.spec_from_file_location("orders_upsert", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    sinks = example.build_sinks(str(tmp_path / "unused"), postgres.url)
    runner = list(weir._weir.RUNNER_POINTS)
    points = runner[:2] + [p for s in sinks for p in s.fault_points] + runner[2:]
    assert len(points) >= 9, points
    faults = 0
    for point in points:
        batch = committed(chk)
        r = run_example(env, args, fault=f"{point}@{batch}")
        assert r.returncode != 0, f"no crash at {point}@{batch}: {r.stdout}{r.stderr}"
        faults += 1
    # Random kills while more records arrive.
    produce(kafka, topic, values[3000:], partitions=3)
    rng = random.Random(3)
    kills = int(os.environ.get("WEIR_PY_KILLS", "12"))
    for _ in range(kills):
        p = subprocess.Popen([sys.executable, EXAMPLE, "--available-now"] + args, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.4, 2.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
    r = run_example(env, args)
    assert r.returncode == 0, r.stderr
    r = run_example(env, args)  # nothing new: no batch, nothing written
    assert r.returncode == 0, r.stderr

    want = newest_by_rule(values)
    expect = {k: (v["status"], v["amount"], epoch(v["updated_at"])) for k, v in want.items()}
    delta = DeltaTable(os.path.join(folder, "silver_orders")).to_pyarrow_table().to_pylist()
    got = {r["order_id"]: (r["status"], r["amount"], calendar.timegm(r["updated_at"].utctimetuple()))
           for r in delta}
    assert len(delta) == len(expect) == 300
    assert got == expect
    pg = postgres.psql("SELECT order_id, status, amount, extract(epoch FROM updated_at)::bigint FROM orders")
    assert len(pg) == 300
    assert {int(k): (s, None if a == "" else float(a), int(t)) for k, s, a, t in pg} == expect
    n = committed(chk)
    ledger = postgres.psql("SELECT batch_id FROM stream_batches ORDER BY batch_id")
    assert [int(b) for (b,) in ledger] == list(range(n))
    assert postgres.psql("SELECT count(*) FROM orders_batch_staging") == [["0"]]
    # One Delta commit per batch that had rows (all of them here), none twice.
    log = os.path.join(folder, "silver_orders", "_delta_log")
    assert len([f for f in os.listdir(log) if f.endswith(".json")]) == n
    assert n >= 24 and faults == len(points)
