"""Real servers for the Python package's tests: a throw-away PostgreSQL cluster from the
installed server binaries, and the Kafka-protocol broker noida-db (both installed by
.ci/run). Readers that share no code with weir check what the sinks hold: psql, pyarrow,
the deltalake package."""

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, what, proc, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {seconds} s")


def as_postgres(args):
    return (["runuser", "-u", "postgres", "--"] + args) if os.geteuid() == 0 else args


class Postgres:
    def __init__(self, port):
        self.port = port
        self.url = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"

    def psql(self, sql):
        """Rows as lists of strings (psql, unaligned)."""
        out = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", "postgres",
             "-X", "-A", "-t", "-F", "|", "-v", "ON_ERROR_STOP=1", "-c", sql],
            check=True, capture_output=True, text=True,
        ).stdout
        return [line.split("|") for line in out.splitlines() if line]


@pytest.fixture(scope="session")
def postgres():
    initdb = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    assert initdb, "the PostgreSQL server binaries are not installed (.ci/run installs them)"
    bin_dir = os.path.dirname(initdb[-1])
    root = tempfile.mkdtemp(prefix="weir-py-pg-")
    data = os.path.join(root, "data")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    subprocess.run(as_postgres([f"{bin_dir}/initdb", "-D", data, "-U", "postgres", "--auth=trust",
                                "--no-sync", "-E", "UTF8", "--locale=C.UTF-8"]),
                   check=True, capture_output=True)
    port = free_port()
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    subprocess.run(as_postgres([f"{bin_dir}/pg_ctl", "-D", data, "-l", f"{root}/pg.log", "-w",
                                "-o", opts, "start"]), check=True, capture_output=True)
    try:
        yield Postgres(port)
    finally:
        subprocess.run(as_postgres([f"{bin_dir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def kafka():
    binary = os.environ.get("NOIDA_DB", "/opt/noida/noida_db/noida-db")
    assert os.access(binary, os.X_OK), f"{binary} missing (.ci/run installs noida-db)"
    root = tempfile.mkdtemp(prefix="weir-py-kafka-")
    port = free_port()
    log = open(os.path.join(root, "broker.log"), "wb")
    proc = subprocess.Popen([binary, "start", "--data-dir", os.path.join(root, "data"), "--host",
                             "127.0.0.1", "--only", "kafka", "--kafka-port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, "the Kafka broker", proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def produce(bootstrap, topic, values, partitions=1):
    """JSON values to `topic` (created with `partitions`), through librdkafka's Python client."""
    import json

    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    fs = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    for f in fs.values():
        try:
            f.result(30)
        except Exception as e:  # already there: fine
            if "TOPIC_ALREADY_EXISTS" not in str(e):
                raise
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i, v in enumerate(values):
        p.produce(topic, json.dumps(v).encode(), key=str(v.get("order_id", i)).encode(),
                  partition=i % partitions)
        if i % 10_000 == 0:
            p.poll(0)
    assert p.flush(60) == 0, "messages left unsent"


def orders(n, keys, seed=1, start_s=1_767_225_600):
    """n order changes over `keys` order ids, updated_at strictly increasing (no ties)."""
    import random

    r = random.Random(seed)
    out = []
    for i in range(n):
        out.append({
            "order_id": r.randrange(keys),
            "status": r.choice(["new", "paid", "shipped", "ünïcode [1]"]),
            "amount": None if i % 17 == 0 else round(r.random() * 100, 2),
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_s + i)),
        })
    return out


def newest_per_key(rows):
    """The newest row per order_id by updated_at (the generated rows have no ties)."""
    best = {}
    for r in rows:
        k = r["order_id"]
        if k not in best or r["updated_at"] > best[k]["updated_at"]:
            best[k] = r
    return best


def newest_by_rule(rows):
    """The winning row per order_id by the sinks' rule: the greatest updated_at, then status,
    then amount, NULL below every value (text in code point order, UTF-8's byte order)."""
    def rank(r):
        return tuple((v is not None, v) if v is not None else (False, 0)
                     for v in (r["updated_at"], r["status"], r["amount"]))
    best = {}
    for r in rows:
        k = r["order_id"]
        if k not in best or rank(r) > rank(best[k]):
            best[k] = r
    return best


def write_json_files(folder, rows, per_file):
    os.makedirs(folder, exist_ok=True)
    import json

    for i in range(0, len(rows), per_file):
        name = os.path.join(folder, f"part [{i // per_file:04d}] ü.json")
        with open(name + ".tmp", "w") as f:
            for r in rows[i:i + per_file]:
                f.write(json.dumps(r) + "\n")
        os.rename(name + ".tmp", name)
        # Distinct modification times keep the file order (Spark orders by mtime).
        t = 1_700_000_000 + i // per_file
        os.utime(name, (t, t))
