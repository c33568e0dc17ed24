"""Everything a training run needs before its first step: the accelerator, data, target, head and its
objective, optimizer, schedule, loaders, and where to resume from. `setup` reads top to bottom."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from transformers import get_scheduler

from spechead.heads import hub
from spechead.heads.errors import HeadError
from spechead.heads.hybrid import check_attention_only
from spechead.training import checkpoint, memory_plan, tracking, zero
from spechead.training.checkpoint import TrainState
from spechead.training.decode_eval import DecodeEval, DecodeEvaluator, TreeTune
from spechead.training.errors import TrainError
from spechead.training.inputs import training_data, training_target
from spechead.training.objectives import Objective, build_objective
from spechead.training.settings import TrainSettings
from spechead.training.target import TargetConfig, load_tokenizer

SCHEDULE_NAMES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


@dataclass
class Run:
    """A set-up training run: what the loop in trainer.py reads and advances."""

    s: TrainSettings
    accelerator: Accelerator
    out: Path  # trainer.output_dir
    tokenizer: Any
    target: Any  # FrozenTarget, its ZeRO-3 sharded form, or the offline CachedTarget
    objective: Objective
    model: torch.nn.Module  # objective.module(), prepared by accelerate
    optimizer: Any
    scheduler: Any
    train_loader: Any
    val_loader: Any
    max_steps: int
    state: TrainState  # step, epoch, position in the epoch, tokens, best tau (restored when resuming)
    metrics_file: tracking.MetricsFile
    decoder: DecodeEvaluator

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def setup(s: TrainSettings, decode_eval: DecodeEval | None = None, tune_tree: TreeTune | None = None) -> Run:
    """Build the run `s` describes (resumed from its last checkpoint when there is one)."""
    accelerator = make_accelerator(s)
    stage = zero.configure(accelerator, s)  # DeepSpeed "auto" entries from s.trainer; 0 = no DeepSpeed
    resume_from = resume_points(s)
    tracking.check(s.logger)
    check_reachable(s.model)
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
    objective = build_objective(s.head, target, data.train, tokenizer)
    _describe(accelerator, s, target, objective, stage)
    _check_disk(s, objective, stage)

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
    if resume_from:
        path, state = checkpoint.load_latest(accelerator, resume_from)
        accelerator.print(f"resumed from {path} (step {state.step}/{max_steps})")
    out = Path(s.trainer.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(s.resolved, sort_keys=False))
    tracking.start(accelerator, s.logger, s.resolved, out)
    return Run(
        s, accelerator, out, tokenizer, target, objective, model, optimizer, scheduler, train_loader,
        val_loader, max_steps, state, tracking.MetricsFile(out / "metrics.jsonl", accelerator.is_main_process),
        DecodeEvaluator(
            decode_eval, s.trainer, accelerator, offline=s.data.hidden_states == "offline", tune=tune_tree,
            hybrid=_hybrid(target),
        ),
    )  # fmt: skip


def _hybrid(target) -> str:
    """Why speculative decoding refuses `target` (a hybrid with recurrent-state layers), else ""."""
    config = getattr(target, "config", None)  # (an offline run's target has no config: skipped anyway)
    if config is None:
        return ""
    try:
        check_attention_only(config, "speculative decoding")
    except ValueError as err:
        return str(err)
    return ""


def _describe(accelerator: Accelerator, s: TrainSettings, target, objective: Objective, stage: int) -> None:
    """Print the head, the target, the processes and the memory plan once."""
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
    device = accelerator.device
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if warning := memory_plan.over_device(plan, total):
        accelerator.print(warning)


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


def resume_points(s: TrainSettings) -> list[Path]:
    """The checkpoints to continue from (the newest that reads back whole, checkpoint.load_latest), per
    `trainer.resume`, oldest first; refuses to silently overwrite a run."""
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
    return found


def check_reachable(model: TargetConfig) -> None:
    """TrainError when the target is a Hub id that offline mode (HF_HUB_OFFLINE=1) cannot load: it is not in
    the local Hugging Face cache. Said before anything loads, and without the Hub's several-line reasons."""
    path = model.path
    if Path(path).expanduser().exists() or path.startswith((".", "/", "~")) or path.count("/") > 1:
        return  # a local path (a missing one is target.py's error)
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        return
    if isinstance(huggingface_hub.try_to_load_from_cache(path, "config.json", revision=model.revision), str):
        return
    raise TrainError(
        f"model.path={path} cannot be loaded offline (HF_HUB_OFFLINE=1 and it is not in the Hugging Face "
        "cache): set model.path to a local model directory (model=local model.path=DIR) or go online "
        "(unset HF_HUB_OFFLINE) to download it"
    )


def _check_disk(s: TrainSettings, objective: Objective, stage: int) -> None:
    """Refuse, before training, a run whose checkpoints and head would not fit in trainer.output_dir."""
    module = objective.module()
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    # a checkpoint holds the module's whole state dict; under DeepSpeed only its trainable parameters
    saved = trainable if stage else sum(t.numel() * t.element_size() for t in module.state_dict().values())
    out = Path(s.trainer.output_dir)
    checkpoint.check_disk(out, checkpoint.disk_needed(out, saved, trainable, s.trainer.keep_checkpoints))


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
