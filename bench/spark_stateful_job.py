"""The Spark side of bench/stateful_vs_spark.py: the same stateful queries as weir's.

file source (JSON orders, maxFilesPerTrigger) -> withWatermark(updated_at, 10 minutes) ->
  dedupe:  dropDuplicatesWithinWatermark(order_id)
  window:  groupBy(window(updated_at, 1 minute), status).count(), output mode update
-> foreachBatch writing Parquet under out/batch_id=<id> -> availableNow trigger. Writes every
batch with input rows' progress (Spark's own JSON) to a file, one line per batch.

usage: python spark_stateful_job.py QUERY INPUT_DIR WORK_DIR MAX_FILES_PER_TRIGGER PROGRESS_FILE
"""
import sys

from pyspark.sql import functions as F

from spark_job import SCHEMA, session, write_progress


def main():
    query_kind, input_dir, work, per_trigger, progress_file = sys.argv[1:6]
    spark = session("weir-bench-stateful")
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
    write_progress(query, progress_file)
    spark.stop()


if __name__ == "__main__":
    main()
