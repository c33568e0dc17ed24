"""What a small op costs as the first one after a target forward, against the same op run again.

    python scripts/bench_cold_ops.py                  # the demo target, 6-token verify forwards
    python scripts/bench_cold_ops.py --tokens 1 --repeats 400
    python scripts/bench_cold_ops.py --medusa outputs/medusa2-demo/head   # + a Medusa draft, float / int8

The engine's share of a pass (`bench_overhead.py`) is the host work between the networks' calls. A
forward streams the target's weights through the CPU's caches, so the op that runs first after it
refills the caches with its own code and data: it costs several times what a micro-benchmark of it in
a loop says. This script measures that per op: after each forward ONE op is timed first ("cold"), then
again ("warm"), and after a copy that reads and writes as many bytes as the target's weights ("after
a copy": a like eviction without the forward). Medians over the repeats, the kinds taking turns.
`--medusa HEAD` adds a whole Medusa draft (`MedusaDrafter.propose` of a batch of one, the head's saved tree) with its
projections as trained and in int8 (heads/int8.py, `draft_int8`): the bytes a draft reads again after
each forward are what int8 cuts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from spechead.configs import demo_asset
from spechead.heads import load_head
from spechead.heads.directory import read_tree
from spechead.heads.int8 import to_int8
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.sampling import SamplingParams


def ops(logits: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, drafts: dict | None = None) -> dict:
    """The ops a decoding pass runs after the target's forward, on its logits [1, N, V] (and `drafts`,
    {name: fn}: whole drafts)."""
    return {
        **(drafts or {}),
        "numpy argmax of the logits (+ tolist)": lambda: logits.numpy().argmax(-1).tolist(),
        "torch argmax of the logits (+ tolist)": lambda: logits.argmax(-1).tolist(),
        "a view of the logits": lambda: logits[0, -1],
        "index_select of 5 ids": lambda: torch.index_select(table, 0, ids),
        "long tensor of 5 host ints (numpy)": lambda: torch.from_numpy(np.array([1, 2, 3, 4, 5])),
        "a Python sum of 20 ints": lambda: sum(range(20)),
    }


def medusa_drafts(head_dir: str, hidden_size: int) -> dict:
    """{name: fn} of one Medusa draft (a batch of one) from a random last state [1, H] with the head's projections as trained
    and in int8, each over the head's saved tree (none: the drafter's default)."""
    tree = read_tree(head_dir) or {}
    drafters = {}
    for kind in ("float32", "int8"):
        head = load_head(head_dir).float().eval()
        if kind == "int8" and not to_int8(head):
            raise SystemExit(f"error: --medusa {head_dir}: no projections to put in int8 (a shared lm_head?)")
        drafters[kind] = MedusaDrafter(head, tree.get("choices"))
        drafters[kind].last_hidden = torch.randn(1, hidden_size)  # [B, H], a batch of one
    greedy = [SamplingParams()]
    return {
        f"Medusa draft, {kind}": (lambda d=d: d.propose([5], greedy, [None])) for kind, d in drafters.items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(demo_asset("target")))
    p.add_argument("--tokens", type=int, default=6, help="tokens a forward runs (a verify of N nodes)")
    p.add_argument("--repeats", type=int, default=200, help="forwards per op")
    p.add_argument("--medusa", metavar="HEAD", help="also time a Medusa head's whole draft, float32 and int8")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        p.error("--tokens and --repeats must be >= 1")
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    weights = sum(x.numel() for x in model.parameters())
    src, dst = torch.randn(weights // 2), torch.empty(weights // 2)  # reads + writes: the weights' bytes
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens))
    table, picks = torch.arange(1024), torch.tensor([3, 1, 4, 1, 5])
    drafts = medusa_drafts(args.medusa, model.config.hidden_size) if args.medusa else None
    clock, spent = time.perf_counter, {}
    with torch.no_grad():
        logits = model(ids).logits
        names = list(ops(logits, picks, table, drafts))
        for i in range(args.repeats * len(names) * 2):
            name, copy = names[i % len(names)], (i // len(names)) % 2 == 1
            if copy:
                dst.copy_(src)
            else:
                logits = model(ids).logits  # [1, N, V]
            fn = ops(logits, picks, table, drafts)[name]
            for kind in ("after a copy" if copy else "cold", "warm"):
                start = clock()
                fn()
                spent.setdefault((name, kind), []).append(clock() - start)
    print(f"{args.target}: {weights / 1e6:.1f} M weights, forwards of {args.tokens} tokens; median us")
    print(f"{'op':40s} {'cold':>7s} {'after a copy':>13s} {'warm':>7s}")
    for name in names:
        cold, copied = (statistics.median(spent[(name, k)]) * 1e6 for k in ("cold", "after a copy"))
        warm = statistics.median(spent[(name, "warm")]) * 1e6
        print(f"{name:40s} {cold:7.1f} {copied:13.1f} {warm:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
