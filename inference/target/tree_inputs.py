"""The target runner's verify inputs: a batch of one's, remembered per tree shape (a static tree's shape
repeats every pass, and on a CPU each op that builds a mask or positions costs about as much as the rest
of the engine), and B rows' after their own lengths (eager or inside a compiled pass)."""

from __future__ import annotations

import torch
from torch import Tensor

from spechead.heads.grad import version
from spechead.inference.devices import host_to_device
from spechead.inference.sliding import SlidingLayout, layer_masks, slot_positions
from spechead.inference.tree import ancestors_on_device, mask_after, tree_inputs_on_device


class TreeInputs:
    """Ancestors, depths and additive masks of one row's trees on `device`, kept per tree shape (keyed by
    the host parents' bytes), plus the plain step's all-visible mask."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._zeros: Tensor | None = None  # [1, 1, 1, S] additive zeros: the plain step's mask
        self._trees: dict[bytes, tuple[Tensor, Tensor, Tensor]] = {}  # tree shape -> block, depths, ancestors
        self.wide: dict[bytes, Tensor] = {}  # tree shape seen again -> its mask over W + N columns
        # the last known tree's host parents (kept: its id stays its own), their version, `structure`'s answer
        self._last: tuple[Tensor, int, tuple[Tensor, Tensor, Tensor, bytes]] | None = None

    def structure(self, parents: Tensor, host: Tensor | None) -> tuple[Tensor, Tensor, Tensor, bytes | None]:
        """The additive mask block [1, 1, N, N], depths [1, N] and ancestors [1, N, N] of parents [1, N] (on
        the device), remembered per shape when `host` (the same parents on the host) is given; and the
        shape's key when remembered from an earlier pass (None the first time: dynamic trees rarely repeat)."""
        last = self._last
        if host is not None and last is not None and host is last[0] and version(host) == last[1] >= 0:
            return last[2]  # the very tensor of the last pass, unchanged (a static tree's): no key to make
        key = host.numpy().tobytes() if host is not None else None
        found = self._trees.get(key) if key is not None else None
        if found is not None:
            assert host is not None and key is not None  # (found: looked up by the host's key)
            self._last = (host, version(host), (*found, key))
            return (*found, key)
        found = tree_inputs_on_device(parents, 0, self.dtype)  # block, depths, ancestors
        if key is not None:
            if len(self._trees) >= 64:  # keep the memory bounded
                self._trees.clear()
            self._trees[key] = found
        return (*found, None)

    def mask(self, block: Tensor, key: bytes | None, past: int, columns: int) -> Tensor:
        """The verify mask [1, 1, N, past + N]: the `past` committed entries, then `block` [1, 1, N, N];
        `columns`: how far the cache reaches. A shape seen before (key) keeps [1, 1, N, W + N] (W >= past
        zeros, then the block; at most 4 shapes), so its mask is ONE view. On the CPU only: CUDA's
        memory-efficient attention assumes a 16-element-aligned mask start ('misaligned address')."""
        size = block.shape[-1]
        key = key if block.is_cpu else None
        wide = self.wide.get(key) if key is not None else None
        if key is not None and (wide is None or wide.shape[-1] - size < past):
            if wide is None and len(self.wide) >= 4:
                self.wide.clear()
            width = max(columns, 2 * past, 1024)
            wide = self.wide[key] = torch.cat([block.new_zeros(1, 1, size, width), block], dim=-1)
        if wide is None:  # a new shape: the prefix's zeros and the block, one concatenation
            return torch.cat([self.visible(past).expand(1, 1, size, past), block], dim=-1)
        return wide[..., wide.shape[-1] - size - past :]

    def visible(self, columns: int) -> Tensor:
        """An additive mask [1, 1, 1, columns] of zeros (one query that sees every cached position): a view."""
        if self._zeros is None or self._zeros.shape[-1] < columns:
            self._zeros = torch.zeros(1, 1, 1, max(columns, 1024), dtype=self.dtype, device=self.device)
        return self._zeros[..., :columns]


# ---- B rows, each after its own committed length ----------------------------------------------------


def pad_trees(tokens: Tensor, parents: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Trees tokens / parents [B, N] padded to [B, size] with children of the root nobody attends to
    (where the trees are: the host, usually)."""
    batch, n = tokens.shape
    if size == n:
        return tokens, parents
    tokens = torch.cat([tokens, tokens[:, :1].expand(batch, size - n)], dim=1)
    return tokens, torch.cat([parents, parents.new_zeros(batch, size - n)], dim=1)


def rows_inputs(
    sliding: SlidingLayout | None, parents: Tensor, lengths: Tensor, view: int, dtype: torch.dtype
) -> tuple[Tensor | dict[str, Tensor], Tensor, Tensor]:
    """The model's masks (sliding.layer_masks of the additive [B, 1, N, S] over S = `view` slots),
    positions [B, N] and ancestors [B, N, N] of trees parents [B, N] (on the device) written after the
    device lengths [B]. One node per row (a plain step): a causal row mask, no tree to walk."""
    batch, n = parents.shape
    if n == 1:  # row b sees its prefix and its own new slot; slot j holds position j
        cols = torch.arange(view, device=lengths.device)  # [S]
        blocked = torch.finfo(dtype).min
        mask = torch.where(cols[None, :] <= lengths[:, None], 0.0, blocked).to(dtype)[:, None, None]
        anc = torch.ones(batch, 1, 1, dtype=torch.bool, device=lengths.device)
        return layer_masks(sliding, mask, lengths[:, None], cols), lengths[:, None], anc
    anc = ancestors_on_device(parents)  # [B, N, N]
    mask = mask_after(lengths, anc, view, dtype)[0]  # [B, 1, N, S]: row b's nodes in slots lengths[b]..
    positions = lengths[:, None] + anc.sum(-1) - 1  # [B, N]
    keys = slot_positions(lengths, positions, view) if sliding else positions  # [B, S]
    return layer_masks(sliding, mask, positions, keys), positions, anc


def pack_rows(
    tokens: Tensor, parents: Tensor, rows: list[int], capacity: int, size: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor | slice]:
    """Trees tokens / parents [B, N] of the active rows as [P, size] each for all `capacity` physical rows
    (active row b in physical row rows[b]; idle rows a one-node tree; padding children of the root nobody
    attends to), packed where the trees are and copied to `device` once (no wait), and the active rows'
    index into them (a slice when they are rows 0..B-1: views)."""
    batch, n = tokens.shape
    host = tokens.device.type == "cpu" and parents.device.type == "cpu"
    packed = torch.zeros(2, capacity, size, dtype=torch.long, device="cpu" if host else device)  # [2, P, N']
    packed[1, :, 0] = -1
    picked = None if rows == list(range(batch)) else host_to_device(torch.tensor(rows), packed.device)  # [B]
    index: slice | Tensor = slice(0, batch) if picked is None else picked
    packed[0, index, :n] = tokens
    packed[0, index, n:] = tokens[:, :1]
    packed[1, index, :n] = parents
    all_tokens, all_parents = host_to_device(packed, device)  # [P, N'] each
    if picked is not None and host:
        index = host_to_device(picked, device)
    return all_tokens, all_parents, index
