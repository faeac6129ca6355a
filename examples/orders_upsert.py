"""The seed article's worked example in Python: upserting orders into Delta and PostgreSQL.

The `orders` topic carries the full current state of an order on every change (JSON values
with order_id, status, amount, updated_at). Each micro-batch:

1. keeps the newest row per order_id in the batch (a Delta MERGE refuses two source rows
   for one target row; so does ON CONFLICT DO UPDATE),
2. caches that result, because two sinks read it,
3. MERGEs it into a Delta table with the guard s.updated_at > t.updated_at, recording
   (app id, batch id) in the same commit so a replay is skipped,
4. upserts the same rows into PostgreSQL, the write hardest to undo, last: staging rows for
   the batch, then ledger row + INSERT .. ON CONFLICT .. WHERE o.updated_at <
   EXCLUDED.updated_at in one transaction,
5. releases the cache whatever happened; any exception propagates, so the batch is not
   committed and runs again (same offsets, same id) on the next start.

    KAFKA_BOOTSTRAP=localhost:9092 DATABASE_URL='host=localhost user=postgres dbname=postgres' \\
      python examples/orders_upsert.py [--topic orders] [--dir orders-example] [--available-now]
"""

import argparse
import os
import sys

import weir
from weir.sinks import DeltaMerge, PostgresUpsert

# The newest row per order, ties on updated_at broken by the other columns (NULL lowest):
# the rule the sinks' guard compares by, so a row that ties with a stored one is judged the
# same way in the batch and against the table, whatever order the records came in.
LATEST = """
SELECT order_id, status, amount, updated_at FROM (
  SELECT *, row_number() OVER (
    PARTITION BY order_id
    ORDER BY updated_at DESC NULLS LAST, status DESC NULLS LAST, amount DESC NULLS LAST
  ) AS rn
  FROM batch
) WHERE rn = 1
"""


def build_sinks(folder, url):
    """The two writes of a batch, in order. Already deduplicated in the batch function: the
    sinks need not do it again."""
    silver = DeltaMerge(os.path.join(folder, "silver_orders"), keys=["order_id"],
                        ordering="updated_at", dedupe=False)
    postgres = PostgresUpsert(url, "orders", keys=["order_id"], ordering="updated_at",
                              dedupe=False, create_table=True,
                              staging_table="orders_batch_staging", ledger="stream_batches")
    return silver, postgres


def main():
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--topic", default="orders")
    args.add_argument("--dir", default="orders-example", help="folder for the Delta table and the checkpoint")
    args.add_argument("--max-offsets", type=int, default=200_000, help="maxOffsetsPerTrigger")
    args.add_argument("--available-now", action="store_true", help="read what is there, then stop")
    a = args.parse_args()
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("set DATABASE_URL to the PostgreSQL database to upsert into")

    spark = weir.Session()
    orders = (
        spark.read_stream.format("kafka")
        .option("kafka.bootstrap.servers", os.environ.get("KAFKA_BOOTSTRAP", "localhost:9092"))
        .option("subscribe", a.topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", a.max_offsets)
        .option("valueFormat", "json")  # weir: JSON values straight into these columns
        .schema("order_id BIGINT, status STRING, amount DOUBLE, updated_at TIMESTAMP")
        .load()
    )
    silver, postgres = build_sinks(a.dir, url)

    def merge_latest(batch, batch_id):
        # 1-2. newest row per order, run once and cached for both sinks (persist/unpersist).
        with weir.cache(batch.sql(LATEST)) as latest:
            silver(latest, batch_id)     # 3. Delta MERGE + txn(appId, batch_id)
            postgres(latest, batch_id)   # 4. PostgreSQL last

    query = (
        orders.write_stream.foreach_batch(merge_latest)
        .option("checkpointLocation", os.path.join(a.dir, "checkpoint"))
        .query_name("orders-upsert")
        .trigger(**({"available_now": True} if a.available_now else {"processing_time": "30 seconds"}))
        .start()
    )
    print(f"orders-upsert running (query id {query.id}); Ctrl-C stops after the current batch", flush=True)
    query.await_termination()
    p = query.last_progress
    if p:
        print(f"last batch {p['batchId']}: {p['numInputRows']} rows, "
              f"addBatch {p['durationMs']['addBatch']} ms, "
              f"triggerExecution {p['durationMs']['triggerExecution']} ms")


if __name__ == "__main__":
    main()
