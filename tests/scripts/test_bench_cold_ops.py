"""scripts/bench_cold_ops.py on a tiny target: every op gets its cold, after-a-copy and warm times."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("tokens", [1, 3])
def test_every_op_is_timed_cold_after_a_copy_and_warm(script, tiny_target_dir, capsys, tokens):
    module = script("bench_cold_ops")
    assert module.main(["--target", str(tiny_target_dir), "--tokens", str(tokens), "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert f"forwards of {tokens} tokens" in lines[0]
    rows = lines[2:]
    assert len(rows) == 6 and any(r.startswith("numpy argmax") for r in rows)
    for row in rows:
        times = [float(x) for x in row.split()[-3:]]  # cold, after a copy, warm (us)
        assert all(t > 0 for t in times), row


def test_bad_numbers_are_one_error_line(script, tiny_target_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        script("bench_cold_ops").main(["--target", str(tiny_target_dir), "--repeats", "0"])
    assert exc.value.code == 2
    assert "--tokens and --repeats must be >= 1" in capsys.readouterr().err


def test_planted_times_land_in_their_columns_as_medians(script, tiny_target_dir, capsys, monkeypatch):
    """Planted microseconds by what ran just before the op: a forward (cold), the op itself (warm), or
    neither, the copy (after a copy); each column the median of its repeats, on the script's clock."""
    from types import SimpleNamespace

    from transformers import LlamaForCausalLM

    module = script("bench_cold_ops")
    now, state = [0.0], {"forward": False, "prev": None}
    planted = {
        "cold": [8.0, 30.0, 10.0],
        "after a copy": [4.0, 50.0, 5.0],
        "warm": [1.0, 2.0, 2.0, 2.0, 9.0, 9.0],
    }
    left = {}
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    forward = LlamaForCausalLM.forward

    def seen_forward(self, input_ids, *args, **kwargs):
        state["forward"], state["shape"] = True, state.get("shape", set()) | {tuple(input_ids.shape)}
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", seen_forward)
    real_ops = module.ops

    def planted_ops(logits, ids, table, drafts=None):
        def timed(name, fn):
            def run():
                if state["forward"]:
                    kind = "cold"
                else:
                    kind = "warm" if state["prev"] in ("cold", "after a copy") else "after a copy"
                state["forward"], state["prev"] = False, kind
                now[0] += 1e-6 * left.setdefault((name, kind), list(planted[kind])).pop(0)
                return fn()

            return run

        return {name: timed(name, fn) for name, fn in real_ops(logits, ids, table, drafts).items()}

    monkeypatch.setattr(module, "ops", planted_ops)
    import torch

    sizes, randn = [], torch.randn  # the copy's source: half the weights read, half written
    monkeypatch.setattr(torch, "randn", lambda *a, **k: sizes.append(a) or randn(*a, **k))
    assert module.main(["--target", str(tiny_target_dir), "--tokens", "2", "--repeats", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    weights = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(tiny_target_dir).parameters())
    assert f"{weights / 1e6:.1f} M weights" in lines[0] and (weights // 2,) in sizes
    assert len(lines) == 8 and all(line.split()[-3:] == ["10.0", "5.0", "2.0"] for line in lines[2:])
    assert all(times == [] for times in left.values()) and len(left) == 18  # every planted time taken
    assert state["shape"] == {(1, 2)}  # forwards of --tokens tokens


def test_no_tokens_is_refused(script, tiny_target_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        script("bench_cold_ops").main(["--target", str(tiny_target_dir), "--tokens", "0"])
    assert exc.value.code == 2 and "--tokens and --repeats must be >= 1" in capsys.readouterr().err


def test_a_medusa_head_adds_its_draft_in_float_and_int8(
    script, tiny_target_dir, medusa_for, tmp_path, capsys
):
    """--medusa HEAD: the head's whole draft, as trained and with int8 projections, timed like the ops."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    head_dir = medusa_for(model, num_heads=2).save_pretrained(tmp_path / "medusa")
    module = script("bench_cold_ops")
    argv = ["--target", str(tiny_target_dir), "--repeats", "2", "--medusa", str(head_dir)]
    assert module.main(argv) == 0
    rows = capsys.readouterr().out.strip().splitlines()[2:]
    assert [r.split(",")[0] for r in rows[:2]] == ["Medusa draft"] * 2 and len(rows) == 8
    assert rows[0].split()[2] == "float32" and rows[1].split()[2] == "int8"
    drafts = module.medusa_drafts(str(head_dir), model.config.hidden_size)
    float_draft, int8_draft = drafts.values()
    one, other = float_draft(), int8_draft()  # a batch of one each
    assert one.parents.tolist() == other.parents.tolist() and one.tokens.shape == (1, one.sizes[0])
    int8_head = int8_draft.__defaults__[0].head
    assert {type(block[-1]).__name__ for block in int8_head.heads} == {"Int8Linear"}
    assert {type(block[-1]).__name__ for block in float_draft.__defaults__[0].head.heads} == {"Linear"}
