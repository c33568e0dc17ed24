"""topk_rows: the chunked top-k gives torch.topk's values and the columns that hold them."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.drafters.topk import topk_rows


@pytest.mark.parametrize("shape", [(8, 4096), (3, 1000), (2, 5, 777), (1, 129)])
@pytest.mark.parametrize("chunk", [16, 128])
def test_chunks_give_torch_topk(shape, chunk):
    g = torch.Generator().manual_seed(sum(shape) + chunk)
    x = torch.randn(shape, generator=g)  # distinct values: the ids are unique too
    for k in (1, 8, 16):
        want_values, want_ids = x.topk(k, dim=-1)
        values, ids = topk_rows(x, k, chunk)
        assert torch.equal(values, want_values), (shape, chunk, k)
        assert torch.equal(ids, want_ids), (shape, chunk, k)


def test_the_winners_of_one_chunk_and_the_last_partial_chunk():
    """All of a row's best in one chunk (the second top-k must not take one per chunk), the best in the
    padded last chunk (its ids may not point past the row)."""
    x = torch.zeros(2, 300)
    x[0, 130:138] = torch.arange(8, 0, -1, dtype=torch.float)  # 8 best, all in chunk 8 (128..143)
    x[1, 290:300] = torch.arange(10, dtype=torch.float) + 1  # best at 299, in the 12-wide last chunk
    values, ids = topk_rows(x, 8, 16)
    assert ids[0].tolist() == list(range(130, 138))
    assert ids[1].tolist() == list(range(299, 291, -1))
    assert torch.equal(values, x.topk(8, dim=-1).values)


def test_ties_give_the_same_values_at_columns_holding_them():
    x = torch.randint(0, 4, (4, 1000), generator=torch.Generator().manual_seed(0)).float()
    values, ids = topk_rows(x, 16, 64)
    assert torch.equal(values, x.topk(16, dim=-1).values)
    assert torch.equal(x.gather(-1, ids), values)
    assert all(len(set(row.tolist())) == 16 for row in ids)  # no column named twice


def test_one_stage_when_chunks_cannot_help():
    x = torch.randn(2, 100)
    assert torch.equal(topk_rows(x, 8, None)[1], x.topk(8).indices)
    assert torch.equal(topk_rows(x, 8, 128)[1], x.topk(8).indices)  # a row no longer than a chunk
    assert torch.equal(topk_rows(x, 8, 12)[1], x.topk(8).indices)  # k chunks cover the row (96 + pad)
    assert torch.equal(topk_rows(x, 16, 4)[1], x.topk(16).indices)  # k > chunk, chunked (64 < 100)
    with pytest.raises(ValueError, match="chunk must be a positive number of columns, got 0"):
        topk_rows(x, 8, 0)


def test_the_padding_never_wins_and_no_id_points_past_the_row():
    x = torch.full((2, 300), -5.0)
    x[0, [3, 150, 298]] = torch.tensor([1.0, 2.0, 3.0])  # 3 above the rest; the 5 others tie at -5
    x[1] = float("-inf")  # a row with fewer than k finite entries: ids stay inside it
    x[1, [10, 20]] = torch.tensor([1.0, 2.0])
    values, ids = topk_rows(x, 8, 16)  # 19 chunks, the last 12 wide
    assert torch.equal(values, x.topk(8, dim=-1).values)
    assert torch.equal(x[0].gather(-1, ids[0]), values[0]) and len(set(ids[0].tolist())) == 8
    assert ids[1, :2].tolist() == [20, 10] and int(ids.max()) < 300
    last = torch.full((1, 289), float("-inf"))  # 18 chunks of 16 and one of 1 column + 15 of padding
    last[0, 288] = 1.0  # the only finite entry: its chunk is kept first, with its padding
    values, ids = topk_rows(last, 8, 16)
    assert values[0, 0] == 1.0 and ids[0, 0] == 288 and int(ids.max()) < 289


def test_the_kth_best_in_the_kth_chunk_by_maximum():
    """Each of the k best in its own chunk, the k-th best's chunk the k-th by maximum; and every chunk's
    maximum tied (which k chunks are kept is arbitrary): the values still are torch.topk's."""
    x = torch.zeros(1, 640)  # 40 chunks of 16
    x[0, torch.arange(8) * 80 + 5] = torch.arange(8, 0, -1, dtype=torch.float)  # 8 best, 8 chunks
    values, ids = topk_rows(x, 8, 16)
    assert ids[0].tolist() == (torch.arange(8) * 80 + 5).tolist()
    tied = torch.zeros(2, 640)
    tied[:, ::16] = 1.0  # every chunk's maximum is 1 (40 of them), the rest 0
    values, ids = topk_rows(tied, 8, 16)
    assert torch.equal(values, tied.topk(8, dim=-1).values) and torch.equal(tied.gather(-1, ids), values)


