"""GPU cost benchmark with no download: a Llama-3.1-8B-shaped target and an EAGLE-3 head, random bf16 weights.

    python scripts/bench_gpu.py                              # one H100: about a minute eager
    python scripts/bench_gpu.py --compile --out gpu.json     # inductor + our CUDA graphs, target + draft
    python scripts/bench_gpu.py --compile --compare reduce-overhead    # and torch.compile's CUDA graphs beside
    python scripts/bench_gpu.py --compile cudagraphs --sizes 1,16,64   # CUDA graphs without inductor (fast)
    python scripts/bench_gpu.py --tiny --device cpu          # a tiny Llama on the CPU, seconds (what the test runs)

Measures, through the engine's own TargetRunner (its preallocated row cache) and EagleDrafter: the plain decode step
(batch 1, one token after --context tokens) against the HBM roofline (weight bytes / a measured device copy
bandwidth), verification by tree size (random trees), EAGLE-3 drafting (EAGLE-2 dynamic expansion, timed
for depth 1..D; per depth = the increments), the drafter's accept and the target's commit, and the speedup
projected from those parts: tau * t_step / (t_verify(N) + t_commit + t_draft + t_accept). Batch 1, 4, 16:
plain batched decoding ([B, 1] steps with a cache) and batched tree verification, with projected speculative
tokens/s, and whole passes of batched decoding (plain and EAGLE-3 with a static tree) through the engine
generate_batch runs, projected at tau 5.4 from their measured cost. Batch 1 decoded: whole passes through
SpeculativeGenerator (plain and EAGLE-3), host work and waits included, against the parts' sum. Weights
are random: times are real, accepted lengths are not (tau is an input). The EAGLE-3 draft vocab is
--draft-vocab (default 32000, the published heads' size). Rope scaling is left out (no cost).
Timing: CUDA events (one synchronisation per measurement) on CUDA, perf_counter on CPU; medians of --iters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from gpu_batch_rows import batch_row, decoded_or_error, project_batch, random_parents
from gpu_bench_args import TREE_SIZES, parse_args
from gpu_report import ACCEPTED, COMPARED, TAUS, goals, parallel_goal_keys, render, summarize
from gpu_stream_rows import project_stream, stream_or_error
from parallel_drafts import measure_parallel, parallel_heads, project_parallel
from transformers import LlamaConfig, LlamaForCausalLM

from spechead.heads.attention import NAME as TREE_SDPA
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.fp8 import to_fp8
from spechead.inference.draft_weights import check_draft_settings, fp8_by_default
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.topk import resolve_chunk
from spechead.inference.evaluation.profiling import Timer, copy_bandwidth, profile_part
from spechead.inference.sampling import SamplingParams
from spechead.inference.stacked import stack_projections
from spechead.inference.target.runner import CUDA_BUCKETS, TargetRunner

BATCHES = (1, 4, 16)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_args(argv, __doc__)


def target_config(tiny: bool, context: int) -> LlamaConfig:
    """Llama-3.1-8B's shape (or a tiny one), sdpa attention (tree masks)."""
    sizes = (
        dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1024)
        if tiny
        else dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256)
    )  # fmt: skip
    positions = max(8192, context + 2 * max(TREE_SIZES))
    return LlamaConfig(
        **sizes, rope_theta=500000.0, max_position_embeddings=positions, tie_word_embeddings=False
    )


def build(
    cfg: LlamaConfig, draft_vocab: int, device: torch.device, attention: str = TREE_SDPA
) -> tuple[LlamaForCausalLM, Eagle3Head]:
    """Target (bf16, created on the device: no host copy, attention `attention`) and an EAGLE-3 head of its
    width, random weights."""
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation=attention).eval()
        head_cfg = Eagle3Config.from_target(model.config, draft_vocab_size=min(draft_vocab, cfg.vocab_size))
        head = Eagle3Head(head_cfg).to(torch.bfloat16).eval()
    head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
    return model, head


