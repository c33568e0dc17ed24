"""scripts/bench_overhead.py on a tiny target: the pass splits into target forward, draft networks and
engine, each measured where it happens (wrapped calls), and the JSON holds every number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from spechead.heads.eagle3 import Eagle3Config, Eagle3Head

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, tiny_target_dir) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(model.config))
    return head.save_pretrained(tmp_path_factory.mktemp("overhead") / "eagle3")


def prompts(path: Path) -> Path:
    rows = [
        {"category": "qa", "turns": [q]} for q in ("What is the capital of France?", "Please add 2 and 3.")
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3-compiled", "prompt_lookup"])
def test_pass_splits_into_target_draft_and_engine(
    script, tiny_target_dir, eagle3_dir, tmp_path, capsys, drafter
):
    out = tmp_path / "split.json"
    spec = str(eagle3_dir) if drafter.startswith("eagle3") else drafter
    argv = ["--target", str(tiny_target_dir), "--drafter", spec, "--prompt-set", str(prompts(tmp_path / "p.jsonl")),
            "--max-new-tokens", "10", "--out", str(out)]  # fmt: skip
    if drafter == "eagle3-compiled":  # the whole draft as one graph ("eager": traced, no code generation)
        argv += ["--compile-draft", "eager"]
    assert script("bench_overhead").main(argv) == 0
    printed = capsys.readouterr().out
    row = json.loads(out.read_text())
    assert "engine" in printed and row["plain_step_ms"] > 0 and row["tau"] >= 1
    parts = row["target_forward_ms"] + row["draft_networks_ms"] + row["engine_ms"]
    assert row["pass_ms"] == pytest.approx(parts)
    assert 0 < row["target_forward_ms"] < row["pass_ms"] and row["engine_ms"] > 0
    if drafter.startswith("eagle3"):  # head steps and top-k (compiled: the graphs) timed, per depth
        assert row["draft_networks_ms"] > 0 and row["draft_depths"] == len(max(row["tree"], key=len))
        assert row["draft_ms_per_depth"] == pytest.approx(row["draft_networks_ms"] / row["draft_depths"])
    else:  # no network drafts: prompt lookup's work is all engine
        assert row["draft_networks_ms"] == 0 and row["draft_ms_per_depth"] is None


def test_sampling_times_the_drawn_children_as_draft_work(
    script, tiny_target_dir, eagle3_dir, tmp_path, capsys
):
    """--temperature: both sides sample; an EAGLE head drawing its children (rule=without_replacement)
    has its head calls and draws timed as draft networks, and the class is left as it was."""
    from spechead.inference.drafters.eagle.sampled_children import SampledChildren

    top = SampledChildren.top
    out = tmp_path / "sampled.json"
    tree = tmp_path / "chain.json"
    tree.write_text("[[0], [0, 0], [0, 0, 0]]")
    spec = f"{eagle3_dir}@tree={tree},rule=without_replacement"
    argv = ["--target", str(tiny_target_dir), "--drafter", spec, "--prompt-set", str(prompts(tmp_path / "p.jsonl")),
            "--max-new-tokens", "10", "--temperature", "1.0", "--top-p", "0.9", "--out", str(out)]  # fmt: skip
    assert script("bench_overhead").main(argv) == 0
    row = json.loads(out.read_text())
    assert row["draft_depths"] == 3 and row["draft_networks_ms"] > 0 and row["engine_ms"] > 0
    assert SampledChildren.top is top


def test_a_run_that_raises_leaves_the_class_unwrapped(
    script, tiny_target_dir, eagle3_dir, tmp_path, monkeypatch
):
    """The drawn children's and the rows' top-k timers are set on the shared classes: a decoding error
    still takes them off."""
    from spechead.inference.drafters.eagle.rows import EagleRows
    from spechead.inference.drafters.eagle.sampled_children import SampledChildren

    top, rows_top, module = SampledChildren.top, EagleRows._top, script("bench_overhead")

    def broken(*args, **kwargs):
        assert SampledChildren.top is not top and EagleRows._top is not rows_top  # (instrumented by now)
        raise RuntimeError("decoding failed")

    monkeypatch.setattr(module, "decode", broken)
    argv = ["--target", str(tiny_target_dir), "--drafter", str(eagle3_dir), "--prompt-set",
            str(prompts(tmp_path / "p.jsonl")), "--max-new-tokens", "4"]  # fmt: skip
    with pytest.raises(RuntimeError, match="decoding failed"):
        module.main(argv)
    assert SampledChildren.top is top and EagleRows._top is rows_top


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3-dynamic", "prompt_lookup"])
def test_planted_times_give_exact_shares(
    script, tiny_target_dir, eagle3_dir, tmp_path, capsys, monkeypatch, drafter
):
    """A clock that moves only inside the target's forward (T), the head's calls (D) and the runner's
    commit (E, engine work): the target per pass is T (the prefill's and the warm-up's taken out), the
    engine is E, a plain step T + E, and every share divides by the plain step. (Prompt lookup accepts
    a few tokens here: its passes are fewer than plain decoding's.)"""
    import time

    from transformers import LlamaForCausalLM

    from spechead.heads.eagle3 import Eagle3Head
    from spechead.heads.fused import _FusedStep
    from spechead.inference.drafters.eagle.rows import EagleRows
    from spechead.inference.target.runner import TargetRunner

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    T, D, E = 2.0**-6, 2.0**-10, 2.0**-9

    def ticking(cls, name: str, dt: float) -> None:
        inner = getattr(cls, name)

        def ticked(*args, **kwargs):
            now[0] += dt
            return inner(*args, **kwargs)

        monkeypatch.setattr(cls, name, ticked)

    ticking(LlamaForCausalLM, "forward", T)
    ticking(TargetRunner, "commit", E)
    for cls, name in ((EagleRows, "_top"), (_FusedStep, "__call__"), (Eagle3Head, "step"),
                      (Eagle3Head, "features")):  # fmt: skip
        ticking(cls, name, D)
    out = tmp_path / "planted.json"
    spec, new = {
        "eagle3": (str(eagle3_dir), "10"),
        "eagle3-dynamic": (f"{eagle3_dir}@tree=dynamic", "10"),
    }.get(drafter, (drafter, "24"))
    argv = ["--target", str(tiny_target_dir), "--drafter", spec, "--prompt-set",
            str(prompts(tmp_path / "p.jsonl")), "--max-new-tokens", new, "--out", str(out)]  # fmt: skip
    assert script("bench_overhead").main(argv) == 0
    printed = capsys.readouterr().out
    row = json.loads(out.read_text())
    step = 1e3 * (T + E)
    assert row["plain_step_ms"] == pytest.approx(step)
    assert row["target_forward_ms"] == pytest.approx(1e3 * T)
    assert row["engine_ms"] == pytest.approx(1e3 * E)
    assert (row["draft_networks_ms"] > 0) == drafter.startswith("eagle3")
    assert row["pass_ms"] == pytest.approx(1e3 * (T + E) + row["draft_networks_ms"])
    assert row["engine_share_of_step"] == pytest.approx(E / (T + E))
    if drafter.startswith("eagle3"):
        assert row["draft_ms_per_depth"] == pytest.approx(row["draft_networks_ms"] / row["draft_depths"])
        assert row["draft_depth_share_of_step"] == pytest.approx(row["draft_ms_per_depth"] / step)
    else:
        assert row["tau"] > 1
    # greedy is lossless (the same tokens both ways) and a plain pass makes one token: the speedup is
    # tau plain steps per speculative pass
    assert row["tau"] >= 1 and row["speedup"] == pytest.approx(row["tau"] * step / row["pass_ms"])
    assert f"({100 * E / (T + E):.1f}% of a plain step)" in printed
    assert f"speedup {row['speedup']:.2f}x" in printed and f"tau {row['tau']:.2f}" in printed


def test_every_measured_prompt_runs_plain_then_speculative_alike(
    script, tiny_target_dir, eagle3_dir, tmp_path, monkeypatch
):
    """One warm-up decode per side first (greedy, 8 tokens), then each prompt plain then speculative
    with the same sampling arguments: --temperature, --top-p and one seed per prompt."""
    import sys

    from spechead.inference.generator import SpeculativeGenerator

    calls, generate = [], SpeculativeGenerator.generate

    def spy(self, **kwargs):  # the script's own calls (not from_pretrained's tree calibration)
        if sys._getframe(1).f_code.co_filename.endswith("bench_overhead.py"):
            calls.append((self.drafter is None, kwargs))
        return generate(self, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", spy)
    argv = ["--target", str(tiny_target_dir), "--drafter", str(eagle3_dir), "--prompt-set",
            str(prompts(tmp_path / "p.jsonl")), "--max-new-tokens", "6", "--temperature", "0.7",
            "--top-p", "0.8"]  # fmt: skip
    assert script("bench_overhead").main(argv) == 0
    assert [plain for plain, _ in calls] == [True, False, True, False, True, False]
    assert all(kw["max_new_tokens"] == 8 and "temperature" not in kw for _, kw in calls[:2])
    measured = [kw for _, kw in calls[2:]]
    assert all(
        kw["temperature"] == 0.7 and kw["top_p"] == 0.8 and kw["max_new_tokens"] == 6 for kw in measured
    )
    seeds = [kw["seed"] for kw in measured]
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3] and None not in seeds


def test_a_bad_drafter_option_is_one_error_line(script, tiny_target_dir, eagle3_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        script("bench_overhead").main(["--target", str(tiny_target_dir), "--drafter", f"{eagle3_dir}@tree"])
    assert exc.value.code == 2 and "key=value" in capsys.readouterr().err


@pytest.mark.parametrize("compiled", [False, True])
def test_every_network_call_of_the_drafter_is_timed(
    tiny_target_dir, eagle3_dir, monkeypatch, script, compiled
):
    """instrument() wraps each of EAGLE's network calls (compiled: both graphs of its rows, made at its
    first start; their accept graph fuses the features), and a decode times them as draft networks."""
    from spechead.inference.drafters.eagle.rows import EagleRows
    from spechead.inference.drafters.eagle.sampled_children import SampledChildren
    from spechead.inference.generator import SpeculativeGenerator

    monkeypatch.setattr(SampledChildren, "top", SampledChildren.top)  # (put back after the test)
    monkeypatch.setattr(EagleRows, "_top", EagleRows._top)
    module = script("bench_overhead")
    gen = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), str(eagle3_dir), draft_compile="eager" if compiled else False
    )
    timers = module.Timers()
    module.instrument(gen, timers)
    drafter = gen.drafter
    gen.eos = set()
    gen.generate(input_ids=list(range(5, 17)), max_new_tokens=6)
    if compiled:
        assert drafter._rows is drafter._graphs is not None  # drafted and accepted as graphs
        timed = [drafter._graphs._draft, drafter._graphs._accept]
    else:
        timed = [drafter.head_step, EagleRows._top, drafter.head.features, SampledChildren.top]
    timed.append(gen.runner._forward)
    assert all(getattr(f, "__qualname__", "") == "Timers.wrap.<locals>.timed" for f in timed)
    assert timers.spent["draft_net"] > timers.spent["start_draft_net"] >= 0  # the passes' drafts were timed
    assert timers.spent["target"] > timers.spent["prefill_target"] > 0


@pytest.mark.parametrize("kind", ["medusa", "draft_model"])
def test_medusa_heads_and_a_draft_model_are_timed(script, tiny_target_dir, tmp_path, medusa_for, kind):
    """Medusa: the heads' pass the drafter calls (its fused one where it has it); a draft model: its forward."""
    from spechead.inference.generator import SpeculativeGenerator

    if kind == "medusa":
        model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
        spec = str(medusa_for(model).save_pretrained(tmp_path / "medusa"))
    else:
        spec = str(tiny_target_dir)  # the target itself as its draft model
    module = script("bench_overhead")
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), spec)
    module.instrument(gen, module.Timers())
    drafter = gen.drafter
    timed = drafter.head_logits if kind == "medusa" else drafter.model.forward
    assert timed.__qualname__ == "Timers.wrap.<locals>.timed"
