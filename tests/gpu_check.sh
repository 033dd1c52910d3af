#!/usr/bin/env bash
# The prepared GPU check: one H200, under 10 minutes, every log in DIR (default: $OUT, else gpu_check_logs/).
#   1. env.txt: torch and CUDA versions, the GPU, mark_static_address's guard default (True before torch 2.10);
#   2. probe.log / probe.jsonl: tests/gpu_probe.py at Qwen2.5-0.5B's widths (random weights, no download): frames,
#      CUDA graph skips, graph breaks, held static rows and memory over a sequence of generate(static=True) calls;
#   3. test_cuda.log: python -m pytest -q -s tests/test_cuda.py (graph health, bf16 tolerances, head memory);
#      with 3+ GPUs, test_cuda_async3.log: its async test at K = 2 (1 sampler + 2 trainers, evals mid-run);
#   4. bench.log: python -m tools.bench --device cuda, short (128 new tokens, one RL step): captured / eager at 64 rows,
#      the fraction of max(HBM, FLOP) at 512 rows, the RL step's refresh / sampling / training split.
# summary.txt has each part's exit status and time. The parts' limits add up to under 10 minutes on 1 GPU and on 8
# (the 3-GPU async part shortens the others); a part past its limit gets SIGINT first, so pytest still prints its
# summary naming the test it was in; the parts share one inductor cache. Without CUDA it runs what a CPU can (the
# probe at a tiny size, test_cuda.py's skips) and skips the bench.
#   bash tests/gpu_check.sh [DIR]
set -u
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu_check_logs}}
mkdir -p "$LOG"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$LOG/inductor_cache}"  # compiled once, read by each part
status=0

part() {  # part NAME SECONDS COMMAND...: run it under a time limit, its output in NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG/summary.txt"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  rc=$?
  echo "   exit $rc after $(($(date +%s) - start)) s; last lines:" | tee -a "$LOG/summary.txt"
  tail -n 8 "$LOG/$name.log" | sed 's/^/     /' | tee -a "$LOG/summary.txt"
  [ "$rc" = 0 ] || status=1
}

python - > "$LOG/env.txt" 2>&1 <<'EOF'
import inspect, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
guard = inspect.signature(torch._dynamo.mark_static_address).parameters["guard"].default
print("mark_static_address guard default:", guard)
EOF
cat "$LOG/env.txt" | tee -a "$LOG/summary.txt"
nvidia-smi > "$LOG/nvidia-smi.txt" 2>&1 || true

if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
  short=$([ "$gpus" -ge 3 ] && echo 1 || echo 0)  # 3+ GPUs: the async part needs its share of the 10 minutes
  part probe $((short ? 110 : 150)) python tests/gpu_probe.py --device cuda --size qwen05 --new 48 --out "$LOG"
  part test_cuda $((short ? 190 : 260)) python -m pytest -q -s -rs --durations=5 tests/test_cuda.py -k "not three_gpus"
  if [ "$short" = 1 ]; then  # async at K = 2 on 3 GPUs
    part test_cuda_async3 170 python -m pytest -q -s -rs tests/test_cuda.py -k three_gpus
  fi
  part bench $((short ? 110 : 160)) python -m tools.bench --device cuda --gpu_new 128 --gpu_rl_steps 1
else
  part probe 300 python tests/gpu_probe.py --device cpu --size tiny --new 16 --out "$LOG"
  part test_cuda 120 python -m pytest -q -rs tests/test_cuda.py
  echo "== bench: skipped (no CUDA)" | tee -a "$LOG/summary.txt"
fi
echo "gpu_check: $([ $status = 0 ] && echo ok || echo FAILED), logs in $LOG" | tee -a "$LOG/summary.txt"
exit $status
