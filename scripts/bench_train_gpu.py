"""Train EAGLE-3 at the scale users train: a Llama-3.1-8B-shaped target, bf16, through `accelerate launch`.

    python scripts/bench_train_gpu.py --out outputs/bench_train     # one GPU: at most --budget-s (480 s)
    python scripts/bench_train_gpu.py --tiny --out /tmp/bt           # a tiny Llama on the CPU, 3 steps a mode

On the H200 it runs as gpu_checks' step bench_train, in one call (the wheels the image lacks in .whl/, listed
at the top of scripts/gpu_checks.sh): run(command="bash scripts/gpu_checks.sh bench_train", carry=[".whl"],
timeout_s=600); results come back in $OUT/bench_train/ and $OUT/bench_train.log.

Writes a random-weight target once (LlamaConfig: hidden 4096, 32 layers, 32 heads, 8 kv heads, intermediate
14336, vocab 128256, llama3 rope; weights initialised on the GPU in bf16, no download) with the demo
tokenizer (vocabulary 2048: ids above it are never seen, so the padded vocabulary only costs what it costs
a real 8B run, the embedding, lm_head and the target's logits), and a small dataset: demo conversations
joined into rows longer than --seq-len, so every row is truncated to exactly --seq-len tokens. Then runs
the project's own train.py (head=eagle3, Hydra overrides) for --steps steps in each mode:

  online-ddp     the target runs every step, configs/accelerate/ddp.yaml with one process per GPU
  offline-ddp    from the hidden-state cache that scripts/cache_hidden_states.py builds first (bf16)
  online-zero3   configs/accelerate/zero3.yaml: the target loaded sharded inside zero.Init (1/N of it per
                 GPU), the head at ZeRO-2. offline-zero3 is refused by design (training/zero.check_zero3:
                 offline training never runs the target, so ZeRO-3 has nothing to shard); offline-zero2
                 (configs/accelerate/zero2.yaml) is its DeepSpeed counterpart, on request (--modes).

Per run it reads what the trainer itself reports: training tokens/s (metrics.json, evaluation and
checkpoints excluded, and the last log window's), peak GPU memory (metrics.json: torch.cuda max allocated
and reserved, the largest over processes), and the memory plan printed at start (training/memory_plan.py,
per process) beside it. Everything goes to OUT/bench_train.json (rewritten after each stage, so a run cut
short still reports what finished) and OUT/bench_train.md; the big files (target, cache, runs) go to --work,
and each run's checkpoints are deleted after it. Under --budget-s the remaining runs are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=4096, max_position_embeddings=16384),
}  # fmt: skip
# mode: (hidden states, configs/accelerate file); the GPU files run on a CPU too (one process: gloo, and
# DeepSpeed on its CPU accelerator), so --tiny runs exactly these launches
MODES = {
    "online-ddp": ("online", "ddp.yaml"),
    "offline-ddp": ("offline", "ddp.yaml"),
    "online-zero3": ("online", "zero3.yaml"),
    "offline-zero2": ("offline", "zero2.yaml"),
}
DEFAULT_MODES = ["online-ddp", "offline-ddp", "online-zero3"]
VAL_ROWS = 2
RUNNING: set[int] = set()  # process groups of the launches running now
MIN_RUN_S = 30  # a launch given less is skipped
# disk for the target (16 GB of bf16 weights when not reused), the bf16 cache (~2.7 GB), one run's checkpoint (~5 GB)
NEEDS_GB = {"8b": 30, "tiny": 0.1}
REFUSED = {"offline-zero3": "refused by design: offline training never runs the target, so ZeRO-3 has "
           "nothing to shard (training/zero.check_zero3); offline-zero2 is the DeepSpeed run offline"}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_train")
    p.add_argument("--work", type=Path, default=None, help="target, data, cache, runs (default OUT/work)")
    p.add_argument(
        "--tiny", action="store_true", help="a tiny Llama (hidden 64, 4 layers) on the CPU, 3 steps"
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (50; tiny 3)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step and process")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048; tiny 64)")
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    p.add_argument("--processes", type=int, default=None, help="per launch (GPUs; 1 on a CPU)")
    p.add_argument("--budget-s", type=float, default=None, help="skip runs once this is spent (480)")
    args = p.parse_args(argv)
    args.shape = "tiny" if args.tiny else "8b"
    args.steps = args.steps or (3 if args.tiny else 50)
    args.seq_len = args.seq_len or (64 if args.tiny else 2048)
    args.work = args.work or args.out / "work"
    args.gpu = torch.cuda.is_available()
    args.processes = args.processes or (torch.cuda.device_count() if args.gpu else 1)
    args.budget_s = args.budget_s or (480.0 if not args.tiny else 600.0)
    return args


def make_target(path: Path, shape: str) -> dict:
    """A random-weight Llama of `shape` in bf16 with the demo tokenizer at `path` (reused when already there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    marker = path / "bench_target.json"
    wanted = {"shape": shape, **SHAPES[shape], "rope": ROPE}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return {"seconds": 0.0, "reused": True}
    started = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    tok.model_max_length = SHAPES[shape]["max_position_embeddings"]
    config = LlamaConfig(
        **SHAPES[shape], rope_parameters=dict(ROPE), rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # normal_ on the GPU: seconds for 8B
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    made = time.perf_counter() - started
    model.save_pretrained(path)
    tok.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()  # the runs are other processes: leave them the GPU
    marker.write_text(json.dumps(wanted))
    return {"seconds": time.perf_counter() - started, "init_seconds": made, "reused": False, "params": params}


def make_data(path: Path, tokenizer_dir: Path, rows: int, seq_len: int) -> dict:
    """`rows` conversations, each demo conversations joined until longer than `seq_len` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    demo = itertools.cycle([json.loads(line)["messages"] for line in (DEMO / "chat.jsonl").open()])
    out, lengths = [], []
    for _ in range(rows):
        messages, tokens = [], 0
        while tokens <= seq_len + 16:
            chat = next(demo)
            messages += chat
            tokens += len(tok.apply_chat_template(chat, tokenize=True, return_dict=False))
        out.append(json.dumps({"messages": messages}))
        lengths.append(tokens)
    path.write_text("\n".join(out) + "\n")
    return {"rows": rows, "min_tokens_before_truncation": min(lengths)}


def overrides(args: argparse.Namespace, target: Path, chats: Path) -> list[str]:
    """train.py's Hydra overrides shared by every run and the cache build."""
    every = args.steps  # evaluate and checkpoint once, at the end (the trainer always does at the last step)
    extra = ["head.draft_vocab_size=2048"] if args.tiny else []  # 8B: the default 32000 of 128256
    return [
        "head=eagle3", "model=local", f"model.path={target}", "model.dtype=bfloat16", "data=jsonl",
        f"data.path={chats}", f"data.val_size={VAL_ROWS}", f"trainer.max_steps={args.steps}",
        f"trainer.batch_size={args.batch_size}", f"trainer.max_length={args.seq_len}",
        "trainer.mixed_precision=bf16", f"trainer.eval_every={every}", f"trainer.save_every={every}",
        "trainer.eval_batches=2", f"trainer.log_every={max(1, args.steps // 5)}", "logger=none", *extra,
    ]  # fmt: skip


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def stop_runs(signum: int, _frame) -> None:
    """SIGTERM (gpu_checks' `timeout`): the launches are sessions of their own, so take them along."""
    for pgid in list(RUNNING):
        kill_group(pgid)
    sys.exit(128 + signum)


def stream(cmd: list[str], log: Path, timeout: float) -> tuple[int, str, float]:
    """Run `cmd` (stdout and stderr together) printing as it goes; (exit status, output, seconds)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    started, lines = time.perf_counter(), []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=ROOT, start_new_session=True) as proc:  # fmt: skip
        # at the deadline: the launcher and every process it started
        killed = threading.Event()
        timer = threading.Timer(timeout, lambda: killed.set() or kill_group(proc.pid))
        timer.start()
        RUNNING.add(proc.pid)
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", flush=True)
        rc = proc.wait()
        timer.cancel()
        RUNNING.discard(proc.pid)
    if killed.is_set():
        rc, lines = 124, [*lines, f"killed after {timeout:.0f} s\n"]
    text = "".join(lines)
    log.write_text(text)
    return rc, text, time.perf_counter() - started


def launcher(args: argparse.Namespace, mode: str) -> list[str]:
    config = MODES[mode][1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "configs" / "accelerate" / config), "--num_processes", str(args.processes),
            "--main_process_port", "0"]  # fmt: skip


def plan_from(output: str) -> dict:
    """The memory plan the trainer printed: its lines and its total in GiB (None when not printed)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("memory plan per process")), None)
    if start is None:
        return {"plan_total_gib": None, "plan": []}
    block = [lines[start]] + [line.strip() for line in lines[start + 1 : start + 6] if line.startswith("  ")]
    total = re.search(r"total ~([\d,.]+) (GiB|MiB)", "\n".join(block))
    gib = None if total is None else float(total[1].replace(",", "")) / (1024 if total[2] == "MiB" else 1)
    return {"plan_total_gib": gib, "plan": block}


