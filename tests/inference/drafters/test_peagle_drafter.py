"""PEagleDrafter: ONE head forward per pass drafts every row's block; decoding with it equals the target's
own greedy decoding at batch 1 and 3 (lossless), and row b's draft at B rows is its batch-of-one draft;
for heads of one and of three decoder layers."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from spechead.heads import PEagleConfig, PEagleHead
from spechead.inference.drafters.peagle import PEagleDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams

N = 14
PROMPTS = [[5, 9, 14, 20, 33, 41, 7, 3, 12, 18, 25], [11, 4, 8], [30, 2, 6, 19, 27, 1]]


@pytest.fixture(scope="module", params=[1, 3], ids=["1-layer", "3-layers"])
def dirs(request, tmp_path_factory, tiny_llama, chatml_tokenizer):
    """(target dir, head dir, target): a tiny Llama and a random P-EAGLE head (K = 4) for it, of one
    decoder layer or three (the head cache then holds a layer each)."""
    root = tmp_path_factory.mktemp("peagle")
    vocab = len(chatml_tokenizer)
    target = tiny_llama(vocab, layers=4, hidden=32)
    with torch.no_grad():  # sharper distributions: argmax near-ties are rare
        for p in target.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    target.save_pretrained(root / "target")
    chatml_tokenizer.save_pretrained(root / "target")
    torch.manual_seed(3)
    config = PEagleConfig.from_target(
        target.config, draft_vocab_size=vocab, block_size=4, num_layers=request.param
    )
    head = PEagleHead(config)
    head.save_pretrained(root / "head")
    return root / "target", root / "head", target


def _references(target, prompts):
    out = []
    for prompt in prompts:
        ids = target.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                              pad_token_id=0)  # fmt: skip
        out.append(ids[0, len(prompt) :].tolist())
    return out


def test_decoding_with_a_peagle_head_equals_greedy_decoding(dirs) -> None:
    target_dir, head_dir, target = dirs
    gen = SpeculativeGenerator.from_pretrained(str(target_dir), str(head_dir), calibrate=False)
    gen.eos = set()
    assert isinstance(gen.drafter, PEagleDrafter) or "PEagle" in type(gen.drafter).__name__
    refs = _references(target.eval(), PROMPTS)
    assert gen.generate(input_ids=PROMPTS[0], max_new_tokens=N).token_ids == refs[0]
    rows = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=N, tree_for_batch=False)
    assert [r.token_ids for r in rows] == refs
    tree = SpeculativeGenerator.from_pretrained(
        str(target_dir), str(head_dir), calibrate=False, choices=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]
    )
    tree.eos = set()
    assert tree.generate(input_ids=PROMPTS[2], max_new_tokens=N).token_ids == refs[2]


@torch.no_grad()
def test_row_b_drafts_what_its_batch_of_one_drafts(dirs) -> None:
    """Rows of other lengths in one forward (padding after each block) draft their batch-of-one chains."""
    _, head_dir, target = dirs
    head = PEagleHead.from_pretrained(head_dir)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    layers = head.config.target_layers
    states = []
    for prompt in PROMPTS:
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        states.append({layer: out.hidden_states[layer][0] for layer in layers})
    prompts = [torch.tensor(p) for p in PROMPTS]
    params = [SamplingParams()] * 3
    batch = PEagleDrafter(head)
    batch.start(prompts, states, [1, 2, 3])
    together = batch.propose([1, 2, 3], params, [None] * 3)
    assert together.tokens.shape == (3, 5)  # root + K = 4 drafts, a chain
    for b in range(3):
        alone = PEagleDrafter(head)
        alone.start(prompts[b : b + 1], states[b : b + 1], [b + 1])
        assert torch.equal(alone.propose([b + 1], params[:1], [None]).tokens[0], together.tokens[b])
    # the next pass: rows accepted different path lengths
    tokens = torch.tensor([[1, 7, 8], [2, 0, 0], [3, 9, 0]])
    hidden = {layer: torch.randn(3, 3, 32) for layer in layers}
    batch.accept(tokens, [3, 1, 2], hidden, [4, 5, 6])
    again = batch.propose([4, 5, 6], params, [None] * 3)
    for b, n in enumerate([3, 1, 2]):
        alone = PEagleDrafter(head)
        alone.start(prompts[b : b + 1], states[b : b + 1], [b + 1])
        alone.propose([b + 1], params[:1], [None])
        alone.accept(tokens[b : b + 1], [n], {k: v[b : b + 1] for k, v in hidden.items()}, [4 + b])
        torch.testing.assert_close(alone.propose([4 + b], params[:1], [None]).tokens[0], again.tokens[b])


@torch.no_grad()
def test_the_head_cache_drafts_what_a_pass_over_the_whole_prefix_drafts(dirs) -> None:
    """After passes and accepts, the block from the head's cache equals the block computed afresh from
    every committed position (no cache): a wrong slot, position or next token in the bookkeeping differs."""
    _, head_dir, target = dirs
    head = PEagleHead.from_pretrained(head_dir)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    layers = head.config.target_layers
    seq = torch.tensor(PROMPTS[0] + [2, 40, 17, 9, 5, 33])  # prompt (11) + root 2 + accepted after
    out = target(seq[None], output_hidden_states=True)
    states = {layer: out.hidden_states[layer][0] for layer in layers}  # [T, H]
    drafter = PEagleDrafter(head)
    drafter.start([seq[:11]], [{k: v[:11] for k, v in states.items()}], [2])
    drafter.propose([2], [SamplingParams()], [None])
    drafter.accept(seq[None, 11:14], [3], {k: v[None, 11:14] for k, v in states.items()}, [9])  # 2, 40, 17
    drafter.propose([9], [SamplingParams()], [None])
    drafter.accept(seq[None, 14:16], [2], {k: v[None, 14:16] for k, v in states.items()}, [33])  # 9, 5
    tokens = drafter.propose([33], [SamplingParams()], [None]).tokens[0]
    fused = head.fuse([states[layer][None, :16] for layer in layers])  # committed: positions 0..15
    block = head.draft_block(fused, seq[None, 1:17], DynamicCache())  # next tokens: seq[1..16] (33 = root)
    expected = head.draft_to_target(head.logits(block).argmax(-1))[0]
    assert tokens.tolist() == [33, *expected.tolist()]
