"""Does a target fit its device? Checked from its config before any weight is read: one line in a second,
not minutes of loading and an out-of-memory traceback. spechead decodes with the whole target on one device.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

GB = 1e9


def weight_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int | None:
    """Bytes of the target's weights in `dtype`, counted on the meta device (no memory); None when they
    cannot be counted: a quantized checkpoint or a model class transformers cannot build from its config."""
    if getattr(config, "quantization_config", None) is not None:
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # (remote code, an unknown architecture: the load itself will say what is wrong)
        return None
    # parameters() yields a tied embedding / lm_head once; buffers (rotary tables) are small and skipped.
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def device_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes a target's weights may take on `device`, how that was measured), or None when unknown:
    on CUDA the GPU's free memory now, on a CPU the machine's physical memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"{device} has {free / GB:.1f} GB free of {total / GB:.1f} GB"
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
        return total, f"this machine has {total / GB:.1f} GB of memory"
    return None


def check_target_fits(name: str, config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> None:
    """ValueError (one line saying what to do) when target `name`'s weights in `dtype` exceed what
    `device` has; nothing when they fit or either side cannot be measured."""
    need, room = weight_bytes(config, dtype), device_memory(device)
    if need is None or room is None or need <= room[0]:
        return
    dtype_name = str(dtype).removeprefix("torch.")
    in_bf16 = need // dtype.itemsize * 2
    fix = (
        f"load it in bfloat16 ({in_bf16 / GB:.1f} GB: dtype / --dtype), " if in_bf16 <= room[0] < need else ""
    )
    raise ValueError(
        f"target {name}: its weights need {need / GB:.1f} GB in {dtype_name} but {room[1]}; spechead decodes "
        f"with the whole target on one device (not split over several GPUs): {fix}use a device with more "
        "memory, or export the head for vLLM / SGLang (scripts/export.py), which split a target over GPUs"
    )
