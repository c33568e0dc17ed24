#!/usr/bin/env bash
# Training at scale, in ONE call (the GPU session's whole command; the wheels below in .whl/ first):
#   run(command="bash scripts/gpu_checks.sh bench_train", carry=[".whl"], timeout_s=600)
# bench_train: scripts/bench_train_gpu.py trains EAGLE-3 50 steps x 1 x 2048 tokens on a random Llama-3.1-8B-shaped
#   bf16 target (written once, 16 GB, to outputs/bench_train_work) through train.py under `accelerate launch`:
#   online with configs/accelerate/ddp.yaml, offline from a bf16 cache (scripts/cache_hidden_states.py) with
#   ddp.yaml, online with zero3.yaml, one process each; tokens/s, peak GPU memory (the trainer's metrics.json)
#   and the memory plan's total to $OUT/bench_train/bench_train.json and .md (budget TRAIN_BUDGET_S=480 s: runs
#   left when it is spent are skipped; not yet run on a GPU). The H200 image lacks hydra, DeepSpeed, datasets,
#   pydantic; carry them as wheels (here, in the repo root):
#     pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 transformers==5.24.0 hydra-core==1.3.8 \
#       omegaconf==2.3.1 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#       typing-inspection==0.4.5 typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#       fsspec==2026.9.0
#     pip wheel -w .whl --no-deps antlr4-python3-runtime==4.9.3 deepspeed==0.19.8   # sdists: pure-Python wheels
# Every check that needs a GPU, in two calls of one short lease (last run on one H200, 2026-11-28, second
# session, a cold machine: `pytest_gpu bench_gpu` 405 s in one call (pytest_gpu 171 s, bench_gpu 202 s),
# then `bench_gpu_fp8 bench_gpu_attention` 196 s on the warm machine (71 and 113 s; step 3 is bf16 now); a fresh machine's
# first inductor compile takes longer: give bench_gpu's steps >= 150 s). By default:
#   1. pytest_gpu: the CUDA tests (pytest -m gpu: greedy equality in fp32 and bf16, eager and compiled
#      (inductor + our CUDA graphs, torch.compile's reduce-overhead, compile="graphs": the eager passes
#      captured as our graphs), batch > 1 with the batch passes compiled, seeded sampling, calibration,
#      FP8 drafting eager and as graphs, plain decoding one step ahead, stacked FP8 rows) and
#      tests/inference/test_cuda_syncs.py (a pass waits for the GPU once, batch 1 and batch 2, sampled
#      too). 2026-11-28 (second run): 48 passed. Since then the target's default attention packs one query
#      and runs tree passes as matmuls on a GPU, the draft attends as matmuls there, and an EAGLE head
#      drafts in FP8 by default on an FP8 GPU: tests/inference/test_cuda_defaults.py (new, not yet run) and
#      the CUDA case of test_loading.py (passed alone in that run); P-EAGLE and DFlash on CUDA, eager and as
#      graphs, rows leaving, and their one wait a pass (test_cuda.py, test_cuda_syncs.py: not yet run);
#   2. bench_gpu: scripts/bench_gpu.py --compile --compare graphs --compile-batch graphs --profile
#      (Llama-3.1-8B shape, random bf16 weights, no download: inductor with our CUDA graphs beside the
#      compiler-free graphs, where each part's time goes, batch 1, 4, 16 decoded with the target's batch
#      passes and every row's EAGLE draft as graphs, and batch 1 decoded whole through SpeculativeGenerator,
#      its pass beside the parts' sum, with the host's waits for the GPU counted). With the defaults
#      from_pretrained decodes with: on a GPU with FP8 tensor cores the draft's per-depth layers in FP8
#      e4m3 (--draft-fp8 auto), the target's attention "spechead_sdpa" (one query packed, tree passes as
#      matmuls) and the draft's as matmuls (--draft-attention auto). H200 2026-11-28, FP8 with the
#      attention as matmuls: depth-7 draft 1.286 ms = 23.4% of a step, verify(64) 1.05x, 4.01x at tau
#      5.4; the plain step 68.7% of the roofline before the single query was packed (not yet timed);
#   3. bench_gpu_bf16: the parts with the draft in bf16 (--draft-fp8 off), profiled: the A/B of the FP8
#      default (H200 2026-11-28, with sdpa attention: 1.959 ms bf16, 1.382 FP8);
#   4. bench_gpu_attention: the parts with the former attention: transformers' sdpa in the target
#      (--target-attention sdpa: a compiled single query repeats the key/value cache, tree passes run
#      cuDNN's sdpa) and sdpa in the draft (--draft-attention sdpa), profiled: the A/B of the attention
#      defaults (H200 2026-11-28, that A/B the other way round: verify(64) 6.31 -> 5.78 ms, draft 1.382 ->
#      1.286 ms; the plain step was 5.49 ms with 64 copy-like kernels feeding the attention, 0.317 ms).
#   On request: bench_gpu_stacked (the defaults with the target's q/k/v and gate/up stacked into one GEMM
#      each, --target-stacked, inference/stacked.py: the A/B for the plain step's roofline; not yet run;
#      next after bench_gpu, with bench_gpu_attention, in the second call); bench_gpu_topk (step 3 with
#      one torch.topk a depth, --topk-chunk none; 2026-11-28: 1.551 against 1.419 ms chunked) and bench_gpu_unstacked (step 3 with q/k/v and gate/up unstacked,
#      --fp8-unstacked; 2026-11-28: 1.532 against 1.419 ms stacked): the A/Bs of those defaults, profiled;
#      bench_topk: scripts/bench_topk.py, a depth's top-k alone by chunk (H200: [8, 32000] 44 us by 64,
#      59 in one topk).
#   On request (named): bench_demo_graphs (scripts/benchmark.py on the demo target and heads with
#      compile="graphs"), bench_demo (eager) and bench_demo_compiled (the EAGLE draft as one graph);
#      bench_batch_graphs (scripts/bench_batch.py at batch 1, 4, 16 on the demo heads, batch passes and the
#      EAGLE batch draft as graphs); bench_batch_draft (the EAGLE-3 drafter's batch drafting alone, eager and graphs);
#      bench_demo_full and bench_demo_full_ro, the demo with target and drafters compiled (our CUDA graphs;
#      torch.compile's reduce-overhead); bench_gpu_autotune, bench_gpu with inductor's max-autotune (GEMMs
#      benchmarked against generated kernels) beside plain inductor (its compile time is unmeasured,
#      hence its own limit AUTOTUNE_S); bench_gpu_batch, the batch rows with the target's batch passes
#      compiled by inductor (limit BATCH_S); bench_reference, the EAGLE authors' engine beside ours on the
#      demo target and the EAGLE-1 head outputs/eagle-ref-demo2/head (carry it), both eager, ours as graphs
#      too (limit REF_S; the reference's packages come as wheels in .whl/ref/, installed apart in
#      /tmp/refsite: `pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
#      --no-deps -d .whl/ref transformers==4.36.2 tokenizers==0.15.2 huggingface_hub==0.36.2 eagle-llm==1.2.1`).
#   bench_reference_medusa, the Medusa authors' engine (medusa-llm 0.1) beside ours on outputs/medusa-demo/head
#      (carry it; add medusa_llm-0.1 to .whl/ref/: `pip download ... medusa-llm==0.1`), not run on a GPU yet.
#   bench_sampling and bench_sampling_60 (scripts/bench_sampling.py on CUDA: top-p, the draw and the walk by
#      vocabulary size, over trees of 6 and 60 nodes; the host reads a boolean or two a call, unmeasured on a GPU) and
#      bench_demo_sampled (the demo heads sampling at temperature 1, top-p 0.9, EAGLE-3's top-k children
#      beside children drawn from the head, rule=without_replacement: +12-20% tau on a CPU, not yet timed
#      where draft ops are cheap next to a step).
# Logs and JSON go to $OUT (default outputs/gpu). spechead runs from this tree, linked into /tmp/site (set
# SPECHEAD_INSTALLED=1 to use an installed one instead); other packages the machine lacks or has too old come
# as wheels in .whl/ (carry it): on the H200 image (transformers 5.17), transformers 5.24: `pip download
# --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.24.0`.
#
#   bash scripts/gpu_checks.sh                       # the default four; env PYTEST_S, BENCH_S, FP8_S, DEMO_S: limits (s)
#   (the four do not fit one 600 s call: run `pytest_gpu bench_gpu` in one call and `bench_gpu_bf16
#   bench_gpu_attention` in the next, at once, while the machine is warm)
#   bash scripts/gpu_checks.sh pytest_gpu bench_demo # only the named steps
set -uo pipefail
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "error: installing .whl/ failed"; exit 1; }
fi
# spechead is this tree: its folders linked as the import packages (as pyproject's package-dir maps them),
# so what runs is the code beside this script, never a wheel built before a later commit
if [ -z "${SPECHEAD_INSTALLED:-}" ]; then
    mkdir -p /tmp/site/spechead
    for pkg in configs data heads inference training; do
        rm -rf "/tmp/site/spechead/$pkg" && ln -s "$PWD/$pkg" "/tmp/site/spechead/$pkg"
    done
    rm -rf /tmp/site/spechead-*.dist-info
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
"$PY" -c "import torch, transformers, spechead.inference; print('torch', torch.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name())" || exit 1

