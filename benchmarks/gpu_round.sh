#!/usr/bin/env bash
# One lent-GPU session's measurements, most important first, each in its own process.
#
# Results (JSON per process, a JAX profiler trace and the optimised HLO of jamp's bf16 step)
# go to $WORK and are packed into $OUT/results.tgz (figures), trace.tgz and hlo.tgz (each
# only while under the 16 MiB a returned file may have) after every phase, so a run cut off
# at its time limit still returns what it finished. Afterwards, on any machine:
#
#   tar xzf results.tgz -C /tmp/gpu && python -m benchmarks.run_all --from-dir /tmp/gpu/b16
#
# If even results.tgz is lost, the log (tee it to $OUT/log.txt) has every figure:
# `python -m benchmarks.gpu_log log.txt --out DIR` rebuilds the JSON files.
#
# Usage (the device machine; `.whl` carried, see ../shared/gpu/README.md):
#   OUT=/tmp/out bash benchmarks/gpu_round.sh
# CPU smoke run of the same phases, tiny:
#   OUT=/tmp/out VARIANT=ti16 IMG=32 BATCH=8 STEPS=2 LARGE=ti16 TRAIN_STEPS=4 \
#     DIMS="--config.num_layers=2" bash benchmarks/gpu_round.sh
set -u
VARIANT=${VARIANT:-b16}; IMG=${IMG:-224}; BATCH=${BATCH:-128}; STEPS=${STEPS:-15}
LARGE=${LARGE:-l16}; TRAIN_STEPS=${TRAIN_STEPS:-60}
read -r -a DIMS <<< "${DIMS:---config.num_layers=12 --config.hidden_size=768 --config.num_heads=12 --config.mlp_dim=3072}"
WORK=${WORK:-/tmp/gpu_round}; OUT=${OUT:?set OUT}
mkdir -p "$WORK/b16" "$WORK/large" "$WORK/batch" "$WORK/train" "$OUT"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
T0=$(date +%s)
VIT=(--variant "$VARIANT" --image-size "$IMG" --batch "$BATCH" --steps "$STEPS" --warmup 3)

pack() {  # what is done so far, atomically, into $OUT: the figures apart from the bulky
  # profile and HLO, each under the device tool's 16 MiB per returned file
  tar czf "$OUT/results.tgz.part" -C "$WORK" --exclude=./trace --exclude=./hlo \
    --exclude='*.tfevents.*' . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
  for extra in trace hlo; do
    [ -d "$WORK/$extra" ] && tar czf "$OUT/$extra.tgz.part" -C "$WORK" "$extra" \
      && [ "$(stat -c %s "$OUT/$extra.tgz.part")" -lt 16000000 ] \
      && mv "$OUT/$extra.tgz.part" "$OUT/$extra.tgz"
    rm -f "$OUT/$extra.tgz.part"
  done
  echo "== packed at $(( $(date +%s) - T0 )) s"
}
phase() {  # phase NAME TIMEOUT_S COMMAND...: runs, logs its time, packs
  local name=$1 limit=$2; shift 2
  echo "== $name (t=$(( $(date +%s) - T0 )) s)"
  timeout "$limit" "$@" || echo "== $name FAILED (exit $?)"
  pack
}

phase setup 120 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import jax, flax, optax, jmp, grain, ml_collections, tensorflow_datasets, jamp, torch, timm;
print(jax.devices(), \"jax\", jax.__version__, \"flax\", flax.__version__, \"optax\", optax.__version__,
      \"torch\", torch.__version__, \"timm\", timm.__version__, \"jamp\", jamp.__version__)"' \
  | tee "$WORK/versions.txt"

# 1. jamp bf16 (with the optimised HLO of its step and a 3-step profiler trace), then PyTorch bf16.
phase jamp-bf16 180 env XLA_FLAGS="--xla_dump_to=$WORK/hlo --xla_dump_hlo_module_re=.*train_step.*" \
  python3 -m benchmarks.throughput "${VIT[@]}" --modes bf16 --profile "$WORK/trace" \
  --json "$WORK/b16/jamp-bf16.json"
find "$WORK/trace" -name '*.xplane.pb' -delete 2>/dev/null  # the trace.json.gz remains
find "$WORK/hlo" -type f ! -name '*after_optimizations.txt' ! -name '*buffer-assignment.txt' -delete 2>/dev/null; find "$WORK/hlo" -type d -empty -delete 2>/dev/null
phase torch-bf16 240 python3 -m benchmarks.torch_amp "${VIT[@]}" --modes bf16 \
  --compile eager,compile --json "$WORK/b16/torch-bf16.json"
# 2. the other modes.
for mode in fp16 fp32 fp16_naive; do
  phase "jamp-$mode" 150 python3 -m benchmarks.throughput "${VIT[@]}" --modes "$mode" \
    --json "$WORK/b16/jamp-$mode.json"
  [ "$mode" = fp32 ] && phase torch-fp16-fp32 240 python3 -m benchmarks.torch_amp "${VIT[@]}" \
    --modes fp16,fp32 --compile eager --json "$WORK/b16/torch-fp16-fp32.json"
done
# 3. the trainer on the same model and batch (embedded digits resized to the image size).
phase train-bf16 180 python3 -m jamp.cli --config "vit_bf16:$VARIANT,digits" \
  --config.image_size="$IMG" --config.patch_size=16 --config.batch_size="$BATCH" "${DIMS[@]}" \
  --config.max_steps="$TRAIN_STEPS" --config.log_every_steps=10 \
  --config.checkpoint_every_steps=100000 --config.eval_every_epochs=1000 \
  --workdir "$WORK/train/run"
# 4. fp8 against bf16 on the large ViT.
for mode in bf16 fp8; do
  phase "large-$mode" 200 python3 -m benchmarks.throughput --variant "$LARGE" --image-size "$IMG" \
    --batch "$BATCH" --steps "$STEPS" --warmup 3 --modes "$mode" --json "$WORK/large/jamp-$mode.json"
done
# 5. the largest batch (jamp: compile-time analysis confirmed by running; PyTorch: until OOM).
for mode in bf16 fp32; do
  phase "batch-$mode" 300 python3 -m benchmarks.throughput "${VIT[@]}" --steps 3 --modes "$mode" \
    --max-batch --json "$WORK/batch/jamp-$mode.json"
done
phase batch-torch 300 python3 -m benchmarks.torch_amp "${VIT[@]}" --steps 3 --modes bf16,fp32 \
  --compile eager --max-batch --json "$WORK/batch/torch.json"
echo "== done at $(( $(date +%s) - T0 )) s"
