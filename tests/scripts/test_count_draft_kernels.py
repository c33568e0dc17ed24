"""scripts/count_draft_kernels.py: the GEMMs of a compiled draft's graph by head variant (the inductor
kernel count it prints beside them is a proxy measured in the README, not held here)."""

from __future__ import annotations

import argparse


def test_a_stacked_fp8_draft_runs_fewer_gemms(script):
    """Depth 2: one head step and two lm_heads. bf16 and unstacked FP8: q, k, v, o, gate, up, down a step;
    FP8 stacked: q/k/v and gate/up one GEMM each."""
    count = script("count_draft_kernels")
    args = argparse.Namespace(depth=2, top_k=2, draft_vocab=512)
    gemms = {}
    for variant in ("bf16", "fp8", "fp8-unstacked", "fp8-matmul"):
        count.OPS.clear()
        count.draft_once(variant, args, "aten_ops")
        gemms[variant] = {name: n for name, n in count.OPS.items() if name in count.GEMMS}
    assert sum(gemms["bf16"].values()) == sum(gemms["fp8-unstacked"].values()) == 7 + 2
    assert gemms["fp8"] == {"_scaled_mm": 4 + 2} and gemms["fp8-unstacked"] == {"_scaled_mm": 9}
    assert gemms["fp8-matmul"] == {"_scaled_mm": 4 + 2, "bmm": 2}  # scores and values: the step's attention
