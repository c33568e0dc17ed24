"""`tree_sdpa` (heads/attention.py): transformers' sdpa attention with one query's heads packed (compiled
too), tree passes with the grouped key/value heads inside sdpa on a CPU and as matmuls on a GPU
(`GROUPED_DEVICES`); the same outputs, and transformers' own path elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from spechead.heads import attention
from spechead.heads.attention import MATMUL_NAME, NAME, matmul_attention, runs_sdpa, tree_sdpa
from spechead.inference.target.runner import TargetRunner


class Grouped(nn.Module):
    num_key_value_groups = 3
    is_causal = True


def inputs(queries: int, masked: bool):
    g = torch.Generator().manual_seed(queries)
    q = torch.randn(2, 6, queries, 8, generator=g)  # [B, nh, T, D]
    k, v = torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)  # [B, kv, S, D]
    mask = None
    if masked:  # a tree's additive mask: each query sees a random half of the slots and the last one
        seen = torch.rand(2, 1, queries, 11, generator=g) < 0.5
        seen[..., -1] = True
        mask = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    return q, k, v, mask


@pytest.mark.parametrize(("queries", "masked"), [(5, True), (1, True), (5, False)])
def test_tree_sdpa_equals_transformers_sdpa(monkeypatch, queries, masked):
    """Several queries under a mask (a tree pass): sdpa with `enable_gqa`, not transformers' path (which
    copies the key/value heads); one query under a mask: its heads packed; no mask: transformers' path.
    The same output either way."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counted)
    q, k, v, mask = inputs(queries, masked)
    ours, weights = tree_sdpa(Grouped(), q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(Grouped(), q, k, v, mask, scaling=0.3)
    assert weights is None and ours.shape == (2, queries, 6, 8)  # [B, T, nh, D]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert len(calls) == (0 if masked else 1)


def test_registered_for_transformers(tiny_llama):
    """A model set to "spechead_sdpa" runs through it, with sdpa's masks, and gives sdpa's logits."""
    model = tiny_llama(64, layers=2, hidden=32, seed=1)
    ids = torch.randint(0, 64, (1, 9))
    reference = model(ids).logits
    model.set_attn_implementation(NAME)
    assert model.config._attn_implementation == NAME
    torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=1e-6)


def test_gradients_equal_transformers_sdpa():
    """Medusa-2 trains the target (LoRA) through its attention: the same gradients as sdpa's."""
    q, k, v, mask = inputs(5, True)
    grads = []
    for attend in (tree_sdpa, sdpa_attention_forward):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, _ = attend(Grouped(), *leaves, mask, scaling=0.3)
        grads.append(torch.autograd.grad(out.square().sum(), leaves))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_runs_sdpa_reads_the_model_class():
    from transformers import Gemma2Config, LlamaConfig, PretrainedConfig, Qwen2Config

    assert runs_sdpa(LlamaConfig()) and runs_sdpa(Qwen2Config())
    assert not runs_sdpa(Gemma2Config())  # soft-capped attention: transformers refuses sdpa for it

    class RemoteConfig(PretrainedConfig):  # a config transformers does not map: its own loading decides
        model_type = "spechead-remote"

    assert runs_sdpa(RemoteConfig())


