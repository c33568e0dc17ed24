"""Draft-model token trees (SpecInfer): the draft cache under tree masks reproduces sequential draft runs,
greedy output equals plain decoding for every shape, and sampled output follows the target's exact
distribution under rules A, B and C (children drawn i.i.d. or without replacement from the draft)."""

from __future__ import annotations

import copy

import pytest
import torch

from spechead.inference.drafter_specs import drafter_options
from spechead.inference.drafters.draft_model import DraftModelDrafter, parse_width, width_tree
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams, target_probs
from spechead.inference.tree import children, path_to_node

from ..distributions import sampling_tv
from ..trees import depths

SHAPES = {
    "chain": {"num_draft": 4},
    "widths": {"width": "3x2x2x1"},
    "k_and_depth": {"width": 2, "depth": 3},
    "choices": {"tree": [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [1, 0, 0]]},
    "dynamic": {"tree": "dynamic", "top_k": 3, "depth": 4, "total_tokens": 10},
}


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


def perturbed(model, noise: float = 0.004):
    """A draft model close to the target (its argmax is often another of the target's top few)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        weight = other.lm_head.weight
        weight.add_(noise * torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)))
    return other


def sharpened(model, scale: float):
    """The model with its lm_head scaled: the same ranking, a sharper (scale > 1) distribution."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.mul_(scale)
    return other


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def prompts(n: int, vocab: int, longest: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest, (n,), generator=g).tolist()
    return [torch.randint(5, vocab, (k,), generator=g).tolist() for k in lengths]


# ---- the drafter itself ---------------------------------------------------------------------------


def test_width_shapes_and_bad_options(setup):
    model, _ = setup
    assert parse_width("4x2x2x1") == [4, 2, 2, 1] and parse_width(3) == [3] and parse_width([2, 1]) == [2, 1]
    shape = width_tree([3, 2, 1])
    assert shape.size == 1 + 3 + 6 + 6 and shape.depth.tolist()[-1] == 3
    assert DraftModelDrafter(model).rule == "iid"  # the chain keeps its rule B default
    assert DraftModelDrafter(model, width="2x2").rule == "without_replacement"
    # the tree scratch the runner reserves (the default 64 is too small for these)
    assert DraftModelDrafter(model, width="4x4x4").max_nodes == 1 + 4 + 16 + 64
    assert DraftModelDrafter(model, tree="dynamic", total_tokens=100).max_nodes == 100
    for kwargs, needle in [
        ({"width": "4x0"}, "width"),
        ({"width": "4,2"}, "width"),
        ({"width": True}, "width must be ints"),  # a bool is no int here (was a TypeError from list())
        ({"width": 2.5}, "width must be ints"),
        ({"width": [2, 2], "depth": 3}, "depth"),
        ({"width": 8, "depth": 5}, "draft nodes"),
        ({"rule": "typical"}, "rule"),
        ({"tree": "dynamic", "rule": "without_replacement"}, "deterministic"),
        ({"tree": "static"}, "dynamic"),
    ]:
        with pytest.raises(ValueError, match=needle):
            DraftModelDrafter(model, **kwargs)


def test_flash_attention_draft_models_draft_chains_only(setup):
    """A flash kernel takes no arbitrary 4D mask: a tree (static or dynamic) is refused, a chain is not."""
    draft = copy.deepcopy(setup[0])
    draft.config._attn_implementation = "flash_attention_2"  # (set directly: the kernel needs a GPU)
    assert DraftModelDrafter(draft, num_draft=4).max_nodes == 5
    for kwargs in ({"width": "2x1"}, {"tree": "dynamic"}):
        with pytest.raises(ValueError, match=r"a draft-model tree needs arbitrary 4D masks; .*'flash"):
            DraftModelDrafter(draft, **kwargs)


