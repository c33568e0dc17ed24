"""The static tree follows the batch: with the head's accuracy table, generate_batch re-picks the tree for
its batch size by measuring this device (loading.drafter_for_batch, once per size), times it as it compiles it,
and decodes plain when no tree pays."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.drafters import eagle as eagle_module
from spechead.inference.drafters.eagle.graphs import GraphRows
from spechead.inference.generator import SpeculativeGenerator

from ..test_batch import MAX_NEW, PROMPTS
from ..test_generator import medusa_drafter
from .test_batch_drafters import build


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)  # (test_batch_drafters' target)
    model.generation_config.eos_token_id = None
    return model


def test_tree_follows_the_batch(model, chatml_tokenizer):
    """With an accuracy table, generate_batch re-picks the static tree for the batch size by measuring
    here (once per size); greedy rows still equal HF greedy; tree_for_batch=False keeps the batch-1
    tree and so the batch-1 sampling draws."""
    from ..test_generator import plain_greedy

    drafter = medusa_drafter(model)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, cache="static")
    gen.tree_accuracy = torch.tensor([[0.97, 0.02, 0.01]] * 3)  # drafting surely pays
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    info = gen.batch_calibration[len(PROMPTS)]
    used = gen._batch_drafters[len(PROMPTS)]
    assert used.tree.size == len(info["choices"]) + 1 <= 64 // len(PROMPTS) + 1
    assert max(info["verify_ms_by_size"]) <= 64 // len(PROMPTS) + 1 and info["expected_speedup"] > 0
    assert info["batch"] == len(PROMPTS)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert batch[b].token_ids == plain_greedy(model, prompt, n)
        assert batch[b].stats.drafted_tokens == len(info["choices"]) * len(batch[b].stats.accept_lengths)
    gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)  # measured once per batch size
    assert list(gen.batch_calibration) == [len(PROMPTS)]
    kw = {"temperature": 0.9, "top_k": 20, "seed": [1, 2, 3, 4], "max_new_tokens": MAX_NEW}
    same_tree = gen.generate_batch(input_ids=PROMPTS, tree_for_batch=False, **kw)
    for b, prompt in enumerate(PROMPTS):
        single = gen.generate(
            input_ids=prompt, max_new_tokens=MAX_NEW[b], temperature=0.9, top_k=20, seed=b + 1
        )
        assert same_tree[b].token_ids == single.token_ids
        assert same_tree[b].stats.drafted_tokens == single.stats.drafted_tokens


def test_batch_tree_is_the_one_decoded_fastest_at_that_size(model, chatml_tokenizer, monkeypatch):
    """The part-by-part costs rank the batch trees; the one whose batched passes pay best is used (the
    timings are fixed here: the last candidate's pass 10x cheaper), timed at the batch's own size."""
    import spechead.inference.tuning.pass_timing as pass_timing

    seen = []

    def timed(target, drafters, prompt, new_tokens=32, batch=1, timed_as=None):
        seen.append((batch, [d.tree.size if d else 1 for d in drafters]))
        return [5.0] * (len(drafters) - 1) + [0.5]

    monkeypatch.setattr(pass_timing, "pass_ms_by_drafter", timed)
    gen = SpeculativeGenerator(model, chatml_tokenizer, medusa_drafter(model), cache="static")
    gen.tree_accuracy = torch.tensor([[0.97, 0.02, 0.01]] * 3)
    gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    info = gen.batch_calibration[len(PROMPTS)]
    ((batch, sizes),) = seen
    assert batch == len(PROMPTS) and sizes[0] == 1 and len(sizes) >= 3  # plain decoding, then the trees
    assert info["in_situ"]["candidates"][-1] == info["choices"]
    assert gen._batch_drafters[len(PROMPTS)].tree.size == sizes[-1]


def test_batch_decodes_plain_when_no_tree_pays(model, chatml_tokenizer, monkeypatch):
    """A head that is never right: no tree beats plain batched decoding, so the batch decodes plain. The
    decoded passes' timings are fixed (a tree's pass 10% dearer than a plain one): measured on a busy
    2-core VM, a tree's pass once timed below a plain pass and, at 1.001 tokens a pass, was picked."""
    import spechead.inference.tuning.pass_timing as pass_timing

    from ..test_generator import plain_greedy

    def timed(target, drafters, prompt, new_tokens=32, batch=1, timed_as=None):
        return [1.0] + [1.1] * (len(drafters) - 1)  # plain first, then each tree

    monkeypatch.setattr(pass_timing, "pass_ms_by_drafter", timed)
    drafter = medusa_drafter(model)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, cache="static")
    gen.tree_accuracy = torch.full((3, 3), 0.001)
    batch = gen.generate_batch(input_ids=PROMPTS[:2], max_new_tokens=MAX_NEW[:2])
    assert gen.batch_calibration[2]["choices"] == [] and gen.batch_calibration[2]["expected_speedup"] < 1
    for b in range(2):
        assert batch[b].token_ids == plain_greedy(model, PROMPTS[b], MAX_NEW[b])
        assert batch[b].stats.drafted_tokens == 0


