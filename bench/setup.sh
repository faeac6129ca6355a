# Sourced by the bench scripts (run from the repository root): PySpark in bench/.venv
# (Java 17 must be on the machine) and the weir binary in $WEIR_BIN (built in release mode
# unless given; a cold build takes long on 2 cores, CARGO_TARGET_DIR outside the clone is
# reused).
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
# The release binary is linked with its hot code first (crates/weir-cli/build.rs); say how
# much of that list this build matched, since a stale list costs memory, not correctness.
if command -v nm >/dev/null; then
  python3 bench/hot_symbols.py --check "$WEIR_BIN" crates/weir-cli/link/hot-symbols.txt || true
fi
