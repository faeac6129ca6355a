"""The README's Python example runs as written and leaves what it promises."""

import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from conftest import ROOT, newest_per_key, orders, write_json_files


def readme_block():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_example_runs_as_written(tmp_path):
    rows = orders(400, 60, seed=21)
    write_json_files(tmp_path / "in", rows, 50)  # 8 files, 2 per batch
    (tmp_path / "example.py").write_text(readme_block())
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert [l for l in r.stdout.splitlines() if l.startswith("batch ")] == [
        f"batch {i}: 100 rows" for i in range(4)]
    want = newest_per_key(rows)
    got = DeltaTable(str(tmp_path / "silver_orders")).to_pyarrow_table().to_pylist()
    assert {g["order_id"]: g["status"] for g in got} == {k: v["status"] for k, v in want.items()}
    # applied: per batch, the newest row per key that is paid.
    expect = 0
    for b in range(4):
        chunk = rows[b * 100:(b + 1) * 100]
        expect += sum(1 for v in newest_per_key(chunk).values() if v["status"] == "paid")
    files = [f for f in os.listdir(tmp_path / "applied") if f.endswith(".parquet")]
    got_rows = pa.concat_tables([pq.read_table(tmp_path / "applied" / f) for f in files]).num_rows
    assert got_rows == expect > 0
