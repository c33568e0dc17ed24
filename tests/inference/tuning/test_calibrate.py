"""The tree follows the hardware: from_pretrained times verify/draft costs on this device and picks the
static tree with the best expected speedup for the accuracy table saved with the head."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from spechead.heads import Eagle3Config, Eagle3Head
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tree import tree_from_choices
from spechead.inference.tuning.calibrate import (
    EAGER,
    TimedAs,
    best_for_costs,
    calibrated_choices,
    fit_accuracy,
    saved_accuracy,
    spread,
)
from spechead.inference.tuning.tree_search import expected_accept_length, ranked_choices_for_cost


def test_expensive_verification_gives_a_small_tree():
    accuracy = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.5, 0.1, 0.1]])
    flat = {1: 10.0, 64: 10.5}  # a GPU: 64 nodes cost about one step
    steep = {1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0, 16: 40.0, 64: 160.0}  # a CPU
    big, _ = ranked_choices_for_cost(accuracy, flat, 10.0, draft_ms_per_depth=1.0)[0]
    small, _ = ranked_choices_for_cost(accuracy, steep, 10.0, draft_ms_per_depth=1.0)[0]
    assert len(small) < len(big)


ACCURACY = [[0.7, 0.2, 0.05], [0.6, 0.2, 0.05], [0.6, 0.1, 0.05]]


def saved_head(target_dir, path, accuracy: list[list[float]]) -> None:
    """A seeded EAGLE-3 head for the target at `target_dir`, saved at `path` with a tree.json ([[0]])."""
    config = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, config.num_hidden_layers]))
    head.save_pretrained(path)
    (path / "tree.json").write_text(json.dumps({"choices": [[0]], "accuracy": accuracy}))


def test_from_pretrained_calibrates_the_saved_tree(tiny_target_dir, tmp_path):
    accuracy = ACCURACY
    saved_head(tiny_target_dir, tmp_path / "head", accuracy)
    assert saved_accuracy(tmp_path / "head").shape == (3, 3)
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"))
    assert (
        gen.target.config._attn_implementation == "spechead_sdpa"
    )  # (heads/attention.py; plain below: sdpa)
    info = gen.calibration
    assert info is not None and set(info["verify_ms_by_size"]) >= {1, 2, 4, 8}
    assert gen.compile is False and info["timed_as"] == {
        "target": False,
        "draft": False,
    }  # auto: a CPU's eager
    assert info["draft_ms_per_depth"] > 0 and info["expected_speedup"] > 0
    # every pass also pays the target's commit and the head's accept step: in the expected speedup
    assert info["pass_ms"] > 0
    _, again = ranked_choices_for_cost(torch.tensor(accuracy).float(), info["verify_ms_by_size"], info["step_ms"],
                                     draft_ms_per_depth=info["draft_ms_per_depth"], pass_ms=info["pass_ms"])[0]  # fmt: skip
    assert again == pytest.approx(info["model_speedup"])  # the part-by-part costs; pass_timing.py decodes
    tree_from_choices(info["choices"])  # a valid tree, and the one the drafter uses
    assert gen.drafter._static.size == len(info["choices"]) + 1
    prompt = [5, 9, 11, 7]
    plain = AutoModelForCausalLM.from_pretrained(tiny_target_dir).generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 4:]
    gen.eos = set()
    assert gen.generate(input_ids=prompt, max_new_tokens=12).token_ids == plain.tolist()
    off = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"), calibrate=False)
    assert off.calibration is None and off.drafter._static.size == 2  # the saved [[0]]
    chosen, _ = calibrated_choices(gen.target, gen.drafter, torch.tensor(accuracy), max_nodes=4)
    assert 1 <= len(chosen) <= 4


def test_an_eagle_head_without_a_table_gets_a_cpu_sized_tree(tiny_target_dir, tmp_path):
    config = AutoConfig.from_pretrained(tiny_target_dir)
    Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, 3])).save_pretrained(tmp_path / "h")
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"))
    assert gen.calibration["accuracy_source"].startswith("assumed")
    assert gen.drafter._static is not None  # a measured static tree, not the GPU-sized dynamic default
    assert gen.drafter.rule == "deterministic"
    drawn = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), str(tmp_path / "h"), rule="without_replacement"
    )
    assert drawn.calibration is not None and drawn.drafter.rule == "without_replacement"  # kept through it
    with pytest.raises(ValueError, match='rule must be "without_replacement" or "deterministic"'):
        SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"), rule="iid")
    dynamic = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"), tree="dynamic")
    assert dynamic.calibration is None and dynamic.drafter._static is None


# The demo EAGLE-3 head's table and tree (scripts/build_tree.py on 32 demo-tune prompts: expected accept
# length 4.10, measured tau 3.65 with that tree) and this CPU's costs measured at load (ms).
DEMO_ACCURACY = [[0.739, 0.099, 0.031, 0.021], [0.740, 0.092, 0.030, 0.024], [0.751, 0.088, 0.034, 0.025],
                 [0.734, 0.088, 0.044, 0.026], [0.725, 0.087, 0.035, 0.020], [0.702, 0.096, 0.038, 0.025],
                 [0.667, 0.105, 0.046, 0.028]]  # fmt: skip
DEMO_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0],
             [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0],
             [1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]  # fmt: skip
CPU_COSTS = {"verify_ms_by_size": {1: 3.67, 2: 4.53, 4: 4.57, 8: 4.57, 12: 4.84, 16: 4.96, 24: 5.6, 32: 6.06,
                                   48: 7.16, 64: 8.19},
             "step_ms": 3.67, "draft_ms_per_depth": 0.70, "pass_ms": 0.73}  # fmt: skip


def test_fit_accuracy_matches_the_measured_tau():
    accuracy = torch.tensor(DEMO_ACCURACY, dtype=torch.float64)
    assert expected_accept_length(accuracy, DEMO_TREE) == pytest.approx(4.10, abs=0.01)
    fitted = fit_accuracy(accuracy, DEMO_TREE, 3.65)
    assert expected_accept_length(fitted, DEMO_TREE) == pytest.approx(3.65, abs=1e-4)
    assert torch.allclose(fitted / accuracy, (fitted / accuracy)[0, 0].expand_as(accuracy))  # one factor
    # a tau above what any scaling allows: every depth's total capped at 1
    capped = fit_accuracy(accuracy, DEMO_TREE, 50.0)
    assert float(capped.sum(-1).max()) == pytest.approx(1.0)
    assert torch.equal(fit_accuracy(accuracy, [[0] * 8], 2.0), accuracy)  # a tree the table cannot cover


def test_a_measured_tau_makes_the_cpu_tree_shallow(tmp_path):
    """With the table as measured, this CPU's costs buy the deep 18-node tree (the benchmark measured such a
    tree at 0.95x plain); scaled to the tau decoding really reached, a 4-node chain (measured 1.07x)."""
    accuracy = torch.tensor(DEMO_ACCURACY, dtype=torch.float64)
    costs = {k: v for k, v in CPU_COSTS.items() if k != "verify_ms_by_size"}
    optimistic, _ = ranked_choices_for_cost(accuracy, CPU_COSTS["verify_ms_by_size"], max_nodes=64, **costs)[
        0
    ]
    assert max(map(len, optimistic)) == 7 and len(optimistic) > 10
    (tmp_path / "tree.json").write_text(json.dumps({"choices": DEMO_TREE, "accuracy": DEMO_ACCURACY}))
    assert torch.equal(saved_accuracy(tmp_path), accuracy)  # no measured tau: the table as saved
    (tmp_path / "tree.json").write_text(
        json.dumps({"choices": DEMO_TREE, "accuracy": DEMO_ACCURACY, "measured_tau": 3.65})
    )
    realistic = saved_accuracy(tmp_path)
    assert expected_accept_length(realistic, DEMO_TREE) == pytest.approx(3.65, abs=1e-4)
    chain, _ = ranked_choices_for_cost(realistic, CPU_COSTS["verify_ms_by_size"], max_nodes=64, **costs)[0]
    assert chain == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    assert best_for_costs(realistic, dict(CPU_COSTS), 64) == chain  # what loading picks


def test_a_head_expected_to_lose_here_says_so(tiny_target_dir, tmp_path):
    """Calibration that expects even its best tree below plain decoding warns once, with the number."""
    config = AutoConfig.from_pretrained(tiny_target_dir)
    Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, 3])).save_pretrained(tmp_path / "h")
    hopeless = {"choices": [[0]], "accuracy": [[0.001, 0.0], [0.001, 0.0]]}  # ~never accepted: tau ~1
    (tmp_path / "h" / "tree.json").write_text(json.dumps(hopeless))
    with pytest.warns(UserWarning, match=r"expected at 0\.\d\dx plain decoding \(accuracy tree.json\)"):
        gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"))
    assert gen.calibration["expected_speedup"] < 1.0
    good = {"choices": [[0]], "accuracy": [[0.99, 0.0], [0.99, 0.0]]}
    (tmp_path / "h" / "tree.json").write_text(json.dumps(good))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"))
    assert gen.calibration["expected_speedup"] >= 1.0
    assert not [w for w in seen if "plain decoding" in str(w.message)]  # a tree that pays: no warning


def tree(n: int) -> list[list[int]]:
    """A stand-in tree of n nodes (spread reads sizes only)."""
    return [[i] for i in range(n)]


def test_the_trees_decoded_in_situ_span_size_classes():
    """`spread`: the best tree, then the best of each other size class (N = n + 1 verified nodes in
    (2^(c-1), 2^c]), then the next best; best_for_costs' `ranked` is that spread."""
    sizes = lambda trees: [len(t) for t in trees]  # noqa: E731
    ranked = [tree(n) for n in (15, 14, 13, 16, 7, 3, 31, 4)]  # best first
    assert sizes(spread(ranked, 3)) == [15, 16, 7]  # 15 | 16 (N = 17) | 7 (N = 8): three classes
    assert sizes(spread(ranked, 5)) == [15, 16, 7, 3, 14]  # (31: N = 32, 16's class)
    assert sizes(spread([tree(n) for n in (7, 6, 3, 4)], 3)) == [7, 3, 6]  # two classes: then the next best
    assert sizes(spread([tree(2)], 3)) == [2]
    accuracy = torch.tensor([[0.9, 0.3, 0.2], [0.9, 0.3, 0.2], [0.9, 0.3, 0.2]], dtype=torch.float64)
    info = {"verify_ms_by_size": {1: 4.0, 2: 4.0, 4: 4.0, 8: 4.0, 16: 4.4}, "step_ms": 4.0}
    best = best_for_costs(accuracy, info, 9)
    assert info["ranked"][0] == best and len({len(t).bit_length() for t in info["ranked"]}) == 3


