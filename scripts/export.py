"""Export a spechead head for a serving engine, then check the export by loading it back.

    python scripts/export.py HEAD_DIR --format speculators --out exported/   # EAGLE-3 -> vLLM
    python scripts/export.py HEAD_DIR --format sglang --out exported/        # EAGLE-3 -> SGLang
    python scripts/export.py HEAD_DIR --format medusa --out exported/        # Medusa -> vLLM
    python scripts/export.py HEAD_DIR --format eagle --out exported/         # EAGLE-1/2 -> EAGLE authors' engine, vLLM
    python scripts/export.py HEAD_DIR --format speculators --mask-token-id auto --out exported/  # P-EAGLE -> vLLM
    python scripts/export.py HEAD_DIR --format sglang --out exported/        # DFlash -> SGLang (DFLASH)
    python scripts/export.py HEAD_DIR --format vllm --out exported/          # DFlash -> vLLM (dflash)

HEAD_DIR is a head saved by spechead (a local directory or a Hub id). The export is re-imported
through spechead's loader and its tensors compared with the head's (printed as a check): bit for bit,
except P-EAGLE's mask_hidden, which the speculators layout stores before fc (the import re-applies fc:
equal up to rounding), and the mask token's row of a P-EAGLE head's own embedding, which the layout
shares with the mask embedding.
The speculators and eagle layouts hold the target's input embedding, read from the target checkpoint
(--target, default: the head's target); --no-embedding leaves it out of a speculators export (vLLM then
shares the target's; speculators' own model cannot); a head with its own embedding ships that one (no
target is read). A verifier that is a local path is written as
its directory's name, with a note. --mask-token-id (P-EAGLE; DFlash with a learned mask, --format vllm)
names the token the mask embedding stands in for; auto takes one the target never reads from the target's
tokenizer, by DFlash's rule (<|MASK|>, the first embedding row past the tokenizer's tokens, the lowest
reserved token); a target without one needs an explicit id. A vllm export of a learned-mask DFlash head
ships the embedding in mask_embedding.pt, which the round trip reads back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from spechead.heads import HeadError, load_head
from spechead.heads.dtypes import DTYPES
from spechead.heads.formats import FORMATS, export_formats, export_head
from spechead.heads.formats.dflash_export import sglang_mask_token_id
from spechead.heads.formats.eagle3_export import portable_verifier
from spechead.heads.formats.peagle_export import with_mask_row
from spechead.heads.formats.weights import target_embedding

EMBEDDED = ("eagle", "speculators")  # layouts that hold a copy of the target's input embedding
RECOMPUTED = ("mask_hidden",)  # stored in another form and recomputed on import: equal up to rounding


def mask_token(text: str) -> int | str:
    """--mask-token-id: a token id or "auto" (argparse names this function in its error)."""
    return text if text == "auto" else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", help="spechead head directory or Hub id")
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt", help="layout to write")
    p.add_argument("--out", required=True, help="new (or empty) output directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weight dtype (default: the head's)")
    p.add_argument(
        "--verifier",
        default=None,
        help="speculators: the target's Hub id to record (default: the head's target)",
    )
    p.add_argument("--speculative-tokens", type=int, default=3, help="speculators: default draft length")
    p.add_argument(
        "--target",
        default=None,
        help="eagle, speculators: the target checkpoint whose embedding the layout holds (default: the head's target)",
    )
    p.add_argument(
        "--mask-token-id",
        type=mask_token,
        default=None,
        help="P-EAGLE (speculators), DFlash with a learned mask (vllm): the token whose embedding the head's "
        "mask embedding stands in for, or auto (one the target's tokenizer never produces)",
    )
    p.add_argument(
        "--no-embedding",
        action="store_true",
        help="speculators: leave the target's embedding out (vLLM shares the target's)",
    )
    return p.parse_args(argv)


def expected_tensors(head, mask_token_id: int | None) -> dict[str, torch.Tensor]:
    """The head's tensors as its export reloads them: a P-EAGLE layout holds the mask embedding in the
    mask token's row of the embedding it ships, so a head's own table comes back with that row replaced."""
    tensors = dict(head.state_dict())
    if head.family == "peagle" and "embed_tokens.weight" in tensors and mask_token_id is not None:
        tensors["embed_tokens.weight"] = with_mask_row(
            tensors["embed_tokens.weight"], tensors["mask_embedding"], mask_token_id
        )
    return tensors


def unread_token_id(target: str | None, head) -> int:
    """--mask-token-id auto: a token id of `target` its tokenizer never produces (sglang_mask_token_id's
    rule), HeadError when there is none or no target to read."""
    if not target:
        raise HeadError("--mask-token-id auto reads the target's tokenizer: pass --target TARGET")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    chosen = sglang_mask_token_id(tokenizer.get_vocab(), len(tokenizer), head.config.vocab_size)
    if chosen < 0:
        raise HeadError(
            f"--mask-token-id auto found no token {target} never reads (no <|MASK|>, no embedding row past its "
            f"{len(tokenizer)} tokens, no reserved special token): pass --mask-token-id ID of one its data never holds"
        )
    return chosen


def check_round_trip(head, out: Path, dtype: torch.dtype | None, mask_token_id: int | None = None) -> int:
    """Reload the export with spechead's loader; HeadError unless every tensor matches the head's."""
    back = load_head(out)
    mine, theirs = expected_tensors(head, mask_token_id), back.state_dict()
    if set(mine) != set(theirs):
        raise HeadError(
            f"the export in {out} reloads with other tensors than the head's: {sorted(set(mine) ^ set(theirs))[:4]}"
        )
    for name, tensor in mine.items():
        expected = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        got = theirs[name].to(expected.dtype)
        if name in RECOMPUTED:  # a float64 solve, cast to the export's dtype, then fc again: its rounding
            scale = expected.double().abs().max().clamp_min(1e-30)
            error = float((got.double() - expected.double()).abs().max() / scale)
            same = error <= (1e-5 if expected.dtype in (torch.float32, torch.float64) else 5e-2)
        else:
            same = torch.equal(got, expected)
        if not same:
            raise HeadError(f"the export in {out} reloads {name} with other values than the head's")
    return len(mine)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).expanduser()
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise HeadError(f"--out {out} exists and is not an empty directory: choose a new one")
        head = load_head(args.head)
        if args.fmt not in export_formats(head):
            valid = ", ".join(export_formats(head)) or "none"
            raise HeadError(f"{args.head} is a {head.family} head; formats for {head.family} heads: {valid}")
        options = {"verifier": args.verifier, "speculative_tokens": args.speculative_tokens}
        if args.mask_token_id is not None:
            if head.family not in ("peagle", "dflash"):
                raise HeadError(f"--mask-token-id is for P-EAGLE and DFlash heads, not {head.family}")
            if head.family == "dflash" and head.config.mask_token_id >= 0 and args.mask_token_id == "auto":
                args.mask_token_id = head.config.mask_token_id  # (its masks are that token already)
            if args.mask_token_id == "auto":
                args.mask_token_id = unread_token_id(args.target or head.config.target_name_or_path, head)
                print(
                    f"--mask-token-id auto: {args.mask_token_id}, a token the target's tokenizer never produces"
                )
            options["mask_token_id"] = args.mask_token_id
        if args.no_embedding and args.fmt != "speculators":
            raise HeadError(f"--no-embedding is for --format speculators, not {args.fmt}")
        options["with_embedding"] = not args.no_embedding
        own = bool(getattr(head.config, "own_embedding", False))  # the head ships its own embedding
        if args.fmt in EMBEDDED and not args.no_embedding and not own:  # the layout holds the target's
            target = args.target or head.config.target_name_or_path
            if not target:
                raise HeadError("the head does not record its target: pass --target TARGET")
            options["embedding"] = target_embedding(target)
        export_head(head, args.fmt, out, dtype=dtype, **options)
        checked = check_round_trip(head, out, dtype, args.mask_token_id)
    except (HeadError, OSError) as err:  # OSError: the output directory cannot be written
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.head} ({head.family}) as {args.fmt} to {out}")
    note = portable_verifier(args.verifier or head.config.target_name_or_path)[1]
    if args.fmt == "speculators" and note:
        print(f"note: {note}")
    rounded = [name for name in RECOMPUTED if name in head.state_dict()]
    close = (
        f" ({', '.join(rounded)} equal up to rounding: the layout stores it in another form)"
        if rounded
        else ""
    )
    print(f"round-trip check: reloaded with spechead, {checked} tensors identical{close}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
