"""Build a hidden-state cache: run the frozen target once over the train/val splits, store shards.

Resumable (a rerun skips the shards that some process finished) and distributed (under
`accelerate launch`, process r takes shards r, r + W, ...). The layout is in spechead.training.hidden_cache.layout.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState

from spechead.data.collate import Collator
from spechead.data.pipeline import TrainData, build_datasets
from spechead.training.errors import TrainError
from spechead.training.hidden_cache import layout as hc
from spechead.training.hidden_cache.match import built_for, target_config
from spechead.training.settings import TrainSettings
from spechead.training.target import FrozenTarget, load_target, load_tokenizer

GB = 1e9
PLAN_LABELS = {
    "shards": "cache.shard_mb (shard plan)",
    "dtype": "cache.dtype",
    "bytes_per_token": "cache.dtype",
}


@dataclass
class CacheConfig:
    """The `cache.*` options of scripts/cache_hidden_states.py (the location is data.cache_dir)."""

    dtype: str = "bfloat16"  # storage dtype of the states: bfloat16 | float16 | float32
    shard_mb: float = 1024.0  # target size of one shard file
    batch_size: int = 0  # rows per target forward; 0 = trainer.batch_size
    allow_low_disk: bool = False  # start even if the free disk looks too small (--force)
    max_shards: int = 0  # > 0: stop after this many new shards per process (a rerun continues)

    def __post_init__(self) -> None:
        hc.storage_dtype(self.dtype)
        if self.shard_mb <= 0 or self.batch_size < 0 or self.max_shards < 0:
            raise TrainError("cache.shard_mb must be > 0, cache.batch_size and cache.max_shards >= 0")


@dataclass
class CacheReport:
    """What a build did: sizes (bytes) and throughput."""

    directory: Path
    complete: bool
    tokens: int  # in the whole cache
    built_tokens: int  # run through the target by this process now
    estimate_bytes: int
    disk_bytes: int  # bytes of the finished shard files
    seconds: float
    main: bool = True  # the main process (the one that reports)

    @property
    def tokens_per_s(self) -> float:
        return self.built_tokens / max(self.seconds, 1e-9)


def make_plan(s: TrainSettings, cfg: CacheConfig, data: TrainData, tokenizer: Any) -> dict:
    """The cache's plan.json: what it is built for, its layout and its shard row ranges."""
    config = target_config(s.model).get_text_config()
    record = built_for(s, tokenizer, config.num_hidden_layers)
    per_token = hc.bytes_per_token(
        len(record["stored_layers"]), config.hidden_size, hc.storage_dtype(cfg.dtype)
    )
    lengths = {"train": _lengths(data.train), "val": _lengths(data.val)}
    shards = hc.plan_shards(lengths, per_token, int(cfg.shard_mb * 1e6))
    return {
        "format": hc.FORMAT,
        "version": hc.VERSION,
        "built_for": record,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "dtype": str(hc.storage_dtype(cfg.dtype)).removeprefix("torch."),
        "bytes_per_token": per_token,
        "pad_token_id": data.collator.pad_token_id,
        "stats": asdict(data.stats),
        "shards": [asdict(sh) for sh in shards],
    }


def _lengths(ds) -> list[int]:
    return [len(ids) for ids in ds["input_ids"]] if len(ds) else []


def estimate(plan: dict, numbers: set[int] | None = None) -> int:
    """Bytes of tensor data of the plan's shards (all, or those in `numbers`)."""
    shards = [sh for sh in plan["shards"] if numbers is None or sh["number"] in numbers]
    return sum(
        hc.tensor_bytes(sh["tokens"], sh["end"] - sh["start"], 1, plan["bytes_per_token"]) for sh in shards
    )


def check_disk(directory: Path, needed: int, allow_low: bool) -> str:
    """One line about the disk; TrainError when `needed` bytes do not fit (unless allow_low)."""
    free = shutil.disk_usage(directory).free
    line = f"needs {needed / GB:.3f} GB more on disk; {free / GB:.1f} GB free in {directory}"
    if needed > free and not allow_low:
        raise TrainError(
            f"the cache {line}: free space, choose another data.cache_dir, or pass --force "
            "(cache.allow_low_disk=true) to start anyway"
        )
    return line


def check_existing(directory: Path, plan: dict) -> None:
    """Refuse a directory holding a cache (finished or not) built with other settings than `plan`."""
    existing = directory / hc.PLAN_FILE
    if not existing.is_file():
        if directory.is_dir() and any(directory.iterdir()):
            raise TrainError(f"data.cache_dir={directory} is not empty and holds no cache: choose another")
        return
    old = hc.read_json(existing)
    for key in plan:
        if old.get(key) != plan[key]:
            what = PLAN_LABELS.get(key, key)
            if key == "built_for":
                what = next(k for k in plan[key] if old[key].get(k) != plan[key][k])
            raise TrainError(
                f"data.cache_dir={directory} holds a cache built with another {what}: "
                "choose another data.cache_dir or delete that directory"
            )


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@torch.no_grad()
def build_shard(
    target: FrozenTarget, rows, shard: hc.Shard, layers: list[int], plan: dict, batch_size: int
) -> dict[str, torch.Tensor]:
    """Run the target over the shard's rows (by length, to pad little) and collect the shard's tensors."""
    collate = Collator(pad_token_id=plan["pad_token_id"])
    dtype = hc.storage_dtype(plan["dtype"])
    order = sorted(range(shard.start, shard.end), key=lambda i: len(rows[i]["input_ids"]))
    states: dict[int, dict[int, torch.Tensor]] = {i: {} for i in layers}
    device = next(target.model.parameters()).device
    for a in range(0, len(order), batch_size):
        chunk = order[a : a + batch_size]
        batch = collate([rows[i] for i in chunk])
        cap = target.capture(batch["input_ids"].to(device), batch["attention_mask"].to(device), layers)
        for b, row in enumerate(chunk):
            n = int(batch["attention_mask"][b].sum())
            for layer, h in zip(layers, cap.hidden):
                states[layer][row] = h[b, :n].to(dtype).cpu()  # (T_r, H)
    span = range(shard.start, shard.end)
    ids = [torch.as_tensor(rows[i]["input_ids"]) for i in span]
    masks = [torch.as_tensor(rows[i]["loss_mask"]) for i in span]
    return hc.shard_tensors(ids, masks, {layer: [states[layer][i] for i in span] for layer in layers})