@pytest.mark.parametrize(("device", "kept"), [("cpu", True), ("cuda:0", False), (None, False)])
def test_only_a_tree_tuned_on_this_kind_of_device_is_kept(tiny_target_dir, tmp_path, device, kept):
    config = AutoConfig.from_pretrained(tiny_target_dir)
    head = Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, config.num_hidden_layers]))
    head.save_pretrained(tmp_path / "head")
    tree = {"choices": [[0]], "accuracy": [[0.7, 0.2], [0.6, 0.2]], **({"device": device} if device else {})}
    (tmp_path / "head" / "tree.json").write_text(json.dumps(tree))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an untrained head is expected to lose: not what this tests
        gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"))
    assert ("kept_saved_tree" in gen.calibration) == kept


def test_the_parts_are_timed_as_the_generator_compiles_them():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert TimedAs.of(cuda, True, None) == TimedAs("graphs", "graphs")  # CUDA graphs: the launches gone
    assert TimedAs.of(cuda, False, True) == TimedAs(False, "graphs")  # the drafter alone
    assert TimedAs.of(cuda, "max-autotune", False) == TimedAs("graphs", False)
    assert TimedAs.of(cuda, False, None) == EAGER
    # a CPU: the target's fixed-shape passes (what its compiled passes attend over), the draft eager
    assert TimedAs.of(cpu, True, None) == TimedAs("graphs", False)
    assert TimedAs.of(cpu, False, True) == EAGER


