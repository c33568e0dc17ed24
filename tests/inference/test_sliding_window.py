"""Sliding-window targets decode past their window, losslessly (inference/sliding.py).

The pure mask function at the window's edge (transformers' convention: a key at position p is visible
to a query at position q iff q - p < window), measured in positions, not slots; then tiny targets with a
window of 8 (Mistral: every layer slides, one mask; Gemma-2 and GPT-OSS: sliding and full layers, a mask
per layer type) decoding 40 tokens after prompts of 5-17 tokens with EAGLE-3, Medusa and prompt lookup,
at batch 1 and batch 3 (mixed lengths) on the one runner's row cache, and through its fixed-shape
passes, equal to the model's own `generate` token for token. A window of 16 no
longer stops an EAGLE head from loading: its calibration times passes past the window.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sliding import SlidingLayout, layer_masks, slot_positions
from spechead.inference.target.runner import TargetRunner
from spechead.inference.tree import path_to_node

WINDOW, VOCAB, NEW = 8, 96, 40
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW,
)  # fmt: skip
TARGETS = {
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(head_dim=8, attn_implementation="eager", **SHAPE)
    ),
    "gpt_oss": lambda: transformers.GptOssForCausalLM(  # (no sdpa in transformers: sinks)
        transformers.GptOssConfig(
            head_dim=8, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager", **SHAPE
        )
    ),
}
# three lengths around the window; repeated n-grams give prompt lookup drafts to accept
PROMPTS = [[5, 9, 14, 20, 33], [5, 9, 14, 20, 33, 41, 5, 9, 14, 20, 33], [7, 3, 11, 2, 7, 3, 11, 2] * 2 + [7]]
BLOCKED = torch.finfo(torch.float32).min


def visible(mask: torch.Tensor) -> list[int]:
    """The columns of a one-query additive mask [1, 1, 1, K] that are not blocked."""
    return (mask[0, 0, 0] == 0).nonzero().flatten().tolist()


# ---- the pure function ---------------------------------------------------------------------------


def window_mask(mask: torch.Tensor, query_pos, key_pos, window: int) -> torch.Tensor:
    """layer_masks' windowed mask (every layer slides)."""
    return layer_masks(SlidingLayout(window, None), mask, query_pos, key_pos)


def test_window_mask_keeps_keys_less_than_a_window_behind_the_query():
    """Query at position 10, keys 0..10: window 8 keeps 3..10 (10 - 3 = 7 < 8; 10 - 2 = 8 is out)."""
    full = torch.zeros(1, 1, 1, 11)
    query, keys = torch.tensor([[10]]), torch.arange(11)
    assert visible(window_mask(full, query, keys, 8)) == list(range(3, 11))
    assert visible(window_mask(full, query, keys, 1)) == [10]  # a window of one: the query's own position
    assert visible(window_mask(full, query, keys, 11)) == list(range(11))  # the whole sequence fits
    assert torch.equal(full, torch.zeros(1, 1, 1, 11))  # the full mask is not modified


def test_window_mask_measures_positions_not_slots_and_keeps_blocked_keys_blocked():
    """A tree after 5 committed tokens: nodes 0..3 at slots 5..8, depths 0, 1, 1, 2 (node 3 under node 1).
    Node 3 (position 7) with a window of 3 sees positions 5..7: slots 5 (root, position 5) and 6 (its
    parent, position 6) and itself at slot 8, although slot 8 - 3 = 5 would cut slot 5 by slot; its
    sibling's branch (slot 7) stays blocked."""
    parents_blocked = torch.zeros(1, 1, 1, 9)
    parents_blocked[..., 7] = BLOCKED  # node 2 is not an ancestor of node 3
    positions = torch.tensor([[7]])
    keys = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 7])  # committed slots = positions, then the tree's
    assert visible(window_mask(parents_blocked, positions, keys, 3)) == [5, 6, 8]
    by_slot = window_mask(parents_blocked, torch.tensor([[8]]), torch.arange(9), 3)
    assert visible(by_slot) == [6, 8]  # what windowing by slot would wrongly give


def test_window_mask_rows_have_their_own_positions():
    """Batched: row b's queries and keys at its own positions [B, Q] / [B, K]."""
    full = torch.zeros(2, 1, 2, 6)
    queries = torch.tensor([[4, 5], [2, 3]])
    keys = torch.arange(6).expand(2, 6)
    out = window_mask(full, queries, keys, 2)
    assert out.shape == full.shape  # (one mask per row, not rows x rows)
    assert (out[0, 0] == 0).tolist() == [[False, False, False, True, True, True], [False] * 4 + [True] * 2]
    assert (out[1, 0] == 0).tolist() == [[False, True, True, True, True, True], [False, False] + [True] * 4]


