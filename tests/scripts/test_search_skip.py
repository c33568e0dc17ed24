"""scripts/search_skip.py and inference/tuning/skip_search.py: chain replay on hand-made matches, the predicted
greedy tau equals the tau of real decoding, the beam search, and the script end to end (its drafter
file loads through from_pretrained and decodes exactly as plain greedy decoding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spechead.inference.drafters.layer_skip import LayerSkipDrafter, skip_view
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tuning.skip_search import (
    Candidate,
    beam_search,
    chain_accept_lengths,
    draft_matches,
    linear_fit,
    pooled_tau,
)

ROOT = Path(__file__).resolve().parents[2]


def test_chain_replay_on_hand_made_matches():
    m = torch.tensor(
        [1, 1, 0, 1, 1, 1, 0, 0], dtype=torch.bool
    )  # 9 generated tokens, token 0 from the prefill
    # k=2: root 0 takes m0,m1 -> 3 tokens; root 3 takes m3,m4 -> 3; root 6: m6 fails -> 1; root 7: m7 fails -> 1
    assert chain_accept_lengths(m, 2) == [3, 3, 1, 1]
    assert chain_accept_lengths(m, 3) == [3, 4, 1]  # root 3: m3, m4, m5 -> 4; root 7: last token, clipped
    assert chain_accept_lengths(m, 1) == [2, 1, 2, 2, 1]
    assert chain_accept_lengths(torch.ones(5, dtype=torch.bool), 4) == [5]
    assert chain_accept_lengths(torch.zeros(0, dtype=torch.bool), 3) == []
    assert pooled_tau([m, torch.ones(3, dtype=torch.bool)], 2) == (8 + 3) / (4 + 1)  # pooled, not a mean
    assert linear_fit([1, 2, 3, 4], [2.0, 4.0, 6.0, 8.0]) == pytest.approx([2.0, 4.0, 6.0, 8.0])


def test_beam_search_finds_the_best_set():
    best = (3, 4)  # late layers: a beam that ignored scores (kept the first sets) would never reach it

    def evaluate(skip):  # a score peaked at skipping exactly layers 3 and 4
        return Candidate(skip, 1, 1.0, 2.0 - len(set(skip) ^ set(best)))

    seen = beam_search(evaluate, 5, beam=1)
    assert max(seen.values(), key=lambda c: c.speedup).skip == best
    assert all(len(s) <= 4 for s in seen) and len(seen) < 2**5 - 1  # a beam, not every subset
    assert max(len(s) for s in beam_search(evaluate, 5, beam=1, max_skip=2)) == 2


@pytest.mark.parametrize(("skip", "k"), [([1], 1), ([1, 2], 3), ([2, 3], 2)])
def test_predicted_tau_equals_decoded_tau(tiny_llama, chatml_tokenizer, skip, k):
    """One teacher-forced draft forward predicts the greedy chain decoder's accept lengths exactly."""
    model = tiny_llama(len(chatml_tokenizer), layers=4, hidden=32, seed=3)
    gen = SpeculativeGenerator(model, chatml_tokenizer, LayerSkipDrafter(model, skip, num_draft=k))
    gen.eos = set()
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(5, 300, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 12, (8,), generator=g)
    ]
    sequences, lengths, decoded = [], [], []
    for prompt in prompts:
        result = gen.generate(input_ids=prompt, max_new_tokens=20)
        sequences.append(prompt + result.token_ids)
        lengths.append(len(prompt))
        decoded.append(result.stats.accept_lengths)
    matches = draft_matches(skip_view(model, skip), sequences, lengths, batch=3)
    assert [chain_accept_lengths(m, k) for m in matches] == decoded
    assert pooled_tau(matches, k) > 1.0


def test_script_end_to_end(script, tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "skip.json"
    argv = ["--target", str(tiny_target_dir), "--prompts", "3", "--max-new-tokens", "10", "--max-draft", "2",
            "--beam", "2", "--out", str(out)]  # fmt: skip
    assert script("search_skip").main(argv) == 0
    printed = capsys.readouterr().out
    assert "| drafter spec |" in printed and "early_exit@layer=1" in printed and "equal to plain" in printed
    saved = json.loads(out.read_text())
    # the table is ranked by expected speedup, best first; the saved drafter is the best skip set
    ranking = printed.split("\n\nearly exits:")[0].split("|---|---|---|---|---|\n")[1].splitlines()
    speedups = [float(row.split(" | ")[-1].rstrip("x |")) for row in ranking]
    best = next(row for row in ranking if "(nothing skipped)" not in row)
    assert speedups == sorted(speedups, reverse=True) and f"{saved['expected_speedup']:.2f}x" in best
    decoded = next(line for line in printed.splitlines() if line.startswith("best skip set "))
    assert f" k={saved['num_draft']}: decoded tau " in decoded  # the saved drafter is the one decoded
    assert saved["drafter"] == "layer_skip" and saved["num_layers"] == 4 and saved["skip_layers"]
    assert saved["num_draft"] in (1, 2) and saved["decoded_tau"] == pytest.approx(saved["tau"])
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(out))
    assert list(gen.drafter.skip_layers) == saved["skip_layers"]
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    assert (
        gen.generate("hello", max_new_tokens=8).token_ids
        == plain.generate("hello", max_new_tokens=8).token_ids
    )


