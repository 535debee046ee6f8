#!/usr/bin/env bash
# The fault table: each fault injected into a real CPU sweep (dist executor, gloo), what happened,
# and how many rows were lost. Writes reports/recorded/fault_table.md (or $1).
#   bash benchmarks/fault_table.sh [OUT.md]
# Needs about 3 minutes on 2 cores; the disk-full case mounts a tiny tmpfs (root), else it patches
# the write to fail.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-reports/recorded/fault_table.md}
WORK=$(mktemp -d)
trap 'umount "$WORK/tiny" 2>/dev/null; rm -rf "$WORK"' EXIT
# 8 trials of ~1 s each (more under load): ring attention that sleeps 0.3 s per call (tests/plugins/faulty.py), at P = 2
cat > "$WORK/fault.yaml" <<YAML
name: fault
sweep: {methods: [slow], world_size: [2], seq_len: [64, 96, 128, 160], heads: [2], kv_heads: [2], head_dim: [8],
        causal: [true], passes: [fwd, fwd_bwd]}
run: {warmup: 0, repeats: 1, breakdown: false, plugins: [tests.plugins.faulty], device: cpu}
tracking: {mlflow: false}
results: {root: $WORK/results}
YAML
RUN="$PY -m suite run $WORK/fault.yaml --no-progress"
rows() { # rows, distinct keys, damaged lines of the latest run folder
  $PY - "$WORK/results/fault" <<'PYEOF'
import json, sys, warnings
from pathlib import Path
from suite.results import ResultsStore
runs = sorted(Path(sys.argv[1]).glob("*"))
if not runs:
    print("0 0 0"); sys.exit()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    s = ResultsStore(runs[-1]); r = s.records()
print(len(r), len({x["key"] for x in r}), len(s.damaged))
PYEOF
}
workers_left() { # worker processes of a killed parent still alive after 15 s
  sleep 15; local n=0
  for p in $1; do [ -e /proc/$p ] && ! grep -q '^[0-9]* ([^)]*) Z' /proc/$p/stat && n=$((n + 1)); done; echo $n
}
children() { ps -o pid= --ppid "$1" | tr '\n' ' '; }
wait_rows() { # until the running sweep has stored $1 rows (the fault then lands mid-sweep)
  for _ in $(seq 600); do
    local f; f=$(ls "$WORK"/results/fault/*/trials.jsonl 2>/dev/null | tail -1)
    [ -n "$f" ] && [ "$(grep -c '' "$f")" -ge "$1" ] && return
    sleep 0.5
  done
}
table=()
add() { table+=("| $1 | $2 | $3 |"); echo "$1: $2 -> $3" >&2; }

# 1. kill -9 mid-sweep, then --resume
rm -rf "$WORK/results"; $RUN > "$WORK/log1" 2>&1 & pid=$!
wait_rows 2; sleep 0.5; kids=$(children $pid); kill -9 $pid; wait $pid 2>/dev/null
read -r n1 k1 d1 < <(rows); left=$(workers_left "$kids")
$RUN --resume > "$WORK/log1r" 2>&1; rc=$?
read -r n2 k2 d2 < <(rows)
add "kill -9 mid-sweep, then --resume" "$n1 rows kept at the kill ($d1 damaged lines); $left of the workers alive 15 s later; --resume exit $rc, $n2 rows, $k2 distinct keys of 8" "$((8 - k2))"

# 2. SIGTERM mid-sweep, then --resume
rm -rf "$WORK/results"; $RUN > "$WORK/log2" 2>&1 & pid=$!
wait_rows 2; sleep 0.5; kids=$(children $pid); kill -TERM $pid; wait $pid; rc0=$?
read -r n1 k1 d1 < <(rows); left=$(workers_left "$kids")
$RUN --resume > "$WORK/log2r" 2>&1; rc=$?
read -r n2 k2 d2 < <(rows)
add "SIGTERM mid-sweep, then --resume" "exit $rc0, $n1 rows kept; $left of the workers alive 15 s later; --resume exit $rc, $n2 rows, $k2 distinct keys of 8" "$((8 - k2))"

# 3. a damaged line (garbage, NULs, bytes that are not UTF-8, {}) in a finished store
run=$(ls -d "$WORK"/results/fault/* | tail -1)
printf 'garbage\n\0\0\0\n\xff\xfe{\n{}\n' >> "$run/trials.jsonl"
$RUN --resume > "$WORK/log3" 2>&1; rc=$?
warned=$(grep -c "trials.jsonl:[0-9]*:" "$WORK/log3")
$PY -m suite report "$run" --out "$WORK/report" --no-mlflow > "$WORK/log3b" 2>&1; rcr=$?
read -r n2 k2 d2 < <(rows)
add "4 damaged lines appended to trials.jsonl" "--resume exit $rc with $warned file:line warnings, nothing rerun; report exit $rcr; $n2 rows read, $d2 damaged lines skipped" "0"

# 4. a second writer while the sweep runs
rm -rf "$WORK/results"; $RUN > "$WORK/log4" 2>&1 & pid=$!
wait_rows 1; $RUN --resume > "$WORK/log4b" 2>&1; rc=$?
msg=$(grep -o "being written by another sweep (pid [0-9]*)" "$WORK/log4b")
wait $pid; rc0=$?
read -r n2 k2 d2 < <(rows)
add "second writer (--resume while the sweep runs)" "refused, exit $rc: \"$msg\" (the sweep's pid: $pid); the sweep ended with exit $rc0, $n2 rows, $k2 distinct keys" "$((8 - k2))"

# 5. disk full: the results on a 16 KB tmpfs
mkdir -p "$WORK/tiny"
if mount -t tmpfs -o size=16k tmpfs "$WORK/tiny" 2>/dev/null; then
  how="a 16 KB tmpfs"
  $RUN "results.root=$WORK/tiny" > "$WORK/log5" 2>&1; rc=$?
  run=$(ls -d "$WORK"/tiny/fault/* | tail -1)
else
  how="os.write patched to fail (no tmpfs here)"
  $PY -c "
import errno, os, sys
import suite.results as R
n = [0]
def write(fd, data):
    n[0] += 1
    if n[0] == 4:
        os.write.__wrapped__(fd, bytes(data[:100])); raise OSError(errno.ENOSPC, 'No space left on device')
    return os.write.__wrapped__(fd, data)
write.__wrapped__ = os.write
R.os = type(os)('os'); R.os.__dict__.update(os.__dict__); R.os.write = write
from suite.cli import main
sys.exit(main(['run', '$WORK/fault.yaml', '--no-progress']))" > "$WORK/log5" 2>&1; rc=$?
  run=$(ls -d "$WORK"/results/fault/* | tail -1)
fi
msg=$(grep "^error:" "$WORK/log5" | head -1 | cut -c1-220)
tb=$(grep -c Traceback "$WORK/log5")
partial=$(tail -c1 "$run/trials.jsonl" | od -An -c | tr -d ' ')
whole=$(grep -c '' "$run/trials.jsonl")
add "disk full ($how)" "exit $rc, $tb tracebacks: \"$msg\"; trials.jsonl ends with '$partial' ($whole whole lines)" "the trial being written"

{
  echo "# Fault table"
  echo
  echo "Each fault injected into a real CPU sweep (executor dist over gloo, 8 trials of the test method \`slow\` at"
  echo "P = 2, ~1 s each). Recorded $(date -u +%Y-%m-%dT%H:%MZ) on $(nproc) cores with"
  echo "\`bash benchmarks/fault_table.sh\` (commit $(git rev-parse --short HEAD))."
  echo
  echo "| fault | what happened | rows lost |"
  echo "|---|---|---|"
  printf '%s\n' "${table[@]}"
} > "$OUT"
cat "$OUT"
