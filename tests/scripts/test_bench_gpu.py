"""scripts/bench_gpu.py: the --tiny CPU run (the same code as the H100 run) and its one-line error."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_gpu.py"
# one worker runs this module (pyproject's --dist loadgroup): the tiny run below is built once, not on each
pytestmark = pytest.mark.xdist_group("bench_gpu")
SIZES = ["1", "2", "4", "8", "16", "32", "64", "128"]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def load_script(monkeypatch):
    """bench_gpu.py as a module, its sibling modules found as `python scripts/bench_gpu.py` finds them."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_gpu_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def error_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """main(args)'s exit code and stderr, in this process: for errors found before any work (a process
    costs ~5 s of imports; test_bad_numbers_are_one_error_line runs an error as a process)."""
    module = load_script(monkeypatch)
    capsys.readouterr()
    try:
        code = module.main(list(args))
    except SystemExit as err:  # argparse's errors
        code = err.code
    return code, capsys.readouterr().err


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[dict, str]:
    cwd = tmp_path_factory.mktemp("bench_gpu")
    proc = run(
        "--tiny",
        "--device",
        "cpu",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--profile",
        "--out",
        "tmp.json",
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((cwd / "tmp.json").read_text()), proc.stdout


@pytest.mark.slow
def test_tiny_run_reports_every_part(tiny_run):
    r, _ = tiny_run
    keys = {"device", "device_name", "target", "compile", "context", "draft_vocab", "top_k", "depth", "tree_size",
            "verify_ms", "verify_x_step", "verify_64_x_step", "decode_step_ms", "copy_bandwidth_GBps",
            "weight_bytes", "streamed_bytes", "roofline_ms", "roofline_fraction", "roofline_fraction_streamed",
            "propose_ms", "draft_ms", "draft_x_step", "draft_ms_per_depth", "draft_depth_ms", "draft_depth_x_step",
            "commit_ms", "commit_path_len", "accept_ms", "pass_ms", "projected_speedup", "speedup_tau_5.4",
            "batch", "batch_speculative", "goals"}  # fmt: skip
    assert keys <= set(r), keys - set(r)
    assert r["context"] == 64 and r["draft_vocab"] == 1024 and r["top_k"] == 8
    assert r["device"] == "cpu" and r["compile"] == "off" and r["tree_size"] == 64 and r["depth"] == 7
    for key in ("decode_step_ms", "copy_bandwidth_GBps", "weight_bytes", "streamed_bytes", "roofline_ms",
                "commit_ms", "accept_ms", "draft_ms", "pass_ms"):  # fmt: skip
        assert positive(r[key]), (key, r[key])
    assert 0 < r["streamed_bytes"] < r["weight_bytes"] + 10**6
    assert 0 < r["roofline_fraction"] and 0 < r["roofline_fraction_streamed"]
    assert math.isclose(r["roofline_fraction"], r["roofline_ms"] / r["decode_step_ms"], rel_tol=1e-9)
    assert list(r["verify_ms"]) == SIZES and all(positive(t) for t in r["verify_ms"].values())
    assert r["decode_step_ms"] == r["verify_ms"]["1"] and r["verify_x_step"]["1"] == 1.0
    assert math.isclose(r["verify_64_x_step"], r["verify_ms"]["64"] / r["decode_step_ms"])
    assert list(r["propose_ms"]) == [str(d) for d in range(1, 8)]
    assert all(positive(t) for t in r["propose_ms"].values()) and r["draft_ms"] == r["propose_ms"]["7"]
    assert math.isclose(sum(r["draft_ms_per_depth"].values()), r["draft_ms"])
    assert math.isclose(r["draft_x_step"], r["draft_ms"] / r["decode_step_ms"])
    head_steps = [r["draft_ms_per_depth"][str(d)] for d in range(2, 8)]
    assert math.isclose(r["draft_depth_ms"], sum(head_steps) / 6)
    assert math.isclose(r["draft_depth_x_step"], r["draft_depth_ms"] / r["decode_step_ms"])
    assert r["commit_path_len"] >= 2
    # the draft's roofline: depth 1 reads the draft-vocab head, each further depth the layer, norm and head
    head_bytes = 2 * 1024 * 64  # bf16 lm_head [Vd, H]
    # EAGLE-3's layer: q, k, v over [embedding, feature] (2H = 128 in; kv width 32), o, the MLP, 4 norms
    layer_bytes = 2 * (64 * 128 + 2 * 32 * 128 + 64 * 64 + 3 * 128 * 64 + 4 * 64)
    assert r["draft_bytes"] == head_bytes + 6 * (layer_bytes + head_bytes)
    assert r["draft_floor_ms"] == pytest.approx(r["draft_bytes"] / (r["copy_bandwidth_GBps"] * 1e6))
    assert r["draft_roofline_fraction"] == pytest.approx(r["draft_floor_ms"] / r["draft_ms"])


@pytest.mark.slow
def test_profile_splits_each_part(tiny_run):
    r, out = tiny_run
    assert list(r["profile"]) == ["decode step", "verify(64)", "verify+commit", "draft (depth 7)", "accept"]
    for p in r["profile"].values():  # on a CPU: no kernels, host ops counted and ranked
        assert positive(p["wall_ms"]) and p["device_ms"] is None and p["kernels"] is None
        assert p["host_ops"] > 0 and p["top"] and all(name.startswith("aten::") for name, _, _ in p["top"])
    assert r["profile"]["draft (depth 7)"]["host_ops"] > r["profile"]["accept"]["host_ops"]
    assert "profile (per call) | wall ms | kernel ms" in out and "  draft (depth 7) top: aten::" in out


@pytest.mark.slow
def test_projected_speedup_is_computed_from_the_parts(tiny_run):
    r, _ = tiny_run
    pass_ms = r["verify_ms"]["64"] + r["commit_ms"] + r["propose_ms"]["7"] + r["accept_ms"]
    assert math.isclose(r["pass_ms"], pass_ms)
    assert set(r["projected_speedup"]) == {"3.0", "4.0", "5.0", "5.4", "6.0"}
    for tau, speedup in r["projected_speedup"].items():
        assert math.isclose(speedup, float(tau) * r["decode_step_ms"] / pass_ms)
    assert r["speedup_tau_5.4"] == r["projected_speedup"]["5.4"]


@pytest.mark.slow
def test_batch_rows_and_goals(tiny_run):
    r, out = tiny_run
    assert [row["batch"] for row in r["batch"]] == [1, 4, 16]
    extra = r["pass_ms"] - r["verify_ms"]["64"]
    for row in r["batch"]:
        assert positive(row["plain_step_ms"]) and positive(row["verify_ms"])
        assert math.isclose(row["plain_tokens_per_s"], 1e3 * row["batch"] / row["plain_step_ms"])
        assert math.isclose(row["projected_pass_ms"], row["verify_ms"] + extra)
        assert math.isclose(row["projected_tokens_per_s"], row["batch"] * row["projected_row_tokens_per_s"])
        assert math.isclose(row["projected_speedup"], 5.4 * row["plain_step_ms"] / row["projected_pass_ms"])
        # whole passes decoded through the engine, plain and with a tree of max(4, 64 // B) nodes per row
        assert row["decoded_tree_nodes"] == max(4, 64 // row["batch"])
        spec, plain = row["decoded_spec_pass_ms"], row["decoded_plain_pass_ms"]
        assert positive(spec) and positive(plain)
        assert math.isclose(row["decoded_tokens_per_s"], 1e3 * row["batch"] * 5.4 / spec)
        assert math.isclose(row["decoded_speedup"], 5.4 * plain / spec)
    assert "the second decodes (random weights: about one token a pass)" in out
    assert "batch, decoded (the engine of generate_batch; eager)" in out
    assert len(r["goals"]) == 8  # the 4 EAGLE-3 goals and issue 56's 4 parallel ones (blocks 8 and 16)
    for name, goal in r["goals"].items():
        assert isinstance(goal["met"], bool) and f"goal: {name}:" in out
    assert r["goals"]["projected speedup at tau 5.4 >= 3x"]["value"] == r["speedup_tau_5.4"]
    assert "of roofline" in out and "compile: off" in out
    assert (
        "goals: the issue's GPU goals (a GPU, the 8B shape); this run (cpu, tiny Llama) does not test them"
        in out
    )


@pytest.mark.slow
def test_batch1_decoded_row(tiny_run):
    """Whole passes through SpeculativeGenerator beside the parts' sum (on a CPU: no sync count)."""
    r, out = tiny_run
    row = r["stream"]
    assert row["stream_new_tokens"] == 48
    for name in ("plain", "plain_stepwise", "spec"):  # (on a CPU both plain rows run token by token)
        assert positive(row[f"stream_{name}_pass_ms"]) and row[f"stream_{name}_syncs"] == 0
        assert row[f"stream_{name}_passes"] >= 1  # (the spec passes may emit several tokens each)
        phase = row[f"stream_{name}_phase_ms"]  # the pass split by the generator's own clock
        assert (
            positive(phase["verify"])
            and phase["draft"] >= 0
            and phase["verify"] < row[f"stream_{name}_pass_ms"]
        )
        assert math.isclose(sum(phase.values()), row[f"stream_{name}_pass_ms"])
    assert row["stream_plain_phase_ms"]["draft"] < 0.2 * row["stream_spec_phase_ms"]["draft"]  # plain: none
    assert (
        row["stream_plain_passes"] == row["stream_plain_stepwise_passes"] == 47
    )  # every token but the first
    assert row["stream_plain_tau"] == 1.0 and "token by token, the host reading each" in out
    assert math.isclose(row["stream_speedup"], 5.4 * row["stream_plain_pass_ms"] / row["stream_spec_pass_ms"])
    assert math.isclose(row["stream_gap_ms"], row["stream_spec_pass_ms"] - r["pass_ms"])
    assert "batch 1, decoded (SpeculativeGenerator, 48 tokens" in out and "host waits for the GPU" in out
    for name in ("plain", "spec"):  # a pass's device work (torch.profiler; a CPU: host ops, no kernels)
        dev = row[f"stream_{name}_device"]
        assert dev["kernel_ms"] is None and dev["kernels"] is None and dev["host_ops"] > 10
        assert dev["top"] and all(k.startswith("aten::") for k, _ in dev["top"])
    # (a pass's host ops: the prefill's dropped; EAGLE-3 drafts and verifies, plain only steps)
    assert row["stream_spec_device"]["host_ops"] > 2 * row["stream_plain_device"]["host_ops"]
    assert "a decoded pass on the device (torch.profiler; wall - kernels = the device idle" in out
    assert (
        "a decoded pass by phase, ms (draft / verify, accept and commit / the loop's other work): plain "
        in out
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_without_tiny_on_a_cpu_machine_is_one_error_line(monkeypatch, capsys):
    """(In this process; test_bad_numbers_are_one_error_line checks a process's exit.)"""
    module = load_script(monkeypatch)
    capsys.readouterr()
    code = module.main(["--device", "cuda", "--iters", "1"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("error: ") and "CUDA is not available" in lines[0]


def test_bad_numbers_are_one_error_line(tmp_path):
    proc = run("--tiny", "--device", "cpu", "--iters", "0", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == ["error: --iters must be >= 1, got 0"]


def test_topk_chunk_takes_a_number_auto_or_none(monkeypatch, capsys):
    module = load_script(monkeypatch)
    assert module.parse([]).topk_chunk == "auto"  # the drafters' default
    assert [module.parse(["--topk-chunk", x]).topk_chunk for x in ("64", "none", "auto")] == [
        64,
        None,
        "auto",
    ]
    code, err = error_in_process(monkeypatch, capsys, "--tiny", "--device", "cpu", "--topk-chunk", "0")
    assert code == 2 and "a chunk is a positive number of ids, auto or none, got '0'" in err


def test_draft_fp8_follows_the_loading_default(monkeypatch):
    """--draft-fp8 auto (the default) drafts in FP8 where from_pretrained does (a GPU with FP8 tensor
    cores; here the CPU put in its place), on / bare --draft-fp8 anywhere, off nowhere."""
    module = load_script(monkeypatch)
    from transformers import LlamaConfig

    from spechead.heads import Eagle3Config, Eagle3Head
    from spechead.inference import draft_weights

    assert [module.parse(a).draft_fp8 for a in ([], ["--draft-fp8"], ["--draft-fp8", "off"])] == [
        "auto",
        "on",
        "off",
    ]
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )
    head, cpu = Eagle3Head(Eagle3Config.from_target(cfg)), torch.device("cpu")
    assert [module.drafts_in_fp8(x, head, cpu) for x in ("auto", "on", "off")] == [False, True, False]
    monkeypatch.setattr(draft_weights, "has_fp8_tensor_cores", lambda device: True)
    assert [module.drafts_in_fp8(x, head, cpu) for x in ("auto", "on", "off")] == [True, True, False]


def test_a_failing_compile_still_gives_eager_numbers(tmp_path, monkeypatch, capsys):
    module = load_script(monkeypatch)

    def broken(fn, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("no compiler here\nsecond line")

        return compiled

    monkeypatch.setattr(module.torch, "compile", broken)
    argv = [
        "--tiny",
        "--device",
        "cpu",
        "--compile",
        "--compile-batch",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--out",
        str(tmp_path / "r.json"),
    ]
    assert module.main(argv) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["compile"].startswith("FAILED (RuntimeError: no compiler here)") and positive(
        r["decode_step_ms"]
    )
    out = capsys.readouterr().out
    assert "compile: FAILED" in out
    # the decoded batch rows' compiled passes failed too: said per row, the other numbers kept
    assert all(row["decoded_error"] == "RuntimeError: no compiler here" for row in r["batch"])
    assert all(positive(row["plain_step_ms"]) for row in r["batch"])
    assert out.count("| failed: RuntimeError: no compiler here") == 3


def test_compiled_run_traces_target_and_whole_draft(tmp_path, monkeypatch, capsys):
    """--compile BACKEND --sizes: the target's buckets and the whole-draft graph (depths 1 and D only)."""
    # (--no-stream: the decoded rows are tiny_run's)
    proc = run("--tiny", "--device", "cpu", "--iters", "2", "--warmup", "1", "--compile", "eager", "--sizes",
               "1,64", "--compare", "aot_eager", "--no-batch", "--no-stream", "--out", "c.json", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "c.json").read_text())
    assert r["compile"].startswith("on, target and draft step (eager") and r["draft_status"] == "compiled"
    # --compare: the batch-1 parts measured again with the other backend, beside; --no-batch: no rows
    assert r["compare"]["compile"].startswith("on, target and draft step (aot_eager")
    assert set(r["compare"]) == {"compile", "decode_step_ms", "roofline_fraction", "verify_64_x_step", "draft_ms",
                                 "draft_x_step", "draft_depth_ms", "pass_ms", "speedup_tau_5.4"}  # fmt: skip
    assert all(positive(v) for k, v in r["compare"].items() if k != "compile")
    assert r["batch"] == [] and "compare: decode_step_ms" in proc.stdout and "batch (eager" not in proc.stdout
    # the parallel drafts as decoding's CUDA default runs them beside the compiled EAGLE-3 draft: "graphs"
    assert {row["draft_compile"] for row in r["parallel"].values()} == {
        "graphs"
    } and "draft graphs" in proc.stdout
    assert set(r["verify_ms"]) == {"1", "64"} and set(r["propose_ms"]) == {"1", "7"}
    assert r["draft_depth_ms"] == pytest.approx((r["propose_ms"]["7"] - r["propose_ms"]["1"]) / 6)
    code, err = error_in_process(monkeypatch, capsys, "--tiny", "--device", "cpu", "--sizes", "1,16")
    assert code == 2 and "--sizes must hold 1, 64 and --tree-size 64" in err
    code, err = error_in_process(monkeypatch, capsys, "--tiny", "--device", "cpu", "--compare", "eager")
    assert code == 2 and err.strip().splitlines() == [
        "error: --compare eager measures beside --compile BACKEND: add --compile"
    ]


def test_compiled_batch_rows(tmp_path):
    """--compile-batch BACKEND: the decoded batch rows run the target's batch passes compiled
    (batch_graphs.py) and the EAGLE draft as graphs for a batch of one anywhere, for more rows on CUDA
    only; the batch-1 parts stay eager."""
    proc = run("--tiny", "--device", "cpu", "--iters", "1", "--warmup", "1", "--sizes", "1,64",
               "--compile-batch", "eager", "--no-stream", "--out", "b.json", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["compile_batch"] == "eager" and r["compile"].startswith("off")
    assert [row["batch"] for row in r["batch"]] == [1, 4, 16]
    assert all(
        positive(row[f"decoded_{name}_pass_ms"])
        for row in r["batch"]
        for name in ("plain", "plain_stepwise", "spec", "spec_stepwise")
    )
    # (a CPU: the draft of B > 1 rows eager)
    assert "generate_batch; target compiled: eager, the draft as graphs at B=1)" in proc.stdout
    assert [row["draft_graphs"] for row in r["batch"]] == [True, False, False]


def test_fp8_draft_reads_about_half_the_bytes(tiny_run, tmp_path):
    """--draft-fp8: the head's per-depth layers in e4m3 (heads/fp8.py); its weight bytes (buffers now)
    count in the draft's roofline: about half of bf16's (the norms and row scales stay bf16). With
    --topk-chunk, --draft-attention, --target-attention and --target-stacked (the same run): the depths'
    top-k over chunks, the draft's and the target's few-query attention as matmuls, the target's
    projections stacked, said in the report."""
    # (no decoded row: emulated FP8 decoding on a CPU took two minutes of CI, and the row is the tiny run's)
    proc = run("--tiny", "--device", "cpu", "--iters", "1", "--warmup", "1", "--no-batch", "--no-stream",
               "--draft-fp8", "--topk-chunk", "16", "--draft-attention", "matmul", "--target-attention",
               "spechead_matmul", "--target-stacked", "--out", "fp8.json", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r, bf16 = json.loads((tmp_path / "fp8.json").read_text()), tiny_run[0]
    assert r["draft_fp8"] is True and bf16["draft_fp8"] is False
    assert r["fp8_stacked"] is True and bf16["fp8_stacked"] is False  # q/k/v, gate/up one GEMM each
    assert 0.45 < r["draft_bytes"] / bf16["draft_bytes"] < 0.6
    assert "EAGLE-3 head (per-depth layers FP8 e4m3)" in proc.stdout and positive(r["draft_ms"])
    assert r["topk_chunk"] == 16 and bf16["topk_chunk"] is None and "; top-k in chunks of 16" in proc.stdout
    # --draft-attention (the same run): the measured drafter's step attends as matmuls (heads/fused.py)
    assert r["draft_attention"] == "matmul" and bf16["draft_attention"] == "sdpa"
    assert "; few-query attention as matmuls" in proc.stdout
    # --target-attention (the same run): the target's tree passes through "spechead_matmul"; by default
    # "spechead_sdpa", what from_pretrained loads (and on a CPU the draft's default "auto" is sdpa)
    assert r["target_attention"] == "spechead_matmul" and bf16["target_attention"] == "spechead_sdpa"
    assert "target attention: spechead_matmul" in proc.stdout
    # --target-stacked (the same run): the target's q/k/v and gate/up one GEMM each in its 4 layers, the
    # same weight bytes (each weight once, in its stack)
    assert r["target_stacked"] == 8 and bf16["target_stacked"] == 0
    assert "; q/k/v and gate/up stacked, one GEMM each (8 groups)" in proc.stdout
    assert r["weight_bytes"] == bf16["weight_bytes"]


def test_parallel_drafts_one_forward_beside_eagle3(tmp_path, monkeypatch, capsys):
    """--blocks 8,16: a P-EAGLE head of K and a DFlash head of block K each timed as one forward after the
    context, their chains verified and their passes projected as EAGLE-3's; the issue's parallel goals read
    K=8 P-EAGLE and block-16 DFlash; --no-parallel leaves them out; bad blocks are one error line."""
    proc = run("--tiny", "--device", "cpu", "--iters", "1", "--warmup", "0", "--sizes", "1,64", "--no-batch",
               "--no-stream", "--dflash-layers", "2", "--peagle-layers", "2", "--out", "p.json", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "p.json").read_text())
    assert (
        list(r["parallel"]) == ["peagle-8", "dflash-8", "peagle-16", "dflash-16"]
        and r["parallel_layers"] == 2
        and r["peagle_layers"] == 2
    )
    assert "DFlash 2 layers, P-EAGLE 2;" in proc.stdout
    step = r["decode_step_ms"]
    for name, row in r["parallel"].items():
        k = int(name.split("-")[1])
        assert (row["drafts"], row["nodes"]) == ((k, k + 1) if name.startswith("peagle") else (k - 1, k))
        assert all(positive(row[key]) for key in ("draft_ms", "accept_ms", "verify_ms", "pass_ms"))
        assert math.isclose(
            row["pass_ms"], row["verify_ms"] + r["commit_ms"] + row["draft_ms"] + row["accept_ms"]
        )
        assert math.isclose(row["draft_x_step"], row["draft_ms"] / step)
        assert math.isclose(row["projected_speedup"]["6.0"], 6.0 * step / row["pass_ms"])
        assert f"  {name} ({row['drafts']} drafts): draft {row['draft_ms']:.3f} ms" in proc.stdout
    assert r["dflash_16_draft_x_step"] == r["parallel"]["dflash-16"]["draft_x_step"]
    assert r["speedup_tau_6_peagle_8"] == r["parallel"]["peagle-8"]["projected_speedup"]["6.0"]
    goal = r["goals"]["K=8 P-EAGLE draft <= 8% of a plain step"]
    assert goal["bound"] == 0.08 and goal["value"] == r["peagle_8_draft_x_step"] and len(r["goals"]) == 8
    assert "eagle3 depth 7 (tree 64): draft" in proc.stdout and "does not test them" in proc.stdout
    assert {row["draft_compile"] for row in r["parallel"].values()} == {
        "eager"
    } and "draft eager" in proc.stdout
    alone = run("--tiny", "--device", "cpu", "--iters", "1", "--warmup", "0", "--sizes", "1,64", "--no-batch",
                "--no-stream", "--no-parallel", "--out", "n.json", cwd=tmp_path)  # fmt: skip
    r = json.loads((tmp_path / "n.json").read_text())
    assert alone.returncode == 0 and "parallel" not in r and len(r["goals"]) == 4
    code, err = error_in_process(monkeypatch, capsys, "--tiny", "--device", "cpu", "--blocks", "1,8")
    assert code == 2 and "blocks are numbers >= 2, e.g. 8,16, got '1,8'" in err


def test_parallel_drafts_are_timed_compiled_as_asked(monkeypatch, tiny_llama):
    """measure_parallel(compile=...): every parallel drafter's draft goes through the engine's one compile
    entry point with that mode (on a GPU "graphs" is a CUDA graph, not the eager kernels' launches); a
    compile that fails gives that row's eager numbers, said so."""
    load_script(monkeypatch)  # (its sibling modules on the path)
    import parallel_drafts

    import spechead.inference.compiling as compiling

    model = tiny_llama(64, layers=4, hidden=32).eval()
    prompt = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(0))
    hidden, root = parallel_drafts.target_states(model, prompt)
    heads = parallel_drafts.parallel_heads(model, 64, (4,), 1)
    timer = parallel_drafts.Timer(torch.device("cpu"), 2, 1)
    modes, original = [], compiling.compile_function
    monkeypatch.setattr(
        compiling,
        "compile_function",
        lambda fn, mode, *a, **kw: (modes.append(mode), original(fn, mode, *a, **kw))[1],
    )
    rows = parallel_drafts.measure_parallel(heads, prompt, hidden, root, timer, "graphs")
    assert modes == ["graphs", "graphs"] and {row["draft_compile"] for row in rows.values()} == {"graphs"}
    assert all(positive(row["draft_ms"]) for row in rows.values())

    def broken(fn, mode, *a, **kw):
        raise RuntimeError("no graphs here\nsecond line")

    monkeypatch.setattr(compiling, "compile_function", broken)
    rows = parallel_drafts.measure_parallel(heads, prompt, hidden, root, timer, "graphs")
    assert {row["draft_compile"] for row in rows.values()} == {
        "graphs FAILED (RuntimeError: no graphs here); eager"
    } and all(positive(row["draft_ms"]) for row in rows.values())
