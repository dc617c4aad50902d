#!/usr/bin/env bash
# A lent GPU's measurements for issues 31 and 32, most important first, each in its own
# process with its own time limit; the results files go straight to $OUT (small markdown +
# JSON), every figure is also printed (tee the log to $OUT/log.txt).
#
#   1. jamp.tensor_stats in the trainer's step: off / every 100 / every step, and the two
#      diagnostics that isolate each cond (issue 32; run 1 on 2026-11-26: every_100 1.28x).
#      The same with XLA:GPU command buffers holding while loops and conds.
#   2. jamp.autocast vs mpx vs hand-written float16 Equinox, GPU-sized ViT (width 384,
#      6 heads, MLP 1536, batch 256) and the MLP: the step's time (issue 31: do float32
#      sums of float16 cotangents cost anything on a GPU?).
#   3. autocast_depth at the issue's own CPU size (width 128, batch 128).
#
# Usage (the device machine; `.whl` carried, see ../shared/gpu/README.md, plus the
# mixed-precision-for-JAX wheel for mpx):
#   OUT=/tmp/out bash benchmarks/gpu_cost_round.sh
# CPU smoke run, tiny:
#   OUT=/tmp/out SMOKE=1 bash benchmarks/gpu_cost_round.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT/depth" "$OUT/stats" "$OUT/stats_graphs" "$OUT/depth_small"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONUNBUFFERED=1
T0=$(date +%s)
if [ "${SMOKE:-0}" = 1 ]; then
  BIG=(--width 16 --heads 2 --mlp 32 --batch 4 --depths 1 --steps 1 --warmup 1)
  SMALL=(--batch 4 --depths 1 --steps 1 --warmup 1 --models mlp)
  STATS=(--num-layers 1 --hidden-size 16 --num-heads 2 --mlp-dim 32 --batch 8 --block 3
         --steps 1 --warmup 1)
else
  BIG=(--width 384 --heads 6 --mlp 1536 --batch 256 --depths 2,8 --steps 7 --warmup 2)
  SMALL=(--batch 128 --depths 1,4,16 --steps 7 --warmup 2 --models vit)
  STATS=(--num-layers 4 --hidden-size 384 --num-heads 6 --mlp-dim 1536 --image-size 32
         --patch-size 4 --batch 256 --block 100 --steps 5 --warmup 1)
fi
phase() {  # phase NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name (t=$(( $(date +%s) - T0 )) s)"
  timeout "$limit" "$@" || echo "== $name FAILED (exit $?)"
}
phase setup 90 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import jax, flax, equinox, mpx, jamp;
print(jax.devices(), \"jax\", jax.__version__, \"flax\", flax.__version__,
      \"equinox\", equinox.__version__, \"jamp\", jamp.__version__)"'
phase tensor-stats 170 python3 -m benchmarks.tensor_stats_cost "${STATS[@]}" --out-dir "$OUT/stats"
# Run 2 (2026-11-26) found the host waiting inside every step (enqueueing 100 steps took as
# long as running them, plain steps too): XLA:GPU reads a while loop's (the scanned layers')
# and a cond's predicate on the host. Command buffers that hold loops and conds keep them on
# the device: the same steps with them, to compare with the phase above.
phase tensor-stats-graphs 170 env XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
  python3 -m benchmarks.tensor_stats_cost "${STATS[@]}" --out-dir "$OUT/stats_graphs"
phase depth-gpu-size 200 python3 -m benchmarks.autocast_depth "${BIG[@]}" --parts step \
  --no-hlo --out-dir "$OUT/depth"
phase depth-issue-size 150 python3 -m benchmarks.autocast_depth "${SMALL[@]}" --parts step \
  --no-hlo --out-dir "$OUT/depth_small"
cat "$OUT"/depth/*.md "$OUT"/depth_small/*.md 2>/dev/null
echo "== done at $(( $(date +%s) - T0 )) s"
