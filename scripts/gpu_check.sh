#!/usr/bin/env bash
# Run the CUDA / NCCL checks (tests marked `cuda`: tests/core/test_cuda.py, tests/core/test_cuda_jobs.py) under a
# time limit and write a results file: the machine (GPUs, driver, torch, CUDA, NCCL), the exit status, and one line
# per test.
#
# usage: scripts/gpu_check.sh [RESULTS_FILE]     (default: bench/results/gpu_check.md)
# environment:
#   GPU_CHECK_TIMEOUT_S  wall-clock limit of the pytest run in seconds (default 900); on expiry pytest is
#                        stopped (SIGTERM, then SIGKILL 20 s later) and the file says "timed out"
#   PYTHON               interpreter with torch + transformers (default: .venv/bin/python where scripts/setup.sh made
#                        it, else python3)
#   TENSORPAR_CACHE      a model cache holding SmolLM2 (tests/core/test_cuda.py's SmolLM2 checks skip when it is
#                        neither cached nor downloadable; a GPU machine without network needs this)
# exit status: pytest's (0 = every check passed or was skipped), 124 when the time limit was hit.
# Without a GPU every check is skipped with the reason, and the file says so.
set -u
cd "$(dirname "$0")/.."
results=${1:-bench/results/gpu_check.md}
default_python=python3
[ -x .venv/bin/python ] && default_python=.venv/bin/python
python=${PYTHON:-$default_python}
limit=${GPU_CHECK_TIMEOUT_S:-900}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$results")"

started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
t0=$(date +%s)
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout --kill-after=20 "$limit" \
  "$python" -m pytest -m cuda -p no:cacheprovider -v -rfEs tests/core/test_cuda.py \
  tests/core/test_cuda_jobs.py >"$work/log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - t0 ))

{
  echo "# GPU check ($started)"
  echo
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "- command: pytest -m cuda tests/core/test_cuda.py tests/core/test_cuda_jobs.py (limit ${limit} s, took ${elapsed} s)"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "- result: TIMED OUT after ${limit} s (exit $rc); the lines below are the tests finished before that"
  else
    echo "- result: exit $rc ($( [ "$rc" -eq 0 ] && echo 'all checks passed or skipped' || echo 'FAILURES, see below'))"
  fi
  echo "- summary: $(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$work/log" | tail -1 | tr -d '=' | sed 's/^ *//')"
  echo
  echo "## Machine"
  echo
  echo '```'
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  "$python" - <<'EOF' 2>&1
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available {torch.cuda.is_available()}, "
      f"devices {torch.cuda.device_count()}")
try:
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a")
except Exception as e:  # CPU builds have no NCCL
    print("NCCL: n/a", type(e).__name__)
EOF
  echo '```'
  echo
  echo "## Tests"
  echo
  echo '```'
  grep -E '^tests/.*::.* (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)' "$work/log" | sed -E 's/ +\[ *[0-9]+%\]$//' \
    || echo "(no per-test lines: see the log below)"
  grep -E '^SKIPPED ' "$work/log" | sed 's/^/reason: /'
  echo '```'
  if [ "$rc" -ne 0 ]; then
    echo
    echo "## Log (last 200 lines)"
    echo
    echo '```'
    tail -n 200 "$work/log"
    echo '```'
  fi
} >"$work/results.md"
mv -f "$work/results.md" "$results.tmp.$$" && mv -f "$results.tmp.$$" "$results"
echo "gpu_check: exit $rc; results in $results"
exit "$rc"