def check_logits(target: FrozenTarget, rows, plan: dict) -> None:
    """Refuse targets whose logits are not lm_head(final normed state): the cache relies on that."""
    batch = Collator(pad_token_id=plan["pad_token_id"])([rows[0]])
    device = next(target.model.parameters()).device
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    cap = target.capture(ids, mask, [plan["num_layers"]], with_logits=True)
    again = target.lm_head(cap.hidden[0])
    if not torch.allclose(again.float(), cap.logits.float(), rtol=1e-3, atol=1e-3):
        raise TrainError(
            f"{target.name_or_path}: logits are not lm_head(final hidden state) (soft-capped or scaled?), "
            "so a cache cannot reproduce them: train with data.hidden_states=online"
        )


def build_cache(s: TrainSettings, cfg: CacheConfig, log=print) -> CacheReport:
    """Build (or finish) the cache in s.data.cache_dir for the head/model/data/trainer settings `s`."""
    if not s.data.cache_dir:
        raise TrainError("set data.cache_dir=DIR: where the hidden-state cache goes")
    directory = Path(s.data.cache_dir).expanduser()
    state = PartialState(cpu=not torch.cuda.is_available())
    if not state.is_main_process:
        log = _quiet(log, state.process_index)
    tokenizer = load_tokenizer(s.model)
    with state.main_process_first():
        data = build_datasets(s.data, tokenizer, s.trainer.max_length, s.trainer.seed)
    plan = make_plan(s, cfg, data, tokenizer)
    check_existing(directory, plan)
    done = hc.completed_shards(directory) if directory.is_dir() else {}
    total = sum(sh["tokens"] for sh in plan["shards"])
    todo = [sh for sh in plan["shards"] if sh["number"] not in done]
    log(
        f"cache: {total:,} tokens x {len(plan['built_for']['stored_layers'])} states "
        f"{plan['built_for']['stored_layers']} x H={plan['hidden_size']} x {plan['dtype']} "
        f"= {plan['bytes_per_token']} bytes/token, {estimate(plan) / GB:.3f} GB in {len(plan['shards'])} "
        f"shards ({len(done)} done)"
    )
    log(
        check_disk(
            _existing_parent(directory), estimate(plan, {sh["number"] for sh in todo}), cfg.allow_low_disk
        )
    )
    state.wait_for_everyone()  # every process checked the directory before it changes
    if state.is_main_process and not (directory / hc.PLAN_FILE).is_file():
        directory.mkdir(parents=True, exist_ok=True)
        hc.atomic_write_json(directory / hc.PLAN_FILE, plan)
    state.wait_for_everyone()
    mine = [
        hc.shard_from_dict(sh) for sh in todo if sh["number"] % state.num_processes == state.process_index
    ]
    if cfg.max_shards:
        mine = mine[: cfg.max_shards]
    started, built = time.perf_counter(), 0
    if mine:
        built = _run_shards(s, cfg, data, plan, mine, state, directory, log)
    seconds = time.perf_counter() - started
    state.wait_for_everyone()
    done = hc.completed_shards(directory)
    complete = len(done) == len(plan["shards"])
    if complete and state.is_main_process:
        hc.write_index(directory, plan, done)
        hc.remove_temporaries(directory)
    state.wait_for_everyone()
    disk = sum(entry["bytes"] for entry in done.values())
    report = CacheReport(directory, complete, total, built, estimate(plan), disk, seconds)
    report.main = state.is_main_process
    return report


def _quiet(log, rank: int):
    """Other processes report their shards only, prefixed with their rank."""
    return lambda line: log(f"[rank {rank}] {line}") if line.startswith("shard ") else None


def _run_shards(s, cfg, data, plan, shards, state, directory, log) -> int:
    """Build this process's `shards` in order, recording each as done; returns the tokens run."""
    target = load_target(s.model, state.device)
    rows = {"train": data.train, "val": data.val}
    check_logits(target, rows[shards[0].split], plan)
    layers = plan["built_for"]["stored_layers"]
    batch_size = cfg.batch_size or s.trainer.batch_size
    entries = hc.own_progress(directory, state.process_index)
    built = 0
    for shard in shards:
        t0 = time.perf_counter()
        tensors = build_shard(target, rows[shard.split], shard, layers, plan, batch_size)
        name = shard.file_name(state.process_index)
        # One metadata key: safetensors writes several in a random order, and reruns must give the same bytes.
        size = hc.write_shard(directory / name, tensors, {"shard": f"{shard.split} {shard.number}"})
        entries.append({**asdict(shard), "file": name, "bytes": size})
        hc.record_progress(directory, state.process_index, entries)
        built += shard.tokens
        dt = time.perf_counter() - t0
        log(
            f"shard {shard.number} ({shard.split}, {shard.tokens:,} tokens): {shard.tokens / dt:,.0f} tokens/s"
        )
    return built
