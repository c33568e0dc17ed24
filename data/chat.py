"""Tokenize conversations with the tokenizer's own chat template and mask the assistant tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np

from spechead.data.errors import DataError

Messages = list[dict[str, str]]
# Columns the map writes; the underscored ones feed the stats and are dropped afterwards.
TOKENIZED_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "_num_tokens": datasets.Value("int64"),
        "_loss_tokens_full": datasets.Value("int64"),
        "_loss_tokens": datasets.Value("int64"),
    }
)


@dataclass
class TokenizeStats:
    """What happened to the conversations of one tokenize_dataset call."""

    total: int = 0  # conversations in
    kept: int = 0  # conversations out (at least one assistant token)
    truncated: int = 0  # kept, but longer than max_length and cut
    dropped: int = 0  # had assistant turns, but none of their tokens survived truncation
    empty: int = 0  # no assistant turn with content

    def __add__(self, other: TokenizeStats) -> TokenizeStats:
        return TokenizeStats(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self) -> tuple[int, ...]:
        return (self.total, self.kept, self.truncated, self.dropped, self.empty)

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"{self.kept}/{self.total} conversations kept ({self.truncated} truncated), "
            f"{self.dropped} dropped (no assistant token left after truncation), "
            f"{self.empty} empty (no assistant turn)"
        )


def tokenize_conversation(messages: Messages, tokenizer: Any, max_length: int) -> dict[str, Any]:
    """Tokenize one conversation with the tokenizer's chat template, keeping the first max_length tokens.

    Returns input_ids (T,) and loss_mask (T,) as int lists, T <= max_length, with loss_mask 1 exactly on
    the tokens of assistant turns (their content and end-of-turn marker as the template writes them),
    plus num_tokens_before_truncation.
    """
    ids, mask = encode_with_mask(messages, tokenizer)
    return {
        "input_ids": ids[:max_length],
        "loss_mask": mask[:max_length],
        "num_tokens_before_truncation": len(ids),
    }


def encode_with_mask(messages: Messages, tokenizer: Any) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of the whole rendered conversation, untruncated."""
    require_chat_template(tokenizer)
    # Turns after the last assistant answer carry no loss: leave them out rather than pay for them.
    answered = [i for i, m in enumerate(messages) if _is_answer(m, i)]
    if answered:
        messages = messages[: answered[-1] + 1]
    text, spans = assistant_char_spans(messages, tokenizer, answered)
    return _tokenize_spans(text, spans, tokenizer)


def _is_answer(message: dict[str, str], index: int) -> bool:
    # A leading assistant turn has no prompt to answer and no generation-prompt rendering to align with;
    # a blank one would only teach the model to stop at once. Neither is trained on.
    return message["role"] == "assistant" and index > 0 and bool(message["content"].strip())


def require_chat_template(tokenizer: Any) -> None:
    """DataError when the tokenizer cannot render conversations."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"tokenizer of {name} has no chat template; use a chat/instruct model's tokenizer "
            "or set model.chat_template=FILE.jinja to the template the model is served with"
        )


def assistant_char_spans(
    messages: Messages, tokenizer: Any, answered: list[int]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each answered assistant turn.

    The span of turn i runs from the end of render(messages[:i], generation prompt) to the end of
    render(messages[:i+1]): the turn's content and whatever closing marker the template writes.
    """
    text = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i in answered:
        start = len(_prefix(tokenizer, messages[:i], text, add_generation_prompt=True))
        end = len(_prefix(tokenizer, messages[: i + 1], text, add_generation_prompt=False))
        if end > start:
            spans.append((start, end))
    return text, spans


def _prefix(tokenizer: Any, head: Messages, full: str, *, add_generation_prompt: bool) -> str:
    rendered = _render(tokenizer, head, add_generation_prompt=add_generation_prompt)
    if not full.startswith(rendered):
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise DataError(
            f"chat template of {name} is not prefix-stable: rendering the first {len(head)} turns"
            f"{' with the generation prompt' if add_generation_prompt else ''} is not a prefix of rendering "
            "the whole conversation, so assistant tokens cannot be located; use a template that renders each "
            "turn independently (e.g. one that does not rewrite earlier turns)"
        )
    return rendered


