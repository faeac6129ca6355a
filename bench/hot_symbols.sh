#!/bin/bash
# Regenerates crates/weir-cli/link/hot-symbols.txt, the order file the release `weir`
# binary is linked with (see crates/weir-cli/build.rs).
#
# Runs a release `weir` on small versions of the usual pipelines under valgrind's callgrind
# and lists every function of the binary that ran, so lld places them first and together
# in .text. Without it the code a batch runs (about 6 MB) lies spread over some 50 MB of
# the 140 MB of text, and the kernel maps a 64 KB window around every page it faults in:
# the binary's resident text was 51-58 MB in a 2M-row run, about 15 MB with the order.
#
# Usage: bench/hot_symbols.sh [--kafka HOST:PORT --postgres CONNINFO]
#   WEIR_BIN=path   the release binary to profile (default: build it with cargo). Run the
#                   script again after changes that add or rename hot functions;
#                   a stale list still links (names it lists that no longer exist are
#                   skipped), it only places less of the hot code together.
#   --kafka/--postgres  also profile the worked example (Kafka -> Delta MERGE -> PostgreSQL)
# Needs valgrind and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
kafka="" postgres=""
while [ $# -gt 0 ]; do
  case "$1" in
    --kafka) kafka="${2:?--kafka needs HOST:PORT}"; shift 2 ;;
    --postgres) postgres="${2:?--postgres needs a connection string}"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if { [ -n "$kafka" ] && [ -z "$postgres" ]; } || { [ -z "$kafka" ] && [ -n "$postgres" ]; }; then
  echo "--kafka and --postgres go together (the worked example needs both)" >&2; exit 2
fi
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
if [ -z "${WEIR_BIN:-}" ]; then
  cargo build --release --locked -p weir-cli
  WEIR_BIN="${CARGO_TARGET_DIR:-target}/release/weir"
fi
bin="$(realpath "$WEIR_BIN")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

profile() {
  local name="$1"; shift
  echo "profiling: $name" >&2
  valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/$name.cg" \
    "$bin" "$@" >"$work/$name.log" 2>&1 || { cat "$work/$name.log" >&2; exit 1; }
}

pipeline() { # name input files-per-trigger: the bench's own pipeline (bench/spark_vs_weir.py)
  python3 - "$work" "$@" <<'EOF'
import sys
sys.path.insert(0, "bench")
from spark_vs_weir import NEWEST_PER_ORDER, PIPELINE

work, name, data, per_trigger = sys.argv[1:]
with open(f"{work}/{name}.toml", "w", encoding="utf-8") as f:
    f.write(PIPELINE.format(name=name, work=f"{work}/{name}", input=data,
                            per_trigger=per_trigger, transform=NEWEST_PER_ORDER))
EOF
}

# The bench's two shapes (bench/spark_vs_weir.py) in small: batches of 60k rows (above the
# Parquet sink's 50k rows for encoding on all cores), and of 10 rows.
"$bin" gen --dir "$work/big" --files 4 --rows-per-file 30000 --keys 100000 --seed 7 >/dev/null
"$bin" gen --dir "$work/small" --files 6 --rows-per-file 10 --keys 100 --seed 7 >/dev/null
pipeline throughput "$work/big" 2
pipeline fixed-cost "$work/small" 1
profile throughput run "$work/throughput.toml" --quiet
profile fixed-cost run "$work/fixed-cost.toml" --quiet
# The demo: files -> newest per order -> Delta MERGE and Parquet.
profile demo demo --dir "$work/demo" --files 4 --rows-per-file 2000
if [ -n "$kafka" ] && [ -n "$postgres" ]; then
  profile example demo --dir "$work/example" --files 4 --rows-per-file 2000 \
    --kafka "$kafka" --postgres "$postgres"
fi
# The bench's files path first, then what the demo and the worked example add.
profiles=("$work/throughput.cg" "$work/fixed-cost.cg" "$work/demo.cg")
[ -f "$work/example.cg" ] && profiles+=("$work/example.cg")
python3 bench/hot_symbols.py "$bin" crates/weir-cli/link/hot-symbols.txt "${profiles[@]}"
