"""The engine's acceptance of B rows' trees (engine/accept.py `accept_rows`): padding nodes are never
accepted, and the CPU's host walk per row equals the batched device walk and batch-1 `greedy_accept`."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.drafters.base import BatchDraft
from spechead.inference.sampling import SamplingParams


@pytest.mark.parametrize("on_device", [False, True])
def test_padding_nodes_are_never_accepted(on_device):
    """A row whose tree is shorter than the batch's: its padding (copies of the root, children of
    the root) must not be accepted even where the target's argmax at the root equals the root; by the
    host walk (a CPU's) and by the device's batched walk."""
    from spechead.inference.engine.accept import accept_rows
    from spechead.inference.engine.rows import Row
    from spechead.inference.tree import ancestors_on_device

    draft = BatchDraft(torch.tensor([[7, 7, 7], [5, 6, 8]]), torch.tensor([[-1, 0, 0], [-1, 0, 1]]), [1, 3])
    logits = torch.zeros(2, 3, 10)
    logits[0, :, 7] = 1.0  # row 0: the target continues with 7 = its root token
    logits[1, 0, 6], logits[1, 1, 8], logits[1, 2, 2] = 1.0, 1.0, 1.0  # row 1: the whole chain, then 2
    rows = [Row(b, torch.tensor([1]), 4, SamplingParams(), None, None) for b in range(2)]
    accs = accept_rows(draft, logits, ancestors_on_device(draft.parents), rows, on_device)
    assert [a.path for a in accs] == [[0], [0, 1, 2]]
    assert [a.next_token for a in accs] == [7, 2]
    assert [a.path_tokens for a in accs] == [[7], [5, 6, 8]]


def test_host_and_device_batch_walks_agree():
    """Greedy acceptance of random trees of mixed sizes, where the target mostly agrees: the CPU's
    host walk per row == the batched device walk == batch-1 `greedy_accept`, tokens included."""
    from spechead.inference.acceptance import greedy_accept
    from spechead.inference.engine.accept import accept_rows
    from spechead.inference.engine.rows import Row
    from spechead.inference.tree import TokenTree, ancestors_on_device

    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        batch, n, vocab = 3, 7, 5
        parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in
                                                    range(1, n)]) for _ in range(batch)])  # fmt: skip
        tokens = torch.randint(0, vocab, (batch, n), generator=g)
        sizes = [int(torch.randint(1, n + 1, (1,), generator=g)) for _ in range(batch)]
        for b, size in enumerate(sizes):  # padding: copies of the root hanging from it
            tokens[b, size:], parents[b, size:] = tokens[b, 0], 0
        logits = torch.randn(batch, n, vocab, generator=g)
        logits.scatter_add_(2, tokens.gather(1, torch.randint(0, n, (batch, n), generator=g))[..., None],
                            torch.full((batch, n, 1), 2.0))  # the drafts are often the argmax  # fmt: skip
        draft = BatchDraft(tokens, parents, sizes)
        rows = [Row(b, torch.tensor([1]), 4, SamplingParams(), None, None) for b in range(batch)]
        anc = ancestors_on_device(parents)
        host = accept_rows(draft, logits, anc, rows, on_device=False)
        device = accept_rows(draft, logits, anc, rows, on_device=True)
        single = [greedy_accept(TokenTree(tokens[b, :s], parents[b, :s]), logits[b, :s]) for b, s in
                  enumerate(sizes)]  # fmt: skip
        assert host == device == single
        assert (
            [a.path_tokens for a in host]
            == [a.path_tokens for a in device]
            == [a.path_tokens for a in single]
        )


def test_a_one_node_row_takes_the_targets_own_next_token():
    """Rows of one node beside a bigger tree, greedy and sampled mixed (the per-row walk): each row's
    next token is the target's own, the argmax or `pick`'s draw from its generator, its path the root."""
    from spechead.inference.engine.accept import accept_rows
    from spechead.inference.engine.rows import Row
    from spechead.inference.sampling import make_generator, pick
    from spechead.inference.tree import ancestors_on_device

    draft = BatchDraft(
        torch.tensor([[3, 3, 3], [4, 4, 4], [5, 6, 8]]), torch.tensor([[-1, 0, 0]] * 3), [1, 1, 3]
    )
    logits = torch.randn(3, 3, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 1:] = logits[1, 1:] = 100.0  # padding nodes: never read
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0.7)]
    rows = [Row(b, torch.tensor([1]), 4, p, make_generator(b), None) for b, p in enumerate(params)]
    accs = accept_rows(draft, logits, ancestors_on_device(draft.parents), rows, False)
    assert [a.path for a in accs[:2]] == [[0], [0]] and [a.path_tokens for a in accs[:2]] == [[3], [4]]
    assert accs[0].next_token == int(logits[0, 0].argmax())
    assert accs[1].next_token == pick(logits[1, 0], params[1], make_generator(1))
