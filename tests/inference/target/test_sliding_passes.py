"""The runner on sliding-window targets: the layout it finds, and tree passes past the window equal to
plain forwards with the model's own sliding masks."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.sliding import SlidingLayout, sliding_layout
from spechead.inference.target.runner import TargetRunner
from spechead.inference.tree import path_to_node

from .test_runner import VOCAB, plain, random_tree


def _sliding(kind: str, window: int):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    if kind == "mistral":  # one window for every layer, no per-layer types
        return MistralForCausalLM(MistralConfig(sliding_window=window, **shape)).eval()
    # Qwen2: only layers past max_window_layers slide
    config = Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=1, **shape)
    return Qwen2ForCausalLM(config).eval()


def test_sliding_layout_finds_sliding_layers(tiny_llama):
    """A window without layer types slides every layer (one mask); with types, a dict per type."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert sliding_layout(tiny_llama(VOCAB)) is None
    assert sliding_layout(_sliding("mistral", 24)) == SlidingLayout(24, None)
    assert sliding_layout(_sliding("qwen2", 20)) == SlidingLayout(20, ("full_attention", "sliding_attention"))
    full = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, sliding_window=20,
                       use_sliding_window=True, max_window_layers=2)  # fmt: skip
    assert full.sliding_window == 20 and "sliding_attention" not in full.layer_types
    assert sliding_layout(Qwen2ForCausalLM(full)) is None  # a window set but no layer uses it


@torch.no_grad()
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@pytest.mark.parametrize("rows", [1, 2])
def test_sliding_window_tree_passes_equal_plain_forwards_past_the_window(kind, rows):
    """Tree passes on a window of 8 over prefixes that outgrow it: every node's logits equal the plain
    forward of its root-to-node path (the model's own sliding masks), pass after pass (a one-node step
    among them)."""
    model = _sliding(kind, 8)
    runner = TargetRunner(model)
    seqs = [[3, 9, 27, 17, 51, 25, 4][: 6 + b] for b in range(rows)]
    runner.reserve([len(s) for s in seqs], [24] * rows)
    runner.prefill([torch.tensor(s) for s in seqs])
    for step, n in enumerate([5, 7, 4, 6, 1]):
        tree = random_tree(n, step)
        logits, _ = runner.verify(tree.tokens.expand(rows, n), tree.parents.expand(rows, n))
        for b in range(rows):
            for node in range(n):
                ref = plain(model, seqs[b] + tree.tokens[path_to_node(tree.parents, node)].tolist())[0]
                torch.testing.assert_close(logits[b, node], ref[-1], atol=1e-5, rtol=0)
        keep = path_to_node(tree.parents, n - 1)
        runner.commit([torch.tensor(keep)] * rows)
        seqs = [s + tree.tokens[keep].tolist() for s in seqs]
    assert len(seqs[0]) > 16  # two windows
