#!/usr/bin/env bash
# CPU and bytes of one pipeline with N `weir worker`s on this machine (N = 0: no [cluster]).
# Prints one line: driver CPU per batch, worker CPU per input row, bytes the workers sent
# per row (their write() bytes less the Parquet parts they wrote: the Flight streams).
#
#   weir gen --dir /tmp/in --files 60 --rows-per-file 20000 --keys 100000 \
#     [--kafka 127.0.0.1:9092 --topic orders --partitions 6]
#   for n in 0 1 2 3; do scripts/bench-cluster.sh target/release/weir /tmp/in $n group; done
#   for n in 0 1 2 3; do scripts/bench-cluster.sh target/release/weir kafka://127.0.0.1:9092/orders $n newest; done
#
# INPUT: a folder of JSON files (6 files a batch) or kafka://BROKERS/TOPIC (120,000 records
# a batch). KIND: `pass` (a filter: every row goes back to the driver), `group` (GROUP BY
# status: partial aggregates shuffle between workers) or `newest` (the seed's query: the
# newest row per order_id by a row_number() window, shuffled by order_id), `dedupe`
# (`drop-duplicates = ["order_id"]`, 8 state partitions: on a cluster they run as the
# workers' tasks) or `dedupe-wm` (a 10-minute watermark and
# `drop-duplicates-within-watermark`) or `window` (a one-minute windowed count, sum and
# approx_count_distinct per status, append mode: its state partitions on the workers too).
# SINK=delta-append in the environment writes a Delta table instead of Parquet parts;
# SINK=delta-merge MERGEs by order_id (newest updated_at); SINK=postgres-upsert upserts into
# a new table of the server at PG_URL (its CPU is not counted; the workers' bytes sent then
# include their COPY data). Use `pass` or `newest` with the last two.
# Figures in BENCHMARKS-distributed.md.
set -euo pipefail
BIN=$(realpath "$1"); INPUT=$2; N=$3; KIND=$4; SINK=${SINK:-parquet}
case $INPUT in
  kafka://*) rest=${INPUT#kafka://}; SOURCE="type = \"kafka\"
bootstrap-servers = \"${rest%%/*}\"
subscribe = [\"${rest#*/}\"]
max-offsets-per-trigger = 120000
value-format = \"json\"";;
  *) INPUT=$(realpath "$INPUT"); SOURCE="type = \"files\"
path = \"in\"
format = \"json\"
max-files-per-trigger = 6";;
esac
D=$(mktemp -d); cd $D
case $INPUT in kafka://*) ;; *) cp -r "$INPUT" in;; esac
case $KIND in
  pass) SQL="SELECT order_id, status, amount, updated_at FROM batch WHERE amount IS NOT NULL";;
  group) SQL="SELECT status, count(*) AS n, sum(amount) AS total FROM batch GROUP BY status";;
  newest) SQL="SELECT order_id, status, amount, updated_at FROM (SELECT *, row_number() OVER (PARTITION BY order_id ORDER BY updated_at DESC) AS rn FROM batch) WHERE rn = 1";;
esac
case $KIND in
  dedupe) TRANSFORM='drop-duplicates = ["order_id"]';;
  dedupe-wm) TRANSFORM='with-watermark = { column = "updated_at", delay = "10 minutes" }
drop-duplicates-within-watermark = ["order_id"]';;
  window) TRANSFORM='with-watermark = { column = "updated_at", delay = "1 minute" }
[transform.aggregate]
group-by = ["status"]
window = { column = "updated_at", size = "1 minute" }
aggregates = ["count(*) AS n", "sum(amount) AS total", "approx_count_distinct(order_id) AS ids"]
output-mode = "append"';;
  *) TRANSFORM="sql = \"$SQL\"";;
esac
SINK_TOML="type = \"$SINK\"
path = \"out\""
case $SINK in
  delta-merge) SINK_TOML+="
keys = [\"order_id\"]
ordering = \"updated_at\"";;
  postgres-upsert) SINK_TOML="type = \"postgres-upsert\"
url = \"${PG_URL:?set PG_URL to the server to write to}\"
table = \"cb_$$_$N\"
keys = [\"order_id\"]
ordering = \"updated_at\"
create-table = true";;
esac
PIDS=(); URLS=()
for i in $(seq 1 $N); do
  $BIN worker --listen 127.0.0.1:0 > w$i.log 2>&1 & PIDS+=($!)
done
sleep 1
for i in $(seq 1 $N); do URLS+=("\"$(grep -o 'http://[0-9.:]*' w$i.log)\""); done
CL=""
if [ $N -gt 0 ]; then CL="[cluster]
workers = [$(IFS=,; echo "${URLS[*]}")]"; fi
cat > p.toml <<EOT
[query]
name = "cb"
checkpoint = "chk"
trigger = "available-now"
state-partitions = 8
[source]
$SOURCE
schema = ["order_id bigint", "status string", "amount double", "updated_at timestamp"]
[transform]
$TRANSFORM
[[sink]]
$SINK_TOML
$CL
EOT
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
io() { awk '/^(rchar|wchar)/{print $2}' /proc/$1/io | paste -sd' '; }
declare -A C0; declare -A IO0
for p in ${PIDS[@]+"${PIDS[@]}"}; do C0[$p]=$(cpu $p); IO0[$p]="$(io $p)"; done
/usr/bin/time -f "%U %S %e %M" -o drv.time $BIN run p.toml --quiet --progress prog.jsonl
read U S E M < drv.time
WCPU=0; WOUT=0; WIN=0
TCK=$(getconf CLK_TCK)
for p in ${PIDS[@]+"${PIDS[@]}"}; do
  c=$(( $(cpu $p) - ${C0[$p]} )); WCPU=$((WCPU + c))
  read r1 w1 <<< "$(io $p)"; read r0 w0 <<< "${IO0[$p]}"
  WOUT=$((WOUT + w1 - w0)); WIN=$((WIN + r1 - r0))
  kill $p
done
OUT=0; [ -d out ] && OUT=$(find out -name '*.parquet' -not -path '*/_delta_log/*' -printf '%s\n' | awk '{s+=$1} END {print s+0}')
ROWS=$(python3 -c "import json;print(sum(json.loads(l)['numInputRows'] for l in open('prog.jsonl')))")
B=$(wc -l < prog.jsonl)
python3 - <<PY
rows=$ROWS; b=$B; tck=$TCK
drv=$U+$S; w=$WCPU/tck
# The files the workers wrote are not bytes sent (only file sinks written on the workers).
sub = $OUT if $N and "$SINK" in ("parquet", "delta-append") else 0
print(f"workers=$N kind=$KIND batches={b} rows={rows} wall_s=$E driver_cpu_s={drv:.2f} driver_cpu_ms_per_batch={1000*drv/b:.1f} driver_peak_rss_mb={$M/1024:.1f} worker_cpu_s={w:.2f} worker_cpu_us_per_row={1e6*w/rows if $N else 0:.2f} total_cpu_us_per_row={1e6*(drv+w)/rows:.2f} worker_bytes_sent_per_row={max(0, $WOUT - sub)/rows:.1f} worker_bytes_read_per_row={$WIN/rows:.1f} parquet_bytes_per_row={$OUT/rows:.1f}")
PY
cd /; rm -rf $D