def test_layer_masks_one_mask_per_layer_type():
    """No sliding layer: the mask itself; every layer sliding: the windowed mask; mixed: a dict whose full
    layers get the full mask unchanged."""
    full = torch.zeros(1, 1, 1, 10)
    query, keys = torch.tensor([[9]]), torch.arange(10)
    assert layer_masks(None, full, query, keys) is full
    windowed = window_mask(full, query, keys, 4)
    assert torch.equal(layer_masks(SlidingLayout(4, None), full, query, keys), windowed)
    masks = layer_masks(SlidingLayout(4, ("full_attention", "sliding_attention")), full, query, keys)
    assert set(masks) == {"full_attention", "sliding_attention"} and masks["full_attention"] is full
    assert torch.equal(masks["sliding_attention"], windowed)


def test_slot_positions_put_tree_nodes_at_their_depths():
    """Row 0: 2 committed, nodes at positions 2, 3, 3 (slots 2..4); row 1: 4 committed, a chain at 4..6."""
    keys = slot_positions(torch.tensor([2, 4]), torch.tensor([[2, 3, 3], [4, 5, 6]]), 8)
    assert keys.tolist() == [[0, 1, 2, 3, 3, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]]


# ---- every runner's tree passes -------------------------------------------------------------------

# a tree deeper than the window: a branch of depth 3 (nodes 1-3), then one of depth 10 (nodes 4-13, each
# node's index above its depth) and a twig (14). Node 13 (depth 10) must not see node 4 (depth 1): 9
# positions apart, 13 - 4 = 9 slots apart... but 10 - 4 = 6 from its position: windowing by slot, or
# with a key's slot against a query's position, lets it see node 4
DEEP = [-1, 0, 1, 2, 0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 8]


def _runner(name: str, model):
    """The one runner of `name` over `model`: two rows ("rows") or one, eager or with fixed shapes."""
    if name == "one":
        return TargetRunner(model)
    if name == "compiled":  # fixed shapes, whole-buffer masks (no compiler on a CPU), one physical row
        return TargetRunner(model, compile="graphs", max_length=96)
    if name == "rows":
        return TargetRunner(model, max_length=96)
    return TargetRunner(model, max_length=96, capacity=2, compile="graphs")


@torch.no_grad()
@pytest.mark.parametrize("name", ["one", "compiled", "rows", "compiled_rows"])
@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_every_runners_tree_passes_equal_plain_forwards_past_the_window(kind, name, targets):
    """Each runner verifies a 15-node tree of depth 10 (window 8) after prefixes of 13 and 9 tokens, twice
    (the second after committing the deep path, moved into place): each node's logits equal the model's
    own forward over its root-to-node path (its own sliding masks)."""
    model = targets[kind][0]
    runner = _runner(name, model)
    rows = [PROMPTS[1] + [2, 4], PROMPTS[1][:9]] if "rows" in name else [PROMPTS[1] + [2, 4]]
    parents = torch.tensor([DEEP] * len(rows))
    runner.reserve([len(r) for r in rows], [40] * len(rows))
    runner.prefill([torch.tensor(r) for r in rows])
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        tokens = torch.randint(0, VOCAB, parents.shape, generator=g)
        logits, _ = runner.verify(tokens, parents)
        for b, row in enumerate(rows):
            for node in range(len(DEEP)):
                path = tokens[b, path_to_node(parents[b], node)].tolist()
                want = model(torch.tensor([row + path])).logits[0, -1]
                torch.testing.assert_close(logits[b, node], want, atol=1e-4, rtol=0, msg=f"{step} {b} {node}")
        keep = path_to_node(parents[0], 13 if step == 0 else 3)  # the deep branch, then the short one
        runner.commit([keep] * len(rows))
        rows = [row + tokens[b, keep].tolist() for b, row in enumerate(rows)]


# ---- decoding past the window ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def targets():
    """{kind: (model, the greedy references of PROMPTS: NEW tokens each from transformers' generate)}."""
    out = {}
    for kind, build in TARGETS.items():
        torch.manual_seed(0)
        model = build().eval()
        model.generation_config.eos_token_id = None
        refs = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[
                0, len(p) :
            ]
            for p in PROMPTS
        ]
        out[kind] = (model, [r.tolist() for r in refs])
    return out


