"""The k best entries of each row, in one `torch.topk` or in two stages over column chunks.

On CUDA, `torch.topk` of a few long rows (an EAGLE draft's [k, Vd] logits: 8 rows of 32000) runs the
multi-block radix select: about four passes of three kernels each, one per digit, plus the gather. In
two stages every stage is the single-block kernel over short rows: the k best of each `chunk` columns
([q, V / chunk, chunk] -> [q, V / chunk, k]), then the k best of those. The same k values come out
(every one of the row's k best is among its chunk's k best); which of several equal values is named
may differ. Whether it pays on a GPU is what `scripts/bench_gpu.py --topk-chunk` measures; on a CPU
it does not (about 7x slower at [8, 32000]).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def topk_rows(x: Tensor, k: int, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of x [..., V], sorted (largest first), and their column ids
    [..., k] each. chunk: in two stages over chunks of this many columns (None, or k > chunk: one
    `torch.topk`). x's entries are taken to be finite (logits): a row with fewer than k finite
    entries may name its last column more than once."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of columns, got {chunk}")
    width = x.shape[-1]
    if chunk is None or k > chunk or width <= chunk:
        return x.topk(k, dim=-1)
    pad = -width % chunk
    if pad:  # the last chunk filled up with -inf (never picked over a finite entry)
        x = F.pad(x, (0, pad), value=float("-inf"))
    lead = x.shape[:-1]
    blocks = x.reshape(*lead, -1, chunk)  # [..., V / chunk, chunk]
    values, inner = blocks.topk(k, dim=-1)  # [..., V / chunk, k] each
    best, at = values.reshape(*lead, -1).topk(k, dim=-1)  # [..., k]: the winners' places among those
    column = (at // k) * chunk + inner.reshape(*lead, -1).gather(-1, at)  # [..., k] block start + offset
    return best, column.clamp(max=width - 1) if pad else column
