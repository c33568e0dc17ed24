"""inference/stacked.py: q/k/v and gate/up as one GEMM each through transformers' own forward, exact."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.stacked import StackedLinear, StackedRows, stack_projections

from .test_generator import eagle_drafter


class CountGemms(TorchDispatchMode):
    """Counts the matrix products (aten linear, mm, addmm) run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.linear, torch.ops.aten.mm, torch.ops.aten.addmm):
            self.gemms += 1
        return func(*args, **(kwargs or {}))


def pair(tiny_llama, **config):
    model = tiny_llama(64, layers=3, hidden=32, seed=2, **config)
    model.generation_config.eos_token_id = None  # (random weights: EOS could come first and end the test)
    stacked = copy.deepcopy(model)
    return model, stacked, stack_projections(stacked)


def step_gemms(model, ids) -> int:
    with torch.inference_mode(), CountGemms() as count:
        model(ids)
    return count.gemms


def test_the_stack_computes_what_the_layers_did(tiny_llama):
    model, stacked, groups = pair(tiny_llama)
    assert groups == 6  # two groups in each of three layers
    attn = stacked.model.layers[0].self_attn
    assert isinstance(attn.q_proj, StackedLinear) and isinstance(attn.k_proj, StackedRows)
    assert attn.q_proj.weight.shape == (32 + 2 * 16, 32)  # q 4 heads x 8, k and v 2 heads x 8
    names = {n for n, _ in stacked.named_parameters()}
    assert not any("k_proj" in n or "up_proj" in n for n in names)  # the weights live once, in the stack
    ids = torch.randint(0, 64, (2, 9))
    with torch.inference_mode():
        torch.testing.assert_close(stacked(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    # a layer's step: q/k/v one GEMM, o, gate/up one GEMM, down (4 in place of 7), and the lm_head
    assert step_gemms(model, ids) == 3 * 7 + 1 and step_gemms(stacked, ids) == 3 * 4 + 1


def test_a_step_holds_no_activation_after_it(tiny_llama):
    _, stacked, _ = pair(tiny_llama)
    with torch.inference_mode():
        stacked(torch.randint(0, 64, (1, 5)))
    for layer in stacked.model.layers:
        for stack in (layer.self_attn.q_proj, layer.mlp.gate_proj):
            assert stack._input is None and all(k is None for k in stack._kept)


def test_rows_called_on_another_input_run_their_own_gemm():
    """Any call order stays exact: rows called on a tensor the stack did not just run on (or twice) run
    their own rows' GEMM, never a kept output of another input."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, n, bias=True) for n in (6, 3, 3)]
    stack = StackedLinear(layers)
    k, v = StackedRows(stack, 1), StackedRows(stack, 2)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(stack(x), layers[0](x))
        torch.testing.assert_close(k(y), layers[1](y))  # another tensor: its own GEMM
        torch.testing.assert_close(k(x), layers[1](x))  # the kept output
        torch.testing.assert_close(k(x), layers[1](x))  # taken already: its own GEMM again
        torch.testing.assert_close(v(x.clone()), layers[2](x))  # equal values, another tensor
        torch.testing.assert_close(v(x), layers[2](x))


def test_biases_are_stacked_too(chatml_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    stacked = copy.deepcopy(model)
    assert stack_projections(stacked) == 4 and stacked.model.layers[0].self_attn.q_proj.bias is not None
    ids = torch.randint(0, 64, (1, 7))
    with torch.inference_mode():
        torch.testing.assert_close(stacked(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


def test_layers_it_cannot_stack_stay_as_they_are(tiny_llama):
    class Quantized(nn.Linear):  # not a plain nn.Linear (a quantized or adapter-wrapped layer)
        pass

    model = tiny_llama(64, layers=2, hidden=32, seed=2)
    attn = model.model.layers[0].self_attn
    old = attn.k_proj
    attn.k_proj = Quantized(old.in_features, old.out_features, bias=False)
    assert stack_projections(model) == 3  # layer 0's attention left out
    assert attn.k_proj.__class__ is Quantized and type(attn.q_proj) is nn.Linear
    assert isinstance(model.model.layers[1].self_attn.q_proj, StackedLinear)


def test_layers_of_another_width_dtype_or_bias_stay_as_they_are(tiny_llama):
    """Stacked only with one input width, one dtype and biases on all or none, else the group is left out."""
    model = tiny_llama(64, layers=4, hidden=32, seed=2)
    attn = [layer.self_attn for layer in model.model.layers]
    attn[0].k_proj = nn.Linear(16, attn[0].k_proj.out_features, bias=False)  # another input width
    attn[1].k_proj = attn[1].k_proj.double()
    attn[2].k_proj = nn.Linear(attn[2].k_proj.in_features, attn[2].k_proj.out_features, bias=True)
    assert stack_projections(model) == 5  # 4 MLP groups and the last layer's attention
    assert [type(a.q_proj) for a in attn] == [nn.Linear] * 3 + [StackedLinear]


def test_greedy_decoding_is_unchanged(tiny_llama):
    """Plain and EAGLE-3 decoding (prefill, tree passes, single-token steps) of the stacked target emit
    exactly the unstacked target's tokens."""
    model, stacked, _ = pair(tiny_llama)
    for prompt in ([5, 9, 13], list(range(3, 14))):
        ref = SpeculativeGenerator(model, None, None).generate(input_ids=prompt, max_new_tokens=20)
        for drafter in (None, eagle_drafter(stacked, "eagle3", top_k=3, depth=3, total_tokens=8)):
            out = SpeculativeGenerator(stacked, None, drafter).generate(input_ids=prompt, max_new_tokens=20)
            assert out.token_ids == ref.token_ids and len(ref.token_ids) == 20, drafter


def test_compiled_one_graph_with_one_gemm_per_group(tiny_llama):
    """torch.compile traces the stacked target whole (fullgraph) with one matrix product per group."""
    model, stacked, _ = pair(tiny_llama)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, 64, (1, 6))
    with torch.inference_mode():
        logits = torch.compile(stacked, backend=capture, fullgraph=True)(ids).logits
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    linears = [n for g in graphs for n in g.graph.nodes if n.target is torch._C._nn.linear]
    assert len(graphs) == 1 and len(linears) == 3 * 4 + 1


def test_compiled_passes_decode_the_same(tiny_llama):
    """The target's passes traced by torch.compile (compile="eager": graphs without code generation, a
    graph per tree bucket) with the stacked projections: the same greedy tokens as the unstacked target."""
    model, stacked, _ = pair(tiny_llama)
    prompt = list(range(3, 14))
    ref = SpeculativeGenerator(model, None, None).generate(input_ids=prompt, max_new_tokens=16)
    drafter = eagle_drafter(stacked, "eagle3", top_k=3, depth=3, total_tokens=8)
    torch._dynamo.reset()
    counters.clear()
    gen = SpeculativeGenerator(stacked, None, drafter, compile="eager", buckets=(1, 8))
    assert gen.generate(input_ids=prompt, max_new_tokens=16).token_ids == ref.token_ids
    assert counters["stats"]["unique_graphs"] >= 2  # (the target's buckets, the head's steps)
