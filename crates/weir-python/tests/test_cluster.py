"""``Session(cluster=...)``: the batches' reads run on ``weir worker`` processes (the binary
the Rust tests built, ``$WEIR_BIN``), this process is the driver, and every row reaches the
function once."""

import os
import subprocess

import pyarrow as pa
import pytest

import weir
from conftest import orders, write_json_files

SCHEMA = "order_id BIGINT, status STRING, amount DOUBLE, updated_at TIMESTAMP"


def weir_bin():
    path = os.environ.get("WEIR_BIN", "")
    assert os.path.isfile(path), (
        f"WEIR_BIN={path!r} is not the weir binary: build it first (cargo build -p weir-cli; "
        "test.sh points WEIR_BIN at $CARGO_TARGET_DIR/debug/weir)")
    return path


@pytest.fixture
def workers():
    procs, urls = [], []
    try:
        for _ in range(2):
            p = subprocess.Popen([weir_bin(), "worker", "--listen", "127.0.0.1:0"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(p)
            first = p.stderr.readline()
            assert "listening on " in first, first
            urls.append(first.split("listening on ")[1].split()[0])
        yield urls
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_session_with_a_cluster_reads_on_the_workers_and_each_row_arrives_once(tmp_path, workers):
    rows = orders(90, 20)
    write_json_files(tmp_path / "in", rows, 10)
    tables = []
    session = weir.Session(cluster={"workers": workers, "connect_timeout": "2s"})
    frame = (session.read_stream.format("json").schema(SCHEMA)
             .option("maxFilesPerTrigger", 3).load(tmp_path / "in"))
    q = (frame.write_stream.foreach_batch(lambda b, i: tables.append(pa.table(b)))
         .option("checkpointLocation", str(tmp_path / "chk")).trigger(available_now=True).start())
    q.await_termination()
    assert q.exception() is None
    got = pa.concat_tables(tables)
    assert sorted(got.column("order_id").to_pylist()) == sorted(r["order_id"] for r in rows)
    assert got.num_rows == 90
    # Each batch's three files went to the two workers.
    for p in q.recent_progress:
        ws = p["cluster"]["workers"]
        assert {w["url"].rstrip("/") for w in ws} == set(workers), p
        assert sum(w["inputRows"] for w in ws) == p["numInputRows"] == 30


def test_a_bad_cluster_setting_is_refused_naming_it(tmp_path):
    frame = (weir.Session(cluster={"workers": ["https://x:1"]}).read_stream.format("json")
             .schema(SCHEMA).load(tmp_path))
    with pytest.raises(weir.ConfigError, match="cluster.tls-ca.*CA certificate"):
        frame.write_stream.foreach_batch(lambda b, i: None) \
            .option("checkpointLocation", str(tmp_path / "chk")).start()
    with pytest.raises(weir.ConfigError, match="cluster"):
        weir.Session(cluster=["http://x:1"])
    # No worker listening: an error before batch 0, naming the worker.
    frame = (weir.Session(cluster={"workers": ["http://127.0.0.1:9"], "connect_timeout": "1s"})
             .read_stream.format("json").schema(SCHEMA).load(tmp_path))
    with pytest.raises(weir.WeirError, match="no usable worker.*127.0.0.1:9"):
        frame.write_stream.foreach_batch(lambda b, i: None) \
            .option("checkpointLocation", str(tmp_path / "chk2")).start()
    assert not (tmp_path / "chk2" / "offsets" / "0").exists()
