"""The Spark side of bench/spark_vs_weir.py: the same query as weir's.

file source (JSON orders, maxFilesPerTrigger) -> foreachBatch: newest row per order_id by a
window, written as Parquet under out/batch_id=<id> (overwrite, so a replay rewrites the same
folder) -> availableNow trigger. Writes every batch's progress (query.recentProgress, the
JSON Spark itself produces) to a file, one line per batch.

usage: python spark_job.py INPUT_DIR WORK_DIR MAX_FILES_PER_TRIGGER PROGRESS_FILE
"""
import json
import sys

from pyspark.sql import SparkSession, Window
from pyspark.sql import functions as F

SCHEMA = "order_id BIGINT, status STRING, amount DOUBLE, updated_at TIMESTAMP"


def session(app):
    """local[2] with the settings both bench jobs use."""
    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # 2 cores: 200 shuffle partitions would make every tiny batch pay for 200 tasks.
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.numRecentProgressUpdates", "10000")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def write_progress(query, progress_file):
    """Every batch with input rows, as Spark's own progress JSON, one line each."""
    with open(progress_file, "w") as f:
        for p in query.recentProgress:
            # PySpark 4 gives dict subclasses whose `json` property is Spark's own JSON.
            raw = getattr(p, "json", None)
            d = json.loads(raw() if callable(raw) else raw) if raw is not None else dict(p)
            if d.get("numInputRows", 0) > 0:
                f.write(json.dumps(d) + "\n")


def main():
    input_dir, work, per_trigger, progress_file = sys.argv[1:5]
    spark = session("weir-bench")

    def newest_per_order(batch_df, batch_id):
        w = Window.partitionBy("order_id").orderBy(F.col("updated_at").desc())
        latest = batch_df.withColumn("rn", F.row_number().over(w)).filter("rn = 1").drop("rn")
        latest.write.mode("overwrite").parquet(f"{work}/out/batch_id={batch_id}")

    query = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", int(per_trigger))
        .json(input_dir)
        .writeStream.foreachBatch(newest_per_order)
        .option("checkpointLocation", f"{work}/checkpoint")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    write_progress(query, progress_file)
    spark.stop()


if __name__ == "__main__":
    main()