def test_compiled_parts_are_timed_compiled(tiny_target_dir, tmp_path, monkeypatch):
    """Each part as the generator runs it: the target's runners, the draft's depth (the compiled whole
    draft at two depths) and its accept; from_pretrained passes its compile settings down."""
    from spechead.inference.drafters.eagle import EagleDrafter
    from spechead.inference.target import runner as runner_module

    runners, drafts = [], []
    init, use_compile = runner_module.TargetRunner.__init__, EagleDrafter.use_compile
    monkeypatch.setattr(
        runner_module.TargetRunner,
        "__init__",
        lambda self, *a, **kw: (runners.append(kw.get("compile", False)), init(self, *a, **kw))[1],
    )
    monkeypatch.setattr(
        EagleDrafter, "use_compile", lambda self, mode: (drafts.append(mode), use_compile(self, mode))[1]
    )
    accuracy = ACCURACY
    saved_head(tiny_target_dir, tmp_path / "head", accuracy)
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"), calibrate=False)
    runners.clear()
    graphs = TimedAs("graphs", "graphs")
    chosen, info = calibrated_choices(
        gen.target, gen.drafter, torch.tensor(accuracy), max_nodes=8, timed_as=graphs
    )
    assert runners == ["graphs", "graphs"] and drafts == ["graphs"] * 3  # verify, commit; depths 1, 4, accept
    assert info["timed_as"] == {"target": "graphs", "draft": "graphs"} and info["draft_ms_per_depth"] >= 0
    assert info["pass_ms"] > 0 and 1 <= len(chosen) <= 8
    runners.clear()
    drafts.clear()
    compiled = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), str(tmp_path / "head"), compile="graphs"
    )
    assert compiled.calibration["timed_as"] == {
        "target": "graphs",
        "draft": False,
    }  # (a CPU: the draft eager)
    # verify, commit, the in-situ passes, the generator's own; eager: the timing prompt the target writes
    assert runners.count("graphs") == 4 and runners.count(False) == 1
    assert drafts == ["graphs"]  # the generator's drafter, compiled as asked; calibration's stayed eager


