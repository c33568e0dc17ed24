"""DFlashDrafter: one head forward proposes every row's chain of block_size - 1 drafts; decoding with it
equals the target's plain greedy decoding at batch 1 and 3 (lossless), and row b's chain at B rows is its
batch-of-one chain."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import DFlashConfig, DFlashHead
from spechead.inference.drafters.dflash import DFlashDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams

from ..test_batch import MAX_NEW, PROMPTS


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=4, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model


def drafter_for(model, block_size: int = 4) -> DFlashDrafter:
    head = DFlashHead(DFlashConfig.from_target(model.config, block_size=block_size, num_layers=2))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # weights at 1/sqrt(fan_in): every input moves the drafts
        for weight in head.parameters():
            if weight.dim() == 2:
                weight.copy_(torch.randn(weight.shape, generator=g) / weight.shape[1] ** 0.5)
    head.attach_target_modules(model.get_output_embeddings(), model.get_input_embeddings())
    return DFlashDrafter(head)


def test_decoding_with_it_equals_plain_greedy(model, chatml_tokenizer):
    from ..test_generator import plain_greedy

    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter_for(model), cache="static")
    gen.eos = set()
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        single = gen.generate(input_ids=prompt, max_new_tokens=n)
        assert single.token_ids == plain_greedy(model, prompt, n), b
        assert batch[b].token_ids == single.token_ids, b
        assert batch[b].stats.accept_lengths == single.stats.accept_lengths, b
        assert batch[b].stats.drafted_tokens == single.stats.drafted_tokens > 0, b


def test_every_row_gets_its_batch1_chain(model):
    from spechead.inference.target.runner import TargetRunner

    drafter = drafter_for(model, block_size=5)
    layers = drafter.hidden_layers
    runner = TargetRunner(model, layers)
    prompts = [torch.tensor(p) for p in PROMPTS]
    states = [runner.prefill([p])[1][0] for p in prompts]  # {layer: [T_b, H]} each
    roots = [3 + b for b in range(len(prompts))]
    greedy = [SamplingParams()] * len(prompts)
    drafter.start(prompts, states, roots)
    together = drafter.propose(roots, greedy, [None] * len(prompts))
    assert together.sizes == [5] * len(prompts) and together.parents[0].tolist() == [-1, 0, 1, 2, 3]
    for b, prompt in enumerate(prompts):
        alone = DFlashDrafter(drafter.head)
        alone.start([prompt], [states[b]], [roots[b]])
        draft = alone.propose([roots[b]], greedy[:1], [None])
        assert draft.tokens[0].tolist() == together.tokens[b].tolist(), b
    # accepting two tokens on row 0 only moves row 0's chain
    before = together.tokens.clone()
    new = {layer: torch.randn(len(prompts), 2, model.config.hidden_size) for layer in layers}
    drafter.accept(torch.zeros(len(prompts), 2, dtype=torch.long), [2] + [0] * (len(prompts) - 1), new, roots)
    after = drafter.propose(roots, greedy, [None] * len(prompts))
    assert torch.equal(after.tokens[1:], before[1:]) and drafter.lengths[0] == len(prompts[0]) + 2


def test_kept_rows_draft_as_before_without_a_second_buffer(model):
    """keep: finished rows dropped (the kept ones ascending) moves the kept rows up in place, in the same
    buffers (no copy of the drafter's whole context); another order gathers. Either way each kept row then
    drafts the chain it drafted before."""
    from spechead.inference.target.runner import TargetRunner

    drafter = drafter_for(model, block_size=5)
    runner = TargetRunner(model, drafter.hidden_layers)
    prompts = [torch.tensor(p) for p in PROMPTS]
    states = [runner.prefill([p])[1][0] for p in prompts]  # {layer: [T_b, H]} each
    roots = [3 + b for b in range(len(prompts))]
    greedy = [SamplingParams()] * len(prompts)
    drafter.start(prompts, states, roots)
    before = drafter.propose(roots, greedy, [None] * len(prompts)).tokens  # [B, N]
    buffers = [layer.keys.data_ptr() for layer in drafter.cache.row_layers]
    kept = [0, 2]  # row 2 moves up to row 1
    drafter.keep(kept)
    layers = drafter.cache.row_layers
    assert [layer.keys.data_ptr() for layer in layers] == buffers and layers[0].keys.shape[0] == len(kept)
    after = drafter.propose([roots[b] for b in kept], greedy[:2], [None] * 2).tokens
    assert torch.equal(after, before[kept]) and drafter.lengths == [len(prompts[b]) for b in kept]
    drafter.keep([1, 0])  # another order: gathered
    again = drafter.propose([roots[kept[1]], roots[kept[0]]], greedy[:2], [None] * 2).tokens
    assert torch.equal(again, before[[kept[1], kept[0]]])


def test_parallel_drafters_draft_through_the_fused_chain(tiny_llama, chatml_tokenizer):
    """P-EAGLE's step and DFlash's block forward run as heads/fused.py's chains where the layer kind
    allows (the default draft layers: Llama for P-EAGLE, Qwen3 for DFlash); their equality with the
    modules is tests/heads/test_fused*.py's, the drafters' losslessness test_parallel_lossless.py's."""
    from spechead.heads.fused import _FusedStep
    from spechead.heads.fused_block import _FusedBlock

    from .parallel_heads import dflash_head, parallel_drafter, peagle_head

    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    assert isinstance(parallel_drafter(peagle_head(model, None), "peagle_chain").head_step, _FusedStep)
    assert isinstance(parallel_drafter(dflash_head(model, None), "dflash_chain").head_forward, _FusedBlock)


def test_an_eager_start_sizes_the_cache_for_its_rows(model):
    """DFlash's eager draft attends over the cache's every slot, so a start after a longer one makes a cache
    sized for its own rows (P-EAGLE keeps a fitting one: its draft reads only up to the longest row)."""
    from spechead.inference.target.runner import TargetRunner

    drafter = drafter_for(model, block_size=4)
    runner = TargetRunner(model, drafter.hidden_layers)
    long, short = torch.arange(3, 40), torch.arange(3, 8)
    for prompt in (long, short):
        drafter.start([prompt], [runner.prefill([prompt])[1][0]], [3])
        assert drafter.cache is not None
        assert drafter.cache.max_length == 2 * (len(prompt) + drafter.tree.depth + 1)