status=0
steps=" ${*:-pytest_gpu bench_gpu bench_gpu_bf16 bench_gpu_attention} "
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, remember a failure
    local name=$1 limit=$2
    shift 2
    [[ $steps == *" $name "* ]] || return 0
    echo "=== $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}
step pytest_gpu "${PYTEST_S:-300}" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/inference/test_cuda.py \
    tests/inference/test_cuda_syncs.py tests/inference/test_cuda_defaults.py tests/inference/test_loading.py
# inductor with our CUDA graphs (GraphedFunction) and, in the same process, the eager passes as our graphs;
# the loading defaults (an FP8 GPU: the draft in FP8, compiled by inductor, which fuses each layer's
# activation quantization and output scaling around the FP8 GEMM)
step bench_gpu "${BENCH_S:-330}" "$PY" scripts/bench_gpu.py --compile --compare graphs --compile-batch graphs \
    --sizes 1,64 --profile --out "$OUT/bench_gpu.json"
# the draft in bf16, as trained (an A/B against the FP8 default)
step bench_gpu_bf16 "${FP8_S:-300}" "$PY" scripts/bench_gpu.py --compile --draft-fp8 off --sizes 1,64 --profile \
    --no-batch --no-stream --out "$OUT/bench_gpu_bf16.json"
