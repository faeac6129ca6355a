"""weir: Spark Structured Streaming's ``foreachBatch`` contract without a JVM.

Each micro-batch reads a recorded offset range from Kafka or a folder of files and hands the
rows to your function with the batch id; the batch is committed only after the function
returns. After a crash the uncommitted batch runs again with the same rows and id, and the
sinks in :mod:`weir.sinks` make that second write a no-op::

    import weir
    from weir.sinks import DeltaMerge

    spark = weir.Session()
    orders = (spark.read_stream.format("json")
              .schema("order_id BIGINT, status STRING, updated_at TIMESTAMP")
              .option("maxFilesPerTrigger", 20)
              .load("in"))
    silver = DeltaMerge("silver_orders", keys=["order_id"], ordering="updated_at")

    def merge_latest(batch, batch_id):
        silver(batch, batch_id)

    q = (orders.write_stream.foreach_batch(merge_latest)
         .option("checkpointLocation", "chk").query_name("orders")
         .trigger(available_now=True).start())
    q.await_termination()
"""

from contextlib import contextmanager

from . import sinks
from ._weir import Batch, __version__
from .errors import ConfigError, SinkError, StreamingQueryException, WeirError
from .streaming import (
    DataStreamReader,
    DataStreamWriter,
    Session,
    StreamingDataFrame,
    StreamingQuery,
)


@contextmanager
def cache(batch):
    """Spark's ``persist()``/``unpersist()`` around a fan-out: the batch's plan runs once,
    every sink inside the block reads the same rows, and the memory is released when the
    block ends, whether it raised or not::

        with weir.cache(batch.sql(LATEST)) as latest:
            delta(latest, batch_id)
            postgres(latest, batch_id)
    """
    cached = batch.cache()
    try:
        yield cached
    finally:
        cached.unpersist()


__all__ = [
    "Batch",
    "ConfigError",
    "DataStreamReader",
    "DataStreamWriter",
    "Session",
    "SinkError",
    "StreamingDataFrame",
    "StreamingQuery",
    "StreamingQueryException",
    "WeirError",
    "cache",
    "sinks",
    "__version__",
]