def read_run(out: Path) -> dict:
    """What the trainer wrote: throughput, peak memory, the last log window's throughput."""
    summary = json.loads((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if "train/tokens_per_s" in r]
    return {
        "steps": summary["step"],
        "tokens_per_s": summary["train_tokens_per_s"],
        "last_window_tokens_per_s": windows[-1]["train/tokens_per_s"] if windows else None,
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "peak_reserved_gib": summary.get("peak_reserved_gib"),
        "train_seconds": summary["seconds"],
        "final_loss": windows[-1]["train/loss"] if windows else None,
    }


def train_run(args: argparse.Namespace, mode: str, base: list[str], cache: Path, timeout: float) -> dict:
    """One train.py launch in `mode`; its numbers, or why there are none."""
    states, config = MODES[mode]
    out = args.work / "runs" / mode
    shutil.rmtree(out, ignore_errors=True)
    extra = [f"data.hidden_states={states}"] + ([f"data.cache_dir={cache}"] if states == "offline" else [])
    cmd = [*launcher(args, mode), str(ROOT / "train.py"), *base, *extra, f"trainer.output_dir={out}"]
    rc, text, seconds = stream(cmd, args.work / f"{mode}.log", timeout)
    row = {"mode": mode, "hidden_states": states, "accelerate_config": config, "processes": args.processes,
           "exit": rc, "wall_seconds": seconds, **plan_from(text)}  # fmt: skip
    if rc == 0:
        row.update(read_run(out))
    else:
        row["error"] = [line for line in text.splitlines() if line.strip()][-5:]
    for big in ("checkpoints", "head", "best"):  # GBs at 8B; the numbers are read
        shutil.rmtree(out / big, ignore_errors=True)
    return row


def build_cache(args: argparse.Namespace, base: list[str], cache: Path, timeout: float) -> dict:
    """scripts/cache_hidden_states.py over the same data (one process), bf16 states."""
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "cache_hidden_states.py"), *base, f"data.cache_dir={cache}",
           "cache.dtype=bfloat16", "cache.batch_size=4"]  # fmt: skip
    rc, text, seconds = stream(cmd, args.work / "cache.log", timeout)
    built = re.search(r"built ([\d,]+) tokens in ([\d.]+) s \(([\d,]+) tokens/s", text)
    disk = re.search(r"cache complete in .*: ([\d,]+) bytes on disk", text)
    return {
        "exit": rc, "wall_seconds": seconds,
        "tokens": int(built[1].replace(",", "")) if built else None,
        "tokens_per_s": float(built[3].replace(",", "")) if built else None,
        "bytes_on_disk": int(disk[1].replace(",", "")) if disk else None,
    }  # fmt: skip