def _check_against_sequential(draft, drafter, context: list[int], sampling: SamplingParams, generator):
    """propose() from `context` (prompt + root, the root last); every node with children must carry the
    draft's distribution on its own path (the tree-masked cache vs a plain sequential run)."""
    out = drafter.propose(context[-1], sampling, generator)
    tree, kids = out.tree, children(out.tree.parents)
    assert 4 < tree.size <= drafter.max_nodes  # the runner reserves max_nodes of tree scratch
    with torch.no_grad():
        for node in range(tree.size):
            if not kids[node]:
                continue
            path = tree.tokens[path_to_node(tree.parents, node)[1:]].tolist()
            logits = draft(torch.tensor([context + path])).logits[0, -1]  # [V]
            if out.q is not None:  # rules B/C: q row = the distribution the children were drawn from
                want = torch.log(target_probs(logits, sampling))  # log q: sensitive to small logit errors
                torch.testing.assert_close(out.q[node].log(), want, atol=1e-4, rtol=0)
            else:  # top-k children, in rank order
                want = logits.topk(len(kids[node])).indices.tolist()
                if drafter.shape is None:  # a dynamic tree's beam keeps a subset of the top_k
                    assert set(tree.tokens[kids[node]].tolist()) <= set(
                        logits.topk(drafter.top_k).indices.tolist()
                    )
                else:
                    assert tree.tokens[kids[node]].tolist() == want, f"node {node}"
    return out


def test_a_dynamic_tree_expands_the_best_scored_nodes(setup):
    """EAGLE-2's beam: at every depth exactly the top_k nodes of highest cumulative draft log-prob get
    children (total_tokens keeps every drafted node; scores from sequential draft runs)."""
    model, _ = setup
    draft = perturbed(model)
    drafter = DraftModelDrafter(draft, tree="dynamic", top_k=3, depth=3, total_tokens=40)
    prompt = prompts(1, model.config.vocab_size)[0] + list(range(20, 30))
    drafter.start(torch.tensor(prompt[:-1]), {}, prompt[-1])
    tree = drafter.propose(prompt[-1], SamplingParams(), None).tree
    assert tree.size == 1 + 3 + 9 + 9
    kids, depth, score = children(tree.parents), depths(tree.parents).tolist(), [0.0]
    with torch.no_grad():
        for node in range(1, tree.size):  # parents first
            parent = int(tree.parents[node])
            path = tree.tokens[path_to_node(tree.parents, parent)[1:]].tolist()
            logp = torch.log_softmax(draft(torch.tensor([prompt + path])).logits[0, -1], -1)
            score.append(score[parent] + float(logp[tree.tokens[node]]))
    for d in (1, 2):
        level = [n for n in range(tree.size) if depth[n] == d]
        best = sorted(level, key=lambda n: -score[n])[:3]
        assert {n for n in level if kids[n]} == set(best), f"depth {d}"


@pytest.mark.parametrize(
    ("shape", "temperature"),
    [("widths", 0.0), ("widths", 1.0), ("choices", 0.0), ("dynamic", 0.0), ("k_and_depth", 1.0)],
)
def test_tree_nodes_match_sequential_draft_runs(setup, shape, temperature):
    """Tree mask, position ids (long prompts, so rotary positions matter) and the crop back to the
    committed tokens: several propose/accept rounds, each node checked against a sequential run."""
    model, _ = setup
    # sharpened: a wrong rotary position moves this tiny model's logits by ~4e-3 (by ~2e-4 unscaled)
    draft = sharpened(perturbed(model), 20.0)
    drafter = DraftModelDrafter(draft, **SHAPES[shape])
    sampling = SamplingParams(temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    prompt = prompts(1, model.config.vocab_size, longest=40)[0] + list(range(20, 50))
    drafter.start(torch.tensor(prompt[:-1]), {}, prompt[-1])
    context = list(prompt)
    for step in range(3):
        out = _check_against_sequential(draft, drafter, context, sampling, generator)
        # accept the path to the deepest node of the LAST branch (not the first rows), then a new root
        leaf = max(range(out.tree.size), key=lambda i: (len(path_to_node(out.tree.parents, i)), i))
        path = path_to_node(out.tree.parents, leaf)
        accepted = out.tree.tokens[path[: 2 + step % 2]]  # root + 1 or 2 drafts
        next_root = 100 + step
        drafter.accept(accepted, {}, next_root)
        context += accepted[1:].tolist() + [next_root]


def test_options_reach_the_drafter_from_a_spec(tiny_target_dir):
    """`--drafter NAME=DRAFT@width=...,rule=...` (benchmark) and from_pretrained keyword options."""
    path, options = drafter_options(f"{tiny_target_dir}@width=3x2,rule=without_replacement,num_draft=2")
    assert options == {"width": "3x2", "rule": "without_replacement", "num_draft": 2}
    with pytest.raises(ValueError, match="width per depth"):
        drafter_options("d@rule=without-replacement")
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), path, **options)
    assert gen.drafter.rule == "without_replacement" and gen.drafter.shape.size == 1 + 3 + 6
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    assert (
        gen.generate("hello", max_new_tokens=6).token_ids
        == plain.generate("hello", max_new_tokens=6).token_ids
    )
    with pytest.raises(ValueError, match="unknown option.*valid: num_draft, width"):
        SpeculativeGenerator.from_pretrained(str(tiny_target_dir), path, widht=2)


