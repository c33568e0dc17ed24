"""bench_gpu.py's command line: its options and their parsers (a sibling module, found as
`python scripts/bench_gpu.py` finds it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from spechead.heads.attention import NAME as TREE_SDPA
from spechead.inference.drafters.topk import Chunk

TREE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
BACKENDS = ("inductor", "max-autotune", "graphs", "reduce-overhead", "cudagraphs", "aot_eager", "eager")


def parse_args(argv: list[str] | None, doc: str | None) -> argparse.Namespace:
    """bench_gpu.py's options (its module doc `doc` as the help's description)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (cpu needs --tiny)")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama config (runs on a CPU in seconds)")
    # --compile / --compile-batch [BACKEND]: a plain flag means inductor
    backend = {"nargs": "?", "const": "inductor", "default": None, "choices": BACKENDS, "metavar": "BACKEND"}
    p.add_argument(
        "--compile",
        **backend,
        help="torch.compile the target and the draft step: inductor (plain --compile; CUDA: each shape "
        "captured as a CUDA graph of our own, replayed with no guards), max-autotune (the same with GEMMs "
        "autotuned by inductor: a longer compile), graphs (no compiler: the eager passes captured as our "
        "CUDA graphs, ready in seconds), reduce-overhead (inductor with torch.compile's CUDA graphs) or "
        "cudagraphs (torch.compile's CUDA graphs without inductor)",
    )
    p.add_argument(
        "--compare",
        default=None,
        choices=BACKENDS,
        metavar="BACKEND",
        help="with --compile: measure the batch-1 parts again compiled with this backend, in the same "
        "process on the same weights (an A/B of the two fast paths)",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=TREE_SIZES,
        help="tree sizes to verify, e.g. 1,16,64 (fewer graphs to compile; must hold 1, 64 and --tree-size)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement")
    p.add_argument("--iters", type=int, default=20, help="timed runs per measurement (median)")
    p.add_argument("--context", type=int, default=None, help="tokens before the step (default 512; tiny 64)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE-3 draft vocab (capped at the vocab)")
    p.add_argument("--top-k", type=int, default=8, help="EAGLE-2 expansion width")
    p.add_argument("--depth", type=int, default=7, help="EAGLE-2 draft depth")
    p.add_argument("--tree-size", type=int, default=64, choices=TREE_SIZES, help="nodes verified per pass")
    p.add_argument("--out", type=Path, default=None, help="also write every number to this JSON file")
    p.add_argument("--no-batch", action="store_true", help="skip the batch 1, 4, 16 rows (eager: about 20 s)")
    p.add_argument(
        "--no-stream", action="store_true",
        help="skip the batch-1 decoded row (whole passes through SpeculativeGenerator, compiled like --compile)",
    )  # fmt: skip
    p.add_argument(
        "--draft-fp8", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
        help="the head's per-depth layers in FP8 e4m3 (heads/fp8.py: half the bytes a draft depth reads): auto "
             "(default, what from_pretrained drafts with: on a GPU with FP8 tensor cores), on (bare "
             "--draft-fp8) or off",
    )  # fmt: skip
    p.add_argument(
        "--fp8-unstacked", action="store_true",
        help="with --draft-fp8: q/k/v and gate/up as GEMMs of their own, not stacked into one each (an A/B)",
    )  # fmt: skip
    p.add_argument(
        "--topk-chunk", type=topk_chunk, default="auto", metavar="N",
        help="each draft depth's top-k over the k chunks of N ids with the largest maxima (drafters/topk.py); "
             "none: one topk; default auto (the drafters' default: chunks of 64 for a draft vocab >= 20000)",
    )  # fmt: skip
    p.add_argument(
        "--draft-attention", choices=("auto", "sdpa", "matmul"), default="auto",
        help="how a draft depth's few queries attend (heads/fused.py): auto (default, the drafters' own: "
             "matmul on a GPU, sdpa elsewhere), sdpa, or matmul (heads/attention.py grouped_attention)",
    )  # fmt: skip
    p.add_argument(
        "--target-attention", choices=(TREE_SDPA, "sdpa", "spechead_matmul"), default=TREE_SDPA,
        help=f"the target's attention: {TREE_SDPA} (default, what from_pretrained loads: one query packed, "
             "tree passes as matmuls on a GPU; heads/attention.py), transformers' sdpa (an A/B), or "
             "spechead_matmul (tree passes as matmuls on any device)",
    )  # fmt: skip
    p.add_argument(
        "--target-stacked", action="store_true",
        help="the target's q/k/v and gate/up as one GEMM each (inference/stacked.py; an A/B: one wide GEMM in "
             "place of the narrow k/v ones)",
    )  # fmt: skip
    p.add_argument(
        "--compile-batch",
        **backend,
        help="the batch rows' decoded passes with the target's batch passes compiled (batch_graphs.py: "
        "CUDA graphs of our own with inductor; a graph per batch size and tree bucket, compiled first)",
    )
    p.add_argument(
        "--blocks", type=_blocks, default=(8, 16), metavar="K,K",
        help="parallel drafters' blocks (default 8,16): a P-EAGLE head of K and a DFlash head of block K each, "
             "one forward per pass, timed beside EAGLE-3's depth-D draft (scripts/parallel_drafts.py)",
    )  # fmt: skip
    p.add_argument("--dflash-layers", type=int, default=5, help="DFlash drafter layers (default 5)")
    p.add_argument(
        "--peagle-layers", type=int, default=1,
        help="P-EAGLE decoder layers (default 1, the demo recipe's; AWS's published P-EAGLE drafters: 4)",
    )  # fmt: skip
    p.add_argument("--no-parallel", action="store_true", help="skip the P-EAGLE / DFlash rows")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile each part (torch.profiler): wall vs kernel time, kernel counts, top kernels",
    )
    return p.parse_args(argv)


def topk_chunk(text: str) -> Chunk:
    """ "64" -> 64, "auto" -> "auto", "none" -> None (one topk)."""
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a chunk is a positive number of ids, auto or none, got {text!r}")
    return int(text)


def _blocks(text: str) -> tuple[int, ...]:
    """ "8,16" -> (8, 16), each >= 2 (a block drafts at least one token)."""
    try:
        blocks = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        blocks = ()
    if not blocks or min(blocks) < 2:
        raise argparse.ArgumentTypeError(f"blocks are numbers >= 2, e.g. 8,16, got {text!r}")
    return blocks


def _sizes(text: str) -> tuple[int, ...]:
    """ "1,16,64" -> (1, 16, 64), each one of TREE_SIZES."""
    sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    if not sizes or any(n not in TREE_SIZES for n in sizes):
        raise argparse.ArgumentTypeError(f"tree sizes must come from {TREE_SIZES}, got {text!r}")
    return sizes
