"""The PySpark-shaped API: ``Session().read_stream ... .write_stream ... .start()``.

Option names are Spark's (``maxOffsetsPerTrigger``, ``maxFilesPerTrigger``,
``startingOffsets``, ``failOnDataLoss``, ``kafka.*``); each reader/writer method has its
PySpark camelCase alias (``readStream``, ``foreachBatch``, ``awaitTermination``, ...).
"""

import inspect
import json
import os

from . import _weir
from ._schema import schema_columns
from .errors import ConfigError

# Spark's option name -> (weir config key, type). Keys not listed are refused by name.
_FILE_OPTIONS = {
    "path": ("path", str),
    "maxFilesPerTrigger": ("max-files-per-trigger", int),
    "latestFirst": ("latest-first", bool),
    "maxFileAge": ("max-file-age", str),
    "mode": ("mode", str),
    "cleanSource": ("clean-source", str),
    "sourceArchiveDir": ("source-archive-dir", str),
    # weir's own: a folder for malformed lines (JSON), and how long a call may take.
    "deadLetter": ("dead-letter", str),
    "timeout": ("timeout", str),
}
_CSV_OPTIONS = {
    "header": ("csv-header", bool),
    "sep": ("csv-delimiter", str),
    "delimiter": ("csv-delimiter", str),
}
_KAFKA_OPTIONS = {
    "kafka.bootstrap.servers": ("bootstrap-servers", str),
    "subscribe": ("subscribe", list),
    "subscribePattern": ("subscribe-pattern", str),
    "startingOffsets": ("starting-offsets", str),
    "maxOffsetsPerTrigger": ("max-offsets-per-trigger", int),
    "minOffsetsPerTrigger": ("min-offsets-per-trigger", int),
    "maxTriggerDelay": ("max-trigger-delay", str),
    "failOnDataLoss": ("fail-on-data-loss", bool),
    "includeHeaders": ("include-headers", bool),
    # weir's own: decode JSON values into the .schema(...) columns instead of Spark's
    # binary `value` column (valueFormat="json"), and what a malformed value does.
    "valueFormat": ("value-format", str),
    "mode": ("mode", str),
    "commitToGroup": ("commit-to-group", str),
    # What a null value becomes ("row", "skip", "delete"), the column a delete's Kafka
    # timestamp goes to, a folder for bad records, and how long a call may take.
    "tombstones": ("tombstones", str),
    "tombstoneTimestamp": ("tombstone-timestamp", str),
    "deadLetter": ("dead-letter", str),
    "timeout": ("timeout", str),
}
_RATE_OPTIONS = {
    "rowsPerSecond": ("rows-per-second", int),
    "maxOffsetsPerTrigger": ("max-offsets-per-trigger", int),
}
_FORMATS = {"json": "files", "csv": "files", "parquet": "files", "kafka": "kafka", "rate": "rate"}


def _text(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _convert(fmt, name, value, kind):
    where = f"option '{name}' of format '{fmt}'"
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "false"):
            return text == "true"
        raise ConfigError(f"{where}: '{value}' is not true or false")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: '{value}' is not a whole number")
        try:
            number = int(str(value).strip())
        except ValueError:
            raise ConfigError(f"{where}: '{value}' is not a whole number") from None
        if number < 0:
            raise ConfigError(f"{where}: {number} is negative")
        return number
    if kind is list:
        if isinstance(value, (list, tuple)):
            return [str(v).strip() for v in value]
        return [t.strip() for t in str(value).split(",") if t.strip()]
    return _text(value)


