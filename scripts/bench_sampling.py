"""What sampling costs a decoding step, by vocabulary size: spechead's top-p and draw against a sort and
torch.multinomial, torch against numpy (a CPU's path), and a tree's acceptance walk.

    python scripts/bench_sampling.py                            # V = 2048 (the demo), 32000, 128256
    python scripts/bench_sampling.py --vocab 128256 --rows 60 --device cuda

Per vocabulary size V and logits scale (logits = N(0, 1) x scale: the larger the scale, the fewer ids
the top-p nucleus holds; its size is printed), medians in microseconds:
- top-p of one row: a stable descending sort of the whole row (the definition), `sampling.nucleus` in
  torch (a top-k of 64, then 1024, then a sort; a GPU's path) and `sampling.host_nucleus` in numpy (a
  CPU's path; "-" on another device);
- draw, one row: torch.multinomial against `sampling.sample` (an inverse CDF in torch: numpy's was
  slower on a CPU, 15 against 11 us at V = 2048 and 0.45 against 0.22 ms at 128256);
- walk: `sample_accept` (rule A) on a chain of `--rows` nodes, each the best child of its parent: in
  torch with every row's target_probs made first (the engine before TargetRows and numpy rows), and as
  the engine walks now (`TargetRows`: a row made when the walk reads it; numpy rows on a CPU);
- walk, siblings: as the engine walks, a tree of `--rows` nodes whose root has the row's three best
  tokens as children (fewer when --rows < 4), the rest a chain of best children under the first: a flat
  row rejects its first children, and each rejection's residual is what rule A pays for.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spechead.inference.acceptance import sample_accept, walk
from spechead.inference.sampling import (
    SamplingParams,
    TargetRows,
    host_nucleus,
    nucleus,
    sample,
    torch_probs,
)
from spechead.inference.tree import TokenTree


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p keep mask [..., V] by a stable sort of the whole row (what `nucleus` replaced)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.cumsum(sorted_p, -1) - sorted_p < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def median_us(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in microseconds (synchronised on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def measure(
    vocab: int, scale: float, rows: int, top_p: float, repeats: int, device: torch.device
) -> dict[str, float]:
    """The timings of one vocabulary size and logits scale (see the module's docstring)."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g, device=device) * scale  # [N, V]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    probs = torch.softmax(logits, -1)  # [N, V]
    assert torch.equal(nucleus(probs, top_p), sorted_nucleus(probs, top_p))  # the same mask
    whole = torch_probs(logits, params)  # [N, V]
    tokens = torch.cat([torch.zeros(1, dtype=torch.long, device=device), whole[:-1].argmax(-1)])  # [N]
    chain = TokenTree(tokens, torch.arange(-1, rows - 1, device=device))  # each node's best child
    siblings = sibling_tree(whole)
    coins = torch.Generator(device=device).manual_seed(1)
    time_it = lambda fn: median_us(fn, repeats, device)  # noqa: E731
    host = probs[0].numpy() if device.type == "cpu" else None  # [V]
    return {
        "nucleus ids": float(nucleus(probs[0], top_p).sum()),
        "top-p sort": time_it(lambda: sorted_nucleus(probs[0], top_p)),
        "top-p torch": time_it(lambda: nucleus(probs[0], top_p)),
        "top-p numpy": time_it(lambda: host_nucleus(host, top_p)) if host is not None else float("nan"),
        "multinomial": time_it(lambda: int(torch.multinomial(whole[0], 1, generator=coins))),
        "draw": time_it(lambda: sample(whole[0], coins)),
        "walk torch, every row": time_it(
            lambda: walk(chain, torch_probs(logits, params), "deterministic", None, coins, host=False)
        ),
        "walk": time_it(
            lambda: sample_accept(chain, TargetRows(logits, params), "deterministic", None, coins)
        ),
        "walk, siblings": time_it(
            lambda: sample_accept(siblings, TargetRows(logits, params), "deterministic", None, coins)
        ),
    }


def sibling_tree(probs: torch.Tensor) -> TokenTree:
    """N nodes over probs [N, V]: the root's best min(3, N - 1) tokens as its children (in rank order),
    then a chain of best children under the first child (node i's child reads row i)."""
    rows = probs.shape[0]
    width = min(3, rows - 1)
    tokens = [0, *probs[0].topk(width).indices.tolist()]  # [1 + width]
    parents = [-1] + [0] * width
    for node in range(width + 1, rows):
        parent = 1 if node == width + 1 else node - 1
        tokens.append(int(probs[parent].argmax()))
        parents.append(parent)
    return TokenTree(torch.tensor(tokens, device=probs.device), torch.tensor(parents, device=probs.device))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[2048, 32000, 128256])
    p.add_argument("--scale", type=float, nargs="+", default=[6.0, 4.0, 2.0], help="logits = N(0, 1) x scale")
    p.add_argument("--rows", type=int, default=6, help="rows a verified tree has (its nodes)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if min(args.vocab) < 2 or args.rows < 2 or args.repeats < 1 or not 0 < args.top_p < 1:
        p.error("--vocab >= 2, --rows >= 2, --repeats >= 1 and 0 < --top-p < 1, please")
    device = torch.device(args.device)
    print(f"top-p {args.top_p}, {args.device}, walks of {args.rows} nodes, median of {args.repeats} (us)")
    header = None
    for vocab in args.vocab:
        for scale in args.scale:
            row = measure(vocab, scale, args.rows, args.top_p, args.repeats, device)
            if header is None:
                header = ["V", "scale", *row]
                print(" | ".join(header))
            cells = ("-" if x != x else f"{x:.0f}" for x in row.values())  # (NaN: not on this device)
            print(" | ".join([str(vocab), f"{scale:g}", *cells]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
