#!/usr/bin/env bash
# The GPU check, in one run of under 8 minutes: the environment report, every GPU-marked test,
# and the GPU benchmarks. Meant for a machine with a GPU whose own Python already has torch
# (the package is used from this source tree through PYTHONPATH, nothing is installed).
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]     (default: benchmarks/results/<date>-<gpu>)
#
# Everything printed is also written to RESULTS_DIR; commit that folder.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '-')
out=${1:-benchmarks/results/$(date +%Y-%m-%d)-${gpu:-nogpu}}
mkdir -p "$out"
status=0
step() {  # step NAME COMMAND...: run, show, keep the output, remember failures
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name exited $rc"
  [ "$rc" -eq 0 ] || status=1
}
step doctor timeout 120 "$PY" -m mgpu_helpers.cli doctor
# The test files whose GPU tests need no Jupyter stack (the notebooks run on the CPU in CI).
step gpu_tests timeout 240 "$PY" -m pytest -p no:cacheprovider -q -rs -m "gpu or multigpu" \
  tests/test_data_parallel.py tests/test_ddp.py tests/test_devices_cli.py \
  tests/test_devices_extra.py tests/test_launch.py tests/test_model_parallel.py \
  tests/test_timing.py tests/test_train.py
step loop_overhead timeout 150 "$PY" benchmarks/loop_overhead.py --out "$out/loop_overhead.json"
step launch_overhead timeout 150 "$PY" benchmarks/launch_overhead.py --repeats 5 \
  --out "$out/launch_overhead.json"
step pipeline timeout 150 "$PY" benchmarks/pipeline.py --out "$out/pipeline.json"
echo "results in $out (status $status)"
exit $status