class Session:
    """The entry point (Spark's ``SparkSession``). ``storage_options`` are object-store
    settings for ``s3://``, ``az://`` and ``gs://`` paths (``aws_endpoint``,
    ``aws_region``, ...; a value ``env:NAME`` is read from the environment).

    ``cluster`` runs the batches on ``weir worker`` processes, as a pipeline file's
    ``[cluster]`` table: ``{"workers": ["http://10.0.0.5:7400", ...], "token":
    "env:WEIR_CLUSTER_TOKEN", "max_batch_attempts": 3, "connect_timeout": "5s"}``. This
    process is the driver and keeps the checkpoint; the function gets the rows the workers
    computed."""

    def __init__(self, storage_options=None, cluster=None):
        self._storage = {str(k): _text(v) for k, v in (storage_options or {}).items()}
        self._cluster = None
        if cluster is not None:
            if not isinstance(cluster, dict):
                raise ConfigError("cluster: a dict such as {'workers': ['http://host:7400']}")
            self._cluster = {str(k).replace("_", "-"): v for k, v in cluster.items()}

    @property
    def read_stream(self):
        return DataStreamReader(self)

    readStream = read_stream


class DataStreamReader:
    """Spark's ``DataStreamReader``: ``format``, ``option``, ``schema``, ``load``."""

    def __init__(self, session):
        self._session = session
        self._format = None
        self._options = {}
        self._schema = None

    def format(self, source):
        fmt = str(source).lower()
        if fmt not in _FORMATS:
            raise ConfigError(
                f"format '{source}' is not supported: use kafka, json, csv, parquet or rate"
            )
        self._format = fmt
        return self

    def option(self, key, value):
        self._options[str(key)] = value
        return self

    def options(self, **options):
        for k, v in options.items():
            self.option(k, v)
        return self

    def schema(self, schema):
        """A DDL string (``"order_id BIGINT, updated_at TIMESTAMP"``), a list of
        ``"name type"`` strings, or a ``pyarrow.Schema``."""
        columns = schema_columns(schema)
        # Checked here, as the engine reads it: a bad type is refused at the line that
        # wrote it, naming the word.
        _weir.check_schema(columns)
        self._schema = columns
        return self

    def load(self, path=None):
        if self._format is None:
            raise ConfigError("call .format(...) before .load(): kafka, json, csv, parquet or rate")
        options = dict(self._options)
        if path is not None:
            options["path"] = os.fspath(path)
        kind = _FORMATS[self._format]
        return StreamingDataFrame(self._session, kind, self._config(kind, options), [])

    def _config(self, kind, options):
        fmt = self._format
        config = {}
        if kind == "files":
            table = dict(_FILE_OPTIONS)
            if fmt == "csv":
                table.update(_CSV_OPTIONS)
            config["format"] = fmt
        elif kind == "kafka":
            table = _KAFKA_OPTIONS
        else:
            table = _RATE_OPTIONS
        kafka = {}
        for name, value in options.items():
            if name in table:
                key, typ = table[name]
                config[key] = _convert(fmt, name, value, typ)
            elif kind == "kafka" and name.startswith("kafka."):
                # librdkafka's settings, as Spark passes kafka.* to the consumer.
                kafka[name[len("kafka."):]] = _text(value)
            else:
                known = ", ".join(sorted(table))
                extra = ", kafka.<librdkafka setting>" if kind == "kafka" else ""
                raise ConfigError(f"unknown option '{name}' for format '{fmt}' (known: {known}{extra})")
        if kafka:
            config["kafka"] = kafka
        if self._schema is not None:
            if kind == "rate":
                raise ConfigError("the rate source has a fixed schema (timestamp, value)")
            config["schema"] = self._schema
        if kind == "files" and "path" not in config:
            raise ConfigError(f"format '{fmt}' needs a folder: .load(path) or .option('path', ...)")
        if kind == "kafka" and "bootstrap-servers" not in config:
            raise ConfigError("format 'kafka' needs .option('kafka.bootstrap.servers', 'host:port')")
        if "mode" in config:
            config["mode"] = config["mode"].upper()
        if kind == "files" and "clean-source" in config:
            config["clean-source"] = config["clean-source"].lower()
        if fmt == "csv" and "csv-header" not in config:
            config["csv-header"] = False  # Spark's default: the first line is a row
        if kind == "rate" and "rows-per-second" not in config:
            config["rows-per-second"] = 1
        return config


