#!/usr/bin/env bash
# The GPU check, in one run of under 8 minutes: the environment report, every lesson in quick
# mode, every GPU-marked test, and the GPU benchmarks. Meant for a machine with a GPU whose own
# Python already has torch (the package is used from this source tree through PYTHONPATH,
# nothing is installed). The Jupyter stack is optional: without it each lesson's code cells run
# as a script, with a small stand-in for the kernel (scripts/lesson_as_script.py says how).
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]     (default: benchmarks/results/<date>-<gpu>)
#
# Time. Each step has a limit, and the whole run a budget (GPU_CHECK_BUDGET, default 450 s):
# a step gets at most what is left of it, and one that would start with less than 20 s left is
# skipped (and counts as a failure). The lessons run right after the environment report, so
# that a failing or slow step cannot keep them from running; each lesson gets LESSON_TIMEOUT
# seconds (default 90). A failing step or lesson does not stop the others; the exit status is 0
# only when every step passed.
#
# Results (everything printed is also kept there; commit the folder):
#   RESULTS_DIR/steps.txt                 each step's exit status (or "skipped") and seconds
#   RESULTS_DIR/<step>.txt                each step's output: doctor, lessons, gpu_tests,
#                                         loop_overhead, launch_overhead, pipeline,
#                                         ddp_from_scratch, allreduce, sharding,
#                                         parallelisms
#   RESULTS_DIR/<benchmark>.json          the benchmarks' measurements
#   RESULTS_DIR/lessons/summary.json      the lessons' mode (kernel or script), the modules this
#                                         Python has or lacks, and per lesson: status, seconds,
#                                         recorded results, self-checks, failing cell and error
#   RESULTS_DIR/lessons/NN_name/          one lesson: output.log (all it printed, with a
#                                         "=== cell N" line before each cell and the failing
#                                         cell's traceback), lesson.json, figures/cellNNN-K.png,
#                                         and NN_name.py + displays.json (script mode) or the
#                                         executed NN_name.ipynb (kernel mode)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET:-450}
lesson_timeout=${LESSON_TIMEOUT:-90}
deadline=$((SECONDS + budget))
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '-')
out=${1:-benchmarks/results/$(date +%Y-%m-%d)-${gpu:-nogpu}}
mkdir -p "$out"
: >"$out/steps.txt"
status=0

step() {  # step NAME LIMIT COMMAND...: run within LIMIT s (less if the budget is short), keep the output
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS - 10))  # 10 s for `timeout -k` to kill a step that hangs on
  if [ "$left" -lt 20 ]; then
    echo "== $name skipped: the ${budget} s budget is spent" | tee "$out/$name.txt"
    echo "$name skipped (budget spent)" >>"$out/steps.txt"
    status=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (at most ${limit} s): $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || echo "== $name ran past its ${limit} s limit" | tee -a "$out/$name.txt"
  echo "== $name exited $rc after $((SECONDS - start)) s"
  echo "$name exited $rc after $((SECONDS - start)) s" >>"$out/steps.txt"
  [ "$rc" -eq 0 ] || status=1
}

step doctor 60 "$PY" -m mgpu_helpers.tooling.cli doctor
# The lessons' own cap leaves 25 s of the step's limit for the runner's environment report and
# for stopping a lesson that runs late (SIGTERM, then SIGKILL 15 s later).
lessons_limit=$((deadline - SECONDS - 90))
[ "$lessons_limit" -le 300 ] || lessons_limit=300
[ "$lessons_limit" -ge 60 ] || lessons_limit=60  # then `step` cuts it to what is left, or skips
step lessons "$lessons_limit" "$PY" scripts/lesson_as_script.py run --quick \
  --out "$out/lessons" --timeout "$lesson_timeout" --total "$((lessons_limit - 25))" \
  --mode "${LESSON_MODE:-auto}"
# The test files whose GPU tests need no Jupyter stack (the notebooks run on the CPU in CI);
# test_torchrun_gpu.py: lesson 07's scripts/train_ddp.py under torchrun, a rank killed; the last
# four of the line before the last: lessons 08a-08c (memory accounting, ZeRO by hand, FSDP2,
# sharded checkpoints); then lessons 09a-09b (tensor parallelism, pipelines, the 2-D mesh); the last
# two lines: lessons 10a-10c (errors produced on GPUs: NCCL's barrier meeting an all-reduce and
# the watchdog (its dump wait cut to 2 s), device_id without set_device, a device-side assert, out
# of memory, 10a's DataParallel check on cuda:0, CUDA before a fork, NCCL on a shared GPU, a
# checkpoint that lands on GPU 0, DDP's entries over NCCL); lesson 11's training script in the
# GPU's training dtype (bf16 autocast, or fp16 with loss scaling).
step gpu_tests 210 "$PY" -m pytest -p no:cacheprovider -q -rs -m "gpu or multigpu" \
  tests/test_data_parallel.py tests/test_ddp.py tests/test_ddp_batchnorm.py tests/test_devices.py \
  tests/test_doctor.py tests/test_devices_extra.py tests/test_launch.py \
  tests/test_model_parallel.py tests/test_allocator_claims.py tests/test_timing.py \
  tests/test_train.py tests/test_ddp_by_hand.py tests/test_overlap.py tests/test_comm.py \
  tests/test_scaling.py \
  tests/test_no_sync.py tests/test_amp.py tests/test_loading.py \
  tests/test_torchrun_gpu.py \
  tests/test_memory.py tests/test_zero.py tests/test_fsdp.py tests/test_sharded_checkpoint.py \
  tests/test_tensor_parallel.py tests/test_pipelining.py tests/test_2d_mesh.py \
  tests/test_parallelisms_benchmark.py \
  tests/test_troubleshooting_processes.py tests/test_troubleshooting_ddp.py \
  tests/test_troubleshooting_myths.py tests/test_lm_train.py tests/test_mfu.py \
  tests/test_lm_benchmark.py
step loop_overhead 90 "$PY" benchmarks/loop_overhead.py --out "$out/loop_overhead.json"
# 3 repeats: the benchmark also times bare spawn (each rank imports torch and starts CUDA again)
step launch_overhead 90 "$PY" benchmarks/launch_overhead.py --repeats 3 \
  --out "$out/launch_overhead.json"
step pipeline 90 "$PY" benchmarks/pipeline.py --out "$out/pipeline.json"
# lesson 06a: the hand-built DDP against DDP (one GPU: 2 ranks share it over gloo); lesson 06b:
# the all-reduce sweep from 1 KiB to 64 MiB (its default on NCCL, 1 GiB, takes longer)
step ddp_from_scratch 60 "$PY" benchmarks/ddp_from_scratch.py --repeats 5 \
  --out "$out/ddp_from_scratch.json"
step allreduce 60 "$PY" benchmarks/allreduce.py --max-mb 64 --repeats 3 \
  --out "$out/allreduce.json"
# lessons 08a-08b: per-rank memory of DDP, ZeRO-1/2 and FSDP2 at 1, 2 and 4 ranks (ranks beyond the
# GPUs run as CPU processes), and step time against DDP
step sharding 60 "$PY" benchmarks/sharding.py --repeats 3 --out "$out/sharding.json"
# lessons 09a-09b: one device, DDP, tensor parallel, GPipe, 1F1B and dp x tp side by side (4 ranks:
# CPU processes with fewer than 4 GPUs)
step parallelisms 60 "$PY" benchmarks/parallelisms.py --repeats 3 --out "$out/parallelisms.json"
echo "== steps:"
cat "$out/steps.txt"
echo "results in $out (status $status, $SECONDS s)"
exit $status