def drafter_for(kind: str, model, medusa_for):
    """A drafter of `kind` for `model`: a random EAGLE-3 head (its drafts mostly rejected: the tree passes
    still run), Medusa heads started as the lm_head (often accepted), prompt lookup."""
    torch.manual_seed(1)
    if kind == "eagle3":
        head = Eagle3Head(Eagle3Config.from_target(model.config, target_layers=[0, 1, 2]))
        head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
        return EagleDrafter(head.eval().requires_grad_(False), tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    if kind == "medusa":
        return MedusaDrafter(medusa_for(model, num_heads=3).eval())
    return PromptLookupDrafter()


def assert_generates_references(gen: SpeculativeGenerator, refs: list[list[int]]) -> int:
    """Every prompt at batch 1 and all three at once equal their references; the tokens accepted."""
    gen.eos = set()
    accepted = 0
    for prompt, ref in zip(PROMPTS, refs):
        result = gen.generate(input_ids=prompt, max_new_tokens=NEW)
        assert result.token_ids == ref
        accepted += result.stats.accepted_tokens
    rows = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=NEW)
    assert [r.token_ids for r in rows] == refs
    return accepted


@torch.no_grad()
@pytest.mark.parametrize("drafter", ["eagle3", "medusa", "prompt_lookup"])
@pytest.mark.parametrize("kind", list(TARGETS))
def test_greedy_decoding_past_the_window_equals_generate(kind, drafter, targets, medusa_for):
    """Prompts + answers of 45-57 tokens on a window of 8, batch 1 and batch 3."""
    model, refs = targets[kind]
    gen = SpeculativeGenerator(model, None, drafter_for(drafter, model, medusa_for))
    assert gen.runner.sliding is not None and gen.runner.sliding.window == WINDOW
    accepted = assert_generates_references(gen, refs)
    if drafter != "eagle3":  # (an untrained EAGLE-3 layer's drafts are rejected: no paths to commit)
        assert accepted > 0


@torch.no_grad()
@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_the_fixed_shape_passes_decode_past_the_window(kind, targets, medusa_for):
    """compile="graphs" (no compiler on a CPU): the whole-buffer masks of the compiled runner's tree passes,
    windowed, at batch 1 (one physical row) and 3 (four)."""
    model, refs = targets[kind]
    gen = SpeculativeGenerator(model, None, drafter_for("medusa", model, medusa_for), compile="graphs")
    assert gen.runner.static_shapes
    assert assert_generates_references(gen, refs) > 0


@torch.no_grad()
def test_plain_decoding_past_the_window_equals_generate(targets):
    """No drafter: one-token steps (the runners' single-query masks) at batch 1 and 3."""
    model, refs = targets["gemma2"]
    assert_generates_references(SpeculativeGenerator(model, None, None), refs)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_sliding_draft_models_tree_drafts_are_windowed_too(kind, targets):
    """The target drafting trees for itself (DraftModelDrafter over the same model): its rank-0 chain is
    the target's own greedy answer only when its tree passes are windowed as the target's, so every pass
    past the window accepts the whole chain."""
    from spechead.inference.drafters.draft_model import DraftModelDrafter

    model, refs = targets[kind]
    gen = SpeculativeGenerator(model, None, DraftModelDrafter(model, num_draft=4, width=2), cache="static")
    gen.eos = set()
    result = gen.generate(input_ids=PROMPTS[2], max_new_tokens=NEW)
    assert result.token_ids == refs[2]
    assert result.stats.accept_lengths[:-1] == [5] * (len(result.stats.accept_lengths) - 1)


def test_an_eagle_head_loads_and_decodes_on_a_window_of_16(tmp_path, chatml_tokenizer):
    """from_pretrained calibrates an EAGLE-3 head's tree (verify passes after 128 tokens) on a target
    whose window is 16: it loads (the window once refused it) and decodes past the window as generate."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        **{**SHAPE, "vocab_size": len(chatml_tokenizer), "sliding_window": 16}
    )
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "target")
    chatml_tokenizer.save_pretrained(tmp_path / "target")
    head = Eagle3Head(Eagle3Config.from_target(model.config, target_layers=[0, 1, 2]))
    head.save_pretrained(tmp_path / "head")
    gen = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"))
    assert gen.calibration is not None  # the tree was measured here
    gen.eos = set()
    prompt = PROMPTS[1]
    model.generation_config.eos_token_id = None
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert gen.generate(input_ids=prompt, max_new_tokens=30).token_ids == ref[0, len(prompt) :].tolist()
