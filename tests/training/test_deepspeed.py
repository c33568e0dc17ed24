"""Real DeepSpeed runs of train.py under `accelerate launch`, two processes on CPU (gloo).

Every run trains the same EAGLE-3 head (it reads the target's embedding, lm_head and logits) with
gradient accumulation and a clipping threshold that bites; ZeRO-2, ZeRO-3 and a two-"node" launch
must all end with the head that plain two-process DDP trains, and a ZeRO-2 run resumed from a
checkpoint with exactly the head of the uninterrupted run. One more ZeRO-3 run trains the head's own
embedding, and the parallel heads (P-EAGLE, DFlash) train under ZeRO-3 as under DDP.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spechead.heads import load_head

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "accelerate"
EXTRA = {"head": "eagle3", "head.ttt_steps": 2, "trainer.grad_accum": 2, "trainer.grad_clip": 0.05}

# one worker runs them all (`--dist loadgroup`): the lazily made runs of `runs` are then made once, not once
# per worker that needs them
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deepspeed")]


def launcher(config: str, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / config),
        *flags,
    ]


def run(
    kit, target_dir, chat_file, out: Path, config: str, *flags: str, **more
) -> subprocess.CompletedProcess:
    args = kit.overrides(target_dir, chat_file, out, **EXTRA, **more)
    proc = kit.cli(args, launcher=launcher(config, *flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_same_head(a: Path, b: Path, atol: float) -> None:
    x, y = load_file(str(a / "head" / "model.safetensors")), load_file(str(b / "head" / "model.safetensors"))
    assert x.keys() == y.keys()
    for key in x:
        torch.testing.assert_close(x[key], y[key], rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir, chat_file, training_kit):
    """Lazily made runs shared by the tests: name -> (output dir, completed process)."""
    made: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}
    root = tmp_path_factory.mktemp("deepspeed")

    def get(config: str) -> tuple[Path, subprocess.CompletedProcess]:
        if config not in made:
            out = root / config.removesuffix(".yaml")
            made[config] = (out, run(training_kit, tiny_target_dir, chat_file, out, config))
        return made[config]

    return get


def test_zero2_trains_like_ddp(runs):
    ddp, _ = runs("cpu-2proc.yaml")
    out, proc = runs("cpu-zero2.yaml")
    assert "2 processes" in proc.stdout and "ZeRO-2" in proc.stdout
    assert_same_head(out, ddp, atol=1e-6)
    # ZeRO-2: each process wrote only its own shard of the optimizer states.
    shards = sorted(
        p.name for p in (out / "checkpoints" / "step-00000006" / "pytorch_model").glob("zero_pp_*")
    )
    assert shards == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    head = load_head(out / "head")
    assert head.family == "eagle3" and head.config.target_num_layers == 4


def test_zero2_resumes_exactly(runs, tmp_path, tiny_target_dir, chat_file, training_kit):
    whole, _ = runs("cpu-zero2.yaml")
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "head")  # as if killed right after the checkpoint of step 3
    shutil.rmtree(resumed / "checkpoints" / "step-00000006")
    proc = run(training_kit, tiny_target_dir, chat_file, resumed, "cpu-zero2.yaml")
    assert f"resumed from {resumed / 'checkpoints' / 'step-00000003'}" in proc.stdout
    assert_same_head(resumed, whole, atol=0)


def test_zero2_medusa2_checkpoints_leave_the_frozen_target_out(
    tmp_path, tiny_target_dir, chat_file, training_kit
):
    """Medusa-2 puts the whole target in the trained module; its frozen weights must not be checkpointed."""
    out = tmp_path / "medusa2"
    args = training_kit.overrides(tiny_target_dir, chat_file, out, head="medusa2", **{"trainer.max_steps": 3})
    proc = training_kit.cli(args, launcher=launcher("cpu-zero2.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = torch.load(
        out / "checkpoints" / "step-00000003" / "pytorch_model" / "mp_rank_00_model_states.pt",
        weights_only=True,
    )
    assert any("lora_A" in k for k in states["module"]) and any(
        k.startswith("head.") for k in states["module"]
    )
    assert not any("lora" not in k and k.startswith("target.") for k in states["module"])
    assert not states.get("frozen_param_fragments")  # DeepSpeed's own copy of frozen weights
    assert (out / "head" / "adapter" / "adapter_model.safetensors").is_file()


def test_zero3_shards_the_target_and_trains_like_ddp(runs):
    ddp, _ = runs("cpu-2proc.yaml")
    out, proc = runs("cpu-zero3.yaml")
    # The plan counts the whole target although each process holds half of every large parameter.
    assert "ZeRO-3" in proc.stdout and "target  61.73K params" in proc.stdout
    assert_same_head(out, ddp, atol=1e-6)
    # Checkpoints hold the head only: the sharded target is never given to accelerate.
    states = torch.load(
        out / "checkpoints" / "step-00000006" / "pytorch_model" / "mp_rank_00_model_states.pt",
        weights_only=True,
    )
    assert states["module"] and not any(k.startswith("model.") for k in states["module"])


def test_zero3_trains_a_heads_own_embedding_from_the_whole_target_embedding(
    tmp_path, tiny_target_dir, chat_file, training_kit
):
    """head.own_embedding under ZeRO-3: the head's own table starts from the target's embedding, which ZeRO-3
    has sharded (gathered whole first: rows of tokens the data never shows stay exactly the target's, no
    weight decay), trains (the rows it reads move, by about lr a step) and ships with the head."""
    out = tmp_path / "own"
    run(training_kit, tiny_target_dir, chat_file, out, "cpu-zero3.yaml", **{"head.own_embedding": "true"})
    assert load_head(out / "head").config.own_embedding
    mine = load_file(str(out / "head" / "model.safetensors"))["embed_tokens.weight"]  # (V, H)
    target = load_file(str(tiny_target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    moved = (mine - target).abs().amax(dim=1)  # (V,)
    assert (moved == 0).any() and 0 < moved.max() < 0.05, moved


@pytest.mark.parametrize("head", ["peagle", "peagle@own_embedding", "dflash"])
def test_zero3_trains_the_parallel_heads_like_ddp(head, tmp_path, tiny_target_dir, chat_file, training_kit):
    """P-EAGLE (also with its own embedding, initialised from the target's) and DFlash under ZeRO-3 (the
    sharded target; the heads read its lm_head / embedding, made whole first) end with the head plain
    two-process DDP trains."""
    name, _, own = head.partition("@")
    extra = {"head": name, "trainer.grad_accum": 2, "trainer.grad_clip": 0.05}
    if own:
        extra["head.own_embedding"] = "true"
    for config in ("cpu-2proc.yaml", "cpu-zero3.yaml"):
        args = training_kit.overrides(tiny_target_dir, chat_file, tmp_path / config, **extra)
        proc = training_kit.cli(args, launcher=launcher(config))
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_head(tmp_path / "cpu-zero3.yaml", tmp_path / "cpu-2proc.yaml", atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes(runs, tmp_path, tiny_target_dir, chat_file, training_kit):
    """The README's multi-node command, with two "machines" of one process each on this host."""
    ddp, _ = runs("cpu-2proc.yaml")
    out = tmp_path / "two-nodes"
    port = str(_free_port())

    def node(rank: int) -> list[str]:
        return launcher(
            "cpu-zero2.yaml", "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", port,
            "--deepspeed_multinode_launcher", "standard",
        )  # fmt: skip

    args = training_kit.overrides(tiny_target_dir, chat_file, out, **EXTRA)
    cmd = [str(ROOT / "train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    second = subprocess.Popen(
        node(1) + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env
    )
    try:
        first = training_kit.cli(args, launcher=node(0))
        assert first.returncode == 0, first.stderr[-3000:]
        assert second.wait(timeout=120) == 0
    finally:
        if second.poll() is None:
            second.kill()
    assert "2 processes" in first.stdout
    assert_same_head(out, ddp, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zero3_on_gpus_bf16(tmp_path, tiny_target_dir, chat_file, training_kit):
    """zero3.yaml as shipped, on the GPUs there are (at most 2), in bf16."""
    gpus = str(min(2, torch.cuda.device_count()))
    out = tmp_path / "gpu"
    args = training_kit.overrides(
        tiny_target_dir, chat_file, out, **EXTRA, **{"trainer.mixed_precision": "bf16"}
    )
    proc = training_kit.cli(args, launcher=launcher("zero3.yaml", "--num_processes", gpus))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO-3" in proc.stdout and "on cuda" in proc.stdout
    assert load_head(out / "head").family == "eagle3"
