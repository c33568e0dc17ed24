#!/usr/bin/env bash
# The parallel drafters against EAGLE-3 on a SECOND target, not the demo, so the demo recipes are not
# tuned to one model: a deeper model of another family (Qwen3: q/k norms, 12 layers against the demo's 8
# Llama layers) with its own tokenizer, trained from scratch on a fresh draw of the chat corpus (seed 1).
# Everything is made here, outside the repository (outputs/second/), offline on a CPU:
#   bash scripts/second_target.sh            # target (~20 min), 3 heads (10 min each + eval and tree tuning), bench
#   STEP=heads bash scripts/second_target.sh # skip the target (already built)
#   STEP=bench bash scripts/second_target.sh # only the benchmark
# Each head trains with its demo recipe's settings (draft vocabulary, TTT depth, block size, layers, lr)
# for the same training time: steps = BUDGET_S / (seconds a step takes, from a 20- and a 120-step run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/second}
BUDGET_S=${BUDGET_S:-600}
STEP=${STEP:-all}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} WANDB_MODE=offline

if [[ $STEP == all ]]; then
  $PY scripts/make_demo.py --out "$OUT" --arch qwen3 --seed 1 --num-layers 12
fi

# head name -> the demo recipe's overrides (configs/head_tuning/HEAD-demo.yaml), for model=local
declare -A RECIPE=(
  [eagle3]="head.draft_vocab_size=1024 head.ttt_steps=4"
  [peagle]="head.draft_vocab_size=1024"
  [dflash]="head.num_layers=2 head.block_size=8"
)
train() {  # HEAD STEPS DIR [extra overrides]: one training run on the second target
  local head=$1 steps=$2 dir=$3
  shift 3
  # shellcheck disable=SC2086
  $PY train.py head="$head" model=local model.path="$OUT/target" data=jsonl data.path="$OUT/chat.jsonl" \
    logger=none ${RECIPE[$head]} trainer.lr=3e-3 trainer.max_length=384 trainer.batch_size=8 \
    trainer.max_steps="$steps" trainer.output_dir="$dir" trainer.resume=false "$@"
}
seconds_per_step() {  # seconds a training step of HEAD takes: the trainer's "time:" of a 20- and a 120-step run,
  # differenced, so start-up and the end of a run (final eval and save, up to 13 s) cancel out
  local n
  for n in 20 120; do
    train "$1" $n "$OUT/time-$1-$n" trainer.eval_every=1000 trainer.save_every=1000 > "$OUT/time-$1-$n.log" 2>&1
  done
  $PY - "$OUT/time-$1-20.log" "$OUT/time-$1-120.log" <<'EOF'
import re, sys
t20, t120 = (float(re.findall(r"^time: ([0-9.]+) s for", open(f).read(), re.M)[-1]) for f in sys.argv[1:])
print((t120 - t20) / 100)
EOF
}

if [[ $STEP == all || $STEP == heads ]]; then
  # the three timings back to back (the same machine load), then the three runs
  declare -A STEPS
  : > "$OUT/steps.txt"
  for head in eagle3 peagle dflash; do
    sps=$(seconds_per_step "$head")
    STEPS[$head]=$($PY -c "print(int($BUDGET_S / $sps))")
    echo "$head: $sps s/step -> ${STEPS[$head]} steps in $BUDGET_S s" | tee -a "$OUT/steps.txt"
  done
  for head in eagle3 peagle dflash; do
    steps=${STEPS[$head]}
    t0=$(date +%s)
    train "$head" "$steps" "$OUT/$head" trainer.eval_every="$steps" trainer.save_every="$steps" \
      trainer.decode_eval_every="$steps" trainer.tree_tune_prompts=32 > "$OUT/$head.log" 2>&1
    echo "$head: $steps steps, $(($(date +%s) - t0)) s wall with eval and tree tuning" | tee -a "$OUT/steps.txt"
  done
fi

$PY scripts/benchmark.py --target "$OUT/target" --drafter eagle3="$OUT/eagle3/head" \
  --drafter peagle="$OUT/peagle/head" --drafter dflash="$OUT/dflash/head" \
  --prompts 24 --repeats 3 --out "$OUT/bench"
