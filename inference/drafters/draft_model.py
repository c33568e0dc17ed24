"""An independent small draft model (any HF causal LM sharing the target's tokenizer), drafting a chain.

Greedy decoding drafts its argmax (deterministic children); sampling drafts i.i.d. from its own
distribution after the same temperature/top-k/top-p, and returns it as q for lossless rule B.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from spechead.inference.drafters.base import Draft, Drafter, chain
from spechead.inference.kv_cache import cache_length, keep_positions
from spechead.inference.sampling import SamplingParams, sample, target_probs


class DraftModelDrafter(Drafter):
    """Chain drafting with a small causal LM and its own KV cache (kept to the committed tokens)."""

    def __init__(self, model: PreTrainedModel, num_draft: int = 5):
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        self.model = model.eval()
        self.num_draft = num_draft
        self.cache: DynamicCache | None = None
        self.pending: list[int] = []  # committed tokens not yet in the draft cache

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        mine = self.model.get_output_embeddings().weight.shape[0]
        if mine != vocab_size:
            raise ValueError(
                f"draft model has a vocabulary of {mine} tokens, the target {vocab_size}: use a draft model with the target's tokenizer"
            )

    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.pending = [*prompt.tolist(), root]

    @torch.no_grad()
    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Append ids to the draft cache; returns the last position's logits [V]."""
        device = self.model.device
        out = self.model(
            input_ids=torch.tensor([ids], device=device), past_key_values=self.cache, use_cache=True
        )
        return out.logits[0, -1].float()

    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        logits = self._feed(self.pending)
        self.pending = []
        committed = cache_length(self.cache)
        drafted, rows = [], []
        for i in range(self.num_draft):
            if sampling.is_greedy:
                token = int(logits.argmax())
            else:
                q = target_probs(logits, sampling)  # [V]
                rows.append(q)
                token = sample(q, generator)
            drafted.append(token)
            if i + 1 < self.num_draft:
                logits = self._feed([token])
        # Drop the speculative entries: only committed tokens stay in the draft cache.
        keep_positions(self.cache, committed, torch.empty(0, dtype=torch.long))
        tree = chain(drafted, root)
        if sampling.is_greedy:
            return Draft(tree)
        q = torch.stack(rows + [rows[-1]])  # [N, V]: row i = distribution node i's child came from
        return Draft(tree, rule="iid", q=q)

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        self.pending = [*tokens[1:].tolist(), next_root]  # the root itself was fed in propose
