#!/usr/bin/env bash
# weir and Spark side by side on the same files and query; writes BENCHMARKS.md.
#
#   bench/spark_vs_weir.sh [--rounds N]
#
# Installs pyspark from PyPI into a virtualenv (bench/.venv; Java 17 must be on the machine),
# builds the weir binary in release mode (or uses $WEIR_BIN) and the Python wheel (or installs
# $WEIR_WHEEL), then runs the engines
# alternately (bench/spark_vs_weir.py). A cold release build takes long on 2 cores (~45 min
# here); CARGO_TARGET_DIR is kept outside the clone so it is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

. bench/setup.sh

# The Python package (release wheel) in the same venv, for the Python column.
if [ -z "${WEIR_WHEEL:-}" ]; then
  "$venv/bin/pip" install --quiet "maturin==1.16.0"
  wheels="$(mktemp -d)"
  (cd crates/weir-python && "../../$venv/bin/maturin" build --release --locked -q -o "$wheels")
  WEIR_WHEEL="$(ls "$wheels"/weir-*.whl)"
fi
"$venv/bin/pip" install --quiet --force-reinstall --no-deps "$WEIR_WHEEL"

exec python3 bench/spark_vs_weir.py --weir "$WEIR_BIN" --python "$venv/bin/python" \
  --weir-python "$venv/bin/python" \
  --write BENCHMARKS.md --command "bench/spark_vs_weir.sh${*:+ $*}" "$@"
