"""inference/devices.py: device names checked in one line; host values copied without a wait (the CUDA
side of `host_to_device` is tested in test_cuda_syncs.py)."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.devices import check_device, host_ids, host_to_device, load_dtype


def test_host_to_device_on_the_same_device_is_the_tensor_itself():
    x = torch.arange(4)
    assert host_to_device(x, torch.device("cpu")) is x  # (no copy, no op: the CPU loop pays nothing)


def test_host_ids_are_long_tensors_of_the_lists_shape_on_the_device():
    ids = host_ids([[5, 0, 2**40]], torch.device("cpu"))  # [1, K]; an id past int32 kept exactly
    assert ids.dtype == torch.long and ids.tolist() == [[5, 0, 2**40]]
    path = host_ids([0, 2, 3], torch.device("meta"))  # [K], moved to the device given
    assert path.device.type == "meta" and path.shape == (3,) and path.dtype == torch.long


def test_bad_device_names_are_one_clear_error():
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a device name"):
        check_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"CUDA is not available on this machine .*use --device cpu"):
            check_device("cuda")


def test_auto_dtype_is_float32_on_a_cpu_and_the_checkpoints_elsewhere():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert (
        load_dtype("auto", "cpu", "bfloat16") == fp32
        and load_dtype("auto", torch.device("cpu"), None) == fp32
    )
    assert (
        load_dtype("auto", "cuda", "bfloat16") == bf16 and load_dtype("auto", "cuda:1", torch.float16) == fp16
    )
    assert (
        load_dtype("auto", "cuda", "float32") == fp32 and load_dtype("auto", "cuda", "torch.float16") == fp16
    )
    assert (
        load_dtype("auto", "cuda", None) == bf16 and load_dtype("auto", "cuda", "int8") == bf16
    )  # none named
    assert load_dtype("float16", "cpu") == fp16 and load_dtype(bf16, "cpu") == bf16  # given: as given
    with pytest.raises(ValueError, match=r"^dtype 'fp8' is not one of auto, float32, bfloat16, float16$"):
        load_dtype("fp8", "cuda")


def test_from_pretrained_loads_a_bf16_checkpoint_in_float32_on_a_cpu(
    tiny_llama, chatml_tokenizer, tmp_path, monkeypatch
):
    """dtype="auto" (the default) on this CPU: float32 whatever the checkpoint's dtype, which load_dtype
    is shown; a bad name fails in one line before anything loads (the target path is not read)."""
    from spechead.inference import loading
    from spechead.inference.generator import SpeculativeGenerator

    seen = []
    monkeypatch.setattr(loading, "load_dtype", lambda *a: (seen.append(a), load_dtype(*a))[1])

    tiny_llama(len(chatml_tokenizer), layers=1, hidden=32).to(torch.bfloat16).save_pretrained(tmp_path / "t")
    chatml_tokenizer.save_pretrained(tmp_path / "t")
    assert SpeculativeGenerator.from_pretrained(str(tmp_path / "t")).target.dtype == torch.float32
    assert seen == [("auto", "cpu", torch.bfloat16)]  # (the checkpoint's dtype, read from its config)
    assert (
        SpeculativeGenerator.from_pretrained(str(tmp_path / "t"), dtype="bfloat16").target.dtype
        == torch.bfloat16
    )
    with pytest.raises(ValueError, match=r"^dtype 'half' is not one of auto"):
        SpeculativeGenerator.from_pretrained("/no/such/target", dtype="half")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_without_mps_is_one_clear_error():
    """--device mps where there is no MPS (any machine but a Mac's) fails in one line naming cpu."""
    with pytest.raises(
        ValueError, match="^--device mps: MPS is not available on this machine; use --device cpu$"
    ):
        check_device("mps")
