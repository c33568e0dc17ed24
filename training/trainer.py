"""The training loop, top to bottom: setup, loop, evaluate, checkpoint, save the head.

Only this module (with checkpoint.py and tracking.py) knows about `Accelerator`. The head is a plain
module; the frozen target is moved to the device as a replica and never wrapped, since it has no
gradients to synchronise.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from spechead.heads import hub
from spechead.heads.errors import HeadError
from spechead.training import checkpoint, memory_plan, tracking, zero
from spechead.training.checkpoint import TrainState
from spechead.training.decode_eval import DecodeEval, DecodeEvaluator
from spechead.training.errors import TrainError
from spechead.training.objectives import Objective, build_objective
from spechead.training.offline import training_data, training_target
from spechead.training.settings import TrainSettings
from spechead.training.target import FrozenTarget, load_tokenizer

SCHEDULE_NAMES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


@dataclass
class TrainResult:
    head_dir: Path
    metrics: dict[str, float]
    steps: int
    seconds: float
    tokens_per_second: float


def make_accelerator(s: TrainSettings) -> Accelerator:
    """CPU (gloo) when there is no GPU; our own scheduler stepping; a seeded, resumable data order."""
    return Accelerator(
        **zero.device_options(),  # DeepSpeed on CPU needs cpu=False + gloo
        mixed_precision=s.trainer.mixed_precision,
        gradient_accumulation_steps=s.trainer.grad_accum,
        log_with=tracking.log_with(s.logger) or None,
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=s.trainer.seed),
    )


def resume_point(s: TrainSettings) -> Path | None:
    """The checkpoint to continue from, per `trainer.resume`; refuses to silently overwrite a run."""
    out = Path(s.trainer.output_dir)
    found = checkpoint.list_checkpoints(out)
    if s.trainer.resume == "true" and not found:
        raise TrainError(
            f"trainer.resume=true but {out}/checkpoints has no checkpoint; use trainer.resume=auto"
        )
    if s.trainer.resume == "false" and found:
        raise TrainError(
            f"{out} already holds checkpoints of an earlier run: continue it with trainer.resume=auto, "
            "or choose another trainer.output_dir"
        )
    if found:
        _check_same_run(out, s.resolved)
    return found[-1] if found else None


def _check_same_run(out: Path, resolved: dict) -> None:
    saved_file = out / "config.yaml"
    if not saved_file.is_file():
        return
    saved = yaml.safe_load(saved_file.read_text())
    for section in ("head", "model"):
        if saved.get(section) != resolved.get(section):
            raise TrainError(
                f"{out} holds a run with a different {section} config; resuming would mix them: "
                "choose another trainer.output_dir or restore the original settings"
            )


def make_scheduler(s: TrainSettings, optimizer: torch.optim.Optimizer, max_steps: int):
    warmup = int(s.trainer.warmup_ratio * max_steps)
    return get_scheduler(SCHEDULE_NAMES[s.trainer.schedule], optimizer, warmup, max_steps)


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


def train(s: TrainSettings, decode_eval: DecodeEval | None = None) -> TrainResult:
    """Train a head as `s` says; resumable; returns where the head went and its final metrics.

    `decode_eval` decodes real prompts with the head at `trainer.decode_eval_every` steps (train.py
    passes spechead.inference's; training itself never imports inference).
    """
    # --- setup ---------------------------------------------------------------------------------
    out = Path(s.trainer.output_dir)
    accelerator = make_accelerator(s)
    stage = zero.configure(accelerator, s)  # DeepSpeed "auto" entries from s.trainer; 0 = no DeepSpeed
    main = accelerator.is_main_process
    resume_from = resume_point(s)
    tracking.check(s.logger)
    if s.trainer.push_to_hub:  # fail now, not after hours of training
        try:
            hub.preflight(s.trainer.push_to_hub)
        except HeadError as err:
            raise TrainError(str(err)) from None
    set_seed(s.trainer.seed)
    tokenizer = load_tokenizer(s.model)
    with accelerator.main_process_first():
        data = training_data(s, tokenizer)  # data.hidden_states=offline: rows of the hidden-state cache
    accelerator.print(f"data: {data.stats.summary()}; {len(data.train)} train / {len(data.val)} val")
    if stage == 3:  # the target loaded sharded across processes, for inference; the head trains at ZeRO-2
        from spechead.training.sharded_target import load_sharded_target  # imports deepspeed

        target = load_sharded_target(s, accelerator)
        set_seed(s.trainer.seed)  # zero.Init drew random numbers: start the head as without ZeRO-3
    else:
        target = training_target(s, data, accelerator.device)  # offline: only embedding + lm_head
    objective = build_objective(s.head, target, data.train)
    n_params = sum(p.numel() for p in objective.module().parameters() if p.requires_grad)
    for note in objective.notes:
        accelerator.print(note)
    procs = accelerator.num_processes
    accelerator.print(
        f"head: {s.head.name} ({n_params / 1e6:.2f}M trainable) on target {target.name_or_path}; "
        f"{procs} process{'es' if procs > 1 else ''} on {accelerator.device}"
    )
    plan = memory_plan.from_run(
        target, objective, processes=procs, stage=stage, mixed_precision=s.trainer.mixed_precision,
        batch_size=s.trainer.batch_size, seq_len=s.trainer.max_length,
    )  # fmt: skip
    accelerator.print(plan.summary())

    # Loaders draw their seeds from their own generators, never from the global RNG: a resumed run
    # re-creates its data iterator after restoring the RNG, which must not shift dropout or feature noise.
    train_loader = DataLoader(
        data.train,
        s.trainer.batch_size,
        shuffle=True,
        collate_fn=data.collator,
        num_workers=s.trainer.num_workers,
        generator=torch.Generator().manual_seed(s.trainer.seed),
    )
    val_loader = DataLoader(
        data.val, s.trainer.batch_size, collate_fn=data.collator, generator=torch.Generator().manual_seed(0)
    )
    train_loader, val_loader = accelerator.prepare(train_loader, val_loader)
    steps_per_epoch = math.ceil(len(train_loader) / s.trainer.grad_accum)
    max_steps = s.trainer.max_steps if s.trainer.max_steps > 0 else s.trainer.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(
        objective.param_groups(s.trainer.lr),
        betas=tuple(s.trainer.betas),
        weight_decay=s.trainer.weight_decay,
    )
    scheduler = make_scheduler(s, optimizer, max_steps)
    model, optimizer, scheduler = accelerator.prepare(objective.module(), optimizer, scheduler)

    state = TrainState()
    if resume_from is not None:
        state = checkpoint.load(accelerator, resume_from)
        accelerator.print(f"resumed from {resume_from} (step {state.step}/{max_steps})")
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(s.resolved, sort_keys=False))
    tracking.start(accelerator, s.logger, s.resolved, out)
    metrics_file = tracking.MetricsFile(out / "metrics.jsonl", main)
    decoder = DecodeEvaluator(decode_eval, s.trainer, accelerator, offline=s.data.hidden_states == "offline")

    # --- loop ----------------------------------------------------------------------------------
    bar = tqdm(
        total=max_steps, initial=state.step, disable=not main, desc="train", unit="step", dynamic_ncols=True
    )
    started = time.perf_counter()
    window_start, window_tokens, run_tokens, paused = time.perf_counter(), 0, 0, 0.0
    last_eval: dict[str, float] | None = None
    last_decode: dict[str, float] = {}
    model.train()
    while state.step < max_steps:
        train_loader.set_epoch(state.epoch)
        batches = accelerator.skip_first_batches(train_loader, state.batch_in_epoch)
        for batch in batches:
            state.batch_in_epoch += 1
            with accelerator.accumulate(model):
                loss, logs = objective.loss(model, target, batch, state.step)
                accelerator.backward(loss)
                if accelerator.sync_gradients and s.trainer.grad_clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), s.trainer.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            window_tokens += _tokens(batch)
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            state.step += 1
            bar.update(1)

            if state.step % s.trainer.log_every == 0 or state.step == max_steps:
                tokens = int(
                    accelerator.reduce(torch.tensor(window_tokens, device=accelerator.device), "sum")
                )
                mean_loss = float(accelerator.reduce(loss.detach(), "mean"))
                tok_s = tokens / max(time.perf_counter() - window_start, 1e-9)
                state.tokens += tokens
                run_tokens += tokens
                window_start, window_tokens = time.perf_counter(), 0
                row = {
                    "train/loss": mean_loss,
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/tokens_per_s": tok_s,
                }
                row.update({f"train/{k}": v for k, v in logs.items()})
                accelerator.log(row, step=state.step)
                metrics_file.write(state.step, row)
                bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{tok_s:,.0f}")

            # --- eval ------------------------------------------------------------------------------
            pause_start = time.perf_counter()  # eval and checkpoints do not count as training time
            if state.step % s.trainer.eval_every == 0 or state.step == max_steps:
                last_eval = evaluate(
                    accelerator, model, objective, target, val_loader, s.trainer.eval_batches
                )
                _report(accelerator, metrics_file, state.step, last_eval)
                if last_eval.get("tau", 0.0) > state.best_tau:
                    state.best_tau = last_eval["tau"]
                    if main:
                        zero.save_head(objective, out / "best")
            if decoder.due(state.step, max_steps):
                last_decode = decoder.run(target.model, tokenizer, objective.head, out, state.step)
                metrics_file.write(state.step, last_decode)
                model.train()

            # --- checkpoint ------------------------------------------------------------------------
            if state.step % s.trainer.save_every == 0 or state.step == max_steps:
                checkpoint.save(accelerator, out, state, s.trainer.keep_checkpoints)
            pause = time.perf_counter() - pause_start
            paused += pause
            window_start += pause
            if state.step >= max_steps:
                break
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
    bar.close()

    # --- final head ----------------------------------------------------------------------------
    if last_eval is None:  # resumed a finished run: report its metrics again
        last_eval = evaluate(accelerator, model, objective, target, val_loader, s.trainer.eval_batches)
    seconds = time.perf_counter() - started
    tokens_per_s = run_tokens / max(seconds - paused, 1e-9)  # training throughput, eval excluded
    head_dir = out / "head"
    if main:
        zero.save_head(objective, head_dir)
        summary = {
            "step": state.step,
            "seconds": seconds,
            "train_tokens_per_s": tokens_per_s,
            **last_eval,
            **last_decode,
        }
        (out / "metrics.json").write_text(json.dumps(summary, indent=1))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    accelerator.print(f"head saved to {head_dir}")
    if main and s.trainer.push_to_hub:
        _push(head_dir, s.trainer.push_to_hub, s.trainer.push_private)
    accelerator.print("final: " + _fmt(last_eval))
    accelerator.print(
        f"time: {seconds:.0f} s for {state.step} steps; training throughput {tokens_per_s:,.0f} tokens/s"
    )
    return TrainResult(head_dir, last_eval, state.step, seconds, tokens_per_s)


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