def test_size_costs_are_the_minimum_made_non_decreasing():
    """size_costs_ms: the minimum over repeats per size, never below a smaller size's (a bigger tree never
    costs less: a cheap outlier of size 2 is lifted to size 1's cost)."""
    import time

    from spechead.inference.tuning.calibrate import size_costs_ms

    calls = {1: lambda: time.sleep(0.03), 2: lambda: None, 4: lambda: time.sleep(0.005)}
    costs = size_costs_ms(calls, 2, torch.device("cpu"))
    assert list(costs) == [1, 2, 4] and costs[1] >= 30.0
    assert costs[2] == costs[1] and costs[4] == costs[1]


def test_covers_needs_an_entry_for_every_node():
    """A tree as deep and as wide as the table is covered; one level deeper or one rank wider is not."""
    from spechead.inference.tuning.tree_search import covers

    table = torch.zeros(2, 3)
    assert covers(table, [[0], [2], [0, 2]])
    assert not covers(table, [[0], [0, 0], [0, 0, 0]]) and not covers(table, [[3]]) and not covers(table, [])


def test_a_compiled_depth_costs_the_difference_per_added_depth(tiny_target_dir, tmp_path, monkeypatch):
    """compiled_depth_cost_ms: (draft to `depth` - draft to depth 1) / (depth - 1); the draft times are
    planted (1 ms + 2 ms a depth), the drafters are real and compiled as asked."""
    from spechead.inference.tuning import calibrate

    saved_head(tiny_target_dir, tmp_path / "head", ACCURACY)
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"), calibrate=False)
    depths = []

    def planted(drafter, fn, repeats):
        depths.append(max(map(len, drafter.choices)))
        return 1.0 + 2.0 * depths[-1]

    monkeypatch.setattr(calibrate, "_drafter_ms", planted)
    assert calibrate.compiled_depth_cost_ms(gen.drafter, "graphs", depth=4) == pytest.approx(2.0)
    assert depths == [1, 4]


def test_the_verify_costs_reach_the_largest_tree_with_its_root(tiny_target_dir, tmp_path):
    """A tree of max_nodes drafted nodes is verified with its root: max_nodes + 1 = 8 is timed, not
    extrapolated from the sizes below it."""
    saved_head(tiny_target_dir, tmp_path / "head", ACCURACY)
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"), calibrate=False)
    _, info = calibrated_choices(gen.target, gen.drafter, torch.tensor(ACCURACY), max_nodes=7)
    assert list(info["verify_ms_by_size"]) == [1, 2, 4, 8]


