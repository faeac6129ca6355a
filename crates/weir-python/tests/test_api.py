"""The PySpark-shaped API, the batch handed over as Arrow, errors, stop and Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import weir
from conftest import orders, write_json_files

SCHEMA = "order_id BIGINT, status STRING, amount DOUBLE, updated_at TIMESTAMP"


def files_stream(folder, per_trigger=1):
    return (weir.Session().read_stream.format("json").schema(SCHEMA)
            .option("maxFilesPerTrigger", per_trigger).load(folder))


def run(frame, fn, chk, name="t", **trigger):
    q = (frame.write_stream.foreach_batch(fn).option("checkpointLocation", str(chk))
         .query_name(name).trigger(**(trigger or {"available_now": True})).start())
    q.await_termination()
    return q


def test_unknown_and_bad_options_are_refused_by_their_spark_name(tmp_path):
    r = weir.Session().read_stream
    with pytest.raises(weir.ConfigError, match="unknown option 'maxFilesPerTriger'.*maxFilesPerTrigger"):
        r.format("json").schema(SCHEMA).option("maxFilesPerTriger", 2).load(tmp_path)
    with pytest.raises(weir.ConfigError, match="'maxOffsetsPerTrigger'.*'lots' is not a whole number"):
        weir.Session().read_stream.format("kafka").option("kafka.bootstrap.servers", "x:1") \
            .option("subscribe", "t").option("maxOffsetsPerTrigger", "lots").load()
    with pytest.raises(weir.ConfigError, match="format 'avro' is not supported"):
        weir.Session().read_stream.format("avro")
    frame = files_stream(tmp_path)
    with pytest.raises(weir.ConfigError, match="checkpointLocation"):
        frame.write_stream.foreach_batch(lambda b, i: None).start()
    with pytest.raises(weir.ConfigError, match="exactly one"):
        frame.write_stream.trigger(once=True, available_now=True)


def test_a_schema_type_weir_cannot_read_is_refused_at_schema_naming_the_word():
    reader = weir.Session().read_stream.format("json")
    with pytest.raises(weir.ConfigError) as e:
        reader.schema("order_id BIGINT, price DECIMAL")
    said = str(e.value)
    assert "schema[1]" in said and "unknown type 'DECIMAL' in 'price DECIMAL'" in said, said
    with pytest.raises(weir.ConfigError, match=r"schema\[0\].*unknown type 'BIGNT'") as e:
        reader.schema("order_id BIGNT")
    # Said where it was written, not as a position in the settings weir builds from it.
    assert "line 1" not in str(e.value) and "column 1" not in str(e.value), str(e.value)


def test_a_pyarrow_schema_is_accepted(tmp_path):
    write_json_files(tmp_path / "in", orders(10, 5), 10)
    schema = pa.schema([("order_id", pa.int64()), ("status", pa.string()),
                        ("updated_at", pa.timestamp("us", tz="UTC"))])
    seen = []
    frame = weir.Session().read_stream.format("json").schema(schema).load(tmp_path / "in")
    run(frame, lambda b, i: seen.append(pa.table(b)), tmp_path / "chk")
    assert seen[0].schema == schema
    assert seen[0].num_rows == 10


def test_every_row_reaches_pyarrow_and_polars_once_in_file_order(tmp_path):
    rows = orders(120, 30)
    write_json_files(tmp_path / "in", rows, 10)
    tables, ids, polars_rows = [], [], 0

    def fn(batch, batch_id):
        assert isinstance(batch, weir.Batch) and batch.batch_id == batch_id
        assert batch.columns == ["order_id", "status", "amount", "updated_at"]
        t = pa.table(batch)  # the PyCapsule interface
        assert batch.count() == t.num_rows
        nonlocal polars_rows
        polars_rows += pl.DataFrame(batch).height
        assert batch.to_pyarrow().equals(t)
        tables.append(t)
        ids.append(batch_id)

    run(files_stream(tmp_path / "in", 3), fn, tmp_path / "chk")
    assert ids == [0, 1, 2, 3]
    got = pa.concat_tables(tables)
    assert got.num_rows == polars_rows == 120
    assert got.column("order_id").to_pylist() == [r["order_id"] for r in rows]
    assert got.column("status").to_pylist() == [r["status"] for r in rows]
    assert got.column("amount").to_pylist() == [r["amount"] for r in rows]


def test_batch_sql_runs_in_weir_and_gives_another_batch(tmp_path):
    write_json_files(tmp_path / "in", orders(200, 20), 200)
    out = {}

    def fn(batch, batch_id):
        latest = batch.sql("SELECT order_id, max(updated_at) AS newest, count(*) AS n "
                           "FROM batch GROUP BY order_id ORDER BY order_id")
        assert isinstance(latest, weir.Batch) and latest.batch_id == batch_id
        out["t"] = pa.table(latest)
        with pytest.raises(weir.WeirError, match="batch 0: the SQL `SELECT nope FROM batch`"):
            batch.sql("SELECT nope FROM batch")

    run(files_stream(tmp_path / "in"), fn, tmp_path / "chk")
    t = out["t"]
    assert t.num_rows == 20
    assert pc.sum(t.column("n")).as_py() == 200


def test_progress_is_a_dict_with_sparks_keys(tmp_path):
    write_json_files(tmp_path / "in", orders(30, 5), 10)
    q = run(files_stream(tmp_path / "in"), lambda b, i: None, tmp_path / "chk", name="prog")
    p = q.last_progress
    assert p["batchId"] == 2 and p["numInputRows"] == 10 and p["name"] == "prog"
    for k in ("addBatch", "getBatch", "latestOffset", "triggerExecution", "walCommit"):
        assert k in p["durationMs"]
    assert p["id"] == q.id and p["runId"] == q.run_id
    assert [r["batchId"] for r in q.recent_progress] == [0, 1, 2]
    assert sum(r["numInputRows"] for r in q.recent_progress) == 30
    assert q.lastProgress == p and not q.is_active and q.exception() is None


def test_an_exception_in_the_function_stops_the_query_and_the_batch_runs_again(tmp_path):
    write_json_files(tmp_path / "in", orders(30, 5), 10)
    chk = tmp_path / "chk"
    seen = []

    def failing(batch, batch_id):
        seen.append((batch_id, batch.is_replay, batch.count()))
        if batch_id == 1:
            raise ValueError("no room for order 42")

    q = (files_stream(tmp_path / "in").write_stream.foreach_batch(failing)
         .option("checkpointLocation", str(chk)).query_name("fails")
         .trigger(available_now=True).start())
    with pytest.raises(weir.StreamingQueryException) as e:
        q.await_termination()
    msg = str(e.value)
    assert "batch 1" in msg and "ValueError: no room for order 42" in msg
    assert "Traceback" in msg and 'raise ValueError("no room for order 42")' in msg
    assert isinstance(e.value.__cause__, ValueError)
    assert isinstance(q.exception(), weir.StreamingQueryException)
    assert sorted(os.listdir(chk / "commits")) == ["0"]
    assert sorted(os.listdir(chk / "offsets")) == ["0", "1"]

    # The next start runs batch 1 again: same id, same rows, marked as a replay.
    seen.clear()
    run(files_stream(tmp_path / "in"), lambda b, i: seen.append((i, b.is_replay, b.count())),
        chk, name="fails")
    assert seen == [(1, True, 10), (2, False, 10)]


def test_stop_ends_a_running_query_after_its_batch(tmp_path):
    write_json_files(tmp_path / "in", orders(20, 5), 10)
    calls = []
    q = (files_stream(tmp_path / "in").write_stream
         .foreach_batch(lambda b, i: (calls.append(i), time.sleep(0.2)))
         .option("checkpointLocation", str(tmp_path / "chk"))
         .trigger(processing_time="100 milliseconds").start())
    assert q.is_active
    assert q.await_termination(timeout=0.05) is False
    while len(calls) < 2:
        time.sleep(0.05)
    q.stop()
    assert not q.is_active and q.exception() is None
    # Every batch that started was committed.
    chk = tmp_path / "chk"
    assert sorted(os.listdir(chk / "commits")) == sorted(os.listdir(chk / "offsets"))


def test_ctrl_c_stops_the_query_cleanly(tmp_path):
    write_json_files(tmp_path / "in", orders(50, 5), 10)
    script = textwrap.dedent(f"""
        import sys, time, weir
        frame = (weir.Session().read_stream.format("json").schema({SCHEMA!r})
                 .option("maxFilesPerTrigger", 1).load({str(tmp_path / 'in')!r}))
        def fn(batch, batch_id):
            print("batch", batch_id, flush=True)
            time.sleep(0.5)
        q = (frame.write_stream.foreach_batch(fn)
             .option("checkpointLocation", {str(tmp_path / 'chk')!r})
             .trigger(processing_time="1 second").start())
        try:
            q.await_termination()
        except KeyboardInterrupt:
            print("interrupted twice", flush=True)
            sys.exit(3)
        print("stopped", q.is_active, flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "batch 0"
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert "stopped False" in out
    chk = tmp_path / "chk"
    assert sorted(os.listdir(chk / "commits")) == sorted(os.listdir(chk / "offsets"))


def test_a_cached_batch_is_released_when_its_block_ends(tmp_path):
    write_json_files(tmp_path / "in", orders(10, 5), 10)
    kept = {}

    def fn(batch, batch_id):
        with weir.cache(batch) as cached:
            assert cached.is_cached and cached.count() == 10
            kept["c"] = cached
        with pytest.raises(weir.WeirError, match="unpersisted"):
            kept["c"].count()

    run(files_stream(tmp_path / "in"), fn, tmp_path / "chk")
    assert "c" in kept


def test_stop_called_inside_the_function_ends_the_query_after_that_batch(tmp_path):
    write_json_files(tmp_path / "in", orders(30, 5), 10)
    holder, calls = {}, []

    def fn(batch, batch_id):
        calls.append(batch_id)
        holder["q"].stop()  # must not wait for itself

    holder["q"] = (files_stream(tmp_path / "in").write_stream.foreach_batch(fn)
                   .option("checkpointLocation", str(tmp_path / "chk"))
                   .trigger(processing_time="50 milliseconds").start())
    assert holder["q"].await_termination(timeout=30) is True
    assert calls == [0]
    assert os.listdir(tmp_path / "chk" / "commits") == ["0"]


def test_a_script_that_exits_with_its_query_running_ends_without_a_crash(tmp_path):
    write_json_files(tmp_path / "in", orders(30, 5), 10)
    script = textwrap.dedent(f"""
        import time, weir
        frame = (weir.Session().read_stream.format("json").schema({SCHEMA!r})
                 .option("maxFilesPerTrigger", 1).load({str(tmp_path / 'in')!r}))
        q = (frame.write_stream.foreach_batch(lambda b, i: time.sleep(0.05))
             .option("checkpointLocation", {str(tmp_path / 'chk')!r})
             .trigger(processing_time="10 milliseconds").start())
        time.sleep(0.3)
        print("leaving", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "leaving" in r.stdout


def test_csv_files_have_no_header_unless_told_as_in_spark(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("1,alice\n2,bob\n3,carol\n")
    seen = []
    frame = weir.Session().read_stream.format("csv").schema("id INT, name STRING").load(tmp_path / "in")
    run(frame, lambda b, i: seen.append(pa.table(b)), tmp_path / "chk")
    assert seen[0].column("name").to_pylist() == ["alice", "bob", "carol"]
    (tmp_path / "in2").mkdir()
    (tmp_path / "in2" / "a.csv").write_text("id,name\n1,alice\n")
    seen.clear()
    frame = (weir.Session().read_stream.format("csv").schema("id INT, name STRING")
             .option("header", "true").load(tmp_path / "in2"))
    run(frame, lambda b, i: seen.append(pa.table(b)), tmp_path / "chk2")
    assert seen[0].column("name").to_pylist() == ["alice"]


def test_an_async_or_generator_function_is_refused_before_it_could_commit_unwritten(tmp_path):
    write_json_files(tmp_path / "in", orders(10, 5), 10)

    async def later(batch, batch_id):
        pass

    def gen(batch, batch_id):
        yield batch

    for fn in (later, gen):
        with pytest.raises(weir.ConfigError, match="plain function"):
            files_stream(tmp_path / "in").write_stream.foreach_batch(fn)
    # A callable that hands back a coroutine is caught when it returns one.
    q = (files_stream(tmp_path / "in").write_stream.foreach_batch(lambda b, i: later(b, i))
         .option("checkpointLocation", str(tmp_path / "chk")).trigger(available_now=True).start())
    with pytest.raises(weir.StreamingQueryException, match="returned coroutine for batch 0"):
        q.await_termination()
    assert not os.path.exists(tmp_path / "chk" / "commits" / "0")


def test_state_partitions_is_a_writer_option_fixed_once_the_state_is_written(tmp_path):
    rows = orders(300, 40)
    write_json_files(tmp_path / "in", rows, 100)
    seen = []

    def start(**options):
        w = files_stream(tmp_path / "in").drop_duplicates(["order_id"]).write_stream
        for k, v in options.items():
            w = w.option(k, v)
        return (w.foreach_batch(lambda b, i: seen.extend(pa.table(b).column("order_id").to_pylist()))
                .option("checkpointLocation", str(tmp_path / "chk")).query_name("parts")
                .trigger(available_now=True).start())

    with pytest.raises(weir.ConfigError, match="statePartitions"):
        start(statePartitions=0)
    q = start(statePartitions=3)
    q.await_termination()
    assert sorted(seen) == sorted({r["order_id"] for r in rows})
    op = q.last_progress["stateOperators"][0]
    assert op["numStateStoreInstances"] == 3
    assert op["numRowsTotal"] == len({r["order_id"] for r in rows})
    assert sorted(os.listdir(tmp_path / "chk" / "state" / "0")) == ["0", "1", "2", "_metadata"]
    # Another number on the same checkpoint is refused, naming the setting.
    with pytest.raises(weir.WeirError, match="state-partitions.*3 partition"):
        start(**{"spark.sql.shuffle.partitions": 5}).await_termination()


def test_a_connection_error_runs_the_batch_again_after_a_pause_and_others_stop(tmp_path):
    write_json_files(tmp_path / "in", orders(30, 5), 10)
    seen = []
    calls = {"n": 0}

    def flaky(batch, batch_id):
        seen.append((batch_id, batch.is_replay, batch.count()))
        if batch_id == 1 and calls["n"] < 2:
            calls["n"] += 1
            raise ConnectionRefusedError("the warehouse is restarting")

    def start(fn, chk, **options):
        w = files_stream(tmp_path / "in").write_stream
        for k, v in options.items():
            w = w.option(k, v)
        return (w.foreach_batch(fn).option("checkpointLocation", str(chk)).query_name("flaky")
                .trigger(available_now=True).start())

    # A ConnectionError (here ConnectionRefusedError) may pass: batch 1 runs again from the
    # checkpoint, same id and rows, until it gets through; the query ends by itself.
    q = start(flaky, tmp_path / "chk", retryInitial="50ms", retryMax="200ms")
    q.await_termination()
    assert q.exception() is None
    assert seen == [(0, False, 10), (1, False, 10), (1, True, 10), (1, True, 10), (2, False, 10)]
    assert sorted(os.listdir(tmp_path / "chk" / "commits")) == ["0", "1", "2"]

    # With one run allowed, the same error stops the query at once.
    calls["n"] = 0
    seen.clear()
    q = start(flaky, tmp_path / "chk2", retryAttempts=1)
    with pytest.raises(weir.StreamingQueryException) as e:
        q.await_termination()
    assert isinstance(e.value.__cause__, ConnectionRefusedError)
    assert seen == [(0, False, 10), (1, False, 10)]

    # Any other exception stops it too, whatever the retry options.
    def broken(batch, batch_id):
        raise ValueError("no room for order 42")

    q = start(broken, tmp_path / "chk3", retryAttempts=5)
    with pytest.raises(weir.StreamingQueryException):
        q.await_termination()
    with pytest.raises(weir.ConfigError, match="retryAttempts"):
        start(flaky, tmp_path / "chk4", retryAttempts=0)
    with pytest.raises(weir.ConfigError, match="retry.initial"):
        start(flaky, tmp_path / "chk4", retryInitial="5s", retryMax="1s")


def test_dead_letter_timeout_tombstones_and_lease_wait_are_options(tmp_path):
    import pyarrow.parquet as pq
    folder = tmp_path / "in [x] ü"
    folder.mkdir()
    (folder / "a.json").write_text(
        '{"order_id": 1, "status": "a", "amount": 1.5, "updated_at": "2026-01-01T00:00:00Z"}\n'
        '{"order_id": 2, "amount": "7.25"}\n'
        '{"order_id": 3\n')
    seen = []
    dead = tmp_path / "dead ü"
    frame = (weir.Session().read_stream.format("json").schema(SCHEMA)
             .option("deadLetter", str(dead)).option("timeout", "1m").load(folder))
    q = (frame.write_stream.foreach_batch(lambda b, i: seen.append(pa.table(b)))
         .option("checkpointLocation", str(tmp_path / "chk")).option("leaseWait", "5s")
         .option("leaseTtl", "30s").trigger(available_now=True).start())
    q.await_termination()
    assert [t.column("order_id").to_pylist() for t in seen] == [[1]]
    letters = pa.concat_tables([pq.read_table(dead / f) for f in os.listdir(dead)])
    assert sorted(letters.column("line").to_pylist()) == [2, 3]
    assert set(letters.column("batch_id").to_pylist()) == {0}
    # Checked as a pipeline file's keys are, naming them.
    bad = (weir.Session().read_stream.format("kafka").option("kafka.bootstrap.servers", "x:1")
           .option("subscribe", "t").option("tombstones", "delete").load())
    with pytest.raises(weir.ConfigError, match="source.tombstones"):
        bad.write_stream.foreach_batch(lambda b, i: None) \
            .option("checkpointLocation", str(tmp_path / "chk2")).start()
    with pytest.raises(weir.ConfigError, match="lease-wait|leaseWait|duration"):
        frame.write_stream.foreach_batch(lambda b, i: None) \
            .option("checkpointLocation", str(tmp_path / "chk3")).option("leaseWait", "soon").start()
