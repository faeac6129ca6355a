"""Each sink called from Python makes the second write of a replayed batch a no-op, and
holds exactly what it must (read back with deltalake, pyarrow and psql)."""

import json
import os

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

import weir
from conftest import newest_per_key, orders, write_json_files
from weir.sinks import DeltaAppend, DeltaMerge, ParquetSink, PostgresLedger, PostgresUpsert

SCHEMA = "order_id BIGINT, status STRING, amount DOUBLE, updated_at TIMESTAMP"


def start(folder, chk, fn, name):
    frame = (weir.Session().read_stream.format("json").schema(SCHEMA)
             .option("maxFilesPerTrigger", 2).load(folder))
    return (frame.write_stream.foreach_batch(fn).option("checkpointLocation", str(chk))
            .query_name(name).trigger(available_now=True).start())


def parquet_rows(folder):
    files = sorted(f for f in os.listdir(folder) if f.endswith(".parquet"))
    return pa.concat_tables([pq.read_table(os.path.join(folder, f)) for f in files]) if files else None


def delta_txn(path):
    """(appId, version) of every txn action and the number of commits, read from the log."""
    log = os.path.join(path, "_delta_log")
    commits = sorted(f for f in os.listdir(log) if f.endswith(".json"))
    txns = []
    for c in commits:
        with open(os.path.join(log, c)) as f:
            for line in f:
                a = json.loads(line)
                if "txn" in a:
                    txns.append((a["txn"]["appId"], a["txn"]["version"]))
    return txns, len(commits)


def as_key_rows(rows):
    return {r["order_id"]: (r["status"], r["amount"]) for r in rows}


def test_a_batch_that_fails_after_every_sink_wrote_is_replayed_as_a_no_op(tmp_path, postgres):
    rows = orders(300, 40, seed=7)
    write_json_files(tmp_path / "in", rows, 50)  # 6 files, 2 per batch: 3 batches
    postgres.psql("DROP TABLE IF EXISTS py_counts; CREATE TABLE py_counts (batch_id bigint, n bigint)")
    append = DeltaAppend(tmp_path / "append")
    merge = DeltaMerge(tmp_path / "merge", keys=["order_id"], ordering="updated_at")
    parquet = ParquetSink(tmp_path / "pq")
    upsert = PostgresUpsert(postgres.url, "py_orders", keys=["order_id"], ordering="updated_at",
                            create_table=True, ledger="py_ledger")
    ledger = PostgresLedger(postgres.url, "py_own_ledger")
    fail_at = {"batch": 1}

    def fn(batch, batch_id):
        with weir.cache(batch) as rows_:
            append(rows_, batch_id)
            merge(rows_, batch_id)
            parquet(rows_, batch_id)
            upsert(rows_, batch_id)
            n = rows_.count()
            ledger.run_once(rows_, batch_id,
                            [("INSERT INTO py_counts VALUES ($1, $2)", [batch_id, n])])
        if fail_at["batch"] == batch_id:
            raise RuntimeError("the process dies after every write of this batch")

    q = start(tmp_path / "in", tmp_path / "chk", fn, "sinks")
    with pytest.raises(weir.StreamingQueryException, match="batch 1"):
        q.await_termination()
    fail_at["batch"] = None
    q = start(tmp_path / "in", tmp_path / "chk", fn, "sinks")
    q.await_termination()
    replay = q.recent_progress[0]
    assert replay["batchId"] == 1
    skipped = sorted(k for k, v in replay["sink"]["metrics"].items() if k.endswith(".skipped") and v == "true")
    assert [k.split(" ")[0] for k in skipped] == ["delta-append", "delta-merge", "postgres-ledger", "postgres-upsert"]

    # Delta append: every row once; one commit and one txn version per batch.
    t = DeltaTable(str(tmp_path / "append")).to_pyarrow_table()
    assert t.num_rows == 300
    assert sorted(t.column("order_id").to_pylist()) == sorted(r["order_id"] for r in rows)
    txns, commits = delta_txn(tmp_path / "append")
    assert commits == 3 and [v for _, v in txns] == [0, 1, 2]
    assert len({a for a, _ in txns}) == 1 and q.id in txns[0][0]
    # Delta MERGE: the newest row per key.
    want = newest_per_key(rows)
    got = DeltaTable(str(tmp_path / "merge")).to_pyarrow_table().to_pylist()
    assert len(got) == len(want) == 40
    assert as_key_rows(got) == as_key_rows(want.values())
    assert delta_txn(tmp_path / "merge")[1] == 3
    # Parquet: every row once (the replay wrote the same files again).
    assert parquet_rows(tmp_path / "pq").num_rows == 300
    # PostgreSQL: newest per key, one ledger row per batch, the user's statements once.
    pg = postgres.psql("SELECT order_id, status, amount FROM py_orders ORDER BY order_id")
    assert {int(k): (s, None if a == "" else float(a)) for k, s, a in pg} == as_key_rows(want.values())
    assert postgres.psql("SELECT batch_id FROM py_ledger ORDER BY batch_id") == [["0"], ["1"], ["2"]]
    assert postgres.psql("SELECT batch_id, n FROM py_counts ORDER BY batch_id") == [["0", "100"], ["1", "100"], ["2", "100"]]
    assert postgres.psql("SELECT count(*) FROM py_own_ledger") == [["3"]]


