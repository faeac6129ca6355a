#!/usr/bin/env bash
# Speed and memory of a stateful deduplication (`drop-duplicates = ["order_id"]`, no
# watermark: the state grows with every distinct key) for a number of state partitions.
# Prints one JSON line: rows/s over the run, peak RSS, RSS per key in the state (the
# peak less that of a run over the first 4 files, one batch of the same size, per key
# more: what a batch itself holds is in both), memoryUsedBytes per key, and the median
# triggerExecution of the batches.
#
#   weir gen --dir /tmp/keys --files 40 --rows-per-file 100000 --keys 100000000
#   for p in 1 2 8; do scripts/bench-state.sh target/release/weir /tmp/keys $p; done
#
# INPUT: a folder of JSON order files (4 files a batch). Figures in the README ("Stateful
# queries") and the closing notes.
set -euo pipefail
BIN=$(realpath "$1"); INPUT=$(realpath "$2"); PARTS=$3
D=$(mktemp -d); trap 'rm -rf "$D"' EXIT
cd "$D"
run() {  # run NAME FILES...: a checkpoint and output of its own over the files given
  local name=$1; shift
  mkdir -p "$name/in"
  for f in "$@"; do ln -s "$f" "$name/in/"; done
  cat > "$name/p.toml" <<EOF
[query]
name = "state"
checkpoint = "chk"
trigger = "available-now"
state-partitions = $PARTS

[source]
type = "files"
path = "in"
format = "json"
schema = ["order_id bigint", "status string", "amount double", "updated_at timestamp"]
max-files-per-trigger = 4

[transform]
drop-duplicates = ["order_id"]

[[sink]]
type = "parquet"
path = "out"
EOF
  (cd "$name" && /usr/bin/time -f '%M %e' -o time.txt "$BIN" run p.toml --progress progress.jsonl \
    >/dev/null 2>err.txt) || { cat "$name/err.txt" >&2; exit 1; }
}
mapfile -t files < <(ls "$INPUT"/*.json | sort)
run small "${files[@]:0:4}"
run full "${files[@]}"
python3 - "$PARTS" <<'EOF'
import json, statistics, sys
def load(name):
    rows = [json.loads(l) for l in open(f"{name}/progress.jsonl")]
    rss_kb, secs = open(f"{name}/time.txt").read().split()
    op = rows[-1]["stateOperators"][0]
    return rows, int(rss_kb) * 1024, float(secs), op
rows, rss, secs, op = load("full")
_, rss0, _, op0 = load("small")
keys, keys0 = op["numRowsTotal"], op0["numRowsTotal"]
n = sum(r["numInputRows"] for r in rows)
print(json.dumps({
    "statePartitions": int(sys.argv[1]),
    "rows": n,
    "keys": keys,
    "seconds": secs,
    "rowsPerSecond": round(n / secs),
    "peakRssMB": round(rss / 2**20),
    "rssBytesPerKey": round((rss - rss0) / max(1, keys - keys0), 1),
    "memoryUsedBytesPerKey": round(op["memoryUsedBytes"] / max(1, keys), 1),
    "medianTriggerMs": statistics.median(r["durationMs"]["triggerExecution"] for r in rows),
}))
EOF