class StreamingDataFrame:
    """A streaming source with its stateful steps (Spark's streaming ``DataFrame``): the
    rows reach your function as a :class:`weir.Batch` per micro-batch."""

    def __init__(self, session, kind, config, steps):
        self._session = session
        self._kind = kind
        self._config = config
        self._steps = steps

    def _then(self, step):
        return StreamingDataFrame(self._session, self._kind, self._config, self._steps + [step])

    def with_watermark(self, event_time, delay_threshold):
        """Spark's ``withWatermark("updated_at", "10 minutes")``."""
        return self._then({"with-watermark": {"column": event_time, "delay": str(delay_threshold)}})

    withWatermark = with_watermark

    def drop_duplicates(self, subset):
        """Spark's streaming ``dropDuplicates(subset)``: each key once, the state kept in
        the checkpoint (bounded by the watermark when the event-time column is a key)."""
        return self._then({"drop-duplicates": _columns("drop_duplicates", subset)})

    dropDuplicates = drop_duplicates

    def drop_duplicates_within_watermark(self, subset):
        """Spark's ``dropDuplicatesWithinWatermark(subset)`` (needs ``with_watermark``)."""
        return self._then({"drop-duplicates-within-watermark": _columns("drop_duplicates_within_watermark", subset)})

    dropDuplicatesWithinWatermark = drop_duplicates_within_watermark

    @property
    def write_stream(self):
        return DataStreamWriter(self)

    writeStream = write_stream


def _columns(what, subset):
    if isinstance(subset, str):
        subset = [subset]
    cols = [str(c) for c in (subset or [])]
    if not cols or any(not c for c in cols):
        raise ConfigError(f"{what}: give the key columns by name")
    return cols


class DataStreamWriter:
    """Spark's ``DataStreamWriter`` for ``foreachBatch``."""

    def __init__(self, frame):
        self._frame = frame
        self._fn = None
        self._name = None
        self._checkpoint = None
        self._state_partitions = None
        self._retry = {}
        self._lease = {}
        self._trigger = "0"

    def foreach_batch(self, func):
        """``func(batch, batch_id)`` runs once per attempt of each batch; the batch is
        committed when it returns. An exception stops the query; the batch runs again
        (same rows, same id) on the next start. A ``ConnectionError`` or ``TimeoutError``
        (a server down, a connection cut) runs the batch again after a pause instead, as
        the ``retry*`` options say (default: 10 runs, pauses from 1 s doubling up to 60 s)."""
        if not callable(func):
            raise ConfigError("foreach_batch needs a function (batch, batch_id)")
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func) \
                or inspect.isgeneratorfunction(func):
            raise ConfigError(
                "foreach_batch needs a plain function: an async function or a generator would "
                "return before its body ran, and the batch would be committed unwritten"
            )

        def checked(batch, batch_id):
            result = func(batch, batch_id)
            if inspect.isawaitable(result) or inspect.isgenerator(result):
                if hasattr(result, "close"):
                    result.close()
                raise TypeError(
                    f"the function returned {type(result).__name__} for batch {batch_id}: its "
                    "body did not run; give foreach_batch a plain function"
                )
            return result

        self._fn = checked
        return self

    foreachBatch = foreach_batch

    def option(self, key, value):
        if key == "checkpointLocation":
            self._checkpoint = os.fspath(value)
        elif key in ("statePartitions", "spark.sql.shuffle.partitions"):
            # The partitions of the stateful operators' state (weir's own name; Spark's
            # setting is accepted too): fixed once the state is written.
            if isinstance(value, bool) or int(value) != value or int(value) < 1:
                raise ConfigError(f"writer option '{key}' must be a whole number of at least 1")
            self._state_partitions = int(value)
        elif key == "retryAttempts":
            # Runs of a batch that fails with an error that may pass (ConnectionError,
            # TimeoutError, a server down) before the query stops; 1: no retry.
            if isinstance(value, bool) or int(value) != value or int(value) < 1:
                raise ConfigError(f"writer option '{key}' must be a whole number of at least 1")
            self._retry["attempts"] = int(value)
        elif key in ("retryInitial", "retryMax"):
            # The first pause between runs, doubling up to the longest: "500ms", "30s", "1m".
            self._retry["initial" if key == "retryInitial" else "max"] = str(value)
        elif key in ("leaseWait", "leaseTtl"):
            # How long a start waits for another holder of the checkpoint to let it go
            # (default: refuse at once), and an object-store lease's time to live.
            self._lease["wait" if key == "leaseWait" else "ttl"] = str(value)
        else:
            raise ConfigError(
                f"unknown writer option '{key}' (known: checkpointLocation, statePartitions, "
                "retryAttempts, retryInitial, retryMax, leaseWait, leaseTtl)"
            )
        return self

    def options(self, **options):
        for k, v in options.items():
            self.option(k, v)
        return self

    def query_name(self, name):
        self._name = str(name)
        return self

    queryName = query_name

    def trigger(self, processing_time=None, once=None, available_now=None, processingTime=None,
                availableNow=None):
        """One of ``processing_time="30 seconds"``, ``once=True``, ``available_now=True``
        (the default, as in Spark, is a new batch as soon as the previous one ends)."""
        processing_time = processing_time if processing_time is not None else processingTime
        available_now = available_now if available_now is not None else availableNow
        given = [x for x in (processing_time, once, available_now) if x is not None]
        if len(given) != 1:
            raise ConfigError("trigger: give exactly one of processing_time, once, available_now")
        if processing_time is not None:
            self._trigger = str(processing_time)
        elif once:
            self._trigger = "once"
        elif available_now:
            self._trigger = "available-now"
        else:
            raise ConfigError("trigger: once=False / available_now=False is not a trigger")
        return self

    def _spec(self):
        if self._fn is None:
            raise ConfigError("call .foreach_batch(func) before .start()")
        if not self._checkpoint:
            raise ConfigError(
                "option 'checkpointLocation' is required: the offsets and commits of each batch "
                "are kept there (exactly-once needs them)"
            )
        f = self._frame
        return json.dumps({
            "source": dict(f._config, type=f._kind),
            "storage": f._session._storage,
            "cluster": f._session._cluster,
            "steps": f._steps,
            "name": self._name or "weir",
            "checkpoint": self._checkpoint,
            "trigger": self._trigger,
            "state-partitions": self._state_partitions,
            "retry": self._retry,
            "lease-wait": self._lease.get("wait"),
            "lease-ttl": self._lease.get("ttl"),
            "base": os.getcwd(),
        })

    def start(self):
        """Starts the query: returns once its checkpoint, source and sinks are open."""
        spec = self._spec()
        return StreamingQuery(_weir.start_query(spec, self._fn))


