"""The k best entries of each row, in one `torch.topk` or over the k column chunks with the largest maxima.

On CUDA, `torch.topk` of a few long rows (an EAGLE draft's [k, Vd] logits: 8 rows of 32000) runs the
multi-block radix select: about four passes of three kernels each, one per digit, plus the gather. Chunked,
each row is cut into chunks of `chunk` columns and only the k chunks with the largest maxima are searched:
a max over each chunk (a reduction the compiler fuses), the k best of those maxima ([q, V / chunk]), a gather
of the k chunks and the k best of their [q, k * chunk] entries. Both top-ks run the single-block kernel over
short rows. The same k values come out: a row's i-th best entry a_i either sits in a kept chunk with the
i - 1 above it, or some a_j (j <= i) sits in a dropped chunk, and then each of the k kept chunks holds an
entry >= a_j >= a_i. Which of several equal values is named may differ from `torch.topk`.

(An earlier form took the k best of every chunk, then the k best of those: about 2,000 single-block top-ks a
depth at [8, 32000], chunk 128; on an H200 its depth-7 FP8 draft was 1.64 against one topk's 1.71 ms.)
Whether this pays on a GPU is what `scripts/bench_gpu.py --topk-chunk` and `scripts/bench_topk.py` measure.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def topk_rows(x: Tensor, k: int, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of x [..., V], sorted (largest first), and their column ids
    [..., k] each. chunk: search only the k chunks of this many columns with the largest maxima (None,
    or k chunks cover the row: one `torch.topk`). x's entries are taken to be finite (logits): a row with
    fewer than k finite entries may name its last column more than once."""
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
    kept = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [..., k] the chunks with the largest maxima
    picked = blocks.gather(-2, kept[..., None].expand(*lead, k, chunk))  # [..., k, chunk]
    best, at = picked.reshape(*lead, k * chunk).topk(k, dim=-1)  # [..., k]: places among the kept
    column = kept.gather(-1, at // chunk) * chunk + at % chunk  # [..., k] chunk start + offset
    return best, column.clamp(max=width - 1) if pad else column
