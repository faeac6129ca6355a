"""The Spark side of bench/stateful_vs_spark.py: the same stateful queries as weir's.

file source (JSON orders, maxFilesPerTrigger) -> withWatermark(updated_at, 10 minutes) ->
  dedupe:  dropDuplicatesWithinWatermark(order_id)
  window:  groupBy(window(updated_at, 1 minute), status).count(), output mode update
-> foreachBatch writing Parquet under out/batch_id=<id> -> availableNow trigger. Writes every
batch's progress (Spark's own JSON) to a file, one line per batch.

usage: python spark_stateful_job.py QUERY INPUT_DIR WORK_DIR MAX_FILES_PER_TRIGGER PROGRESS_FILE
"""
import json
import sys

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

SCHEMA = "order_id BIGINT, status STRING, amount DOUBLE, updated_at TIMESTAMP"


def main():
    query_kind, input_dir, work, per_trigger, progress_file = sys.argv[1:6]
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("weir-bench-stateful")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.numRecentProgressUpdates", "10000")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    stream = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", int(per_trigger))
        .json(input_dir)
        .withWatermark("updated_at", "10 minutes")
    )
    if query_kind == "dedupe":
        out = stream.dropDuplicatesWithinWatermark(["order_id"])
        mode = "append"
    else:
        out = (
            stream.groupBy(F.window("updated_at", "1 minute"), "status")
            .agg(F.count("*").alias("n"))
            .select(
                "status",
                F.col("window.start").alias("window_start"),
                F.col("window.end").alias("window_end"),
                "n",
            )
        )
        mode = "update"

    def write(batch_df, batch_id):
        batch_df.write.mode("overwrite").parquet(f"{work}/out/batch_id={batch_id}")

    query = (
        out.writeStream.outputMode(mode)
        .foreachBatch(write)
        .option("checkpointLocation", f"{work}/checkpoint")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    with open(progress_file, "w") as f:
        for p in query.recentProgress:
            raw = getattr(p, "json", None)
            d = json.loads(raw() if callable(raw) else raw) if raw is not None else dict(p)
            f.write(json.dumps(d) + "\n")
    spark.stop()


if __name__ == "__main__":
    main()
