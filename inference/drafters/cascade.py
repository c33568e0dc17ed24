"""Cascade drafting (tiny -> medium -> target): a drafter that is itself a speculative decoder.

A tiny draft LM (a `DraftModelDrafter` chain) drafts for a medium LM, which verifies it with the lossless
rules on its own KV cache until it has produced `num_draft` tokens, handed to the target as ONE chain.
The inner loop is exact speculative sampling, so the chain is distributed like sampling from the medium
(greedy: its greedy continuation), and the target verifies it with rule "iid" (B) on q = the medium's
per-node distribution (the tiny's q, or its proposal before the medium verified it, would be biased).
Each level's cache keeps a prefix of the sequence: `accept` crops both to what the target accepted.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from spechead.heads.hybrid import check_attention_only
from spechead.inference.acceptance import greedy_accept, sample_accept
from spechead.inference.drafters.base import Draft, at_least, chain
from spechead.inference.drafters.draft_model import DraftModelDrafter, check_vocab, run_model
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.kv_cache import crop, croppable_cache
from spechead.inference.sampling import SamplingParams, target_probs
from spechead.inference.stops import eos_ids, until_stop


class CascadeDrafter(RowDrafter):
    """Chains of `num_draft` tokens: the medium model's output, itself drafted by the tiny model in
    chains of `tiny_draft` tokens. Both models must share the target's tokenizer."""

    rule = "iid"  # sampled: the medium model's tokens are draws from its q (rule B)
    cache: DynamicCache  # the medium's (made by start): a prefix of context + chain

    def __init__(
        self, tiny: PreTrainedModel, medium: PreTrainedModel, num_draft: int = 8, tiny_draft: int = 4
    ):
        at_least("num_draft", num_draft)
        at_least("tiny_draft", tiny_draft)
        check_attention_only(medium.config, "drafting with it", "use an attention-only medium model")
        medium_vocab = medium.get_output_embeddings().weight.shape[0]
        fix = "both must use the target's tokenizer"
        check_vocab(tiny, medium_vocab, "cascade: the tiny model", fix, other="the medium")
        self.medium = medium.eval()
        self.tiny = DraftModelDrafter(tiny, tiny_draft)  # a chain, rule "iid" under sampling
        self.num_draft = num_draft
        self.max_nodes = num_draft + 1
        self.eos = eos_ids(medium)  # the chain stops there: tokens after an EOS are never emitted
        self.context: list[int] = []  # tokens in the target's cache (the root not yet)

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        fix = "use cascade:TINY+MEDIUM with models that share the target's tokenizer"
        check_vocab(self.medium, vocab_size, "cascade: the medium model", fix)

    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.cache = croppable_cache(self.medium)
        self.context = prompt.tolist()
        self.tiny.start(prompt, {}, root)

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        self.context += tokens.tolist()  # root + accepted drafts: a prefix of the proposed chain
        # Both caches hold a prefix of context + chain: keep what the target accepted, drop the rest.
        for cache in (self.cache, self.tiny.cache):
            crop(cache, min(cache.get_seq_length(), len(self.context)))
        self.tiny.pending = [*self.context, next_root][self.tiny.cache.get_seq_length() :]

    @torch.inference_mode()
    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        seq = [*self.context, root]  # grows with the medium's verified tokens
        start = len(seq)
        rows: list[torch.Tensor] = []  # [V] each: the medium's distribution at tree node i (sampling)
        while len(seq) - start < self.num_draft:
            tokens, p = self._inner_step(seq, sampling, generator)
            rows += p
            seq += tokens
            if self.eos.intersection(tokens):
                break
        drafted = until_stop(seq[start : start + self.num_draft], self.eos)
        tree = chain(drafted, root)
        if sampling.is_greedy or not drafted:
            return Draft(tree)
        # [N, V]: row i = the medium's distribution of node i's child; the leaf repeats its parent's
        q = torch.stack(rows[: len(drafted)] + rows[len(drafted) - 1 : len(drafted)])
        return Draft(tree, rule="iid", q=q)

    def _inner_step(self, seq: list[int], sampling: SamplingParams, generator) -> tuple[list[int], list]:
        """One tiny draft verified by the medium: the medium's new tokens (accepted drafts + its own
        correction/bonus) and its distributions [V] at the inner root and each accepted draft."""
        draft = self.tiny.propose(seq[-1], sampling, generator)  # chain rooted at seq[-1], q = tiny's
        fed = seq[self.cache.get_seq_length() :] + draft.tree.tokens[1:].tolist()  # not run by the medium yet
        # [n, V]: the inner root (seq[-1]) and each of the tiny's drafts
        logits = run_model(self.medium, self.cache, fed, logits_to_keep=draft.tree.size)
        if sampling.is_greedy:
            acc, p = greedy_accept(draft.tree, logits), None
        else:
            p = target_probs(logits, sampling)  # [n, V]: what the medium would sample from
            acc = sample_accept(draft.tree, p, draft.rule, draft.q, generator)
        # The medium keeps the inner root and its accepted drafts (a chain: the first entries).
        crop(self.cache, len(seq) - 1 + len(acc.path))
        accepted = draft.tree.tokens[acc.path]  # [a + 1], the inner root first
        self.tiny.accept(accepted, {}, acc.next_token)
        return [*accepted[1:].tolist(), acc.next_token], [] if p is None else [p[i] for i in acc.path]