# the FP8 draft with the former attention: transformers' sdpa in the target and in the draft (an A/B against
# the attention defaults)
step bench_gpu_attention "${FP8_S:-300}" "$PY" scripts/bench_gpu.py --compile --draft-fp8 --draft-attention sdpa \
    --target-attention sdpa --sizes 1,64 --profile --no-batch --no-stream --out "$OUT/bench_gpu_attention.json"
# the defaults with the target's q/k/v and gate/up stacked, one GEMM each (inference/stacked.py; an A/B
# against bench_gpu's plain step: the narrow k/v GEMMs of the 8B shape joined to the query's), profiled
step bench_gpu_stacked "${FP8_S:-300}" "$PY" scripts/bench_gpu.py --compile --target-stacked --sizes 1,64 --profile \
    --no-batch --no-stream --out "$OUT/bench_gpu_stacked.json"
# the same with one torch.topk a draft depth (an A/B against the step above: its chunked top-k, the default),
# profiled: the JSON keeps the draft's 30 costliest kernels
step bench_gpu_topk "${FP8_S:-300}" "$PY" scripts/bench_gpu.py --compile --draft-fp8 --topk-chunk none --sizes 1,64 --profile \
    --no-batch --no-stream --out "$OUT/bench_gpu_topk.json"
# the FP8 draft with q/k/v and gate/up as GEMMs of their own (an A/B against the stacked GEMMs, the
# default: H200 2026-11-28 1.532 against 1.419 ms), profiled
step bench_gpu_unstacked "${FP8_S:-300}" "$PY" scripts/bench_gpu.py --compile --draft-fp8 --fp8-unstacked --sizes 1,64 \
    --profile --no-batch --no-stream --out "$OUT/bench_gpu_unstacked.json"
# on request: one draft depth's top-k alone, one topk against chunks of 32 to 256 ids, eager and compiled
step bench_topk "${DEMO_S:-100}" "$PY" scripts/bench_topk.py --device cuda --out "$OUT/bench_topk.json"
# on request: GEMMs autotuned (max-autotune) against the default inductor, both with our CUDA graphs
step bench_gpu_autotune "${AUTOTUNE_S:-500}" "$PY" scripts/bench_gpu.py --compile max-autotune --compare inductor \
    --sizes 1,64 --no-batch --out "$OUT/bench_gpu_autotune.json"
# on request: batch 1, 4, 16 decoded with the target's batch passes compiled by inductor (batch-1 parts eager)
step bench_gpu_batch "${BATCH_S:-500}" "$PY" scripts/bench_gpu.py --compile-batch --sizes 1,64 \
    --out "$OUT/bench_gpu_batch.json"
