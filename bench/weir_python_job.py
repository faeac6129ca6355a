"""The weir Python side of bench/spark_vs_weir.py: the same query as spark_job.py, written
with the `weir` package (the Rust engine under a PySpark-shaped API).

file source (JSON orders, maxFilesPerTrigger) -> foreach_batch: newest row per order_id by a
window (batch.sql, run by weir's DataFusion), written by weir's Parquet sink (file names by
batch id, so a replay rewrites the same files) -> available_now trigger. Writes every
batch's progress (the engine's report, Spark's keys) to a file, one line per batch.

usage: python weir_python_job.py INPUT_DIR WORK_DIR MAX_FILES_PER_TRIGGER PROGRESS_FILE
"""
import json
import sys

import weir
from weir.sinks import ParquetSink

SCHEMA = "order_id BIGINT, status STRING, amount DOUBLE, updated_at TIMESTAMP"
NEWEST = (
    "SELECT order_id, status, amount, updated_at FROM (SELECT *, row_number() OVER "
    "(PARTITION BY order_id ORDER BY updated_at DESC) AS rn FROM batch) WHERE rn = 1"
)


def main():
    input_dir, work, per_trigger, progress_file = sys.argv[1:5]
    out = ParquetSink(f"{work}/out")

    def newest_per_order(batch, batch_id):
        out(batch.sql(NEWEST), batch_id)

    query = (
        weir.Session().read_stream.format("json").schema(SCHEMA)
        .option("maxFilesPerTrigger", int(per_trigger))
        .load(input_dir)
        .write_stream.foreach_batch(newest_per_order)
        .option("checkpointLocation", f"{work}/checkpoint")
        .query_name("weir-python-bench")
        .trigger(available_now=True)
        .start()
    )
    query.await_termination()
    with open(progress_file, "w") as f:
        for p in query.recent_progress:
            if p.get("numInputRows", 0) > 0:
                f.write(json.dumps(p) + "\n")


if __name__ == "__main__":
    main()
