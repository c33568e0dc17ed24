"""SamplingParams validation and the target distribution (temperature, top-k, top-p)."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.acceptance import sample_accept, walk
from spechead.inference.sampling import (
    SamplingParams,
    TargetRows,
    argmax_ids,
    host_nucleus,
    make_generator,
    nucleus,
    sample,
    target_probs,
    torch_probs,
)
from spechead.inference.tree import TokenTree

# target_probs on a CPU goes through numpy; torch_probs is the path of every other device
PROBS = pytest.mark.parametrize("probs_of", [target_probs, torch_probs], ids=["host", "torch"])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_params_validation_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_is_greedy():
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


@PROBS
def test_greedy_is_one_hot_argmax(probs_of):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 2.0, 0.0]])
    probs = probs_of(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@PROBS
def test_temperature_scaling_fp32(probs_of):
    logits = torch.tensor([0.0, 1.0, 2.0], dtype=torch.bfloat16)
    probs = probs_of(logits, SamplingParams(temperature=0.5))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, torch.softmax(torch.tensor([0.0, 2.0, 4.0]), -1))
    assert torch.allclose(
        probs_of(logits, SamplingParams(temperature=1.0)), torch.softmax(logits.float(), -1)
    )


@PROBS
def test_top_k(probs_of):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 0.0, 0.0, 0.0]])  # [2, V]
    probs = probs_of(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, False, True]
    assert torch.allclose(probs[0, [1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    # ties at the k-th value are kept; top_k >= V is off
    assert (probs[1] > 0).sum() == 4
    assert torch.allclose(probs_of(logits, SamplingParams(1.0, top_k=10)), torch.softmax(logits, -1))


@PROBS
def test_top_p_smallest_set_and_at_least_argmax(probs_of):
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log()
    keep = lambda top_p: (probs_of(logits, SamplingParams(1.0, top_p=top_p)) > 0).tolist()  # noqa: E731
    assert keep(0.5) == [True, False, False, False]  # mass 0.5 >= 0.5
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.8) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1e-6) == [True, False, False, False]  # always at least the argmax
    assert keep(1.0) == [True, True, True, True]
    probs = probs_of(logits, SamplingParams(1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


@PROBS
def test_top_k_then_top_p_batched(probs_of):
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0))  # [..., V]
    probs = probs_of(logits, SamplingParams(temperature=0.8, top_k=10, top_p=0.9))
    assert probs.shape == logits.shape
    assert torch.allclose(probs.sum(-1), torch.ones(3, 5))
    assert ((probs > 0).sum(-1) <= 10).all() and ((probs > 0).sum(-1) >= 1).all()


def test_sample_follows_probs_and_seed():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    g = make_generator(0)
    draws = torch.tensor([sample(probs, g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert freq[1] == 0 and (freq - probs).abs().max() < 0.03
    a = [sample(probs, make_generator(7)) for _ in range(3)]
    assert a == [sample(probs, make_generator(7)) for _ in range(3)]
    assert make_generator(None) is None


# Temperature, then top-k, then top-p (Hugging Face `generate`'s warper order). Logits / 0.5 are
# [4, 3, 2, 1, 0]; top-3 renormalised is [0.6652, 0.2447, 0.0900], whose first two hold 0.9099 >= 0.9,
# so top-p 0.9 keeps two: [e^4, e^3] / (e^4 + e^3) = [0.7311, 0.2689]. Top-p before top-k (0.8808 < 0.9
# on the full softmax keeps three) or temperature last (top-p on the unsharpened logits) keep three.
ORDER_CASES = [
    (
        [2.0, 1.5, 1.0, 0.5, 0.0],
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9),
        [0.7311, 0.2689, 0.0, 0.0, 0.0],
    ),
    # Logits / 0.5 = [5, 4, 2, 1, 0]: top-3 renormalised puts 0.7054 >= 0.7 on the argmax, so only it
    # stays; top-p on the full softmax (0.6932 < 0.7) or before the temperature keeps two.
    (
        [2.5, 2.0, 1.0, 0.5, 0.0],
        SamplingParams(temperature=0.5, top_k=3, top_p=0.7),
        [1.0, 0.0, 0.0, 0.0, 0.0],
    ),
]


def hf_warped(logits: torch.Tensor, params: SamplingParams, order: str = "TKP") -> torch.Tensor:
    """Probs [V] after Hugging Face's own warpers, applied in `order` (T = temperature, K, P)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = {
        "T": TemperatureLogitsWarper(params.temperature),
        "K": TopKLogitsWarper(params.top_k),
        "P": TopPLogitsWarper(params.top_p),
    }
    scores = logits[None].clone()  # [1, V]
    for name in order:
        scores = warpers[name](torch.zeros(1, 1, dtype=torch.long), scores)
    return torch.softmax(scores, -1)[0]