def drafts_in_fp8(setting: str, head: Eagle3Head, device: torch.device) -> bool:
    """--draft-fp8 on / off, or auto: where from_pretrained's default drafts in FP8 (`fp8_by_default`: a
    GPU with FP8 tensor cores)."""
    return setting == "on" or (setting == "auto" and fp8_by_default(head, device))


def draft_attention(drafter: EagleDrafter, device: torch.device) -> str | None:
    """How the drafter's fused step attends on `device`: "matmul" or "sdpa" (None: no fused step)."""
    step = drafter.head_step
    if step is None or not hasattr(step, "attends_as_matmuls"):
        return None
    return "matmul" if step.attends_as_matmuls(device) else "sdpa"


def deepest_path(parents: torch.Tensor) -> torch.Tensor:
    """Node ids root..deepest node (ascending) of parents [N]."""
    depth = [0] * parents.numel()
    for i in range(1, parents.numel()):
        depth[i] = depth[int(parents[i])] + 1
    node, path = max(range(len(depth)), key=depth.__getitem__), []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return torch.tensor(path[::-1], dtype=torch.long)


@torch.inference_mode()
def measure_runner(
    model, head, args, timer: Timer, compile: bool | str = False, keep: dict | None = None
) -> dict:
    """Decode step, verify by tree size, commit, EAGLE-3 propose by depth and accept (batch 1).

    compile: the runner's compiled verify (fixed-shape cache, one graph per bucket; CUDA graphs on CUDA)
    and the drafter's compiled head step and top-k (one graph per frontier size). keep: receives the
    runner and the drafter (the decoded row reuses them, graphs and all)."""
    device, ctx, vocab = next(model.parameters()).device, args.context, model.config.vocab_size
    buckets = CUDA_BUCKETS if device.type == "cuda" or compile else None
    runner = TargetRunner(model, head.config.target_layers, max_length=ctx + 2 * max(TREE_SIZES),
                          buckets=buckets, compile=compile)  # fmt: skip
    ids = torch.randint(0, vocab, (1, ctx + max(TREE_SIZES)), generator=torch.Generator().manual_seed(0))
    prompt, tree_ids = ids[:, :ctx], ids[:, ctx:].to(device)
    logits, hiddens = runner.prefill(list(prompt))  # one row
    hidden = {layer: h.clone() for layer, h in hiddens[0].items()}  # [T, H] (graph outputs get reused)
    root = int(logits.argmax(-1)[0])
    verify_ms = {}
    for n in args.sizes:
        parents = random_parents(n).to(device)
        verify_ms[n] = timer.ms(lambda n=n, parents=parents: runner.verify(tree_ids[:, :n], parents))
    parents = random_parents(args.tree_size)
    path = deepest_path(parents[0])

    def verify_tree() -> None:
        runner.lengths = [ctx]  # drop the previous commit: every pass starts after the same context
        runner.verify(tree_ids[:, : args.tree_size], parents)

    commit_ms = timer.ms(lambda: runner.commit([path]), setup=verify_tree)
    runner.lengths = [ctx]
    sampling, propose_ms = SamplingParams(), {}
    # one drafter (one set of compiled graphs) drafting to depth 1..D: only the depth loop's bound changes
    drafter = EagleDrafter(head, tree="dynamic", top_k=min(args.top_k, head.config.draft_vocab_size),
                           depth=args.depth, total_tokens=args.tree_size)  # fmt: skip
    drafter.topk_chunk, drafter.head_step.attention = args.topk_chunk, args.draft_attention  # (a fused step)
    draft_status = "eager"

    def propose() -> None:  # a batch of one (compiled: the graphs' rows; eager: `EagleRows`)
        drafter.propose([root], [sampling], [None])

    if compile:
        try:  # a drafter that fails to compile still gives eager draft numbers beside the compiled target
            drafter.use_compile(compile)
            drafter.start([prompt[0]], [hidden], [root])
            propose()
            draft_status = "compiled"
        except Exception as err:  # noqa: BLE001 - reported in the output
            draft_status = f"compile FAILED ({type(err).__name__}: {str(err).splitlines()[0][:160]}); eager"
            drafter.use_compile(False)
    drafter.start([prompt[0]], [hidden], [root])
    # compiled: the draft's depth is part of its graph, so only depths 1 and D (two graphs to compile)
    for depth in sorted({1, args.depth}) if compile else range(1, args.depth + 1):
        drafter.depth = depth
        propose_ms[depth] = timer.ms(propose)
    # the accept as decoding reading each acceptance first runs it (`accept_paths`): the verified tree's
    # states {l: [1, N, H]} and the path of its first ACCEPTED nodes (the path's rows are gathered, then
    # fused and committed: eagerly, or by the accept graph when compiled)
    tree_states = {layer: h[None, : args.tree_size] for layer, h in hidden.items()}
    accepted = ([prompt[0, :ACCEPTED].tolist()], tree_states, [list(range(ACCEPTED))], [root])

    def restart() -> None:  # every accept commits after the same prompt (the cache does not fill up)
        restart_at(drafter, ctx)

    accept_ms = timer.ms(lambda: drafter.accept_paths(*accepted), setup=restart)
    if keep is not None:  # (and the prompt's states: the parallel drafters draft after the same context)
        keep.update(runner=runner, drafter=drafter, prompt=prompt[0], hidden=hidden, root=root)
    out = {"verify_ms": verify_ms, "commit_ms": commit_ms, "propose_ms": propose_ms, "accept_ms": accept_ms,
           "commit_path_len": int(path.numel()), "draft_status": draft_status,
           "draft_attention": draft_attention(drafter, device)}  # fmt: skip
    if args.profile:
        step_parents = random_parents(1).to(device)
        parts: dict[str, Callable[[], object]] = {
            "decode step": lambda: runner.verify(tree_ids[:, :1], step_parents),
            f"verify({args.tree_size})": verify_tree,
            "verify+commit": lambda: (verify_tree(), runner.commit([path])),
            f"draft (depth {args.depth})": propose,
            "accept": lambda: (restart(), drafter.accept_paths(*accepted)),
        }
        if compile:  # beside it, the same draft eager (no graph): what the graph saves
            eager = EagleDrafter(head, tree="dynamic", top_k=drafter.top_k, depth=args.depth,
                                 total_tokens=args.tree_size)  # fmt: skip
            eager.topk_chunk, eager.head_step.attention = args.topk_chunk, args.draft_attention
            eager.start([prompt[0]], [hidden], [root])
            parts["draft eager"] = lambda: eager.propose([root], [sampling], [None])
        out["profile"] = {name: asdict(profile_part(fn, device)) for name, fn in parts.items()}
    return out


