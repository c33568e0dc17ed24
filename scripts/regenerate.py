"""Self-distillation data: rewrite a dataset's assistant turns with the target's own answers.

    python scripts/regenerate.py --target data/demo/target --data data/demo/chat.jsonl \\
        --out outputs/regenerated/chat.jsonl --max-examples 200
    python train.py data=jsonl data.path=outputs/regenerated/chat.jsonl ...

Heads trained on what the target itself writes accept more of its tokens when decoding. System and
user turns are kept; every assistant turn is replaced by the target's generation given the conversation
so far (chat template, batched `generate`). The output is `messages` JSONL, the format the training
data loader reads. Input: any format the loader reads (messages or ShareGPT; json/jsonl/parquet/Hub).

Resumable: rows are written and fsynced one batch at a time, with OUT.state.json beside them; run
the same command again to continue (or with a larger --max-examples to extend). Settings that change
the answers must match the file's, else it refuses: choose a new --out or pass --overwrite.
Deterministic given --seed (sampling uses one generator per conversation and answer).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spechead.data.chat import require_chat_template
from spechead.data.conversations import DataConfig, load_conversations
from spechead.data.errors import DataError
from spechead.data.regenerate import RegenerateSettings, regenerate_into, run_key
from spechead.data.resumable_jsonl import ResumableJsonl
from spechead.heads.dtypes import DTYPES
from spechead.inference.devices import check_device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory or Hub id")
    p.add_argument("--data", required=True, help="json/jsonl/parquet file, folder, or Hub dataset id")
    p.add_argument("--out", required=True, type=Path, help="output .jsonl file")
    p.add_argument("--max-examples", type=int, default=None, help="regenerate the first N conversations")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", choices=["all", "first"], default="all",
                   help="all: replace every answer; first: keep the conversation up to its first answer")  # fmt: skip
    p.add_argument("--answer-last-user", action="store_true",
                   help="append an answer to conversations ending with a user turn (prompt-only data)")  # fmt: skip
    p.add_argument("--data-format", default="auto", choices=["auto", "messages", "sharegpt"])
    p.add_argument("--messages-field", default=None, help="column holding the turns")
    p.add_argument("--split", default="train")
    p.add_argument("--subset", default=None, help="Hub dataset config name")
    p.add_argument("--chat-template", default=None, help="a .jinja file to use instead of the tokenizer's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (1 is much faster on a busy machine)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="discard an existing --out and start over")
    return p.parse_args(argv)


def load_tokenizer(target: str, chat_template: str | None):
    """The target's tokenizer (with --chat-template applied); DataError when it cannot chat."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as err:
        raise DataError(f"--target {target}: no tokenizer could be loaded ({_first_line(err)})") from None
    if chat_template:
        path = Path(chat_template)
        if not path.is_file():
            raise DataError(f"--chat-template {chat_template}: no such file")
        tokenizer.chat_template = path.read_text()
    require_chat_template(tokenizer)
    return tokenizer


def load_model(target: str, dtype: str, device: str):
    try:
        # straight onto the device, shard by shard (not staged whole in host memory)
        model = AutoModelForCausalLM.from_pretrained(
            target, dtype=DTYPES[dtype], device_map=torch.device(device)
        )
        return model.eval()
    except (OSError, ValueError, RuntimeError) as err:
        raise DataError(
            f"--target {target} could not be loaded as a causal LM ({_first_line(err)})"
        ) from None


def _canonical(name: str) -> str:
    """Local paths as absolute paths (the same file from any folder), Hub ids as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def _first_line(err: BaseException) -> str:
    return (str(err).strip() or type(err).__name__).splitlines()[0][:300]


def run(args: argparse.Namespace) -> str:
    """Regenerate into args.out; returns the summary line."""
    settings = RegenerateSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, batch_size=args.batch_size, turns=args.turns,
        answer_last_user=args.answer_last_user,
    )  # fmt: skip
    if args.max_examples is not None and args.max_examples < 1:
        raise DataError(f"--max-examples {args.max_examples} must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise DataError(f"--threads {args.threads} must be at least 1")
    try:
        check_device(args.device)  # before any loading: one line, not a CUDA traceback after minutes
    except ValueError as err:
        raise DataError(str(err)) from None
    data_cfg = DataConfig(path=args.data, format=args.data_format, messages_field=args.messages_field,
                          split=args.split, subset=args.subset)  # fmt: skip
    data_key = {k: getattr(data_cfg, k) for k in ("path", "format", "messages_field", "split", "subset")}
    data_key["path"] = _canonical(args.data)
    if data_key["path"] == _canonical(str(args.out)):
        raise DataError(f"--out {args.out} is the input data: write the regenerated data to another file")
    tokenizer = load_tokenizer(args.target, args.chat_template)
    try:
        config = AutoConfig.from_pretrained(args.target)
    except (OSError, ValueError) as err:
        raise DataError(
            f"--target {args.target}: no model config could be loaded ({_first_line(err)})"
        ) from None
    key = run_key(_canonical(args.target), config, tokenizer, args.dtype, data_key, settings)
    writer = ResumableJsonl(args.out, key, overwrite=args.overwrite)  # refuses other settings before loading
    conversations = load_conversations(data_cfg)
    total = len(conversations) if args.max_examples is None else min(args.max_examples, len(conversations))
    if writer.rows >= total:
        return f"{args.out}: already has {writer.rows} conversations (nothing to do)"
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.target, args.dtype, args.device)
    started = time.perf_counter()
    with tqdm(total=total, initial=writer.rows, unit="conv", desc="regenerating") as bar:
        stats = regenerate_into(writer, model, tokenizer, conversations, settings, limit=total,
                                progress=bar.update)  # fmt: skip
    return f"{args.out}: {stats.summary()}; this run {time.perf_counter() - started:.1f} s"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    try:
        print(run(args))
    except DataError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the finished batches are in {args.out}; rerun to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