class StreamingQuery:
    """Spark's ``StreamingQuery``: ``id``, ``run_id``, ``last_progress``,
    ``await_termination``, ``stop``, ``exception``."""

    def __init__(self, native):
        self._q = native

    @property
    def id(self):
        return self._q.id

    @property
    def run_id(self):
        return self._q.run_id

    runId = run_id

    @property
    def name(self):
        return self._q.name

    @property
    def is_active(self):
        return self._q.is_active

    isActive = is_active

    @property
    def last_progress(self):
        """The newest progress report as a dict with Spark's keys, or None."""
        p = self._q.last_progress()
        return None if p is None else json.loads(p)

    lastProgress = last_progress

    @property
    def recent_progress(self):
        """Up to the last 100 progress reports (dicts), oldest first."""
        return [json.loads(p) for p in self._q.recent_progress()]

    recentProgress = recent_progress

    def await_termination(self, timeout=None):
        """Waits for the end (``timeout`` in seconds: returns False if still running).
        Raises :class:`weir.StreamingQueryException` if a batch failed. Ctrl-C stops the
        query after the batch in progress."""
        return self._q.await_termination(timeout)

    awaitTermination = await_termination

    def stop(self):
        """Stops after the batch in progress (committed, not cut off) and waits."""
        self._q.stop()

    def exception(self):
        """The :class:`weir.StreamingQueryException` the query failed with, or None."""
        return self._q.exception()

    def __repr__(self):
        return f"StreamingQuery(name={self.name!r}, id={self.id}, active={self.is_active})"
