"""The batch > 1 decoding loop behind `SpeculativeGenerator.generate_batch`.

Each row has its own drafter (a clone of the generator's drafter sharing its weights), its own tree,
its own accepted length, its own stop (EOS, its max_new_tokens) and, when sampling, its own
generator seeded per row. The rows' trees are verified in ONE target forward per pass (`BatchRunner`);
drafting and acceptance run per row in a Python loop (first version: the batched part is the
target). Every row makes exactly the calls of batch-1 decoding, in the same order, with its own
generator, so row b's output equals its batch-1 output (greedy: token for token; sampling with the
same seed: the same draws). Finished rows leave the batch (`BatchRunner.keep`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from spechead.inference.acceptance import Acceptance, greedy_accept, sample_accept
from spechead.inference.batch import BatchRunner
from spechead.inference.drafters.base import Draft, Drafter, chain
from spechead.inference.sampling import SamplingParams, make_generator, sample, target_probs
from spechead.inference.tree import TokenTree


def clone_drafter(drafter: Drafter) -> Drafter:
    """A per-row copy of `drafter`: its own state, the SAME modules (weights are shared, not copied)."""
    memo: dict[int, object] = {}

    def share(obj: object) -> None:
        if isinstance(obj, nn.Module) and id(obj) not in memo:
            for module in obj.modules():
                memo[id(module)] = module
                for value in vars(module).values():  # modules attached outside _modules (target lm_head)
                    share(value)

    for value in vars(drafter).values():
        share(value)
    return copy.deepcopy(drafter, memo)


@dataclass
class _Row:
    """One sequence of the batch while it decodes."""

    index: int  # position in the caller's list
    prompt: torch.Tensor  # [T]
    max_new: int
    params: SamplingParams
    generator: torch.Generator | None
    drafter: Drafter | None
    stats: object
    ids: list[int] = field(default_factory=list)
    root: int = 0
    pending: list[int] = field(default_factory=list)
    accepted: tuple | None = None
    checked: tuple | None = None  # (tree, logits [N_b, V]) of the last pass, for Drafter.verified
    draft: Draft | None = None
    tree: TokenTree | None = None


def pick(logits: torch.Tensor, params: SamplingParams, generator) -> int:
    """The target's own next token from logits [V] (argmax, or a sample)."""
    if params.is_greedy:
        return int(logits.argmax())
    return sample(target_probs(logits, params), generator)


def until_stop(tokens: list[int], eos: set[int], room: int) -> list[int]:
    """tokens up to and including the first EOS, and at most `room` of them."""
    out = []
    for t in tokens[: max(room, 0)]:
        out.append(t)
        if t in eos:
            break
    return out


