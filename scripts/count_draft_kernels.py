"""Count the kernels of one compiled EAGLE-3 draft on this machine's inductor: a GPU-free proxy for what
a draft depth launches (each kernel on a GPU is a launch and a gap in the CUDA graph).

    python scripts/count_draft_kernels.py                 # bf16, FP8 stacked / unstacked / attention as matmuls
    python scripts/count_draft_kernels.py --depth 7 --top-k 8 --draft-vocab 32000

The head is bench_gpu.py's tiny stand-in (64 wide) with a draft vocabulary as long as the 8B head's, so the
top-k runs chunked as it does there; kernel counts do not depend on the width. Per variant: the kernels
inductor generated for the whole draft (`torch._inductor.metrics.generated_kernel_count`; fused pointwise
and reduction kernels, C++ on a CPU, Triton on a GPU: the fusion decisions are the scheduler's, the counts
close but not equal) and the GEMMs of its graph (extern kernels: `mm`, `addmm`, `bmm`, `_scaled_mm`).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import torch._inductor.metrics as metrics
from torch._dynamo import register_backend
from torch._functorch.aot_autograd import aot_module_simplified

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import build, target_config  # noqa: E402

from spechead.heads.fp8 import to_fp8  # noqa: E402
from spechead.inference.drafters.eagle import EagleDrafter  # noqa: E402
from spechead.inference.sampling import SamplingParams  # noqa: E402
from spechead.inference.target.runner import TargetRunner  # noqa: E402

GEMMS = ("mm", "addmm", "bmm", "_scaled_mm")
# bf16; FP8 stacked; FP8 unstacked (--fp8-unstacked); FP8 stacked, attention as matmuls (--draft-attention)
VARIANTS = ("bf16", "fp8", "fp8-unstacked", "fp8-matmul")
OPS: collections.Counter = collections.Counter()


@register_backend
def aten_ops(gm, inputs):  # noqa: ANN001, ANN201 - a torch.compile backend's signature
    """Counts the aten ops of the graph (OPS), then runs it as traced."""

    def count(graph, _inputs):  # noqa: ANN001, ANN202
        OPS.update(str(n.target).split(".")[1] for n in graph.graph.nodes if "aten" in str(n.target))
        return graph.forward

    return aot_module_simplified(gm, inputs, fw_compiler=count)


def draft_once(variant: str, args: argparse.Namespace, backend: str | bool) -> None:
    """Compile and run one whole draft of a fresh head in `variant` (VARIANTS)."""
    cfg = target_config(True, 64)
    cfg.vocab_size = args.draft_vocab
    torch.manual_seed(0)
    model, head = build(cfg, args.draft_vocab, torch.device("cpu"))
    model, head = model.float(), head.float()  # (bf16 GEMMs on a CPU take another code path; counts alike)
    if variant != "bf16":
        to_fp8(head, stack=variant != "fp8-unstacked")
    runner = TargetRunner(model, head.config.target_layers, max_length=256)
    ids = torch.randint(0, args.draft_vocab, (1, 32))
    with torch.inference_mode():
        logits, hiddens = runner.prefill(list(ids))  # one row
        hidden = {k: h.clone() for k, h in hiddens[0].items()}
        root = int(logits.argmax(-1)[0])
        drafter = EagleDrafter(head, tree="dynamic", top_k=args.top_k, depth=args.depth, total_tokens=64)
        if variant == "fp8-matmul":  # the few-query attention as matmuls (bench_gpu.py --draft-attention)
            drafter.head_step.attention = "matmul"
        drafter.use_compile(backend)
        drafter.start([ids[0]], [hidden], [root])  # a batch of one (compiled: its graphs' rows)
        drafter.propose([root], [SamplingParams()], [None])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = p.parse_args(argv)
    for variant in args.variants:
        if variant not in VARIANTS:
            p.error(f"unknown variant {variant!r}: use one of {', '.join(VARIANTS)}")
        OPS.clear()
        draft_once(variant, args, "aten_ops")
        gemms = sum(OPS[name] for name in GEMMS)
        torch._dynamo.reset()
        metrics.reset()
        draft_once(variant, args, True)
        print(
            f"{variant:14s} depth {args.depth}, top-k {args.top_k}: {metrics.generated_kernel_count} generated "
            f"kernels + {gemms} GEMMs ({sum(OPS.values())} aten ops in the graph)"
        )
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
