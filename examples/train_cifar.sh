#!/usr/bin/env bash
# A whole training job from a shell: write train/val dataset folders from PyTorch,
# export the CNN of examples/cifar_cnn.py once, train it in the lean runtime (no torch)
# with evaluation, TensorBoard, a metrics file and checkpoints, stop it the way a
# scheduler does (SIGTERM), resume it from its newest checkpoint, and evaluate the result.
#
#   bash examples/train_cifar.sh [OUT_DIR]        # default: a new temporary folder
#   ROWS=50000 EPOCHS=10 bash examples/train_cifar.sh runs/cifar
#
# Small by default (3,000 rows, 3 epochs: ~1 minute on 2 CPU cores). The images are
# examples/write_dataset.py's synthetic ones, whose labels (row % 10) cannot be read
# from the pixels: the loss falls only by memorising, and the val set (the same
# script's first rows) is seen in training. Put your own Dataset in write_dataset.py
# for a real job. Needs .venv (torch, for writing and exporting) and .venv-lean.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-$(mktemp -d -t stepbundle-cifar.XXXXXX)}
ROWS=${ROWS:-3000}
VAL_ROWS=${VAL_ROWS:-500}
EPOCHS=${EPOCHS:-3}
BATCH=64                              # the batch examples/cifar_cnn.py is traced with
STEPS=$((EPOCHS * (ROWS / BATCH)))    # the last short batch of each epoch is dropped
TORCH_PY=${TORCH_PY:-.venv/bin/python}
LEAN_PY=${LEAN_PY:-.venv-lean/bin/python}
if [ -e "$OUT/ckpt" ]; then
  echo "$OUT already holds a job; give a new folder." >&2
  exit 2
fi
mkdir -p "$OUT"

echo "== datasets (PyTorch Dataset -> sharded .npy folders) =="
"$TORCH_PY" examples/write_dataset.py "$OUT/train" "$ROWS"
"$TORCH_PY" examples/write_dataset.py "$OUT/val" "$VAL_ROWS"

echo "== export (torch + torch_xla, traced once) =="
"$TORCH_PY" -m stepbundle export examples/cifar_cnn.py:recipe -o "$OUT/cifar.stepbundle"

# One command line for the first run and the resume: --until-step is a total, so the
# resumed run ends at the same step, and the schedule is the checkpoint's own.
run=("$LEAN_PY" -m stepbundle run "$OUT/cifar.stepbundle"
  --data "$OUT/train" --epochs "$EPOCHS" --until-step "$STEPS"
  --lr-schedule "warmup_cosine:peak=3e-3,warmup=20,total=$STEPS,min=1e-5"
  --eval-data "$OUT/val" --eval-every 20
  --checkpoint-dir "$OUT/ckpt" --checkpoint-every 25
  --tensorboard "$OUT/tb" --metrics-file "$OUT/metrics.jsonl" --log-every 10)

echo "== train $STEPS steps (lean process, no torch); SIGTERM after the first checkpoint =="
"${run[@]}" &
pid=$!
while kill -0 "$pid" 2>/dev/null && ! compgen -G "$OUT/ckpt/step-*.safetensors" >/dev/null; do
  sleep 0.2
done
kill -TERM "$pid" 2>/dev/null || true
code=0
wait "$pid" || code=$?
if [ "$code" != 143 ] && [ "$code" != 0 ]; then
  echo "the first run failed with exit code $code" >&2
  exit "$code"
fi
echo "(first run ended with exit code $code: 143 is SIGTERM's clean stop)"

newest=$(ls "$OUT"/ckpt/step-*.safetensors | sort | tail -n 1)
echo "== resume from $newest =="
"${run[@]}" --resume "$newest"

final=$(ls "$OUT"/ckpt/step-*.safetensors | sort | tail -n 1)
echo "== evaluate $final on the val set =="
"$LEAN_PY" -m stepbundle eval "$OUT/cifar.stepbundle" --data "$OUT/val" --resume "$final"
echo "TensorBoard: tensorboard --logdir $OUT/tb    metrics: $OUT/metrics.jsonl"
