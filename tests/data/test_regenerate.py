"""Self-distillation: assistant turns replaced by the target's own generations, resumable and deterministic."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spechead.data.conversations import DataConfig, load_conversations
from spechead.data.errors import DataError
from spechead.data.regenerate import (
    RegenerateSettings,
    answer_slots,
    regenerate_conversations,
    regenerate_into,
    run_key,
    stop_token_ids,
)
from spechead.data.resumable_jsonl import ResumableJsonl

DEMO = Path(__file__).resolve().parents[2] / "data" / "demo"
CONVS = [
    [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "Thanks! Please add 2 and 3."},
        {"role": "assistant", "content": "2 plus 3 is 5."},
    ],
    [{"role": "user", "content": "Translate hello into Spanish."}, {"role": "assistant", "content": "hola"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [
        {"role": "user", "content": "Please add 12 and 30."},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "What is the capital of Spain?"},
    ],
    [
        {"role": "user", "content": "What is the capital of Spain?"},
        {"role": "assistant", "content": "Madrid."},
    ],
]


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_target_dir)


def direct_greedy(model, tokenizer, messages, max_new_tokens: int) -> str:
    """The answer plain HF greedy `generate` gives for `messages`, cut at the first stop token.

    An answer cut by max_new_tokens loses a trailing partial character, as regenerate does.
    """
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()  # fmt: skip
    stops = stop_token_ids(model, tokenizer)
    cut = next((i for i, t in enumerate(out) if t in stops), None)
    text = tokenizer.decode(out[:cut], skip_special_tokens=True)
    return text if cut is not None else text.rstrip("\ufffd")


def test_stop_tokens_include_the_templates_end_of_turn(tiny, llama3_tokenizer):
    model, tokenizer = tiny
    # The model's own eos list (generation_config) and the tokenizer's eos (= ChatML's end of turn).
    expected = {model.generation_config.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert set(stop_token_ids(model, tokenizer)) == expected
    # A tokenizer whose eos is not the end-of-turn marker: the template's <|eot_id|> still stops answers.
    tok = copy.deepcopy(llama3_tokenizer)
    tok.eos_token = "<s>"
    model = copy.deepcopy(model)
    model.generation_config.eos_token_id = None
    assert set(stop_token_ids(model, tok)) == {tok.convert_tokens_to_ids("<|eot_id|>"), tok.bos_token_id}


def test_answers_are_the_targets_greedy_continuations(tiny):
    model, tokenizer = tiny
    settings = RegenerateSettings(max_new_tokens=10, batch_size=4)
    out, stats = regenerate_conversations(model, tokenizer, CONVS[:4], 0, settings)
    for src, new in zip(CONVS, out):
        assert [m["role"] for m in new] == [m["role"] for m in src]
        assert [m for m in new if m["role"] != "assistant"] == [m for m in src if m["role"] != "assistant"]
    # Each answer equals plain greedy decoding of the conversation so far, earlier answers regenerated.
    first = direct_greedy(model, tokenizer, out[0][:2], 10)
    assert out[0][2]["content"] == first and first != CONVS[0][2]["content"]
    assert out[0][4]["content"] == direct_greedy(model, tokenizer, out[0][:4], 10)
    assert out[1][1]["content"] == direct_greedy(model, tokenizer, out[1][:1], 10)
    assert (stats.conversations, stats.answers) == (4, 4)
    assert 0 < stats.new_tokens <= 40 and stats.unfinished <= 4
    # Batch composition does not change an answer (same conversation index, alone or in a batch).
    alone, _ = regenerate_conversations(model, tokenizer, CONVS[1:2], 1, settings)
    assert alone[0] == out[1]


def test_turn_policies():
    convs = {"lead": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "q"}]}
    assert answer_slots(CONVS[0], RegenerateSettings()) == [2, 4]
    assert answer_slots(CONVS[0], RegenerateSettings(turns="first")) == [2]
    assert answer_slots(CONVS[2], RegenerateSettings()) == []
    assert answer_slots(CONVS[2], RegenerateSettings(answer_last_user=True)) == [1]
    assert answer_slots(CONVS[3], RegenerateSettings(answer_last_user=True)) == [1, 3]
    assert answer_slots(convs["lead"], RegenerateSettings(answer_last_user=True)) == [2]  # greeting kept


def test_first_turn_policy_and_answering_prompts(tiny):
    model, tokenizer = tiny
    first = RegenerateSettings(max_new_tokens=6, turns="first")
    out, _ = regenerate_conversations(model, tokenizer, CONVS[:3], 0, first)
    assert [len(c) for c in out] == [3, 2, 1]  # cut after the first answer; a bare prompt stays as it is
    answer = RegenerateSettings(max_new_tokens=6, answer_last_user=True)
    out, stats = regenerate_conversations(model, tokenizer, CONVS[2:4], 2, answer)
    assert [m["role"] for m in out[0]] == ["user", "assistant"]
    assert [m["role"] for m in out[1]] == ["user", "assistant", "user", "assistant"]
    assert out[1][2] == CONVS[3][2] and stats.answers == 3


def test_prompt_filling_the_context_ends_the_conversation(tiny):
    model, tokenizer = tiny
    long = " ".join(["sea"] * 600)  # > 512 positions of the tiny target
    conv = CONVS[1] + [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"}]
    out, stats = regenerate_conversations(model, tokenizer, [conv], 0, RegenerateSettings(max_new_tokens=4))
    assert [m["role"] for m in out[0]] == ["user", "assistant", "user"] and out[0][2]["content"] == long
    assert (stats.cut, stats.answers) == (1, 1)


def test_sampling_is_seeded_per_conversation(tiny):
    model, tokenizer = tiny
    hot = RegenerateSettings(max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.95, seed=7, batch_size=4)
    a, _ = regenerate_conversations(model, tokenizer, CONVS[:4], 0, hot)
    b, _ = regenerate_conversations(model, tokenizer, CONVS[:4], 0, hot)
    assert a == b
    alone, _ = regenerate_conversations(model, tokenizer, CONVS[3:4], 3, hot)
    assert alone[0] == a[3]  # independent of the batch it is in
    other, _ = regenerate_conversations(
        model, tokenizer, CONVS[:4], 0, RegenerateSettings(**{**vars(hot), "seed": 8})
    )
    assert other != a
    greedy, _ = regenerate_conversations(
        model, tokenizer, CONVS[:4], 0, RegenerateSettings(max_new_tokens=12)
    )
    assert greedy != a


@pytest.mark.parametrize(
    "bad",
    [
        {"max_new_tokens": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"batch_size": 0},
        {"turns": "last"},
    ],
)
def test_bad_settings_are_one_line_errors(bad):
    with pytest.raises(DataError, match=next(iter(bad))):
        RegenerateSettings(**bad)


def regenerate_file(model, tokenizer, out: Path, convs, settings, limit=None, **kw) -> ResumableJsonl:
    key = run_key("tiny", model.config, tokenizer, "float32", {"path": "inline"}, settings)
    writer = ResumableJsonl(out, key, **kw)
    regenerate_into(writer, model, tokenizer, convs, settings, limit=limit)
    return writer


def test_resume_gives_the_same_file_as_one_run(tiny, tmp_path):
    model, tokenizer = tiny
    settings = RegenerateSettings(max_new_tokens=8, temperature=1.0, seed=3, batch_size=2)
    whole = regenerate_file(model, tokenizer, tmp_path / "whole.jsonl", CONVS, settings)
    assert whole.rows == 5 and whole.info["stats"]["conversations"] == 5
    again = regenerate_file(model, tokenizer, tmp_path / "again.jsonl", CONVS, settings)
    assert again.path.read_bytes() == whole.path.read_bytes()  # deterministic given the seed
    part = tmp_path / "part.jsonl"
    assert regenerate_file(model, tokenizer, part, CONVS, settings, limit=3).rows == 3
    # A crash mid-chunk: a full row and half a line written after the last saved state.
    with part.open("a") as f:
        f.write(json.dumps({"messages": []}) + '\n{"messages": [{"ro')
    resumed = regenerate_file(model, tokenizer, part, CONVS, settings)
    assert part.read_bytes() == whole.path.read_bytes()
    assert resumed.info == whole.info
    rows = [json.loads(line)["messages"] for line in part.read_text().splitlines()]
    assert len(rows) == 5 and [m["role"] for m in rows[0]] == [m["role"] for m in CONVS[0]]


def test_resume_refuses_other_settings_data_or_files(tiny, tmp_path):
    model, tokenizer = tiny
    settings = RegenerateSettings(max_new_tokens=4)
    out = tmp_path / "out.jsonl"
    regenerate_file(model, tokenizer, out, CONVS, settings, limit=2)
    with pytest.raises(DataError, match=r"other settings \(generation.temperature: 0.0 -> 0.5\)"):
        regenerate_file(model, tokenizer, out, CONVS, RegenerateSettings(max_new_tokens=4, temperature=0.5))
    with pytest.raises(DataError, match="first 2 conversations of the data differ"):
        regenerate_file(model, tokenizer, out, CONVS[1:], settings)
    # Another batch size is fine (answers do not depend on it); --overwrite starts over.
    assert (
        regenerate_file(model, tokenizer, out, CONVS, RegenerateSettings(max_new_tokens=4, batch_size=3)).rows
        == 5
    )
    assert regenerate_file(model, tokenizer, out, CONVS, settings, limit=1, overwrite=True).rows == 1
    out.write_text("")
    with pytest.raises(DataError, match="state records"):
        regenerate_file(model, tokenizer, out, CONVS, settings)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"messages": []}\n')
    with pytest.raises(DataError, match="not written by this tool"):
        regenerate_file(model, tokenizer, foreign, CONVS, settings)
    with pytest.raises(DataError, match="does not exist"):
        regenerate_file(model, tokenizer, tmp_path / "no" / "out.jsonl", CONVS, settings)


def test_every_loader_format_regenerates_to_messages_jsonl(tiny, tmp_path):
    model, tokenizer = tiny
    sharegpt = tmp_path / "sharegpt.json"
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in conv]} for conv in CONVS
    ]))  # fmt: skip
    ds = load_conversations(DataConfig(path=str(sharegpt)))
    settings = RegenerateSettings(max_new_tokens=5, batch_size=3)
    out = regenerate_file(model, tokenizer, tmp_path / "out.jsonl", ds, settings).path
    reread = load_conversations(DataConfig(path=str(out)))
    assert len(reread) == 5
    assert [[m["role"] for m in c] for c in reread["messages"]] == [[m["role"] for m in c] for c in CONVS]
    from_list, _ = regenerate_conversations(model, tokenizer, CONVS, 0, settings)
    assert reread["messages"] == from_list


def test_demo_target_rewrites_demo_answers():
    model = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "target")
    convs = [json.loads(line)["messages"] for line in (DEMO / "chat.jsonl").read_text().splitlines()[:3]]
    out, stats = regenerate_conversations(model, tokenizer, convs, 0, RegenerateSettings(max_new_tokens=96))
    assert out[0][1]["content"] == direct_greedy(model, tokenizer, convs[0][:1], 96)
    # The demo target ends its answers itself, with real text; user turns are untouched.
    assert stats.unfinished == 0 and stats.answers == sum(m["role"] == "assistant" for c in convs for m in c)
    for src, new in zip(convs, out):
        assert [m for m in new if m["role"] == "user"] == [m for m in src if m["role"] == "user"]
        assert all(len(m["content"].split()) >= 2 for m in new if m["role"] == "assistant")


def test_a_prompt_exactly_filling_the_context_is_cut_and_keeps_no_source_answer(tiny):
    """A prompt that fills the target's context to the last position leaves no room for an answer: the
    conversation ends before that answer (one position more: a one-token answer), and none of the
    source's later turns, its own answers included, is copied after the cut."""
    model, tokenizer = tiny
    conv = CONVS[1] + [{"role": "user", "content": "And goodbye?"}, {"role": "assistant", "content": "adios"}]
    fill = len(tokenizer.apply_chat_template(conv[:1], add_generation_prompt=True, return_dict=False))
    settings = RegenerateSettings(max_new_tokens=4)
    for context, roles, cut in ((fill, ["user"], 1), (fill + 1, ["user", "assistant", "user"], 1)):
        short = copy.deepcopy(model)
        short.config.max_position_embeddings = context
        out, stats = regenerate_conversations(short, tokenizer, [conv], 0, settings)
        assert [m["role"] for m in out[0]] == roles and stats.cut == cut
        assert all(m["content"] not in ("hola", "adios") for m in out[0])
    assert stats.new_tokens <= 1  # (the one position left)


def test_the_run_key_changes_with_what_the_target_computes_only(tiny):
    """An output's key holds the target config's digest: another architecture (a resume with another
    model under the same path) changes it, how the same model was loaded or saved (dtype, path) does not."""
    model, tokenizer = tiny
    settings, data = RegenerateSettings(), {"source": "chats.jsonl"}
    key = run_key("t", model.config, tokenizer, "float32", data, settings)
    other = copy.deepcopy(model.config)
    other.num_hidden_layers += 1
    assert run_key("t", other, tokenizer, "float32", data, settings) != key
    loaded = copy.deepcopy(model.config)
    loaded._name_or_path, loaded.dtype = "elsewhere", torch.bfloat16
    assert run_key("t", loaded, tokenizer, "float32", data, settings) == key
