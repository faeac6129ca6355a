"""A Spark Structured Streaming query over a folder of JSON order files, writing a checkpoint
that weir must be able to continue: readStream json (maxFilesPerTrigger 1), foreachBatch,
availableNow.

    python file_query.py INPUT CHECKPOINT OUT [--fail-at N] [--stateful]

--fail-at N raises in batch N (Spark then leaves offsets/N without commits/N);
--stateful adds a dropDuplicates on order_id (a state store in the checkpoint).
"""
import sys

from pyspark.sql import SparkSession
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType, TimestampType

input_dir, checkpoint, out = sys.argv[1], sys.argv[2], sys.argv[3]
fail_at = int(sys.argv[sys.argv.index("--fail-at") + 1]) if "--fail-at" in sys.argv else -1
stateful = "--stateful" in sys.argv

spark = (
    SparkSession.builder.master("local[1]")
    .appName("weir-continuation")
    .config("spark.ui.enabled", "false")
    .config("spark.sql.shuffle.partitions", "2")
    .config("spark.sql.session.timeZone", "UTC")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
schema = StructType(
    [
        StructField("order_id", LongType()),
        StructField("status", StringType()),
        StructField("amount", DoubleType()),
        StructField("updated_at", TimestampType()),
    ]
)
df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(input_dir)
if stateful:
    df = df.dropDuplicates(["order_id"])


def write(batch_df, batch_id):
    if batch_id == fail_at:
        raise RuntimeError(f"failing batch {batch_id} on purpose")
    batch_df.write.mode("append").parquet(f"{out}/batch={batch_id}")


q = (
    df.writeStream.foreachBatch(write)
    .option("checkpointLocation", checkpoint)
    .trigger(availableNow=True)
    .start()
)
try:
    q.awaitTermination()
except Exception as e:  # the failing batch
    print(f"spark query failed: {e}", file=sys.stderr)
    sys.exit(3)
