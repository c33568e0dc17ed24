"""Incremental detokenization for streaming: text as ids arrive, never half a character."""

from __future__ import annotations


class TextStream:
    """The text of one row's ids as they arrive, cut from the decoded text of ALL ids so far (a tokenizer
    spaces tokens in context), so the pieces join to `tokenizer.decode(all ids)`. A piece ending in U+FFFD
    waits: a character split over tokens decodes as that until its last byte arrives."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""  # the text handed out so far

    def push(self, ids: list[int]) -> str:
        """The new text after `ids` ('' while nothing new or a character is incomplete)."""
        self.ids.extend(ids)
        text = text_of(self.tokenizer, self.ids)
        return "" if text.endswith("\ufffd") else self._advance(text)

    def flush(self) -> str:
        """Whatever was held back (a partial character at the end shows as U+FFFD)."""
        return self._advance(text_of(self.tokenizer, self.ids))

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown) :], text
        return piece


def text_of(tokenizer, ids: list[int]) -> str:
    """The text of ids, special tokens skipped ('' without a tokenizer)."""
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
