"""The training loop, top to bottom: set up (setup.py), step, evaluate, checkpoint, finish.

Only this module (with setup.py, checkpoint.py and tracking.py) knows about `Accelerator`. The head is a
plain module; the frozen target is moved to the device as a replica and never wrapped, since it has no
gradients to synchronise.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from spechead.heads import hub
from spechead.heads.errors import HeadError
from spechead.training import checkpoint, tracking
from spechead.training.decode_eval import DecodeEval, TreeTune
from spechead.training.errors import TrainError
from spechead.training.metrics import best_score
from spechead.training.objectives import Objective
from spechead.training.settings import TrainSettings
from spechead.training.setup import Run, setup
from spechead.training.target import FrozenTarget


@dataclass
class TrainResult:
    head_dir: Path
    metrics: dict[str, float]
    steps: int
    seconds: float
    tokens_per_second: float


@dataclass
class Meter:
    """Training throughput: tokens over the time spent training (evaluation and checkpoints excluded)."""

    started: float = field(default_factory=time.perf_counter)
    window_start: float = field(default_factory=time.perf_counter)  # of the current logging window
    window_tokens: int = 0
    run_tokens: int = 0  # this process's run, not the resumed steps before it
    paused: float = 0.0

    def pause(self, seconds: float) -> None:
        self.paused += seconds
        self.window_start += seconds


def train(
    s: TrainSettings, decode_eval: DecodeEval | None = None, tune_tree: TreeTune | None = None
) -> TrainResult:
    """Train a head as `s` says; resumable; returns where the head went and its final metrics.

    `decode_eval` decodes real prompts with the head at `trainer.decode_eval_every` steps and at the end;
    `tune_tree` tunes the saved head's tree for this device at the end (`trainer.tree_tune_prompts`).
    train.py passes spechead.inference's; training itself never imports inference.
    """
    run = setup(s, decode_eval, tune_tree)
    state, meter = run.state, Meter()
    last_eval: dict[str, float] | None = None
    bar = tqdm(
        total=run.max_steps, initial=state.step, disable=not run.main, desc="train", unit="step",
        dynamic_ncols=True,
    )  # fmt: skip
    run.model.train()
    while state.step < run.max_steps:
        run.train_loader.set_epoch(state.epoch)
        for batch in run.accelerator.skip_first_batches(run.train_loader, state.batch_in_epoch):
            loss, logs = step(run, batch)
            meter.window_tokens += _tokens(batch)
            if not run.accelerator.sync_gradients:
                continue  # accumulating: the optimizer has not stepped
            run.scheduler.step()
            state.step += 1
            bar.update(1)
            if _due(run, s.trainer.log_every):
                bar.set_postfix(log(run, meter, loss, logs))

            pause_start = time.perf_counter()  # eval and checkpoints do not count as training time
            if _due(run, s.trainer.eval_every):
                last_eval = evaluate_and_keep_best(run)
            if run.decoder.due(state.step, run.max_steps):
                decoded = run.decoder.run(
                    run.target.model, run.tokenizer, run.objective.head, run.out, state.step
                )
                run.metrics_file.write(state.step, decoded)
                run.model.train()
            if _due(run, s.trainer.save_every):
                checkpoint.save(run.accelerator, run.out, state, s.trainer.keep_checkpoints)
            meter.pause(time.perf_counter() - pause_start)
            if state.step >= run.max_steps:
                break
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
    bar.close()
    return finish(run, meter, last_eval)


def step(run: Run, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch: forward, backward and (when gradients sync) the clipped optimizer step."""
    run.state.batch_in_epoch += 1
    with run.accelerator.accumulate(run.model):
        loss, logs = run.objective.loss(run.model, run.target, batch, run.state.step)
        run.accelerator.backward(loss)
        if run.accelerator.sync_gradients and run.s.trainer.grad_clip > 0:
            run.accelerator.clip_grad_norm_(run.model.parameters(), run.s.trainer.grad_clip)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    return loss, logs


def log(run: Run, meter: Meter, loss: torch.Tensor, logs: dict[str, float]) -> dict[str, str]:
    """Log the window's loss, learning rate and throughput (all processes); the progress-bar fields."""
    acc = run.accelerator
    tokens = int(acc.reduce(torch.tensor(meter.window_tokens, device=acc.device), "sum"))
    mean_loss = float(acc.reduce(loss.detach(), "mean"))
    tok_s = tokens / max(time.perf_counter() - meter.window_start, 1e-9)
    run.state.tokens += tokens
    meter.run_tokens += tokens
    meter.window_start, meter.window_tokens = time.perf_counter(), 0
    row = {"train/loss": mean_loss, "train/lr": run.scheduler.get_last_lr()[0], "train/tokens_per_s": tok_s}
    row.update({f"train/{k}": v for k, v in logs.items()})
    row.update({f"train/{k}": v for k, v in peak_memory(acc).items()})
    acc.log(row, step=run.state.step)
    run.metrics_file.write(run.state.step, row)
    return {"loss": f"{mean_loss:.3f}", "tok_s": f"{tok_s:,.0f}"}


def evaluate_and_keep_best(run: Run) -> dict[str, float]:
    """Evaluate on the validation split, report it, and save the head as OUT/best when its tau improved
    (`metrics.best_score`: tau_walked, the one decoding sees, where the family reports it)."""
    metrics = evaluate(
        run.accelerator, run.model, run.objective, run.target, run.val_loader, run.s.trainer.eval_batches
    )
    _report(run.accelerator, run.metrics_file, run.state.step, metrics)
    best, state = best_score(metrics), run.state
    # (a run resumed from a checkpoint that kept its best by another metric starts its best anew)
    if best is not None and (best[1] > state.best_tau or best[0] != state.best_by):
        state.best_by, state.best_tau, state.best_step = best[0], best[1], state.step
        if run.main:
            checkpoint.save_head(run.objective, run.out / "best")
    return metrics


