"""Schemas given to ``.schema(...)``, as the engine's ``"name type"`` columns."""

from .errors import ConfigError

_ARROW = {
    "string": "string", "large_string": "string", "string_view": "string",
    "int64": "bigint", "int32": "int", "int16": "smallint",
    "double": "double", "float": "float", "bool": "boolean",
    "date32[day]": "date", "binary": "binary", "large_binary": "binary",
}


def _split(ddl):
    cols, depth, cur = [], 0, ""
    for ch in ddl:
        if ch == "," and depth == 0:
            cols.append(cur)
            cur = ""
            continue
        depth += ch in "(<"
        depth -= ch in ")>"
        cur += ch
    cols.append(cur)
    return [c.strip() for c in cols if c.strip()]


def _arrow_type(name, t):
    text = str(t)
    if text.startswith("timestamp["):
        return "timestamp" if "tz=" in text else "timestamp_ntz"
    if text in _ARROW:
        return _ARROW[text]
    raise ConfigError(f"schema: column '{name}' has type {text}, which weir cannot read into")


def schema_columns(schema):
    if isinstance(schema, str):
        return _split(schema)
    if isinstance(schema, (list, tuple)):
        return [str(c).strip() for c in schema]
    if hasattr(schema, "names") and hasattr(schema, "types"):  # a pyarrow.Schema
        return [f"{n} {_arrow_type(n, t)}" for n, t in zip(schema.names, schema.types)]
    raise ConfigError(
        "schema: give a DDL string ('order_id BIGINT, updated_at TIMESTAMP'), a list of "
        "'name type' strings or a pyarrow.Schema"
    )