def test_auto_chunks_by_64_for_long_rows_only():
    """ "auto" (the drafters' default): rows of 20,000 or more (torch.topk's multi-block select on CUDA)
    in 64-id chunks, measured faster on an H200 and on a CPU; shorter rows keep one topk, and so do
    devices not measured."""
    from spechead.inference.drafters.topk import resolve_chunk

    assert resolve_chunk("auto", "cuda", 32000) == 64 and resolve_chunk("auto", "cpu", 20000) == 64
    assert resolve_chunk("auto", "cuda", 19999) is None and resolve_chunk("auto", "cpu", 2048) is None
    assert resolve_chunk("auto", "mps", 128256) is None
    assert resolve_chunk(16, "cpu", 100) == 16 and resolve_chunk(None, "cuda", 32000) is None
    x = torch.randn(2, 20000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(topk_rows(x, 8, "auto")[1], x.topk(8).indices)


def test_eagle_drafters_default_to_auto_and_pass_it_on():
    from transformers import LlamaConfig

    from spechead.heads.eagle import EagleConfig, EagleHead
    from spechead.inference.drafters.eagle import EagleDrafter

    target = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    head = EagleHead(EagleConfig.from_target(target))
    drafter = EagleDrafter(head, tree="dynamic")
    assert drafter.topk_chunk == "auto" and drafter.with_tree([[0]]).topk_chunk == "auto"


@pytest.mark.parametrize(
    "tree", ["dynamic", [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]], ids=["dynamic", "static"]
)
@pytest.mark.parametrize("draft_compile", [None, "eager"])
def test_an_eagle_draft_past_the_threshold_is_one_topks(tiny_llama, draft_compile, tree):
    """A draft vocab of 24,000 on a CPU: "auto" chunks (eager, and traced whole as the compiled draft;
    dynamic and static trees); the drafter decodes as plain decoding and drafts the trees of one topk
    (tests/inference/test_cuda.py holds the same on CUDA)."""
    from spechead.heads.eagle import EagleConfig, EagleHead
    from spechead.inference.drafters.eagle import EagleDrafter
    from spechead.inference.generator import SpeculativeGenerator
    from spechead.inference.sampling import SamplingParams

    from .one_row import OneRow

    model = tiny_llama(24000, layers=2, hidden=64, seed=1)
    head = EagleHead(EagleConfig.from_target(model.config))
    head.attach_target_modules(
        lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
    )
    prompt, trees = list(range(5, 25)), {}
    plain = SpeculativeGenerator(model, None, None).generate(input_ids=prompt, max_new_tokens=16).token_ids
    for chunk in ("auto", None):
        drafter = EagleDrafter(head.eval(), tree=tree, top_k=4, depth=4, total_tokens=16)
        drafter.topk_chunk = chunk
        gen = SpeculativeGenerator(model, None, drafter, draft_compile=draft_compile)
        assert gen.generate(input_ids=prompt, max_new_tokens=16).token_ids == plain, chunk
        # a batch of one on the same states (eager or compiled as decoding ran it)
        states = torch.Generator().manual_seed(2)
        hidden = {layer: torch.randn(len(prompt), 64, generator=states) for layer in drafter.hidden_layers}
        OneRow(drafter).start(torch.tensor(prompt), hidden, 7)
        draft = OneRow(drafter).propose(7, SamplingParams(), None)
        trees[chunk] = (draft.tree.tokens.tolist(), draft.tree.parents.tolist())
    assert trees["auto"] == trees[None]


def test_a_row_finite_only_in_its_partial_last_chunk_names_no_padding_column():
    """Fewer finite entries than k, the one finite entry in the padded last chunk: the -inf picks may land
    on the padding (which of the tied -inf is named is arbitrary); no id may point past the row."""
    for width in range(5, 40):
        for chunk, k in ((2, 3), (8, 3), (4, 2)):
            if width <= k * chunk or width % chunk == 0:
                continue
            x = torch.full((1, width), float("-inf"))
            x[0, -1] = 1.0
            values, ids = topk_rows(x, k, chunk)
            assert ids[0, 0] == width - 1 and int(ids.max()) < width, (width, chunk, k)