def finish(run: Run, meter: Meter, last_eval: dict[str, float] | None) -> TrainResult:
    """Save OUT/head and OUT/metrics.json, end tracking, publish when asked; the run's result."""
    acc, state = run.accelerator, run.state
    if last_eval is None:  # resumed a finished run: report its metrics again
        last_eval = evaluate(
            acc, run.model, run.objective, run.target, run.val_loader, run.s.trainer.eval_batches
        )
    seconds = time.perf_counter() - meter.started
    tokens_per_s = meter.run_tokens / max(seconds - meter.paused, 1e-9)  # training throughput, eval excluded
    # the tree for this device first, then the last decode eval with it: the speedup printed is the saved
    # head's (both need the full target: never touched when they are off, e.g. with offline states)
    tree, last_decode = None, {}
    if run.decoder.tuning or run.decoder.enabled:
        target, head = run.target.model, run.objective.head
        tree = run.decoder.tune(target, run.tokenizer, head)
        if run.decoder.enabled:
            last_decode = run.decoder.run(target, run.tokenizer, head, run.out, state.step, tree)
            run.metrics_file.write(state.step, last_decode)
    head_dir = run.out / "head"
    peaks = peak_memory(acc)  # (every process takes part)
    if run.main:
        checkpoint.save_head(run.objective, head_dir, tree)  # whole or not at all (TrainError: disk full)
        summary = {"step": state.step, "seconds": seconds, "train_tokens_per_s": tokens_per_s, **peaks,
                   **last_eval, **last_decode}  # fmt: skip
        (run.out / "metrics.json").write_text(json.dumps(summary, indent=1))
    acc.wait_for_everyone()
    _drop_wrappers(run)
    acc.end_training()
    acc.print(f"head saved to {head_dir}")
    if state.best_step:  # (0: no evaluation kept a best head)
        acc.print(
            f"best head by {state.best_by}: {run.out / 'best'} (step {state.best_step}, {state.best_tau:.3f})"
        )
    if run.main and run.s.trainer.push_to_hub:
        _push(head_dir, run.s.trainer.push_to_hub, run.s.trainer.push_private)
    acc.print("final: " + _fmt(last_eval))
    memory = f"; peak GPU memory {peaks['peak_memory_gib']:.2f} GiB" if peaks else ""
    acc.print(
        f"time: {seconds:.0f} s for {state.step} steps; training throughput {tokens_per_s:,.0f} tokens/s"
        + memory
    )
    return TrainResult(head_dir, last_eval, state.step, seconds, tokens_per_s)


def peak_memory(acc: Accelerator) -> dict[str, float]:
    """Peak GPU memory so far (tracking.device_memory), the largest over the processes; empty on a CPU.
    A collective: every process calls it."""
    mine = tracking.device_memory(acc.device)
    if not mine:
        return {}
    peaks = acc.gather(torch.tensor([list(mine.values())], device=acc.device)).amax(0)
    return dict(zip(mine, peaks.tolist()))


def _drop_wrappers(run: Run) -> None:
    """Free the prepared (DDP) model while the process group is still registered, before end_training
    destroys it. DDP's reducer holds the group: freed later, at the end of train(), the reducer's
    deallocation (holding the GIL) ran the gloo group's destructor, which joins its worker threads while
    one of them waited for the GIL to free a finished allreduce's tensors, and the process hung after
    training had finished (seen once in a 2-process CPU run, py-spy: ~ProcessGroupGloo -> thread join
    under ~Reducer). Freed here it only drops a reference; destroy_process_group then releases the GIL.
    One process holds no group: nothing to free early, and the two full garbage collections are skipped
    (each costs a fraction of a second, paid by every in-process train())."""
    run.model = run.accelerator.unwrap_model(run.model)
    if run.accelerator.distributed_type == DistributedType.NO:
        return
    run.accelerator.free_memory()  # accelerate's own references to the prepared model, optimizer, loaders
    gc.collect()  # (DDP's hooks make reference cycles)


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model, objective: Objective, target: FrozenTarget, loader, max_batches: int
) -> dict[str, float]:
    """Sum the objective's counts over the validation split on every process, then summarise."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(loader):
        if 0 <= max_batches <= i:
            break
        counts = objective.eval_counts(model, target, batch)
        for key, value in counts.items():
            sums[key] = sums.get(key, 0) + value.detach().float().to(accelerator.device)
    model.train()
    if not sums:  # no validation split (data.val_size=0 or a tiny dataset)
        return {}
    return objective.summarize({k: accelerator.reduce(v, "sum") for k, v in sums.items()})


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["attention_mask"].sum())


def _due(run: Run, every: int) -> bool:
    """Whether a task run every `every` optimizer steps is due now (always at the last step)."""
    return run.state.step % every == 0 or run.state.step == run.max_steps


def _push(head_dir: Path, repo_id: str, private: bool) -> None:
    """Publish the final head; a failed upload says how to retry (the head itself is saved)."""
    try:
        url = hub.publish(head_dir, repo_id, private=private)
    except HeadError as err:
        raise TrainError(
            f"{err} (the head is saved: retry with python scripts/publish.py {head_dir} --repo-id {repo_id})"
        ) from None
    print(f"published to {url}")


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def _report(
    accelerator: Accelerator, metrics_file: tracking.MetricsFile, step: int, metrics: dict[str, float]
):
    row = {f"val/{k}": v for k, v in metrics.items()}
    accelerator.log(row, step=step)
    metrics_file.write(step, row)
    if accelerator.is_main_process:
        tqdm.write(f"step {step}: " + _fmt(metrics))
