"""Export a spechead head for a serving engine, then check the export by loading it back.

    python scripts/export.py HEAD_DIR --format speculators --out exported/   # EAGLE-3 -> vLLM
    python scripts/export.py HEAD_DIR --format sglang --out exported/        # EAGLE-3 -> SGLang
    python scripts/export.py HEAD_DIR --format medusa --out exported/        # Medusa -> vLLM
    python scripts/export.py HEAD_DIR --format eagle --out exported/         # EAGLE-1/2 -> EAGLE authors' engine, vLLM
    python scripts/export.py HEAD_DIR --format speculators --mask-token-id ID --out exported/  # P-EAGLE -> vLLM
    python scripts/export.py HEAD_DIR --format sglang --out exported/        # DFlash -> SGLang (DFLASH)

HEAD_DIR is a head saved by spechead (a local directory or a Hub id). The export is re-imported
through spechead's loader and its tensors compared with the head's (printed as a check); the P-EAGLE and
DFlash layouts have no importer yet, so their check is skipped (said so).
The speculators and eagle layouts hold the target's input embedding, read from the target checkpoint
(--target, default: the head's target); --no-embedding leaves it out of a speculators export (vLLM then
shares the target's; speculators' own model cannot); a head with its own embedding ships that one (no
target is read). A verifier that is a local path is written as
its directory's name, with a note.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from spechead.heads import HeadError, load_head
from spechead.heads.dtypes import DTYPES
from spechead.heads.formats import FORMATS, export_formats, export_head
from spechead.heads.formats.eagle3_export import portable_verifier
from spechead.heads.formats.weights import target_embedding

EMBEDDED = ("eagle", "speculators")  # layouts that hold a copy of the target's input embedding
NO_IMPORTER = {("peagle", "speculators"), ("dflash", "sglang")}  # (family, format) spechead cannot reload


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
        type=int,
        default=None,
        help="P-EAGLE (speculators): the token whose embedding row carries the head's mask embedding",
    )
    p.add_argument(
        "--no-embedding",
        action="store_true",
        help="speculators: leave the target's embedding out (vLLM shares the target's)",
    )
    return p.parse_args(argv)


def check_round_trip(head, out: Path, dtype: torch.dtype | None) -> int:
    """Reload the export with spechead's loader; HeadError unless every tensor matches the head's."""
    back = load_head(out)
    mine, theirs = head.state_dict(), back.state_dict()
    if set(mine) != set(theirs):
        raise HeadError(
            f"the export in {out} reloads with other tensors than the head's: {sorted(set(mine) ^ set(theirs))[:4]}"
        )
    for name, tensor in mine.items():
        expected = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        if not torch.equal(theirs[name].to(expected.dtype), expected):
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
            if head.family != "peagle":
                raise HeadError(f"--mask-token-id is for P-EAGLE heads, not {head.family}")
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
        reloadable = (head.family, args.fmt) not in NO_IMPORTER
        checked = check_round_trip(head, out, dtype) if reloadable else 0
    except (HeadError, OSError) as err:  # OSError: the output directory cannot be written
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.head} ({head.family}) as {args.fmt} to {out}")
    note = portable_verifier(args.verifier or head.config.target_name_or_path)[1]
    if args.fmt == "speculators" and note:
        print(f"note: {note}")
    if reloadable:
        print(f"round-trip check: reloaded with spechead, {checked} tensors identical")
    else:
        print(f"round-trip check: skipped (spechead cannot import the {head.family} {args.fmt} layout yet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