# on request: the EAGLE authors' engine (eagle-llm, transformers 4.36) beside ours, both eager; ours compiled too
if [[ $steps == *" bench_reference "* || $steps == *" bench_reference_medusa "* ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/refsite .whl/ref/*.whl \
        || { echo "error: installing the reference's wheels from .whl/ref/ failed"; status=1; }
fi
step bench_reference "${REF_S:-400}" "$PY" scripts/bench_reference.py --ref-python "$PY" --ref-path /tmp/refsite \
    --device cuda --compile graphs --head outputs/eagle-ref-demo2/head --prompts 24 --repeats 2 \
    --out "$OUT/bench_reference"
# on request: the Medusa authors' engine (medusa-llm 0.1 among the wheels of .whl/ref/) beside ours, both eager,
# on the Medusa-1 head outputs/medusa-demo/head (carry it; `python train.py head=medusa trainer.output_dir=...`)
step bench_reference_medusa "${REF_S:-400}" "$PY" scripts/bench_reference_medusa.py --ref-python "$PY" \
    --ref-path /tmp/refsite --device cuda --head outputs/medusa-demo/head --prompts 24 --repeats 2 \
    --out "$OUT/bench_reference_medusa"
# on request: sampling's costs by vocabulary size on the GPU (top-p, one draw, the acceptance walk)
step bench_sampling "${DEMO_S:-100}" "$PY" scripts/bench_sampling.py --device cuda --vocab 32000 128256 --rows 6
step bench_sampling_60 "${DEMO_S:-100}" "$PY" scripts/bench_sampling.py --device cuda --vocab 128256 --rows 60
# on request: EAGLE-3 trained on the 8B-shaped target (online DDP, offline DDP, online ZeRO-3; see the top)
step bench_train "${TRAIN_S:-560}" "$PY" scripts/bench_train_gpu.py --out "$OUT/bench_train" \
    --work outputs/bench_train_work --budget-s "${TRAIN_BUDGET_S:-480}"
heads=()
for spec in eagle3=outputs/eagle3-demo/head medusa2=outputs/medusa2-demo/head; do
    [ -f "${spec#*=}/config.json" ] && heads+=(--drafter "$spec")
done
if [ ${#heads[@]} -gt 0 ]; then
    # eager (--compile off; benchmark.py's default on CUDA, auto, is graphs: the next step)
    step bench_demo "${DEMO_S:-100}" "$PY" scripts/benchmark.py --device cuda --prompts 12 --compile off \
        "${heads[@]}" --out "$OUT/bench_demo"
    # target and drafters as our CUDA graphs of the eager passes (no compiler: captured in the warm-up)
    step bench_demo_graphs "${DEMO_S:-100}" "$PY" scripts/benchmark.py --device cuda --prompts 12 --compile graphs \
        --warmup 12 "${heads[@]}" --out "$OUT/bench_demo_graphs"
    # on request: the EAGLE draft as one CUDA graph beside the eager target (compiles during the warm-up answers)
    step bench_demo_compiled "${DEMO_S:-100}" "$PY" scripts/benchmark.py --device cuda --prompts 12 --no-hf \
        --compile-draft --warmup 12 "${heads[@]:0:2}" --out "$OUT/bench_demo_compiled"
    # on request: target AND drafters compiled, with our CUDA graphs and with torch.compile's (an A/B)
    step bench_demo_full "${DEMO_S:-100}" "$PY" scripts/benchmark.py --device cuda --prompts 12 --compile \
        --warmup 12 "${heads[@]}" --out "$OUT/bench_demo_full"
    # on request: batch 1, 4, 16 of the demo prompts with the demo heads, the batch passes as our graphs
    step bench_batch_graphs "${DEMO_S:-100}" "$PY" scripts/bench_batch.py --device cuda --compile graphs \
        --batch-size 1 4 16 --prompts 48 "${heads[@]}" --out "$OUT/bench_batch_graphs"
    # on request: the EAGLE-3 drafter's batch drafting alone, eager beside every row's draft as our CUDA graphs
    [ -f outputs/eagle3-demo/head/config.json ] && step bench_batch_draft "${DEMO_S:-100}" "$PY" \
        scripts/bench_batch_draft.py --device cuda --drafter outputs/eagle3-demo/head --modes eager graphs \
        --batch-size 1 4 16 --out "$OUT/bench_batch_draft"
    # on request: sampling (T 1, top-p 0.9), EAGLE-3's top-k children beside children drawn from the head
    [ -f outputs/eagle3-demo/head/config.json ] && step bench_demo_sampled "${DEMO_S:-100}" "$PY" \
        scripts/benchmark.py --device cuda --prompts 24 --no-hf --temperature 1.0 --top-p 0.9 --seed 0 \
        --drafter eagle3=outputs/eagle3-demo/head \
        --drafter eagle3_drawn=outputs/eagle3-demo/head@rule=without_replacement --out "$OUT/bench_demo_sampled"
    step bench_demo_full_ro "${DEMO_S:-100}" "$PY" scripts/benchmark.py --device cuda --prompts 12 --no-hf \
        --compile reduce-overhead --warmup 12 "${heads[@]}" --out "$OUT/bench_demo_full_ro"
fi
exit $status