@pytest.mark.parametrize(
    ("queries", "masked", "matmul"), [(5, True, True), (1, True, False), (5, False, False)]
)
def test_matmul_attention_equals_sdpa(monkeypatch, queries, masked, matmul):
    """A tree pass (several queries under a mask) through `grouped_attention`; one query or no mask through
    `tree_sdpa`. The same output either way."""
    calls = []
    grouped = attention.grouped_attention
    monkeypatch.setattr(attention, "grouped_attention", lambda *a: calls.append(1) or grouped(*a))
    q, k, v, mask = inputs(queries, masked)
    with torch.no_grad():
        ours, weights = matmul_attention(Grouped().eval(), q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(Grouped(), q, k, v, mask, scaling=0.3)
    assert weights is None and ours.shape == (2, queries, 6, 8)  # [B, T, nh, D]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert len(calls) == int(matmul)
    with torch.no_grad():  # (training keeps sdpa's kernel and gradients)
        matmul_attention(Grouped().train(), q, k, v, mask, scaling=0.3)
    matmul_attention(Grouped().eval(), q, k, v, mask, scaling=0.3)  # (and so do gradients)
    assert len(calls) == int(matmul)


@pytest.mark.parametrize("name", [MATMUL_NAME, NAME])
def test_a_target_set_to_matmul_attention_verifies_trees_as_sdpa(tiny_llama, monkeypatch, name):
    """ "spechead_matmul" is registered: a tree verification gives sdpa's logits, and its
    attention ran as matrix products. So does "spechead_sdpa" on a device in GROUPED_DEVICES (the CPU put in
    a GPU's place)."""
    monkeypatch.setattr(attention, "GROUPED_DEVICES", ("cpu",))
    calls = []
    grouped = attention.grouped_attention
    monkeypatch.setattr(attention, "grouped_attention", lambda *a: calls.append(1) or grouped(*a))
    model = tiny_llama(64, layers=2, hidden=32, seed=1)
    ids, tree = torch.randint(0, 64, (1, 9)), torch.randint(0, 64, (1, 6))
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2]])  # [1, N]: a root, two children, three grandchildren
    logits = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        runner = TargetRunner(model, max_length=32)
        with torch.inference_mode():
            runner.prefill(list(ids))
            logits[impl] = runner.verify(tree, parents)[0]  # [1, N, V]
    assert calls == [1, 1]  # the verify's two layers (not the prefill's 9 queries: no mask there)
    torch.testing.assert_close(logits[name], logits["sdpa"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_head_mask", [False, True])
def test_one_query_packs_its_heads_when_compiled(monkeypatch, per_head_mask):
    """One query under a mask (a decode step on a preallocated cache): its heads are packed as rows of
    their key head, traced by torch.compile too (transformers' own path repeats the key/value cache there:
    a copy of every layer's cache view every step). The same output as transformers' eager sdpa. As on
    CUDA, where sdpa's kernels take no grouped heads under a mask (not `SDPA_GQA_DEVICES`)."""
    monkeypatch.setattr(attention, "SDPA_GQA_DEVICES", ())
    q, k, v, mask = inputs(1, True)  # q [2, 6, 1, 8], k / v [2, 2, 11, 8], mask [2, 1, 1, 11]
    if per_head_mask:  # [B, nh, 1, S]: a mask per query head follows the packed rows
        mask = mask.expand(2, 6, 1, 11) + torch.randn(2, 6, 1, 11).clamp(max=0)

    def traced_shapes(attend) -> list[tuple[int, ...]]:
        """The shapes of every value in the graph torch.compile traces of attend(q, k, v, mask)."""
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch.compile(attend, backend=capture, fullgraph=True)(q, k, v, mask)
        return [
            tuple(n.meta["example_value"].shape)
            for g in graphs
            for n in g.graph.nodes
            if "example_value" in n.meta
        ]

    ours = tree_sdpa(Grouped(), q, k, v, mask, scaling=0.3)[0]
    theirs, _ = sdpa_attention_forward(Grouped(), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    shapes = traced_shapes(lambda *a: tree_sdpa(Grouped(), *a, scaling=0.3)[0])
    assert (2, 1, 6, 8) in shapes and (2, 6, 11, 8) not in shapes  # no key or value repeated to 6 heads
    # transformers' path, traced the same way, does repeat them (what the packing avoids)
    assert (2, 6, 11, 8) in traced_shapes(lambda *a: sdpa_attention_forward(Grouped(), *a, scaling=0.3)[0])


def test_tree_passes_run_as_matmuls_on_grouped_devices(monkeypatch):
    """On a device in GROUPED_DEVICES (a GPU; here the CPU, put in its place) a tree pass in inference runs
    `grouped_attention`; training, gradients, one query or no mask keep sdpa. Elsewhere sdpa. The same
    output either way."""
    calls = []
    grouped = attention.grouped_attention
    monkeypatch.setattr(attention, "grouped_attention", lambda *a: calls.append(1) or grouped(*a))
    q, k, v, mask = inputs(5, True)
    theirs, _ = sdpa_attention_forward(Grouped(), q, k, v, mask, scaling=0.3)
    with torch.no_grad():
        tree_sdpa(Grouped().eval(), q, k, v, mask, scaling=0.3)
    assert calls == []  # (the CPU is not one by default)
    monkeypatch.setattr(attention, "GROUPED_DEVICES", ("cpu",))
    with torch.no_grad():
        ours, _ = tree_sdpa(Grouped().eval(), q, k, v, mask, scaling=0.3)
        tree_sdpa(Grouped().train(), q, k, v, mask, scaling=0.3)
        tree_sdpa(Grouped().eval(), *inputs(1, True), scaling=0.3)
        tree_sdpa(Grouped().eval(), *inputs(5, False)[:3], None, scaling=0.3)
    tree_sdpa(Grouped().eval(), q, k, v, mask, scaling=0.3)
    assert calls == [1]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