def test_a_verify_longer_than_the_default_tree_room_is_timed(tiny_llama):
    """scripts/search_skip.py times chains of any length: 128 + 151 positions need more than the 256 a
    64-position tree room would round to."""
    from spechead.inference.tuning.calibrate import verify_cost_ms

    target = tiny_llama(256, layers=1, hidden=32, seed=0)
    assert verify_cost_ms(target, sizes=(150,), context=128, repeats=1)[150] > 0


def test_an_eagle_pass_pays_the_commit_and_the_accept(tiny_target_dir, tmp_path, monkeypatch):
    """pass_ms = the target's commit + the head's accept step (both paid by every pass, whatever the
    tree); the part times are planted, the calibration around them real."""
    from spechead.inference.tuning import calibrate

    saved_head(tiny_target_dir, tmp_path / "head", ACCURACY)
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"), calibrate=False)
    monkeypatch.setattr(calibrate, "commit_cost_ms", lambda model, compile=False: 3.0)
    monkeypatch.setattr(calibrate, "eagle_accept_cost_ms", lambda drafter: 2.0)
    monkeypatch.setattr(calibrate, "eagle_depth_cost_ms", lambda drafter, width, batch: 0.5)
    _, info = calibrated_choices(gen.target, gen.drafter, torch.tensor(ACCURACY), max_nodes=4)
    assert info["pass_ms"] == 5.0 and info["draft_ms_per_depth"] == 0.5


def test_a_one_pass_draft_is_timed_as_a_propose(tiny_llama, medusa_for, monkeypatch):
    """Medusa (P-EAGLE, DFlash alike): draft_ms = what `_drafter_ms` measures of one propose of a batch
    of one from a one-token start (planted: 4 ms), the same for every tree."""
    from spechead.inference.drafters.medusa import MedusaDrafter
    from spechead.inference.tuning import calibrate

    model = tiny_llama(64, layers=2, hidden=32, seed=1)
    medusa = MedusaDrafter(medusa_for(model, num_heads=3).eval(), [[0]])
    drafts = []
    monkeypatch.setattr(calibrate, "_drafter_ms", lambda drafter, fn, repeats: drafts.append(fn()) or 4.0)
    _, info = calibrated_choices(model, medusa, torch.tensor(ACCURACY), max_nodes=4)
    assert info["draft_ms"] == 4.0 and "draft_ms_per_depth" not in info
    assert len(drafts) == 1 and drafts[0].tokens.shape[0] == 1


def test_one_path_times_any_drafters_draft(tiny_llama, medusa_for):
    """`propose_timer`: a batch of one through `rows_drafter` and the batched API, whether the drafter is
    batched itself (Medusa) or a batch-1 drafter (prompt lookup): each draft a tree rooted at 0, the
    one the drafter proposes from those states."""
    from spechead.inference.drafters.medusa import MedusaDrafter
    from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
    from spechead.inference.sampling import SamplingParams
    from spechead.inference.tuning.calibrate import propose_timer

    model = tiny_llama(64, layers=2, hidden=32, seed=1)
    medusa = MedusaDrafter(medusa_for(model, num_heads=3).eval(), [[0], [1], [0, 0]])
    for drafter in (medusa, PromptLookupDrafter(num_draft=3)):
        states = {layer: torch.randn(6, 32) for layer in drafter.hidden_layers}  # [T, H]
        draft = propose_timer(drafter, states)()
        assert draft.tokens.shape[0] == 1 and int(draft.tokens[0, 0]) == 0, type(drafter)
    alone = MedusaDrafter(medusa.head, medusa.choices)
    alone.start([torch.zeros(6, dtype=torch.long)], [states_of(medusa, 6)], [0])
    timed = propose_timer(medusa, states_of(medusa, 6))()
    assert timed.tokens.tolist() == alone.propose([0], [SamplingParams()], [None]).tokens.tolist()


def states_of(drafter, length: int) -> dict[int, torch.Tensor]:
    """The same states {layer: [T, H]} on every call (seeded)."""
    g = torch.Generator().manual_seed(length)
    return {layer: torch.randn(length, 32, generator=g) for layer in drafter.hidden_layers}
