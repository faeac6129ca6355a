"""The sinks weir ships, to call inside your ``foreach_batch`` function as
``sink(batch, batch_id)``. Each makes the second write of a replayed batch a no-op:

- :class:`DeltaAppend`: Delta append with an application transaction (txnAppId = the
  query, txnVersion = the batch id) in the same commit; a replay is skipped.
- :class:`DeltaMerge`: newest row per key in the batch, MERGE with an ordering guard and
  the application transaction in one commit.
- :class:`PostgresUpsert`: ledger row + COPY into staging + ``INSERT .. ON CONFLICT DO
  UPDATE .. WHERE guard`` in one transaction.
- :class:`ParquetSink`: file names derived from (batch id, part), written to a temp name
  and renamed.
- :class:`PostgresLedger`: your own SQL, exactly once per batch.

``batch`` may be the batch, a result of ``batch.sql(...)`` or ``weir.cache(...)``, or any
Arrow table (a ``pyarrow.Table``, a ``polars.DataFrame``) made from it. A write that fails
raises :class:`weir.SinkError`: let it propagate, so the batch is not committed.
"""

import json
import os

from . import _weir


class _Sink:
    def __init__(self, kind, config, storage_options=None):
        # A pipeline file's [[sink]] table: type = kind, the other keys in kebab-case.
        table = {"type": kind}
        table.update((k.replace("_", "-"), v) for k, v in config.items() if v is not None)
        storage = {str(k): str(v) for k, v in (storage_options or {}).items()}
        self._native = _weir.Sink(json.dumps(table), json.dumps(storage), os.getcwd())

    @property
    def label(self):
        """The name this sink has in progress reports and errors."""
        return self._native.label

    @property
    def fault_points(self):
        """The points a batch passes in this sink, in order (``WEIR_FAULT`` crash tests)."""
        return list(self._native.fault_points)

    def __call__(self, batch, batch_id):
        self._native(batch, batch_id)

    def __repr__(self):
        return f"{type(self).__name__}({self.label})"


class DeltaAppend(_Sink):
    """Appends each batch to the Delta table at ``path`` (local, ``s3://``, ``az://``,
    ``gs://``), exactly once per batch."""

    def __init__(self, path, *, app_id=None, partition_by=None, optimize_every=None,
                 target_file_size=None, allow_app_id_reuse=False, storage_options=None):
        super().__init__("delta-append", {
            "path": os.fspath(path), "app_id": app_id, "partition_by": partition_by,
            "optimize_every": optimize_every, "target_file_size": target_file_size,
            "allow_app_id_reuse": allow_app_id_reuse or None,
        }, storage_options)


class DeltaMerge(_Sink):
    """Upserts the newest row per ``keys`` (by ``ordering``) into the Delta table at
    ``path``; a stored row is replaced only by a newer one (``s.ordering > t.ordering``)."""

    def __init__(self, path, *, keys, ordering, dedupe=None, update_condition=None,
                 prune_by=None, partition_by=None, null_keys=None, null_ordering=None,
                 app_id=None, optimize_every=None, allow_app_id_reuse=False,
                 storage_options=None):
        super().__init__("delta-merge", {
            "path": os.fspath(path), "keys": list(keys), "ordering": ordering,
            "dedupe": dedupe, "update_condition": update_condition, "prune_by": prune_by,
            "partition_by": partition_by, "null_keys": null_keys,
            "null_ordering": null_ordering, "app_id": app_id,
            "optimize_every": optimize_every, "allow_app_id_reuse": allow_app_id_reuse or None,
        }, storage_options)


class PostgresUpsert(_Sink):
    """Upserts the newest row per ``keys`` into PostgreSQL ``table``, in one transaction
    with the batch's ledger row (``url``: libpq ``host=.. user=..``, a ``postgresql://``
    URL, or ``env:NAME``)."""

    def __init__(self, url, table, *, keys, ordering, ledger=None, staging_table=None,
                 create_table=False, dedupe=None, load=None, null_keys=None,
                 null_ordering=None, app_id=None, allow_app_id_reuse=False):
        super().__init__("postgres-upsert", {
            "url": url, "table": table, "keys": list(keys), "ordering": ordering,
            "ledger": ledger, "staging_table": staging_table,
            "create_table": create_table or None, "dedupe": dedupe, "load": load,
            "null_keys": null_keys, "null_ordering": null_ordering, "app_id": app_id,
            "allow_app_id_reuse": allow_app_id_reuse or None,
        })


class ParquetSink(_Sink):
    """Writes each batch as Parquet files named by batch id into ``path``; a replay
    writes the same files again. ``compression``: ``"snappy"`` (Spark's default),
    ``"zstd"``, ``"lz4"``, ``"gzip"`` or ``"none"``."""

    def __init__(self, path, *, target_rows_per_file=None, compression=None,
                 storage_options=None):
        super().__init__("parquet", {
            "path": os.fspath(path), "target_rows_per_file": target_rows_per_file,
            "compression": compression,
        }, storage_options)


class PostgresLedger:
    """Your own SQL, exactly once per batch: ``run_once(batch, batch_id, statements)``
    runs the statements in one transaction with the ledger row ``(app id, batch id)``; a
    replayed batch finds the row and runs nothing. Statements are SQL strings or
    ``(sql, params)`` pairs (``$1``, ``$2``; params None/bool/int/float/str), or a
    function returning them (called only when the batch has not landed)."""

    def __init__(self, url, ledger, *, app_id=None):
        self._native = _weir.Ledger(url, ledger, app_id)

    def run_once(self, batch, batch_id, statements):
        """True if the statements ran, False if this batch had already landed."""
        return self._native.run_once(batch, batch_id, statements)


__all__ = ["DeltaAppend", "DeltaMerge", "ParquetSink", "PostgresLedger", "PostgresUpsert"]
