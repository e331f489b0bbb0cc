#!/usr/bin/env bash
# Run several GPU benchmark scripts in one device session, each under its own time budget.
#
#   OUT=/tmp/bench bash bench/gpu/run_all.sh adkv:100 adacal:200:timing adakvq
#
# Each argument is <slug>[:<budget seconds>[:<sections>]]; the budget goes to the script's --budget-s
# (default 420; scripts without one get only the outer `timeout`, budget + 60 s) and the sections,
# comma-separated, to its --only. Output goes to stdout and, when OUT is
# set, to $OUT/run_all.log; each script also writes its $OUT/<slug>.json. A failing script does not
# stop the others; the exit status is the number of scripts that failed. PYTHON picks the
# interpreter (default python3); BENCH_ARGS adds flags to every script, e.g. a CPU smoke run:
#   PYTHON=.venv/bin/python BENCH_ARGS="--device cpu --quick" bash bench/gpu/run_all.sh amaris
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log=${OUT:+$OUT/run_all.log}
log=${log:-/dev/null}
failed=0
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  $PY -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee -a "$log"
for arg in "$@"; do
  IFS=: read -r slug budget only <<<"$arg"
  budget=${budget:-420}
  flags=()
  grep -q -- "--budget-s" "bench/gpu/$slug.py" && flags=(--budget-s "$budget")
  [ -n "$only" ] && flags+=(--only "$only")
  echo "=== $slug (budget $budget s)" | tee -a "$log"
  start=$SECONDS
  timeout $((budget + 60)) $PY "bench/gpu/$slug.py" "${flags[@]}" ${BENCH_ARGS:-} 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "=== $slug: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
  [ "$rc" -ne 0 ] && failed=$((failed + 1))
done
exit "$failed"
