"""Where a parallel head's (DFlash, P-EAGLE) validation tau and its decoded tau part ways, on the target's
own greedy answers.

For each prompt (its first turn) the target's greedy answer is decoded twice (plain, and with the head
drafting a chain), and the head's block is computed at EVERY anchor c of the answer through the training
path (DFlash's `predict_blocks`, P-EAGLE's `parallel_logits`: the calls training's validation makes); a_c =
its leading drafts equal to the answer. Printed (and written as JSON with --out):
- all_anchor_tau: the mean of 1 + a_c over every anchor: what training's validation chain tau counts;
- path_tau: 1 + a_c over the anchors decoding visits (c -> c + 1 + a_c from the prompt's last token), and
  passes_equal: the share of prompts whose decoded passes are those path lengths (the final pass aside,
  cut by the end of the answer): 1.0 when decoding drafts what training measured;
- decoded_tau: the engine's passes (the final pass of each answer left out, as in path_tau);
- depth1_after_miss / depth1_after_hit: the first draft's accuracy at anchors whose previous anchor's first
  draft missed / hit (a pass starts after a miss);
- root_reads: the share of anchors whose first draft changes when only the root token is swapped for a
  random one, the context kept (a head that ignores its root predicts the token after the one it expected).

    python scripts/parallel_anchors.py --target data/demo/target --head outputs/dflash-demo/head --prompts 24
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import AutoTokenizer

from spechead.data.prompt_sets import load_prompt_set
from spechead.heads.dflash import DFlashHead
from spechead.heads.peagle import PEagleHead
from spechead.inference import SpeculativeGenerator
from spechead.inference.drafters.block_tree import chain_choices
from spechead.inference.target.runner import TargetRunner


def leading_right(drafts: torch.Tensor, seq: torch.Tensor, anchors: torch.Tensor) -> list[int]:
    """a_c per anchor: drafts [A, D] (draft d of anchor c is x_{c+2+d}), seq [T], anchors [A] -> how many
    leading drafts equal seq (a draft past the end is wrong)."""
    count = []
    for row, c in zip(drafts.tolist(), anchors.tolist()):
        a = 0
        while a < len(row) and c + 2 + a < len(seq) and row[a] == int(seq[c + 2 + a]):
            a += 1
        count.append(a)
    return count


def path(right: dict[int, int], start: int) -> list[int]:
    """The accept lengths 1 + a_c of the anchors decoding visits from `start` (c -> c + 1 + a_c)."""
    out, c = [], start
    while c in right:
        out.append(1 + right[c])
        c += 1 + right[c]
    return out


@torch.inference_mode()
def context_of(head: DFlashHead | PEagleHead, runner: TargetRunner, seq: torch.Tensor) -> torch.Tensor:
    """The fused target states [1, T, H] over seq [T] (what every block attends to)."""
    hidden = runner.prefill([seq])[1][0]  # {layer: [T, H]}
    return head.fuse([hidden[layer][None] for layer in head.config.target_layers])


@torch.inference_mode()
def block_drafts(
    head: DFlashHead | PEagleHead, context: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Every anchor's block drafts [A, D] (top-1, target ids), the training path: context [1, T, H], the
    blocks' root tokens read from ids [T] (ids[c + 1] for anchor c). DFlash: D = block_size - 1 (block
    position 0 is the root); P-EAGLE: D = K (slot 0 is the real position c, which reads x_{c+1})."""
    if isinstance(head, PEagleHead):
        return head.draft_to_target(head.parallel_logits(context, ids[None], anchors)[0].argmax(-1))  # [A, K]
    blocks = head.predict_blocks(context, ids[None], anchors[None])[0]  # [A, bs, H]
    return head.logits(blocks[:, 1:]).argmax(-1)  # [A, bs - 1]


def analyse(target: str, head_dir: str, prompts: list[list[int]], max_new_tokens: int, seed: int = 0) -> dict:
    """The figures above for prompt ids `prompts` (lists of token ids)."""
    plain = SpeculativeGenerator.from_pretrained(target, None)
    loaded = SpeculativeGenerator.from_pretrained(target, head_dir, calibrate=False)
    head = getattr(loaded.drafter, "head", None)
    if not isinstance(head, (DFlashHead, PEagleHead)):
        raise SystemExit(f"error: {head_dir} is not a parallel (DFlash or P-EAGLE) head")
    # the chain of every block position's best draft, whatever tree the head's tree.json pins: what the walk
    # walks
    slots = head.block_size if isinstance(head, PEagleHead) else head.config.block_size - 1
    chain = loaded.drafter.with_tree(chain_choices(slots))
    gen = SpeculativeGenerator(plain.target, plain.tokenizer, chain)
    runner = TargetRunner(plain.target, tuple(head.config.target_layers))
    random = torch.Generator().manual_seed(seed)
    every, visited, decoded, equal, reads = [], [], [], [], []
    after = {True: [], False: []}  # previous anchor's first draft hit -> this anchor's first draft right
    for ids in prompts:
        answer = plain.generate(input_ids=ids, max_new_tokens=max_new_tokens).token_ids
        passes = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens).stats.accept_lengths
        seq = torch.tensor(ids + answer)  # [T]
        anchors = torch.arange(len(ids) - 1, len(seq) - 2)  # [A]: the root c + 1 is an answer token
        if not len(anchors):
            continue
        context = context_of(head, runner, seq)  # [1, T, H]
        drafts = block_drafts(head, context, seq, anchors)  # [A, D]
        right = dict(zip(anchors.tolist(), leading_right(drafts, seq, anchors)))
        walk = path(right, len(ids) - 1)
        every += [1 + a for a in right.values()]
        visited += walk[:-1]
        decoded += passes[:-1]
        equal.append(walk[:-1] == passes[:-1])  # the final pass aside, cut by the answer's end
        swapped = seq.clone()
        swapped[len(ids) :] = torch.randint(0, head.config.vocab_size, (len(answer),), generator=random)
        first = drafts[:, 0] == seq[anchors + 2]  # [A]
        reads += (block_drafts(head, context, swapped, anchors)[:, 0] != drafts[:, 0]).tolist()
        for prev, now in zip(first[:-1].tolist(), first[1:].tolist()):
            after[prev].append(now)

    def mean(xs: list) -> float:
        return round(sum(xs) / len(xs), 4) if xs else float("nan")

    return {
        "prompts": len(prompts),
        "anchors": len(every),
        "all_anchor_tau": mean(every),
        "path_tau": mean(visited),
        "decoded_tau": mean(decoded),
        "passes_equal": mean(equal),
        "depth1_after_miss": mean(after[False]),
        "depth1_after_hit": mean(after[True]),
        "root_reads": mean(reads),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="the target model (directory or Hub id)")
    p.add_argument("--head", required=True, help="a DFlash or P-EAGLE head directory or Hub id")
    p.add_argument("--prompt-set", default="demo", help="a built-in prompt set or a JSONL file")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1:
        p.error("--prompts and --max-new-tokens must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ids = []
    for prompt in load_prompt_set(args.prompt_set, args.prompts):
        chat = [{"role": "user", "content": prompt.turns[0]}]
        made = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids.append(list(made["input_ids"] if isinstance(made, Mapping) else made))
    figures = analyse(args.target, args.head, ids, args.max_new_tokens)
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