def test_sinks_take_polars_and_pyarrow_rows_made_from_the_batch(tmp_path):
    rows = orders(100, 100, seed=3)
    write_json_files(tmp_path / "in", rows, 25)
    append = DeltaAppend(tmp_path / "append")
    parquet = ParquetSink(tmp_path / "pq")

    def fn(batch, batch_id):
        frame = pl.DataFrame(batch).filter(pl.col("status") != "new")
        append(frame, batch_id)
        parquet(pa.table(batch), batch_id)

    start(tmp_path / "in", tmp_path / "chk", fn, "polars").await_termination()
    kept = [r for r in rows if r["status"] != "new"]
    got = DeltaTable(str(tmp_path / "append")).to_pyarrow_table()
    assert sorted(got.column("order_id").to_pylist()) == sorted(r["order_id"] for r in kept)
    assert parquet_rows(tmp_path / "pq").num_rows == 100


def test_parquet_files_use_spark_s_codec_unless_told_otherwise(tmp_path):
    rows = orders(60, 60, seed=5)
    write_json_files(tmp_path / "in", rows, 20)  # 3 files, 2 per batch: 2 batches
    default = ParquetSink(tmp_path / "snappy")
    zstd = ParquetSink(tmp_path / "zstd", compression="zstd")

    def fn(batch, batch_id):
        default(batch, batch_id)
        zstd(batch, batch_id)

    start(tmp_path / "in", tmp_path / "chk", fn, "codecs").await_termination()
    for folder, codec in [("snappy", "SNAPPY"), ("zstd", "ZSTD")]:
        files = sorted(f for f in os.listdir(tmp_path / folder) if f.endswith(".parquet"))
        assert len(files) == 2
        for f in files:
            meta = pq.ParquetFile(tmp_path / folder / f).metadata
            assert {meta.row_group(g).column(c).compression
                    for g in range(meta.num_row_groups)
                    for c in range(meta.num_columns)} == {codec}
        assert sorted(parquet_rows(tmp_path / folder).column("order_id").to_pylist()) == \
            sorted(r["order_id"] for r in rows)
    with pytest.raises(weir.WeirError, match="brotli"):
        ParquetSink(tmp_path / "x", compression="brotli")


def test_a_sink_refuses_a_batch_id_that_is_not_the_batch(tmp_path):
    write_json_files(tmp_path / "in", orders(10, 5), 10)
    parquet = ParquetSink(tmp_path / "pq")
    errors = []

    def fn(batch, batch_id):
        with pytest.raises(weir.WeirError, match="called with batch_id 7 for the rows of batch 0"):
            parquet(batch, 7)
        with pytest.raises(weir.WeirError, match="no batch 7 is being handled"):
            parquet(pa.table(batch), 7)
        with pytest.raises(weir.WeirError, match="not a table"):
            parquet([1, 2], batch_id)
        errors.append(batch_id)

    start(tmp_path / "in", tmp_path / "chk", fn, "ids").await_termination()
    assert errors == [0]
    assert not os.path.exists(tmp_path / "pq") or parquet_rows(tmp_path / "pq") is None