@pytest.mark.parametrize("compile", [None, "graphs"])
def test_batch_tree_for_an_eagle_head(model, chatml_tokenizer, compile):
    """EAGLE: the batched head step is timed per depth; the static tree found is drafted and verified
    for every row (greedy rows equal HF greedy). A compiled drafter's tree for the batch is compiled
    likewise and drafts every row as fixed-shape graphs (forced here: by default on CUDA only)."""
    from ..test_generator import plain_greedy

    drafter = build(model, "eagle3_static")
    drafter.batch_graphs = bool(compile)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, cache="static", draft_compile=compile)
    gen.tree_accuracy = torch.tensor([[0.97, 0.02]] * 4)
    for _ in range(3):  # timed here: on a loaded CPU the tiny target's plain pass can win; time it again
        batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
        if gen.batch_calibration[len(PROMPTS)]["choices"]:
            break
        gen.batch_calibration.clear()
    info = gen.batch_calibration[len(PROMPTS)]
    used = gen._batch_drafters[len(PROMPTS)]._rows  # where its rows were drafted
    assert isinstance(used, GraphRows) == bool(compile), type(used)
    assert info["draft_ms_per_depth"] > 0 and "draft_ms" not in info and info["choices"]
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert batch[b].token_ids == plain_greedy(model, prompt, n)
        assert batch[b].stats.drafted_tokens == len(info["choices"]) * len(batch[b].stats.accept_lengths)


def test_batch_trees_are_timed_as_generate_batch_compiles_them(model, chatml_tokenizer, monkeypatch):
    """A compiled generator's batch calibration times its batch passes on fixed-shape runners (fixed
    physical rows: `capacity`), the verify by size and the in-situ passes; a compiled drafter (CUDA: the whole
    batch draft one graph) is timed per depth as its chains of 1 and 4 drafted compiled."""
    from spechead.inference.loading import drafter_for_batch
    from spechead.inference.target import runner as runner_module
    from spechead.inference.tuning.calibrate import TimedAs, calibrated_choices

    from ..test_generator import plain_greedy

    runners, compiled, capacities = [], [], []
    init, use_compile = runner_module.TargetRunner.__init__, eagle_module.EagleDrafter.use_compile

    def counted(self, *a, **kw):  # the runners of fixed physical rows (batch passes), not a batch of one's
        if kw.get("capacity") is not None:
            runners.append(kw["compile"])
            capacities.append(kw["capacity"])
        init(self, *a, **kw)

    monkeypatch.setattr(runner_module.TargetRunner, "__init__", counted)
    monkeypatch.setattr(
        eagle_module.EagleDrafter,
        "use_compile",
        lambda self, mode: (compiled.append(mode), use_compile(self, mode))[1],
    )
    accuracy = torch.tensor([[0.97, 0.02]] * 4)
    graphs = TimedAs("graphs", "graphs")
    _, info = calibrated_choices(model, build(model, "eagle3_static"), accuracy, 16, graphs, batch=4)
    # the verify; the chains of 1 and 4, and the accept step's graph
    assert runners == ["graphs"] and compiled == ["graphs"] * 3 and capacities == [4]  # 4 rows verified
    assert info["timed_as"] == {"target": "graphs", "draft": "graphs"} and info["draft_ms_per_depth"] >= 0
    runners.clear()
    found, info = drafter_for_batch(model, build(model, "eagle3_static"), accuracy, 4, "graphs", "graphs")
    # the verify; the in-situ passes of plain decoding and of the trees (one kept runner per layers)
    assert runners == ["graphs"] * 3 and info["in_situ"]["pass_ms"]
    runners.clear()
    gen = SpeculativeGenerator(model, chatml_tokenizer, build(model, "eagle3_static"), compile="graphs")
    gen.tree_accuracy = accuracy
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    assert gen.batch_calibration[len(PROMPTS)]["timed_as"] == {"target": "graphs", "draft": False}  # (a CPU)
    assert (
        runners == ["graphs"] * 5
    )  # the calibration's three; the generator's batch-of-one and 4-row runners
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert batch[b].token_ids == plain_greedy(model, prompt, n)
