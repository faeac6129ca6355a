#!/usr/bin/env bash
# weir and Spark side by side on stateful queries (dedupe within the watermark, windowed
# count); writes BENCHMARKS-stateful.md. Same set-up as bench/spark_vs_weir.sh.
#
#   bench/stateful_vs_spark.sh [--rounds N]
set -euo pipefail
cd "$(dirname "$0")/.."

. bench/setup.sh

exec python3 bench/stateful_vs_spark.py --weir "$WEIR_BIN" --python "$venv/bin/python" \
  --write BENCHMARKS-stateful.md --command "bench/stateful_vs_spark.sh${*:+ $*}" "$@"