def test_a_failed_write_raises_sink_error_naming_the_sink_and_batch(tmp_path, postgres):
    write_json_files(tmp_path / "in", orders(10, 5), 10)
    # A table that refuses the rows (a CHECK no amount passes).
    postgres.psql("DROP TABLE IF EXISTS py_bad; CREATE TABLE py_bad (order_id bigint PRIMARY KEY, "
                  "status text, amount double precision CHECK (amount < 0), updated_at timestamptz)")
    bad = PostgresUpsert(postgres.url, "py_bad", keys=["order_id"], ordering="updated_at")

    def fn(batch, batch_id):
        bad(batch, batch_id)

    q = start(tmp_path / "in", tmp_path / "chk", fn, "bad")
    with pytest.raises(weir.StreamingQueryException) as e:
        q.await_termination()
    assert isinstance(e.value.__cause__, weir.SinkError)
    assert "postgres-upsert" in str(e.value.__cause__) and "batch 0" in str(e.value.__cause__)
    assert not os.path.exists(tmp_path / "chk" / "commits" / "0")


def test_delta_tables_named_with_hash_and_question_marks_are_where_they_were_told(tmp_path):
    write_json_files(tmp_path / "in", orders(20, 5), 10)
    # A '%' is refused (delta-rs would read victim%41 as victimA), before anything runs.
    with pytest.raises(weir.ConfigError, match="'%' in a local Delta table"):
        DeltaAppend(tmp_path / "victim%41")
    with pytest.raises(weir.ConfigError, match="'%' in a local Delta table"):
        DeltaMerge(tmp_path / "victim%41", keys=["order_id"], ordering="updated_at")
    names = ["sales#staging", "x?y", "sales"]
    sinks = [DeltaAppend(tmp_path / n) for n in names]

    def fn(batch, batch_id):
        for s in sinks:
            s(batch, batch_id)

    start(tmp_path / "in", tmp_path / "chk", fn, "names").await_termination()
    for n in names:
        assert DeltaTable(str(tmp_path / n)).to_pyarrow_table().num_rows == 20, n
    assert sorted(os.listdir(tmp_path)) == sorted(["chk", "in"] + names)


def test_a_sink_refuses_rows_of_a_batch_whose_function_returned(tmp_path, postgres):
    write_json_files(tmp_path / "in", orders(10, 5), 10)
    kept = {}
    parquet = ParquetSink(tmp_path / "pq")
    ledger = PostgresLedger(postgres.url, "py_late_ledger")
    start(tmp_path / "in", tmp_path / "chk", lambda b, i: kept.update(b=b, i=i), "late").await_termination()
    with pytest.raises(weir.WeirError, match="batch 0 is no longer being handled"):
        parquet(kept["b"], kept["i"])
    with pytest.raises(weir.WeirError, match="batch 0 is no longer being handled"):
        ledger.run_once(kept["b"], kept["i"], ["SELECT 1"])
    assert not os.path.exists(tmp_path / "pq")


def test_a_ledger_function_is_called_only_for_a_batch_that_has_not_landed(tmp_path, postgres):
    write_json_files(tmp_path / "in", orders(10, 5), 10)
    postgres.psql("DROP TABLE IF EXISTS py_fn_counts; CREATE TABLE py_fn_counts (batch_id bigint)")
    ledger = PostgresLedger(postgres.url, "py_fn_ledger")
    calls, fail = [], {"on": True}

    def fn(batch, batch_id):
        def statements():
            calls.append(batch_id)
            return [("INSERT INTO py_fn_counts VALUES ($1)", [batch_id])]
        ledger.run_once(batch, batch_id, statements)
        if fail["on"]:
            raise RuntimeError("dies after the ledger transaction")

    with pytest.raises(weir.StreamingQueryException):
        start(tmp_path / "in", tmp_path / "chk", fn, "fn-ledger").await_termination()
    fail["on"] = False
    q = start(tmp_path / "in", tmp_path / "chk", fn, "fn-ledger")
    q.await_termination()
    assert calls == [0]  # the replay found the ledger row and asked for nothing
    assert q.recent_progress[0]["sink"]["metrics"]["postgres-ledger py_fn_ledger.skipped"] == "true"
    assert postgres.psql("SELECT batch_id FROM py_fn_counts") == [["0"]]
