"""Assistant-token masking with real chat templates, truncation, and tokenize_dataset stats."""

from __future__ import annotations

import copy

import datasets
import pytest

from spechead.data.chat import TokenizeStats, tokenize_conversation, tokenize_dataset
from spechead.data.errors import DataError

# What each conftest template writes after an assistant turn's content.
END_OF_TURN = {"chatml_tokenizer": "<|im_end|>\n", "llama3_tokenizer": "<|eot_id|>"}
LONG = "The quick brown fox jumps over the lazy dog. " * 6

CONVERSATION = [
    {"role": "system", "content": "Write a short poem about the sea."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Please add 12 and 30."},
    {"role": "assistant", "content": "12 plus 30 is 42."},
]


@pytest.fixture(params=["chatml_tokenizer", "llama3_tokenizer"])
def tok_name(request):
    return request.param


@pytest.fixture
def tok(request, tok_name):
    return request.getfixturevalue(tok_name)


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for token, m in zip(ids, mask):
        if m:
            cur.append(token)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


def conv(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


def test_mask_is_exactly_the_assistant_turns(tok, tok_name):
    out = tokenize_conversation(CONVERSATION, tok, max_length=1000)
    ids, mask = out["input_ids"], out["loss_mask"]
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == [a + END_OF_TURN[tok_name] for a in answers]
    # One tokenization of the template's text: identical to the template's own tokenization.
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert out["num_tokens_before_truncation"] == len(ids)
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert "France?" in unmasked and "sea." in unmasked and "assistant" in unmasked
    assert not any(a in unmasked for a in answers)


def test_generation_prompt_header_is_not_masked(tok):
    out = tokenize_conversation(CONVERSATION[1:3], tok, max_length=1000)
    ids, mask = out["input_ids"], out["loss_mask"]
    prompt = tok.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=True, return_dict=False)
    assert ids[: len(prompt)] == prompt  # the template is prefix-stable at token level too
    assert not any(mask[: len(prompt)]) and all(mask[len(prompt) :])


def test_trailing_turns_after_last_answer_are_dropped(tok):
    full = tokenize_conversation(CONVERSATION, tok, max_length=1000)
    extra = tokenize_conversation([*CONVERSATION, {"role": "user", "content": "Thanks!"}], tok, 1000)
    assert extra == full


def test_blank_and_leading_assistant_turns_are_not_trained(tok):
    messages = conv(("assistant", "hola"), ("user", "hello"), ("assistant", "  "), ("user", "Thanks!"))
    out = tokenize_conversation(messages, tok, max_length=1000)
    assert sum(out["loss_mask"]) == 0 and len(out["input_ids"]) > 0


def test_truncation_keeps_the_start(tok):
    full = tokenize_conversation(CONVERSATION, tok, max_length=1000)
    cut = tokenize_conversation(CONVERSATION, tok, max_length=30)
    assert cut["input_ids"] == full["input_ids"][:30]
    assert cut["loss_mask"] == full["loss_mask"][:30]
    assert cut["num_tokens_before_truncation"] == len(full["input_ids"]) > 30


def test_no_chat_template_is_a_data_error(chatml_tokenizer):
    tok = copy.deepcopy(chatml_tokenizer)
    tok.chat_template = None
    with pytest.raises(DataError, match="has no chat template"):
        tokenize_conversation(CONVERSATION, tok, max_length=100)
    ds = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    with pytest.raises(DataError, match="has no chat template"):
        tokenize_dataset(ds, tok, max_length=100)


def test_template_that_rewrites_earlier_turns_is_rejected(chatml_tokenizer):
    tok = copy.deepcopy(chatml_tokenizer)
    # Marks the final turn differently, so a shorter rendering is not a prefix of the full one.
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}[final]{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(DataError, match="not prefix-stable"):
        tokenize_conversation(CONVERSATION, tok, max_length=100)


def test_template_exception_is_a_data_error(chatml_tokenizer):
    tok = copy.deepcopy(chatml_tokenizer)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match="roles must alternate"):
        tokenize_conversation(CONVERSATION, tok, max_length=100)


def test_tokenize_dataset_counts_and_filters(tok):
    rows = [
        conv(("user", "What is the capital of France?"), ("assistant", "Paris.")),  # kept
        conv(("user", "hello"), ("assistant", LONG)),  # kept, truncated
        conv(("user", LONG), ("assistant", "Paris.")),  # dropped: answer beyond max_length
        conv(("user", "hello"), ("assistant", "")),  # empty: blank answer
        conv(("system", "Be brief."), ("user", "hello")),  # empty: no assistant turn
    ]
    max_length = 40
    lengths = [tokenize_conversation(r, tok, 1000)["num_tokens_before_truncation"] for r in rows]
    assert lengths[0] <= max_length < min(lengths[1], lengths[2])  # the data is what the comments say
    ds = datasets.Dataset.from_dict({"messages": rows})
    out, stats = tokenize_dataset(ds, tok, max_length=max_length)
    assert stats == TokenizeStats(total=5, kept=2, truncated=1, dropped=1, empty=2)
    assert out.column_names == ["input_ids", "loss_mask"] and len(out) == 2
    assert out[0] == {
        k: v
        for k, v in tokenize_conversation(rows[0], tok, max_length).items()
        if k != "num_tokens_before_truncation"
    }
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) <= max_length and any(r["loss_mask"]) for r in out)
    assert stats.summary() == (
        "2/5 conversations kept (1 truncated), 1 dropped (no assistant token left after truncation), "
        "2 empty (no assistant turn)"
    )