@PROBS
@pytest.mark.parametrize(("logits", "params", "expected"), ORDER_CASES)
def test_temperature_then_top_k_then_top_p(probs_of, logits, params, expected):
    logits, expected = torch.tensor(logits), torch.tensor(expected)
    probs = probs_of(logits, params)
    torch.testing.assert_close(probs, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(probs, hf_warped(logits, params, "TKP"), atol=1e-6, rtol=0)
    for wrong in ("TPK", "KPT", "PKT"):  # the case has teeth: any other order gives another answer
        assert not torch.allclose(hf_warped(logits, params, wrong), expected, atol=1e-3)


@pytest.mark.parametrize(("logits", "params", "expected"), ORDER_CASES)
def test_order_matches_hugging_face_generate(tiny_llama, logits, params, expected):
    """HF `generate` itself (whatever order it uses): its processed scores give our distribution."""
    model = tiny_llama(16, layers=1, hidden=16, seed=0)
    prompt = torch.tensor([[3, 1, 4]])
    wanted = torch.full((16,), -30.0)  # [V]: the case on tokens 0..4, the rest negligible
    wanted[:5] = torch.tensor(logits)
    with torch.no_grad():  # lm_head = wanted (x) h / |h|^2 makes the last logits exactly `wanted`
        h = model(prompt, output_hidden_states=True).hidden_states[-1][0, -1]  # [H], after the final norm
        model.lm_head.weight.copy_(wanted[:, None] * (h / h.dot(h))[None])
    out = model.generate(
        prompt,
        do_sample=True,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        max_new_tokens=1,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    raw, processed = out.logits[0][0], out.scores[0][0]  # [V] each
    torch.testing.assert_close(raw, wanted, atol=1e-4, rtol=0)
    torch.testing.assert_close(target_probs(raw, params), torch.softmax(processed, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(target_probs(raw, params)[:5], torch.tensor(expected), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_argmax_ids_equals_torch_argmax_ties_and_nans_included(dtype):
    """The host argmax (numpy on a CPU where it can) picks what torch.argmax picks: first max on ties, a
    NaN as the max; rows [N, V] -> list, one row [V] -> int; views and bfloat16 (no numpy) too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (9, 64), generator=g).to(dtype)  # many ties
    x[3, 10] = float("nan")
    x[4] = float("-inf")
    x[5, 7] = x[5, 40] = 9.0  # two maxima: the first wins
    rows = argmax_ids(x)
    assert isinstance(rows, list) and rows == x.argmax(-1).tolist()
    assert rows[3] == 10 and rows[4] == 0 and rows[5] == 7
    one = argmax_ids(x[5])
    assert isinstance(one, int) and one == 7
    view = x.t().contiguous().t()  # column-major strides
    assert argmax_ids(view) == rows and argmax_ids(x[:, ::2]) == x[:, ::2].argmax(-1).tolist()
    leaf = x.float().requires_grad_()
    assert argmax_ids(leaf) == leaf.argmax(-1).tolist()


def stable_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p keep mask [..., V] by the definition: a stable descending sort, the positions whose mass
    before them is < top_p (the first always), scattered back to the ids."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_p, -1) - sorted_p < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.99, 0.999999])
@pytest.mark.parametrize(
    "scale", [0.1, 1.0, 4.0]
)  # flat rows (a nucleus past 64 and 1024 ids) to peaked ones
def test_nucleus_equals_a_stable_sort_of_the_whole_row(top_p, scale):
    """`nucleus` reads a top-k before it sorts a whole row: every row, whichever the number of ids it
    keeps, gets the mask of the definition (V = 3000: the guesses of 64 and 1024 and the whole sort)."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(7, 3000, generator=g) * scale, -1)  # [N, V]
    kept = stable_sort_nucleus(probs, top_p)
    assert torch.equal(nucleus(probs, top_p), kept)
    for row in range(7):  # one row at a time: what an acceptance walk reads (torch, then numpy)
        assert torch.equal(nucleus(probs[row], top_p), kept[row])
        assert host_nucleus(probs[row].numpy(), top_p).tolist() == kept[row].tolist()


@pytest.mark.parametrize("top_p", [0.2, 0.5, 0.8, 0.95])
def test_nucleus_keeps_the_lowest_ids_of_a_tie_at_its_edge(top_p):
    """Probabilities in a few levels (as bf16 logits give): the edge of the nucleus falls inside a tie,
    and the ids kept there are the lowest, as a stable sort orders them."""
    g = torch.Generator().manual_seed(1)
    levels = torch.tensor([0.0, 1.0, 2.0, 3.0])
    logits = levels[torch.randint(0, 4, (5, 500), generator=g)]  # [N, V]: ties everywhere
    probs = torch.softmax(logits, -1)
    mask = nucleus(probs, top_p)
    assert torch.equal(mask, stable_sort_nucleus(probs, top_p))
    assert [host_nucleus(row.numpy(), top_p).tolist() for row in probs] == mask.tolist()
    edge = [bool(((probs[r] == probs[r][mask[r]].min()) & ~mask[r]).any()) for r in range(5)]
    assert any(edge)  # the case has teeth: some row leaves part of a tie out


def test_sample_never_draws_an_id_of_zero_mass_and_refuses_no_mass():
    """The inverse-CDF draw: ids of zero mass (leading, inner, trailing) are never drawn, a single id of
    mass is always drawn, and probs without a positive finite mass are refused in one line."""
    g = make_generator(3)
    probs = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.75, 0.0])
    draws = {sample(probs, g) for _ in range(2000)}
    assert draws == {1, 4}
    assert {sample(torch.tensor([0.0, 0.0, 1e-30, 0.0]), g) for _ in range(50)} == {2}
    for bad in ([0.0, 0.0], [0.5, float("nan")], [float("inf"), 1.0]):
        with pytest.raises(ValueError, match="positive finite mass"):
            sample(torch.tensor(bad), g)


@pytest.mark.parametrize("seed", range(5))
def test_target_rows_are_the_rows_of_target_probs(seed):
    """`TargetRows` (each row computed when read) walks a tree exactly as the whole [N, V] probs do: the
    same coins give the same path and next token, row by row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 300, generator=g) * 2  # [N, V]
    params = SamplingParams(temperature=0.8, top_k=100, top_p=0.9)
    rows = TargetRows(logits, params)
    assert rows.shape == logits.shape and rows.device == logits.device
    for node in range(6):
        assert torch.equal(rows[node], target_probs(logits, params)[node])
    tree = TokenTree(torch.tensor([5, 7, 9, 7, 1, 2]), torch.tensor([-1, 0, 0, 1, 3, 3]))
    whole = target_probs(logits, params)
    tree.tokens[1:] = torch.stack([whole[0].argmax(), whole[0].argsort()[-2], whole[1].argmax(),
                                   whole[3].argmax(), whole[3].argsort()[-2]])  # fmt: skip
    for coins in range(20):
        a = sample_accept(tree, rows, "deterministic", generator=make_generator(coins))
        b = sample_accept(tree, whole, "deterministic", generator=make_generator(coins))
        assert (a.path, a.next_token) == (b.path, b.next_token)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=50),
        SamplingParams(temperature=0.5, top_k=200, top_p=0.95),
        SamplingParams(temperature=1.0, top_p=0.999),  # a nucleus past the guesses of 64 and 1024
    ],
)
def test_host_probs_are_torch_probs(dtype, params):
    """The CPU's numpy rows and the torch path (every other device) give one distribution: the same
    kept ids, probabilities equal up to fp32 rounding, in any leading shape and input dtype."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 3, 3000, generator=g) * torch.tensor([0.3, 2.0, 6.0])[:, None]).to(dtype)
    logits[0, 0, 100:110] = logits[0, 0, 5]  # a tie, at the k-th value or the nucleus's edge
    host, dev = target_probs(logits, params), torch_probs(logits, params)  # [2, 3, V]
    assert host.shape == dev.shape == logits.shape and host.dtype == dev.dtype == torch.float32
    assert torch.equal(host > 0, dev > 0)
    torch.testing.assert_close(host, dev, atol=1e-6, rtol=1e-5)
    for i in range(3):  # one row is a row of the whole
        assert torch.equal(target_probs(logits[1, i], params), host[1, i])


@pytest.mark.parametrize("rule", ["deterministic", "iid", "without_replacement"])
def test_host_walk_is_the_torch_walk(rule):
    """The acceptance walk over numpy rows (a CPU's) and over torch rows (every other device's) accept
    the same path and next token with the same coins, on a branched tree."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(7, 40, generator=g) * 3  # [N, V]
    p = torch.softmax(logits, -1)  # [N, V]
    q = torch.softmax(logits + torch.randn(7, 40, generator=g), -1)  # [N, V]: a draft near p
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2])  # [N]
    seen = set()
    for trial in range(60):
        draws = {
            node: torch.multinomial(q[node], 3, replacement=rule == "iid", generator=g) for node in (0, 1, 2)
        }
        picks = [draws[0][0], draws[0][1], draws[0][2], draws[1][0], draws[1][1], draws[2][0]]  # [N - 1]
        tree = TokenTree(torch.stack([torch.tensor(0), *picks]), parents)
        a = walk(tree, p, rule, q, make_generator(trial), host=True)
        b = walk(tree, p, rule, q, make_generator(trial), host=False)
        assert (a.path, a.next_token, a.path_tokens) == (b.path, b.next_token, b.path_tokens)
        seen.add(len(a.path))
    assert len(seen) >= 3  # paths of several lengths: rejections and acceptances both walked