def restart_at(drafter: EagleDrafter, committed: int) -> None:
    """Drop a started batch of one's entries after the first `committed` (the next accept lands there): its
    rows' lengths, eager or compiled (`GraphRows`: the host's length and the device's copy its graphs read)."""
    assert drafter._rows is not None  # started
    drafter._rows.rewind(committed)


def draft_bytes(head: Eagle3Head, depth: int) -> int:
    """Weight bytes a depth-D draft must read at least: depth 1 the draft-vocab head (the root's children
    from the accepted feature), each further depth the decoder layer, norm and that head (fc runs in
    accept). Buffers count too: FP8 layers (--draft-fp8) keep their weights there."""
    tensors = [*head.named_parameters(), *head.named_buffers()]
    step = sum(t.nbytes for name, t in tensors if not name.startswith(("fc.", "d2t", "t2d")))
    lm_head = sum(t.nbytes for t in [*head.lm_head.parameters(), *head.lm_head.buffers()])
    return lm_head + (depth - 1) * step


def resolve_device(args: argparse.Namespace) -> torch.device:
    """The device to run on; ValueError on bad options (no CUDA without --tiny, bad numbers)."""
    numbers = {"iters": (args.iters, 1), "warmup": (args.warmup, 0), "context": (1 if args.context is None else args.context, 1),
               "top-k": (args.top_k, 1), "depth": (args.depth, 1), "draft-vocab": (args.draft_vocab, 1),
               "dflash-layers": (args.dflash_layers, 1), "peagle-layers": (args.peagle_layers, 1)}  # fmt: skip
    for name, (value, low) in numbers.items():
        if value < low:
            raise ValueError(f"--{name} must be >= {low}, got {value}")
    if args.compare and not args.compile:
        raise ValueError(f"--compare {args.compare} measures beside --compile BACKEND: add --compile")
    if not {1, 64, args.tree_size} <= set(args.sizes):
        raise ValueError(f"--sizes must hold 1, 64 and --tree-size {args.tree_size}, got {args.sizes}")
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {args.device}: cuda or cpu only (timed with CUDA events or perf_counter)")
    if device.type == "cuda" and not torch.cuda.is_available():
        if not args.tiny:
            raise ValueError(
                f"--device {args.device}: CUDA is not available on this machine (--tiny runs on a CPU)"
            )
        print("note: CUDA is not available; --tiny runs on the CPU")
        device = torch.device("cpu")
    if device.type == "cpu" and not args.tiny:
        raise ValueError("an 8B-shaped target on the CPU is not a meaningful GPU benchmark: add --tiny")
    return device


