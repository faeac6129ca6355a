#!/usr/bin/env bash
# weir and Spark side by side on stateful queries (dedupe within the watermark, windowed
# count); writes BENCHMARKS-stateful.md. Same set-up as bench/spark_vs_weir.sh.
#
#   bench/stateful_vs_spark.sh [--rounds N]
set -euo pipefail
cd "$(dirname "$0")/.."

command -v java >/dev/null || { echo "java (17 or newer) is needed for Spark" >&2; exit 1; }
venv=bench/.venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -c "import pyspark" 2>/dev/null || "$venv/bin/pip" install --quiet "pyspark==4.3.0"
"$venv/bin/python" -c "import pyarrow" 2>/dev/null || "$venv/bin/pip" install --quiet pyarrow

if [ -z "${WEIR_BIN:-}" ]; then
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/root/.cache/weir-target-release}"
  cargo build --release --locked -p weir-cli
  WEIR_BIN="$CARGO_TARGET_DIR/release/weir"
fi

cd bench
exec python3 stateful_vs_spark.py --weir "$WEIR_BIN" --python "$PWD/.venv/bin/python" \
  --write ../BENCHMARKS-stateful.md --command "bench/stateful_vs_spark.sh${*:+ $*}" "$@"