# ---- greedy: exactly plain decoding ---------------------------------------------------------------


def test_greedy_trees_equal_plain_decoding(setup):
    model, tok = setup
    draft = perturbed(model)
    taus = {name: [] for name in SHAPES}
    for i, prompt in enumerate(prompts(20, model.config.vocab_size)):
        n = 12 + i % 7
        reference = plain_greedy(model, prompt, n)
        for name, options in SHAPES.items():
            gen = SpeculativeGenerator(model, tok, DraftModelDrafter(draft, **options))
            gen.eos = set()
            result = gen.generate(input_ids=prompt, max_new_tokens=n)
            assert result.token_ids == reference, f"{name} on prompt {i}"
            taus[name].append(result.stats.tau)
    mean = {name: sum(v) / len(v) for name, v in taus.items()}
    assert mean["widths"] > mean["chain"] + 0.5, mean  # siblings below rank 0 are accepted


def test_greedy_stops_at_eos_and_max_new_tokens_inside_a_draft(setup):
    model, tok = setup
    for i, prompt in enumerate(prompts(6, model.config.vocab_size)):
        reference = plain_greedy(model, prompt, 24)
        eos = reference[3 + i % 4]  # pretend this token is EOS: generation must stop at its first use
        stop = reference.index(eos)
        for name, options in SHAPES.items():
            # the target drafting for itself: every draft is accepted, so EOS lands inside a draft
            gen = SpeculativeGenerator(model, tok, DraftModelDrafter(model, **options))
            gen.eos = {eos}
            assert gen.generate(input_ids=prompt, max_new_tokens=24).token_ids == reference[: stop + 1], name
            gen.eos = set()
            full = gen.generate(input_ids=prompt, max_new_tokens=24)
            if name != "dynamic":  # the draft cache follows the accepted tokens: every path is accepted
                assert all(a == gen.drafter.depth + 1 for a in full.stats.accept_lengths[:-1]), name
            for n in (1, 2, 3, 6):
                assert gen.generate(input_ids=prompt, max_new_tokens=n).token_ids == reference[:n], (name, n)


# ---- sampling: exactly the target's distribution ---------------------------------------------------

PROMPT = [7, 9, 7, 9, 7]
PARAMS = SamplingParams(temperature=1.0, top_k=3)


def passes_per_token(gen: SpeculativeGenerator) -> float:
    """Target passes per emitted token over a few longer sampled runs (1.0 = no draft ever accepted)."""
    runs = [
        gen.generate(input_ids=PROMPT, max_new_tokens=12, temperature=1.0, top_k=3, seed=s) for s in range(10)
    ]
    return sum(r.stats.target_passes for r in runs) / sum(r.stats.new_tokens - 1 for r in runs)


@pytest.fixture(scope="module")
def peaked(setup):
    """A target whose top-3 distribution is not flat (p ~ .41/.34/.25 at PROMPT) and a draft with the
    same ranking but much sharper (q ~ .79/.19/.02): q and p differ, on the same support."""
    model, tok = setup
    target = sharpened(model, 20.0)
    return target, tok, sharpened(model, 150.0)


@pytest.mark.parametrize(
    ("options", "rule", "trials", "bound"),
    [
        # C: rule C verified without its q update (= rule B on these children) lands near TV 0.10
        ({"width": "3x3"}, "without_replacement", 1200, 0.065),
        ({"width": "2x2", "rule": "iid"}, "iid", 600, 0.09),  # B
        ({"tree": "dynamic", "top_k": 3, "depth": 2, "total_tokens": 8}, "deterministic", 400, 0.1),  # A
    ],
)
def test_sampling_matches_the_target_distribution(peaked, options, rule, trials, bound):
    """9 outcomes: sampling noise gives TV about 0.03 at 1200 samples, 0.04 at 600, 0.05 at 400."""
    target, tok, draft = peaked
    drafter = DraftModelDrafter(draft, **options)
    assert drafter.rule == rule
    gen = SpeculativeGenerator(target, tok, drafter)
    assert passes_per_token(gen) < 0.8, "too few drafts accepted for the check to exercise the rule"
    tv = sampling_tv(gen, PROMPT, PARAMS, trials)
    assert tv < bound, f"{options}: TV {tv:.3f}"
