"""Targets beyond Llama through the engine: tree passes equal plain forwards, and speculative greedy
decoding equals transformers' `generate`, on tiny Qwen3, Qwen3-MoE, Mixtral, Gemma-3, Phi-3, OLMo-2 and
Granite models (q/k norms, routed experts, scaled embeddings, sliding-window layer types, fused
projections, scaled residuals), one row and two."""

from __future__ import annotations

import pytest
import torch
import transformers

from spechead.inference.drafters.draft_model import DraftModelDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.target.runner import TargetRunner
from spechead.inference.tree import TokenTree, path_to_node

VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
MODELS = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **SHAPE)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **SHAPE
        )
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **SHAPE)
    ),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(head_dim=8, **SHAPE)),
    "phi3": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **SHAPE)
    ),
    "olmo2": lambda: transformers.Olmo2ForCausalLM(
        transformers.Olmo2Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **SHAPE)
    ),
    "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(**SHAPE)),
}


def _model(kind: str):
    torch.manual_seed(0)
    return MODELS[kind]().eval()


@torch.no_grad()
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("rows", [1, 2])
def test_tree_passes_equal_plain_forwards(kind, rows):
    model = _model(kind)
    runner = TargetRunner(model)
    seqs = [[3, 9, 27, 17, 51, 8][: 5 + b] for b in range(rows)]
    runner.reserve([len(s) for s in seqs], [16] * rows)
    runner.prefill([torch.tensor(s) for s in seqs])
    g = torch.Generator().manual_seed(1)
    for n in (4, 6):
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
        tree = TokenTree(torch.randint(0, VOCAB, (n,), generator=g), torch.tensor(parents))
        logits, _ = runner.verify(tree.tokens.expand(rows, n), tree.parents.expand(rows, n))
        for b, seq in enumerate(seqs):
            for node in range(n):
                ids = seq + tree.tokens[path_to_node(tree.parents, node)].tolist()
                want = model(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(logits[b, node], want, atol=1e-5, rtol=0)
        keep = path_to_node(tree.parents, n - 1)
        runner.commit([torch.tensor(keep)] * rows)
        seqs = [seq + tree.tokens[keep].tolist() for seq in seqs]


@torch.no_grad()
@pytest.mark.parametrize("kind", list(MODELS))
def test_speculative_greedy_equals_generate(kind, chatml_tokenizer):
    """The target drafts for itself on a tree whose rank-1 siblings its greedy verify rejects: every
    pass commits a path that is not the first nodes in order (the cache copies entries into place)."""
    model = _model(kind)
    model.generation_config.eos_token_id = None  # both run to max_new_tokens (min_new_tokens would
    # forbid EOS in generate alone: a different argmax where it is the best token)
    prompt = [5, 9, 14, 20, 33, 41]
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)[
        0, len(prompt) :
    ].tolist()
    assert len(reference) == 16
    drafter = DraftModelDrafter(model, tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter)
    gen.eos = set()
    result = gen.generate(input_ids=prompt, max_new_tokens=16)
    assert result.token_ids == reference
    assert max(result.stats.accept_lengths) == 4  # a whole rank-0 path accepted (nodes 0, 1, 3, 5)
