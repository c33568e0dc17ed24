"""TextStream: streamed pieces join to the whole text and never carry half a character."""

from __future__ import annotations

from spechead.inference.text_stream import TextStream


def test_pieces_join_to_the_text_without_half_characters(chatml_tokenizer):
    tok = chatml_tokenizer
    ids = tok("naïve café ✓ 東京 done", add_special_tokens=False)["input_ids"]
    whole = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" in "".join(tok.decode(ids[:i]) for i in range(1, len(ids)))  # some ids split a character
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == whole
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") > 1  # held back while a character was incomplete (and at the flush)


def test_flush_hands_out_what_is_held_back(chatml_tokenizer):
    tok = chatml_tokenizer
    ids = tok("ok ✓", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok)
    shown = stream.push(ids[:-1])  # the check mark's last byte is missing
    assert "\ufffd" not in shown
    # the end as decoded, replacement character and all
    assert shown + stream.flush() == tok.decode(ids[:-1])
    assert TextStream(None).push([1, 2]) == ""  # no tokenizer: ids only, no text


def test_each_new_character_comes_out_at_once(chatml_tokenizer):
    """A push that completes text hands all of it out then, down to a single new character (nothing
    waits for the flush but a partial character)."""
    tok = chatml_tokenizer
    stream = TextStream(tok)
    for i in tok("a b c ✓ x", add_special_tokens=False)["input_ids"]:
        shown = stream.shown
        text = tok.decode(stream.ids + [i], skip_special_tokens=True)
        piece = stream.push([i])
        if not text.endswith("\ufffd"):
            assert shown + piece == text  # everything decoded so far is out
    assert stream.flush() == ""
