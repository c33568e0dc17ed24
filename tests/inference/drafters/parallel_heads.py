"""Parallel drafters (P-EAGLE, DFlash) with heads fitted a little (Adam steps on the target's own greedy
continuations of some prompts), so decoding accepts paths of several tokens: a random head accepts
nothing and tests nothing. Shared by the lossless and queued tests."""

from __future__ import annotations

import torch
from torch.nn.functional import cross_entropy

from spechead.heads import DFlashConfig, DFlashHead, PEagleConfig, PEagleHead
from spechead.inference.drafters.dflash import DFlashDrafter
from spechead.inference.drafters.peagle import PEagleDrafter
from spechead.inference.target.runner import TargetRunner

BLOCK = 4  # P-EAGLE's K, DFlash's block_size - 1 + 1: chains of 4 (P-EAGLE) / 3 (DFlash) drafts
PEAGLE_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
DFLASH_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]
KINDS = ["peagle_chain", "peagle_tree", "dflash_chain", "dflash_tree"]


def _layers(model) -> list[int]:
    n = model.config.num_hidden_layers
    return [1, max(n // 2, 1), n]


def _sequences(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[torch.Tensor], list[dict]]:
    """Each prompt + its greedy continuation [T], and the target's states {layer: [T, H]} over it."""
    from ..test_generator import plain_greedy

    seqs = [torch.tensor(p + plain_greedy(model, p, new_tokens)) for p in prompts]
    runner = TargetRunner(model, tuple(range(model.config.num_hidden_layers + 1)),
                          max_length=max(s.numel() for s in seqs))  # fmt: skip
    _, hidden = runner.prefill(seqs)  # inference tensors: a clone trains (autograd saves it)
    return seqs, [{k: v.clone() for k, v in states.items()} for states in hidden]


def peagle_head(model, prompts: list[list[int]] | None, steps: int = 120, **fields) -> PEagleHead:
    """A P-EAGLE head (K = BLOCK; config `fields` win) fitted `steps` Adam steps to the target's greedy
    continuations of `prompts` (None: random)."""
    torch.manual_seed(0)
    cfg = PEagleConfig.from_target(model.config, **{"target_layers": _layers(model), "block_size": BLOCK,
                                   "draft_vocab_size": model.config.vocab_size, **fields})  # fmt: skip
    head = PEagleHead(cfg)
    head.attach_target_modules(
        lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
    )
    if prompts:
        seqs, hidden = _sequences(model, prompts, 24)
        opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(steps):
            loss = torch.zeros(())
            for seq, states in zip(seqs, hidden):
                fused = head.fuse([states[layer][None] for layer in cfg.target_layers])  # [1, T, H]
                anchors = torch.arange(seq.numel() - 2)  # [A]: anchor a drafts a + 2 ..
                logits = head.parallel_logits(fused, seq[None], anchors)[0]  # [A, K, V]
                for d in range(BLOCK):
                    ok = anchors + 2 + d < seq.numel()
                    loss = loss + cross_entropy(logits[ok, d], seq[anchors[ok] + 2 + d])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval().requires_grad_(False)


def dflash_head(model, prompts: list[list[int]] | None, steps: int = 120, **fields) -> DFlashHead:
    """A DFlash head (block_size BLOCK, 1 layer; config `fields` win) fitted like `peagle_head`."""
    torch.manual_seed(0)
    fields = {"target_layers": _layers(model), "block_size": BLOCK, "num_layers": 1, **fields}
    cfg = DFlashConfig.from_target(model.config, **fields)
    head = DFlashHead(cfg)
    head.attach_target_modules(model.get_output_embeddings(), model.get_input_embeddings())
    if prompts:
        seqs, hidden = _sequences(model, prompts, 24)
        opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(steps):
            loss = torch.zeros(())
            for seq, states in zip(seqs, hidden):
                context = head.fuse([states[layer][None] for layer in cfg.target_layers])  # [1, T, H]
                anchors = torch.arange(seq.numel() - 2)  # [A]: block position j predicts anchor + 1 + j
                blocks = head.predict_blocks(context, seq[None], anchors[None])[0]  # [A, bs, H]
                logits = head.logits(blocks[:, 1:])  # [A, bs - 1, V]
                for j in range(1, BLOCK):
                    ok = anchors + 1 + j < seq.numel()
                    loss = loss + cross_entropy(logits[ok, j - 1], seq[anchors[ok] + 1 + j])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval().requires_grad_(False)


def parallel_drafter(head: PEagleHead | DFlashHead, kind: str) -> PEagleDrafter | DFlashDrafter:
    """A fresh drafter of one of KINDS over `head` (its family's)."""
    if isinstance(head, PEagleHead):
        return PEagleDrafter(head, PEAGLE_TREE if kind.endswith("tree") else None)
    return DFlashDrafter(head, DFLASH_TREE if kind.endswith("tree") else "chain")
