# source scripts/gpu/steps.sh  -- defines `step NAME SECONDS CMD...` for GPU runs: runs CMD under a timeout,
# logs to $LOGS/NAME.log, prints rc and the log's tail; `pack` tars all logs into $OUT/logs.tgz
# (a run returns at most 8 files, so logs travel as one archive).
export LOGS="${LOGS:-/tmp/futx-logs}"; mkdir -p "$LOGS"
step() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n "${TAILN:-4}" "$LOGS/$name.log" | cut -c1-220
}
pack() { tar -C "$LOGS" -czf "$OUT/logs.tgz" . && echo "logs -> logs.tgz"; }