def test_script_bad_input(script, tiny_target_dir, tmp_path, capsys):
    script = script("search_skip")
    with pytest.raises(SystemExit) as err:
        script.main(["--target", str(tiny_target_dir), "--out", str(tmp_path / "skip.txt")])
    assert err.value.code == 2 and "must end in .json" in capsys.readouterr().err
    assert script.main(["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "s.json")]) == 2
    assert "error:" in capsys.readouterr().err


def test_script_labels_and_table_rows(script):
    """A skip set as its --drafter spec (an early exit when it skips every layer from one on) and the
    table's kept layers, chain length, tau and speedup."""
    search_skip = script("search_skip")
    assert search_skip.label((2, 3), 4) == "early_exit@layer=2"
    assert search_skip.label((3,), 4) == "early_exit@layer=3"
    assert search_skip.label((1, 2), 4) == "layer_skip@skip=1+2"
    assert search_skip.label((), 4) == "(nothing skipped)"
    rows = [Candidate((1, 3), 2, 1.5, 1.25), Candidate((3,), 1, 1.75, 1.125)]
    assert search_skip.table(rows, 4).splitlines()[2:] == [
        "| layer_skip@skip=1+3 | 2 | 2 | 1.50 | 1.25x |",
        "| early_exit@layer=3 | 3 | 1 | 1.75 | 1.12x |",
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top", "0"], "must be >= 1"),
        (["--beam", "0"], "must be >= 1"),
        (["--max-skip", "0"], "--max-skip must be >= 1"),
    ],
)
def test_script_refuses_bad_numbers(script, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as err:
        script("search_skip").parse(["--out", str(tmp_path / "s.json"), *flags])
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_script_refuses_a_target_of_one_layer(script, tiny_llama, chatml_tokenizer, tmp_path, capsys):
    target = tmp_path / "one-layer"
    tiny_llama(len(chatml_tokenizer), layers=1).save_pretrained(target)
    chatml_tokenizer.save_pretrained(target)
    argv = ["--target", str(target), "--prompts", "1", "--out", str(tmp_path / "s.json")]
    capsys.readouterr()  # (saving the target may draw a progress bar: the script's own stderr is checked)
    assert script("search_skip").main(argv) == 2
    assert capsys.readouterr().err == (
        "error: the target has 1 decoder layer(s); skipping layers needs at least 2\n"
    )
    assert not (tmp_path / "s.json").exists()


def test_script_reference_outputs_are_the_prompt_then_its_greedy_continuation(
    script, tiny_llama, chatml_tokenizer
):
    """Each sequence: the first user turn in the chat template (its length is the prompt length), then
    the target's greedy answer to it."""
    from spechead.data.prompt_sets import load_prompt_set

    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    gen = SpeculativeGenerator(model, chatml_tokenizer, None)
    prompts = load_prompt_set("demo", 2)
    sequences, lengths = script("search_skip").reference_outputs(gen, prompts, 5)
    for prompt, sequence, length in zip(prompts, sequences, lengths, strict=True):
        ids = chatml_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.turns[0]}], add_generation_prompt=True, return_dict=False
        )
        assert length == len(ids) and sequence[:length] == ids
        assert sequence[length:] == gen.generate(input_ids=ids, max_new_tokens=5).token_ids


def test_script_max_skip_no_check_and_every_early_exit(script, tiny_target_dir, tmp_path, capsys):
    """--max-skip 1: the beam's sets skip one layer, yet every early exit is tried (they skip more);
    --no-check decodes nothing; the file records the prompts decoded (the JSONL holds fewer than asked)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["What is the capital of France?"]}) + "\n")
    out = tmp_path / "skip.json"
    argv = ["--target", str(tiny_target_dir), "--prompt-set", str(prompts), "--prompts", "3",
            "--max-new-tokens", "8", "--max-draft", "2", "--max-skip", "1", "--no-check", "--out", str(out)]  # fmt: skip
    assert script("search_skip").main(argv) == 0
    printed = capsys.readouterr().out
    ranking, exits = printed.split("\n\nearly exits:\n")
    rows = [row.split(" | ")[0] for row in ranking.splitlines() if row.startswith("| ") and "---" not in row]
    assert all("+" not in spec for spec in rows[1:])  # layer_skip@skip=a+b: two layers, over --max-skip
    exit_rows = [row.split(" | ")[0] for row in exits.splitlines()[2:] if row.startswith("| ")]
    assert sorted(exit_rows) == [f"| early_exit@layer={k}" for k in (1, 2, 3)]
    assert "equal to plain" not in printed and "decoded tau" not in printed
    saved = json.loads(out.read_text())
    assert saved["prompts"] == 1 and "decoded_tau" not in saved and saved["skip_layers"]