@torch.no_grad()
def decode_batch(
    target: nn.Module,
    drafter: Drafter | None,
    prompts: Sequence[torch.Tensor],
    max_new: Sequence[int],
    params: Sequence[SamplingParams],
    eos: set[int],
    stats: Sequence[object],
    max_cache_len: int | None = None,
) -> tuple[list[list[int]], float]:
    """Decode every prompt [T_b]; returns each row's new ids and the batch's wall time (s).

    Fills stats[b] (GenerationStats) per row: new_tokens, accept_lengths, drafted_tokens; wall/phase
    times are the batch's (shared by all rows).
    """
    tree_room = drafter.max_nodes if drafter else 1
    need = max(len(p) + m for p, m in zip(prompts, max_new))
    size = max_cache_len or -(-(need + tree_room) // 256) * 256
    if max_cache_len is not None and need > max_cache_len:
        worst = max(range(len(prompts)), key=lambda b: len(prompts[b]) + max_new[b])
        raise ValueError(
            f"KV cache of {max_cache_len} positions is too small for row {worst}: prompt "
            f"({len(prompts[worst])} tokens) + max_new_tokens ({max_new[worst]}): raise max_cache_len or "
            "lower max_new_tokens"
        )
    device = next(target.parameters()).device
    runner = BatchRunner(target, tuple(drafter.hidden_layers) if drafter else (), max_length=size)
    rows = [
        _Row(
            b,
            prompts[b],
            max_new[b],
            params[b],
            make_generator(params[b].seed, device),
            clone_drafter(drafter) if drafter else None,
            stats[b],
        )  # fmt: skip
        for b in range(len(prompts))
    ]
    start = time.perf_counter()
    times = dict.fromkeys(("prefill", "draft", "verify"), 0.0)
    logits, hiddens = runner.prefill([r.prompt for r in rows])  # [B, V], [{l: [T_b, H]}]
    for b, row in enumerate(rows):
        row.root = pick(logits[b], row.params, row.generator)
        if row.drafter:
            row.drafter.start(row.prompt, hiddens[b], row.root)
        row.pending = [row.root]
    times["prefill"] = time.perf_counter() - start
    active = rows
    while True:
        going = []
        for row in active:
            out = until_stop(row.pending, eos, row.max_new - row.stats.new_tokens)
            row.stats.new_tokens += len(out)
            if row.accepted is not None or row.tree is not None:
                row.stats.accept_lengths.append(len(out))
            row.ids.extend(out)
            stop = len(out) < len(row.pending) or out[-1] in eos or row.stats.new_tokens >= row.max_new
            if not stop:
                going.append(row)
        if not going:
            break
        runner.keep([active.index(r) for r in going])  # finished rows leave; the others are untouched
        active = going
        t0 = time.perf_counter()
        for row in active:
            if row.drafter and row.accepted is not None:
                row.drafter.verified(*row.checked)
                row.drafter.accept(*row.accepted)
            row.draft = row.drafter.propose(row.root, row.params, row.generator) if row.drafter else None
            row.tree = row.draft.tree if row.draft else chain([], row.root)
        room = runner.room()
        for row in active:
            if row.tree.size > room:  # near a fixed cache's end: keep the first nodes (lossless)
                row.tree = TokenTree(row.tree.tokens[:room], row.tree.parents[:room])
        n = max(r.tree.size for r in active)
        tokens = torch.stack([_pad(r.tree.tokens, n, r.root) for r in active])  # [B, N]
        parents = torch.stack([_pad(r.tree.parents, n, 0) for r in active])  # [B, N]
        t1 = time.perf_counter()
        logits, hidden = runner.verify(tokens, parents)  # [B, N, V], {l: [B, N, H]}
        paths = []
        for b, row in enumerate(active):
            tree, row_logits = row.tree, logits[b, : row.tree.size]  # [N_b, V]
            if tree.size == 1:
                acc = Acceptance(path=[0], next_token=pick(row_logits[0], row.params, row.generator))
            elif row.params.is_greedy:
                acc = greedy_accept(tree, row_logits)
            else:
                rule, q = (row.draft.rule, row.draft.q) if row.draft else ("deterministic", None)
                q = q[: tree.size] if q is not None else None  # [N_b, V]
                acc = sample_accept(tree, target_probs(row_logits, row.params), rule, q, row.generator)
            path = torch.tensor(acc.path, dtype=torch.long)
            paths.append(path)
            row.stats.drafted_tokens += tree.size - 1
            row.root = acc.next_token
            row.pending = [*tree.tokens[path[1:]].tolist(), row.root]
            if row.drafter:
                dev_path = path.to(device)
                row.accepted = (tree.tokens[path], {k: v[b, dev_path] for k, v in hidden.items()}, row.root)
                row.checked = (tree, row_logits)
        runner.commit(paths)
        t2 = time.perf_counter()
        times["draft"] += t1 - t0
        times["verify"] += t2 - t1
    wall = time.perf_counter() - start
    for row in rows:
        row.stats.wall_time, row.stats.prefill_time = wall, times["prefill"]
        row.stats.draft_time, row.stats.verify_time = times["draft"], times["verify"]
    return [row.ids for row in rows], wall


def _pad(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    """x [N_b] padded to [n] with `fill` (dummy nodes: children of the root nobody attends to)."""
    return torch.cat([x, x.new_full((n - x.numel(),), fill)]) if x.numel() < n else x