def table(report: dict) -> str:
    """The markdown table: one row per mode."""

    def num(v, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    rows = ["| mode | accelerate config | tokens/s | tokens/s (last window) | peak memory measured (GiB) | "
            "peak reserved (GiB) | memory plan predicted (GiB) | wall s | status |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in report["runs"]:
        status = "ok" if r.get("exit") == 0 else (r.get("skipped") or f"exit {r.get('exit')}")
        config = f"{r['accelerate_config']} x{r['processes']}" if "accelerate_config" in r else "-"
        rows.append(
            f"| {r['mode']} | {config} | {num(r.get('tokens_per_s'), ',.0f')} | "
            f"{num(r.get('last_window_tokens_per_s'), ',.0f')} | {num(r.get('peak_memory_gib'), '.2f')} | "
            f"{num(r.get('peak_reserved_gib'), '.2f')} | {num(r.get('plan_total_gib'), '.2f')} | "
            f"{num(r.get('wall_seconds'), '.0f')} | {status} |"
        )
    s = report["settings"]
    return "\n".join(rows) + (
        f"\n\n{s['shape']} target, bf16, {s['steps']} steps x {s['batch_size']} x {s['seq_len']} tokens per "
        f"process, {s['device']}. tokens/s: the trainer's (evaluation and checkpoints excluded; last window: "
        "its last log_every steps). Peak memory: torch.cuda max allocated/reserved over the whole process, "
        "target loading included. Plan: training/memory_plan.py's per-process total. wall s: the launch, "
        "start to exit.\n"
    )


def write(report: dict) -> None:
    out = Path(report["settings"]["out"])
    (out / "bench_train.json").write_text(json.dumps(report, indent=1))
    (out / "bench_train.md").write_text(table(report))


def run_modes(args: argparse.Namespace, report: dict, base: list[str], cache: Path, started: float) -> None:
    """Each mode in order (the cache built before the first offline one), within --budget-s."""
    for mode in args.modes:
        offline = MODES[mode][0] == "offline"
        left = args.budget_s - (time.perf_counter() - started)
        if offline and "cache" not in report and left >= MIN_RUN_S:
            report["cache"] = build_cache(args, base, cache, left)
            write(report)
            left = args.budget_s - (time.perf_counter() - started)
        if left < MIN_RUN_S:
            report["runs"].append({"mode": mode, "skipped": f"out of time (--budget-s {args.budget_s:.0f})"})
        elif offline and report["cache"]["exit"] != 0:
            report["runs"].append({"mode": mode, "skipped": "the cache build failed"})
        else:
            report["runs"].append(train_run(args, mode, base, cache, left))
        write(report)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    target, chats, cache = args.work / "target", args.work / "chats.jsonl", args.work / "cache"
    free = shutil.disk_usage(args.work).free / 1e9
    if free < NEEDS_GB[args.shape]:
        print(
            f"error: {args.work} has {free:.1f} GB free, the runs need ~{NEEDS_GB[args.shape]} GB: use --work"
        )
        return 2
    device = torch.cuda.get_device_name() if args.gpu else "cpu"
    settings = {"shape": args.shape, **SHAPES[args.shape], "steps": args.steps, "batch_size": args.batch_size,
                "seq_len": args.seq_len, "device": device, "out": str(args.out), "work": str(args.work),
                "free_disk_gb": free, "modes": args.modes}  # fmt: skip
    report: dict = {"settings": settings, "runs": []}
    report["target"] = make_target(target, args.shape)
    print(f"target: {report['target']}", flush=True)
    rows = args.steps * args.batch_size * args.processes + VAL_ROWS
    report["data"] = make_data(chats, target, rows, args.seq_len)
    write(report)
    run_modes(args, report, overrides(args, target, chats), cache, started)
    ok = all(r.get("exit") == 0 for r in report["runs"])  # every mode asked for ran and finished
    report["runs"] += [{"mode": m, "skipped": why} for m, why in REFUSED.items()]
    report["seconds"] = time.perf_counter() - started
    write(report)
    print(table(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop_runs)
    sys.exit(main(sys.argv[1:]))
