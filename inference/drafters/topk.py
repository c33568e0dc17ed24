"""The k best entries of each row, in one `torch.topk` or over the k column chunks with the largest maxima.

Why: on CUDA, `torch.topk` of a few long rows (an EAGLE draft's [k, Vd] logits) runs the multi-block radix
select, many kernels a depth; chunked, both top-ks run over short rows. The same k values come out: a
row's i-th best entry a_i either sits in a kept chunk with the i - 1 above it, or some a_j (j <= i) sits in
a dropped chunk, and then each of the k kept chunks holds an entry >= a_j >= a_i. Which of several equal
values is named may differ from `torch.topk`. "auto" chunks rows of 20,000 or more by 64 (on CUDA and a
CPU: `scripts/bench_topk.py`, docs/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor

Chunk = int | Literal["auto"] | None
AUTO_CHUNK, AUTO_WIDTH = 64, 20000  # "auto": chunks of 64 ids for rows of 20,000 or more (CUDA, CPU)


def resolve_chunk(chunk: Chunk, device_type: str, width: int) -> int | None:
    """The chunk `topk_rows` uses for rows of `width` on a device of this type ("cuda", "cpu")."""
    if chunk != "auto":
        return chunk
    return AUTO_CHUNK if device_type in ("cuda", "cpu") and width >= AUTO_WIDTH else None  # measured on these


def topk_rows(x: Tensor, k: int, chunk: Chunk = None) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of x [..., V], sorted (largest first), and their column ids
    [..., k] each. chunk: search only the k chunks of this many columns with the largest maxima (None,
    or k chunks cover the row: one `torch.topk`; "auto": see the module). x's entries are taken to be
    finite (logits): a row with fewer than k finite entries may name its last column more than once."""
    chunk = resolve_chunk(chunk, x.device.type, x.shape[-1])
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of columns, got {chunk}")
    width = x.shape[-1]
    if chunk is None or width <= k * chunk:
        return x.topk(k, dim=-1)
    pad = -width % chunk
    if pad:  # the last chunk filled up with -inf (never picked over a finite entry)
        x = F.pad(x, (0, pad), value=float("-inf"))
    lead = x.shape[:-1]
    blocks = x.reshape(*lead, -1, chunk)  # [..., V / chunk, chunk]
    # [..., k] the chunks with the largest maxima, in no order (on CUDA sorting them is one more kernel)
    kept = blocks.amax(dim=-1).topk(k, dim=-1, sorted=False).indices
    picked = blocks.gather(-2, kept[..., None].expand(*lead, k, chunk))  # [..., k, chunk]
    best, at = picked.reshape(*lead, k * chunk).topk(k, dim=-1)  # [..., k]: places among the kept
    column = kept.gather(-1, at // chunk) * chunk + at % chunk  # [..., k] chunk start + offset
    return best, column.clamp(max=width - 1) if pad else column
