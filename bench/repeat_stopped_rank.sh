#!/bin/bash
# Runs the job of tests/cli/test_cli_errors.py::test_stopped_rank_names_the_collective_and_ends_the_run N times and
# counts the runs whose stderr is exactly the one expected line (exit 1). Failed runs keep their stderr in OUTDIR.
#   bench/repeat_stopped_rank.sh N [TAG] [OUTDIR]      (load: start `python -c 'while 1: pass' &` twice before)
# Results: bench/results/stopped_rank_repeats.md
cd "$(dirname "$0")/.." || exit 1
N=${1:-10}; TAG=${2:-run}; OUT=${3:-$(mktemp -d)}; PY=${PYTHON:-python}
pass=0; fail=0
echo "$TAG: load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq 1 "$N"); do
  s=$(date +%s.%N)
  env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u TORCHELASTIC_RUN_ID PYTHONPATH="$PWD" TENSORPAR_THREADS=1 \
    timeout 120 "$PY" -m tests._launch_jobs stop_rank1_before_all_reduce 2 2>"$OUT/$TAG.$i.err" >/dev/null
  rc=$?; e=$(date +%s.%N); n=$(wc -l < "$OUT/$TAG.$i.err")
  if [ $rc = 1 ] && [ "$n" = 1 ] && grep -q "rank 1 had been stopped" "$OUT/$TAG.$i.err"; then
    pass=$((pass+1)); r=ok; else fail=$((fail+1)); r=FAIL; fi
  echo "$TAG run $i rc=$rc stderr_lines=$n $r $(echo "$e - $s" | bc) s"
done
echo "$TAG: load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$TAG: $pass passed, $fail failed of $N (stderr of failures in $OUT)"