def weight_and_streamed_bytes(model: LlamaForCausalLM, context: int) -> tuple[int, int]:
    """All parameter bytes; bytes one decode step reads (no embedding table, + the KV cache)."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context * 2  # bf16 K and V
    return weights, weights - model.get_input_embeddings().weight.nbytes + kv


def measure_compiled(
    model, head, args, timer: Timer, device: torch.device, backend: str | None, keep: dict | None = None
) -> tuple[dict, str]:
    """measure_runner with the target compiled with `backend` (eager numbers, said so, if that fails)."""
    if not backend:
        return measure_runner(model, head, args, timer, keep=keep), "off"
    cuda = device.type == "cuda"
    how = {"inductor": "inductor, CUDA graphs captured by GraphedFunction" if cuda else "inductor",
           "reduce-overhead": "inductor, mode=reduce-overhead" if cuda else "inductor",
           "graphs": "no compiler, eager passes captured by GraphedFunction" if cuda else "eager, fixed shapes",
           }.get(backend, backend)  # fmt: skip
    start = time.perf_counter()
    try:
        compile = True if backend == "inductor" else backend
        parts = measure_runner(model, head, args, timer, compile=compile, keep=keep)
        status = f"on, target and draft step ({how}; compiling + measuring took {time.perf_counter() - start:.0f} s)"
    except Exception as err:  # noqa: BLE001 - any compile failure still yields eager numbers
        status = f"FAILED ({type(err).__name__}: {str(err).splitlines()[0][:200]}); eager numbers"
        parts = measure_runner(model, head, args, timer, keep=keep)
    return parts, status


def run(args: argparse.Namespace, device: torch.device) -> dict:
    args.context = args.context or (64 if args.tiny else 512)
    torch.manual_seed(0)
    model, head = build(
        target_config(args.tiny, args.context), args.draft_vocab, device, args.target_attention
    )
    stacked = stack_projections(model) if args.target_stacked else 0  # (an A/B: inference/stacked.py)
    args.draft_fp8 = drafts_in_fp8(args.draft_fp8, head, device)
    if args.draft_fp8:
        to_fp8(head, stack=not args.fp8_unstacked)
    timer = Timer(device, args.iters, args.warmup)
    bandwidth = copy_bandwidth(device, timer, (1 << 30) if device.type == "cuda" else (32 << 20))
    weight_bytes, streamed = weight_and_streamed_bytes(model, args.context)
    kept: dict = {}  # the measured runner and drafter: the decoded row reuses their graphs
    parts, status = measure_compiled(model, head, args, timer, device, args.compile, keep=kept)
    report = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "target": "tiny Llama" if args.tiny else "Llama-3.1-8B shape (random weights)",
              "compile": status, "compile_batch": args.compile_batch, "context": args.context, "draft_vocab": head.config.draft_vocab_size, "draft_fp8": args.draft_fp8, "fp8_stacked": args.draft_fp8 and not args.fp8_unstacked, "target_attention": model.config._attn_implementation, "target_stacked": stacked,
              "topk_chunk": resolve_chunk(args.topk_chunk, device.type, head.config.draft_vocab_size),
              "top_k": args.top_k, "depth": args.depth, "tree_size": args.tree_size, **parts}  # fmt: skip
    report.update(summarize(args, parts, bandwidth, weight_bytes, streamed, draft_bytes(head, args.depth)))
    extra = report["pass_ms"] - parts["verify_ms"][args.tree_size]  # commit + draft + accept at batch 1
    report["batch"] = [
        project_batch(
            {
                **batch_row(model, b, args.context, args.tree_size, timer),
                **decoded_or_error(model, head, b, args.context, compile=args.compile_batch or False),
            },
            extra, tau=5.4,
        )
        for b in (() if args.no_batch else BATCHES)
    ]  # fmt: skip
    report["batch_speculative"] = (
        "batch: the first table projects tau 5.4 from a batched verify + the batch-1 draft, commit and accept; "
        "the second decodes (random weights: about one token a pass) and projects tau 5.4 from its "
        "measured pass, batched drafter and engine included"
    )
    if not args.no_stream:  # whole passes as the engine runs them, beside the parts' sum
        stream = stream_or_error(model, head, args, args.compile or False, kept["runner"], kept["drafter"])
        report["stream"] = project_stream(stream, report["pass_ms"], tau=5.4)
    if not args.no_parallel:  # one P-EAGLE / DFlash forward per pass, blocks of --blocks, beside EAGLE-3's
        report.update(measure_parallel_rows(model, args, timer, kept, parts))
    report["goals"] = goals(report)
    if args.compile and args.compare:  # the batch-1 parts again with another compiled fast path
        other, other_status = measure_compiled(model, head, args, timer, device, args.compare)
        summary = summarize(args, other, bandwidth, weight_bytes, streamed, draft_bytes(head, args.depth))
        report["compare"] = {"compile": other_status, **{key: summary[key] for key in COMPARED}}
    return report


def measure_parallel_rows(model, args: argparse.Namespace, timer: Timer, kept: dict, parts: dict) -> dict:
    """{"parallel": {name: row}, "parallel_layers" (DFlash's), "peagle_layers"} and the goal keys
    (`parallel_goal_keys`): each parallel head's draft after the measured context, its chain verified, its pass
    projected (parallel_drafts.py)."""
    heads = parallel_heads(model, args.draft_vocab, args.blocks, args.dflash_layers, args.peagle_layers)
    # compiled runs: each draft as "graphs", decoding's CUDA default (its eager kernels captured; no launches)
    compile = "graphs" if args.compile else False
    rows = measure_parallel(heads, kept["prompt"], kept["hidden"], kept["root"], timer, compile)
    step = parts["verify_ms"][1]
    rows = project_parallel(rows, kept["runner"], step, parts["commit_ms"], timer, TAUS)
    peagle = next(head for name, head in heads.items() if name.startswith("peagle"))
    layers = {"parallel_layers": args.dflash_layers, "peagle_layers": peagle.config.num_layers}
    return {"parallel": rows, **layers, **parallel_goal_keys(rows)}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        device = resolve_device(args)
        check_draft_settings(args.draft_fp8 == "on", False, device)  # (an A100 has no FP8 tensor cores)
    except (ValueError, RuntimeError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    report = run(args, device)
    print(render(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
