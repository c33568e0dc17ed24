"""Generate with a target and a drafter, printing the text and the speculative-decoding stats.

    python scripts/generate.py --target data/demo/target --drafter outputs/eagle3-demo/head \
        --prompt "What is the capital of France?" --chat
    python scripts/generate.py --target meta-llama/Llama-3.1-8B-Instruct --drafter prompt_lookup --prompt "..."

--drafter takes a spechead head directory or Hub id, a draft model (any causal LM with the target's
tokenizer), `prompt_lookup`, `lookahead` (default options), or nothing (plain decoding through the same
engine).
"""

from __future__ import annotations

import argparse
import json
import sys

import transformers

from spechead.inference.compiling import AUTO, compile_option
from spechead.inference.devices import DTYPE_CHOICES, DTYPE_HELP, check_device
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory or Hub id")
    p.add_argument(
        "--drafter", default=None,
        help="head dir/id, draft model dir/id, prompt_lookup, lookahead, cascade[:TINY+MEDIUM] (tiny -> medium -> "
        "target), or the target itself: layer_skip[@skip=2+3], early_exit[@layer=4], a drafter file from "
        "scripts/search_skip.py",
    )  # fmt: skip
    p.add_argument("--prompt", required=True, action="append", help="repeat for a batch (one row each)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument(
        "--compile", nargs="?", const=True, default=AUTO, type=compile_option, metavar="BACKEND",
        help="auto (the default: graphs on CUDA, off elsewhere), off (eager), inductor (plain --compile; CUDA: "
        "CUDA graphs of our own), graphs (no compiler: the eager passes as our CUDA graphs, ready in seconds), "
        "reduce-overhead (torch.compile's CUDA graphs) or a backend name: the target's verify pass and the drafter",
    )  # fmt: skip
    p.add_argument(
        "--compile-draft", nargs="?", const=True, default=False, type=compile_option, metavar="BACKEND",
        help="torch.compile the drafter only (EAGLE: the whole draft as one graph; CUDA: one CUDA graph), the "
        "target eager: the first answers compile (tens of seconds), later ones draft far cheaper",
    )  # fmt: skip
    p.add_argument(
        "--draft-fp8", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
        help="an EAGLE / EAGLE-3 head's per-depth layers in FP8 e4m3 (half the bytes a draft depth reads; GPUs "
        "of compute capability >= 8.9; lossless); auto (the default): on for such a head on such a GPU; "
        "bare --draft-fp8: on",
    )  # fmt: skip
    p.add_argument(
        "--draft-int8", default="auto", choices=("auto", "on", "off"),
        help="the head's big per-pass layers in int8 (a quarter of float32's bytes; CPUs; lossless); auto (the "
        "default): on for a Medusa head on an AVX512 CPU",
    )  # fmt: skip
    p.add_argument(
        "--stream", action="store_true",
        help="print text as it is accepted (several --prompt: one JSON line per piece, {\"row\": b, \"text\": ...})",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    try:
        # Check the decoding settings before loading anything (fail in a second, not after a load).
        check_device(args.device)
        SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        if args.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {args.max_new_tokens}")
        gen = SpeculativeGenerator.from_pretrained(
            args.target,
            args.drafter,
            device=args.device,
            dtype=args.dtype,
            compile=args.compile,
            draft_compile=args.compile_draft or None,
            draft_fp8={"on": True, "off": False}.get(args.draft_fp8, args.draft_fp8),
            draft_int8={"on": True, "off": False}.get(args.draft_int8, args.draft_int8),
        )
        chats = [[{"role": "user", "content": p}] for p in args.prompt]
        source = {"messages": chats[0]} if args.chat else {"prompt": args.prompt[0]}
        options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, seed=args.seed)  # fmt: skip
        batch = {"messages": chats} if args.chat else {"prompts": args.prompt}
        if args.stream and len(args.prompt) > 1:  # one JSON line per piece: {"row": b, "text": ...}
            for row, piece in gen.stream_batch(**batch, **options):
                print(json.dumps({"row": row, "text": piece}), flush=True)
            return _report(gen.last_batch_stats, args.json)
        if args.stream:
            for piece in gen.stream(**source, **options):
                print(piece, end="", flush=True)
            print()
            stats = gen.last_stats
        elif len(args.prompt) > 1:  # a batch: one target forward per pass over all rows
            results = gen.generate_batch(**batch, **options)
            for i, result in enumerate(results):
                print(f"--- row {i}\n{result.text}")
            return _report([r.stats for r in results], args.json)
        else:
            result = gen.generate(**source, **options)
            print(result.text)
            stats = result.stats
    except (ValueError, OSError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return _report([stats], args.json)


def _report(all_stats: list, as_json: bool) -> int:
    """Print each row's stats (JSON: one object, or a list for a batch); returns 0."""
    if as_json:
        dicts = [s.as_dict() for s in all_stats]
        print(json.dumps(dicts[0] if len(dicts) == 1 else dicts))
        return 0
    for stats in all_stats:
        print(
            f"\n[tau {stats.tau:.2f} tokens per target pass | {stats.new_tokens} tokens in {stats.target_passes} target passes | "
            f"{stats.accepted_tokens}/{stats.drafted_tokens} drafts accepted | {stats.tokens_per_s:.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