def _render(tokenizer: Any, messages: Messages, *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja raise_exception(...) from the template, e.g. role-order rules
        roles = "/".join(m["role"] for m in messages)
        raise DataError(
            f"chat template rejected a conversation with roles {roles} "
            f"({type(e).__name__}: {(str(e).strip() or 'no details').splitlines()[0]}): "
            "fix the data or the template"
        ) from e


def _tokenize_spans(text: str, spans: list[tuple[int, int]], tokenizer: Any) -> tuple[list[int], list[int]]:
    """Tokenize `text` once (the template already wrote BOS) and mark tokens overlapping a span."""
    if not getattr(tokenizer, "is_fast", True):
        return _tokenize_segments(text, spans, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    in_span = bytearray(len(text) + 1)
    for start, end in spans:
        in_span[start:end] = b"\x01" * (end - start)
    mask = []
    for start, end in enc["offset_mapping"]:
        # Zero-width offsets (trimmed whitespace) fall back on their start character.
        mask.append(int(1 in in_span[start:end]) if end > start else in_span[start])
    return list(enc["input_ids"]), mask


def _tokenize_segments(
    text: str, spans: list[tuple[int, int]], tokenizer: Any
) -> tuple[list[int], list[int]]:
    # Tokenizers without offsets: encode each masked/unmasked segment separately. A token can then not
    # straddle a turn boundary, which can differ slightly from encoding the whole text.
    cuts = sorted({0, len(text), *(c for span in spans for c in span)})
    ids: list[int] = []
    mask: list[int] = []
    for a, b in zip(cuts, cuts[1:]):
        seg = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [int(any(s <= a < e for s, e in spans))] * len(seg)
    return ids, mask


def _tokenize_example(example: dict[str, Any], tokenizer: Any, max_length: int) -> dict[str, Any]:
    ids, mask = encode_with_mask(example["messages"], tokenizer)
    return {
        "input_ids": ids[:max_length],
        "loss_mask": mask[:max_length],
        "_num_tokens": len(ids),
        "_loss_tokens_full": sum(mask),
        "_loss_tokens": sum(mask[:max_length]),
    }


def tokenize_dataset(
    ds: datasets.Dataset, tokenizer: Any, max_length: int, num_proc: int = 1, *, allow_empty: bool = False
) -> tuple[datasets.Dataset, TokenizeStats]:
    """Tokenize a `messages` Dataset into columns input_ids (T_i,) and loss_mask (T_i,), T_i <= max_length.

    Conversations left without any assistant token are filtered out and counted in the stats. Raises
    DataError when nothing is kept, unless allow_empty (for small validation splits).
    """
    require_chat_template(tokenizer)
    if max_length < 1:
        raise DataError(f"max_length={max_length} must be positive: raise trainer.max_length")
    if "messages" not in ds.column_names:
        raise DataError(f"dataset to tokenize has no 'messages' column (columns: {ds.column_names})")
    if len(ds) == 0:  # datasets' map on 0 rows writes no columns at all
        if not allow_empty:
            raise _nothing_kept(TokenizeStats(), max_length)
        return _empty_tokenized(), TokenizeStats()
    procs = min(max(num_proc, 1), len(ds))
    # datasets fingerprints the function with the tokenizer and max_length, so reruns hit the cache.
    tokenized = ds.map(
        _tokenize_example,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
        remove_columns=ds.column_names,
        features=TOKENIZED_FEATURES,
        num_proc=procs if procs > 1 else None,
        desc="tokenizing",
    )
    stats = _count(tokenized, max_length)
    if stats.kept == 0 and not allow_empty:
        raise _nothing_kept(stats, max_length)
    kept = tokenized.filter(
        lambda n: [x > 0 for x in n], input_columns="_loss_tokens", batched=True, desc="dropping"
    )
    return kept.remove_columns(["_num_tokens", "_loss_tokens_full", "_loss_tokens"]), stats


def _empty_tokenized() -> datasets.Dataset:
    empty = {"input_ids": [], "loss_mask": []}
    return datasets.Dataset.from_dict(
        empty, features=datasets.Features({k: TOKENIZED_FEATURES[k] for k in empty})
    )


def _count(tokenized: datasets.Dataset, max_length: int) -> TokenizeStats:
    cols = tokenized.select_columns(["_num_tokens", "_loss_tokens_full", "_loss_tokens"]).with_format(
        "numpy"
    )[:]
    n_tokens = np.asarray(cols["_num_tokens"])
    full, kept = np.asarray(cols["_loss_tokens_full"]) > 0, np.asarray(cols["_loss_tokens"]) > 0
    return TokenizeStats(
        total=len(tokenized),
        kept=int(kept.sum()),
        truncated=int((kept & (n_tokens > max_length)).sum()),
        dropped=int((full & ~kept).sum()),
        empty=int((~full).sum()),
    )


def _nothing_kept(stats: TokenizeStats, max_length: int) -> DataError:
    if stats.total == 0:
        return DataError("dataset is empty: point data.path at data with at least one conversation")
    if stats.dropped == 0:
        return DataError(
            f"dataset has no assistant turns: none of the {stats.total} conversations has an assistant turn "
            "with content after a prompt; check data.format, data.role_field and data.role_map"
        )
    also = f" (the other {stats.empty} have no assistant turn)" if stats.empty else ""
    return DataError(
        f"all {stats.dropped} examples lost every assistant token when truncated to max_length={max_length}"
        f"{also}: raise trainer.max_length"
    )