def test_all_answers_truncated_away_says_raise_max_length(chatml_tokenizer):
    ds = datasets.Dataset.from_dict({"messages": [conv(("user", LONG), ("assistant", "Paris."))] * 12})
    with pytest.raises(
        DataError,
        match=r"all 12 examples lost every assistant token .*max_length=8: raise trainer.max_length",
    ):
        tokenize_dataset(ds, chatml_tokenizer, max_length=8)


def test_no_assistant_turns_error(chatml_tokenizer):
    ds = datasets.Dataset.from_dict({"messages": [conv(("user", "hello"))] * 3})
    with pytest.raises(DataError, match="no assistant turns"):
        tokenize_dataset(ds, chatml_tokenizer, max_length=100)


def test_empty_dataset_error_unless_allowed(chatml_tokenizer):
    ds = datasets.Dataset.from_dict({"messages": [CONVERSATION]}).select([])
    with pytest.raises(DataError, match="empty"):
        tokenize_dataset(ds, chatml_tokenizer, max_length=100)
    out, stats = tokenize_dataset(ds, chatml_tokenizer, max_length=100, allow_empty=True)
    assert len(out) == 0 and stats == TokenizeStats() and out.column_names == ["input_ids", "loss_mask"]


def test_stats_add():
    a = TokenizeStats(total=3, kept=2, truncated=1, dropped=1, empty=0)
    assert a + a == TokenizeStats(total=6, kept=4, truncated=2, dropped=2, empty=0)


def test_answer_starting_with_a_one_character_token_is_masked_from_its_first_character(tok, tok_name):
    """The span starts at the answer's first character: a first token one character long is trained."""
    messages = conv(("user", "hello"), ("assistant", "A fox."))
    out = tokenize_conversation(messages, tok, max_length=1000)
    assert masked_runs(tok, out["input_ids"], out["loss_mask"]) == ["A fox." + END_OF_TURN[tok_name]]


def test_token_straddling_the_generation_prompt_and_the_answer_is_masked(chatml_tokenizer):
    """A template whose generation prompt ends in a space (Llama-2's "[/INST] "): the byte-level token
    " The" starts in the prompt but is the answer's first token, so it is trained; the ids stay those of
    the template's own tokenization."""
    tok = copy.deepcopy(chatml_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    out = tokenize_conversation(CONVERSATION[1:3], tok, max_length=1000)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert ids == tok.apply_chat_template(CONVERSATION[1:3], tokenize=True, return_dict=False)
    assert masked_runs(tok, ids, mask) == [" The capital of France is Paris.\n"]


def test_zero_width_offsets_inside_an_answer_are_masked(chatml_tokenizer):
    """GPT-2-style trimmed offsets give whitespace-only tokens zero-width offsets: inside an answer they
    are still trained (the mask equals the one with untrimmed offsets)."""
    from tokenizers import processors

    tok = copy.deepcopy(chatml_tokenizer)
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    messages = conv(("user", "hello"), ("assistant", "Paris  is   big."))
    enc = tok(tok.apply_chat_template(messages, tokenize=False), return_offsets_mapping=True)
    assert any(a == b for a, b in enc["offset_mapping"])  # the case under test occurs
    out = tokenize_conversation(messages, tok, max_length=1000)
    assert out == tokenize_conversation(messages, chatml_tokenizer, max_length=1000)
    assert masked_runs(tok, out["input_ids"], out["loss_mask"]) == ["Paris  is   big.<|im_end|>\n"]


def test_tokenizer_that_adds_bos_does_not_add_a_second_one(chatml_tokenizer):
    """The template already writes BOS: a tokenizer whose post-processor adds BOS (Llama-3's) must not
    add another one, so the ids are exactly the template's own tokenization."""
    from tokenizers import processors

    tok = copy.deepcopy(chatml_tokenizer)
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    assert tok("hello")["input_ids"][0] == bos  # the tokenizer does add BOS by default
    ids = tokenize_conversation(CONVERSATION, tok, max_length=1000)["input_ids"]
    assert ids.count(bos) == 1
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)


def test_tokenizer_without_offsets_masks_the_assistant_turns():
    """A Python (non-fast) tokenizer has no offset mapping: each span is encoded on its own and the
    mask is still exactly the assistant turns (ByT5: one token per byte, no files needed)."""
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    assert not tok.is_fast
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    out = tokenize_conversation(CONVERSATION, tok, max_length=1000)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert masked_runs(tok, ids, mask) == ["The capital of France is Paris.</s>", "12 plus 30 is 42.</s>"]
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)


def test_conversation_exactly_max_length_long_is_not_truncated(chatml_tokenizer):
    """`truncated` counts conversations longer than max_length; one exactly that long is kept whole."""
    messages = conv(("user", "hello"), ("assistant", "Paris."))
    n = tokenize_conversation(messages, chatml_tokenizer, 1000)["num_tokens_before_truncation"]
    ds = datasets.Dataset.from_dict({"messages": [messages]})
    out, stats = tokenize_dataset(ds, chatml_tokenizer, max_length=n)
    assert stats == TokenizeStats(total=1, kept=1, truncated=0, dropped=0, empty=0)
    assert len(out[0]["input_ids"]) == n
    _, stats = tokenize_dataset(ds, chatml_tokenizer, max_length=n - 1)
    assert stats.truncated == 1


def test_max_length_below_one_is_refused(chatml_tokenizer):
    """max_length=0 is a setting error, not "every example lost its assistant tokens"."""
    ds = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    with pytest.raises(DataError, match="max_length=0 must be positive"):
        tokenize_dataset(ds, chatml_tokenizer, max_length=0)
