"""Peak training memory per head family: the memory plan at the 8B shape beside a measured run on a tiny one.

    python scripts/bench_memory.py                       # plan at Llama-3.1-8B's shape, max_length 2048 + tiny run
    python scripts/bench_memory.py --no-measure --seq-len 4096 --partitions 7

Plan (training/memory_plan.py's `from_run`, the lines train.py prints at start): a Llama-3.1-8B-shaped
target (bf16) and each family's head built on the meta device (no weights allocated), batch 1 of --seq-len
tokens, one process: eagle3 with its --ttt-steps TTT, peagle with K = --peagle-block and its
`loss.partitions` (--partitions, and 1 beside it), dflash with block --dflash-block, --dflash-layers layers
and its default anchors (sequence length // block: the plan's per-position work assumes them).

Measured (a CPU, a tiny Llama, random weights): each family's objective trains --steps steps (loss,
backward, AdamW) on one random batch; the peak resident memory above the resident memory before the
first step (Linux's VmHWM, reset through /proc/self/clear_refs; freed heap trimmed between families),
beside the plan's bytes for the same run less the weights already resident (gradients, AdamW state,
activations). RSS counts the allocator's slack too; the tensors' own peak is measured as well, over one
more step under torch.profiler's memory timeline (every live tensor but parameters and AdamW state:
gradients, activations, autograd's saved tensors, inputs; beside the plan's gradients + activations).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from spechead.heads.dflash import DFlashConfig, DFlashHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.peagle import PEagleConfig, PEagleHead
from spechead.training.memory_plan import GiB, MemoryPlan, from_run
from spechead.training.objectives.dflash import DFlashLossConfig, DFlashObjective
from spechead.training.objectives.eagle3 import Eagle3LossConfig, Eagle3Objective
from spechead.training.objectives.peagle import PEagleLossConfig, PEagleObjective
from spechead.training.target import FrozenTarget

SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=2048),
}  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048, help="max_length of the plan (default 2048)")
    p.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3's TTT steps")
    p.add_argument("--peagle-block", type=int, default=8, help="P-EAGLE's K")
    p.add_argument(
        "--partitions", type=int, default=4, help="P-EAGLE's loss.partitions (configs/head/peagle.yaml: 4)"
    )
    p.add_argument("--dflash-block", type=int, default=16, help="DFlash's block size")
    p.add_argument("--dflash-layers", type=int, default=5, help="DFlash drafter layers")
    p.add_argument("--no-measure", action="store_true", help="the plan only (no tiny run)")
    p.add_argument("--measure-seq-len", type=int, default=256, help="tokens per row of the tiny run")
    p.add_argument("--steps", type=int, default=3, help="training steps of the tiny run")
    p.add_argument("--out", type=Path, default=None, help="also write every number to this JSON file")
    args = p.parse_args(argv)
    for name in ("seq_len", "ttt_steps", "partitions", "dflash_layers", "steps", "measure_seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.peagle_block, args.dflash_block) < 2:
        p.error("--peagle-block and --dflash-block must be >= 2")
    return args


def variants(args: argparse.Namespace) -> list[tuple[str, str, dict, object]]:
    """(label, family, head overrides, loss config) per planned run."""
    peagle = {"block_size": args.peagle_block}
    out = [
        (f"eagle3 TTT {args.ttt_steps}", "eagle3", {"ttt_steps": args.ttt_steps}, Eagle3LossConfig()),
        (f"peagle K={args.peagle_block} partitions {args.partitions}", "peagle", peagle,
         PEagleLossConfig(partitions=args.partitions)),
        (f"dflash block {args.dflash_block}, {args.dflash_layers} layers", "dflash",
         {"block_size": args.dflash_block, "num_layers": args.dflash_layers}, DFlashLossConfig()),
    ]  # fmt: skip
    if args.partitions != 1:  # beside it: the unpartitioned parallel positions
        out.insert(2, (f"peagle K={args.peagle_block} partitions 1", "peagle", peagle, PEagleLossConfig()))
    return out


def objective_for(family: str, target_config: LlamaConfig, head: dict, loss: object):
    """The family's objective around a fresh head of the target's width (on the current default device)."""
    if family == "eagle3":
        cfg = Eagle3Config.from_target(
            target_config, draft_vocab_size=min(32000, target_config.vocab_size), **head
        )
        return Eagle3Objective(Eagle3Head(cfg), loss, cfg.ttt_steps)  # type: ignore[arg-type]
    if family == "peagle":
        cfg = PEagleConfig.from_target(
            target_config, draft_vocab_size=min(32000, target_config.vocab_size), **head
        )
        return PEagleObjective(PEagleHead(cfg), loss)  # type: ignore[arg-type]
    return DFlashObjective(DFlashHead(DFlashConfig.from_target(target_config, **head)), loss)  # type: ignore[arg-type]


def target(shape: str, device: str) -> tuple[LlamaConfig, FrozenTarget]:
    """A Llama of `shape` (bf16 on meta for the plan, fp32 on the CPU for the run) as a FrozenTarget."""
    cfg = LlamaConfig(**SHAPES[shape], rope_theta=500000.0, tie_word_embeddings=False)
    dtype = torch.bfloat16 if device == "meta" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return cfg, FrozenTarget(model, f"{shape} Llama")


def planned(frozen: FrozenTarget, objective, seq_len: int, batch: int = 1) -> MemoryPlan:
    """The plan train.py prints for this run (one process, no ZeRO, bf16 mixed precision)."""
    return from_run(
        frozen, objective, processes=1, stage=0, mixed_precision="bf16", batch_size=batch, seq_len=seq_len
    )


def plan_rows(args: argparse.Namespace) -> list[dict]:
    """Per variant at the 8B shape: the plan's GiB by part and in all."""
    cfg, frozen = target("8b", "meta")
    rows = []
    for label, family, head, loss in variants(args):
        with torch.device("meta"):
            p = planned(frozen, objective_for(family, cfg, head, loss), args.seq_len)
        rows.append({"run": label, "family": family, "total_gib": p.total / GiB, "head_activations_gib":
                     p.head_activations / GiB, "target_activations_gib": p.target_activations / GiB,
                     "head_state_gib": (p.head_weights + p.gradients + p.optimizer) / GiB})  # fmt: skip
    return rows


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settle() -> None:
    """Free what can be freed and reset the resident high-water mark to the resident size now."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    Path("/proc/self/clear_refs").write_text("5")


def tensor_peak(step) -> float | None:
    """Peak bytes of live tensors other than parameters and optimizer state while `step()` runs on the CPU
    (torch.profiler's memory timeline: a private torch API, so None where this torch lacks it)."""
    try:
        from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category, MemoryProfileTimeline
    except ImportError:
        return None
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    try:
        timeline = MemoryProfileTimeline(prof._memory_profile())
        _, sizes = timeline._coalesce_timeline("cpu")  # [time][1 + category index] bytes
        order = [None, *sorted(_CATEGORY_TO_INDEX, key=_CATEGORY_TO_INDEX.__getitem__)]  # the sizes' columns
    except (AttributeError, KeyError, RuntimeError):
        return None
    held = {order.index(Category.PARAMETER), order.index(Category.OPTIMIZER_STATE)}
    return float(max(sum(b for i, b in enumerate(row) if i not in held) for row in sizes))


def train_step(objective, model, frozen, batch, optimizer, step: int) -> None:
    """One step of the objective: loss, backward, AdamW."""
    loss, _ = objective.loss(model, frozen, batch, step)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_rows(args: argparse.Namespace) -> list[dict]:
    """Per variant at the tiny shape: measured peak RSS above the start of training beside the plan's
    gradients + AdamW state + activations for the same batch (2 rows of --measure-seq-len tokens)."""
    torch.manual_seed(0)
    cfg, frozen = target("tiny", "cpu")
    length, rows = args.measure_seq_len, []
    ids = torch.randint(0, cfg.vocab_size, (2, length))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    for label, family, head, loss in variants(args):
        objective = objective_for(family, cfg, head, loss)
        objective.head.attach_target_modules(lm_head=frozen.lm_head, embed_tokens=frozen.embed_tokens)
        model = objective.module().train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        p = planned(frozen, objective, length, batch=2)
        _settle()
        start = _status("VmRSS")
        step = partial(train_step, objective, model, frozen, batch, optimizer)
        for i in range(args.steps):
            step(i)
        peak = _status("VmHWM") - start
        tensors = tensor_peak(partial(step, args.steps))
        expected = p.total - p.target_weights - p.head_weights
        rows.append({"run": label, "family": family, "measured_mib": peak / 2**20, "plan_mib": expected / 2**20,
                     "tensor_peak_mib": None if tensors is None else tensors / 2**20,
                     "plan_work_mib": (p.gradients + p.head_activations + p.target_activations) / 2**20})  # fmt: skip
        del objective, model, optimizer, step
    return rows


def render(plan: list[dict], measured: list[dict], args: argparse.Namespace) -> str:
    """The two tables and the issue's memory target."""
    lines = [f"memory plan per process, Llama-3.1-8B shape (bf16 target, fp32 head, AdamW), batch 1 x {args.seq_len} "
             "tokens (training/memory_plan.py):",
             "| run | total GiB | head activations | target activations | head + grads + AdamW |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {r['run']} | {r['total_gib']:.2f} | {r['head_activations_gib']:.2f} | "
              f"{r['target_activations_gib']:.2f} | {r['head_state_gib']:.2f} |" for r in plan]  # fmt: skip
    eagle3 = plan[0]["total_gib"]
    peagle = next(r for r in plan if r["family"] == "peagle")
    lines.append(f"target (issue 56): P-EAGLE's parallel positions at max_length {args.seq_len} fit where EAGLE-3's "
                 f"TTT fits: plan {peagle['total_gib']:.2f} GiB ({peagle['run']}) vs {eagle3:.2f} GiB -> "
                 + ("met (in the plan)" if peagle["total_gib"] <= eagle3 else "NOT met (in the plan)"))  # fmt: skip
    if measured:
        lines += [f"\nmeasured on the CPU, tiny Llama (hidden 128, vocab 2048), 2 x {args.measure_seq_len} tokens, "
                  f"{args.steps} steps: peak RSS above the start vs the plan's grads + AdamW + activations; the "
                  "live tensors' peak (no parameters, no AdamW state) vs the plan's grads + activations",
                  "| run | measured RSS MiB | plan MiB | tensor peak MiB | plan MiB |", "|---|---:|---:|---:|---:|"]  # fmt: skip
        for r in measured:
            peak = "n/a" if r["tensor_peak_mib"] is None else f"{r['tensor_peak_mib']:.1f}"
            lines.append(f"| {r['run']} | {r['measured_mib']:.1f} | {r['plan_mib']:.1f} | {peak} | "
                         f"{r['plan_work_mib']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    plan = plan_rows(args)
    measured = [] if args.no_measure else measure_rows(args)
    print(render(plan, measured, args))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"plan": plan, "measured": measured}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
