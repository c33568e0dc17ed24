"""Build a SpeculativeGenerator from names: a target (path or Hub id) and a head, draft model or method.

The wiring above the engine: it imports the tuning (a head's tree calibrated at load, re-picked per batch
size) that the engine never imports and plugs it in (at the end). Spec names: drafter_specs.py.
"""

from __future__ import annotations

import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spechead.heads import directory
from spechead.heads.attention import NAME as TREE_SDPA
from spechead.heads.attention import runs_sdpa
from spechead.heads.families import family_of
from spechead.heads.hybrid import check_attention_only
from spechead.inference import generator
from spechead.inference.compiling import AUTO, check_compile, resolve_compile
from spechead.inference.cuda_graphs import GraphCaptureError
from spechead.inference.devices import check_device, load_dtype
from spechead.inference.draft_weights import check_draft_settings, quantize_draft
from spechead.inference.drafter_specs import TREE_OPTIONS, check_options, make_drafter
from spechead.inference.drafters.base import Drafter
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.memory_fit import check_target_fits
from spechead.inference.tuning.calibrate import EAGER, TimedAs, calibrated_choices, saved_accuracy
from spechead.inference.tuning.pass_timing import decoded_choice


def merge_head_adapter(target, drafter: str | Drafter | RowDrafter | None):
    """`target` with a head's LoRA adapter (Medusa-2) merged in; any other drafter's passes through."""
    if not isinstance(drafter, str) or not check_options(drafter, {}).get("lora_adapter"):
        return target
    # a Hub head: its snapshot holds the adapter files
    adapter = directory.adapter_dir(directory.resolve(drafter))
    from peft import PeftModel

    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return PeftModel.from_pretrained(target, str(adapter)).merge_and_unload()


def load_generator(
    cls,
    target: str,
    drafter: str | Drafter | RowDrafter | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    attn_implementation: str = TREE_SDPA,
    revision: str | None = None,
    cache: str | None = None,
    max_cache_len: int | None = None,
    calibrate: bool = True,
    compile: bool | str = AUTO,
    draft_compile: bool | str | None = None,
    draft_fp8: bool | str = AUTO,
    draft_int8: bool | str = AUTO,
    **drafter_options,
):
    """SpeculativeGenerator for `target` with `drafter` (drafter_specs.make_drafter), options to the drafter.

    dtype: the target's and the head's weights (devices.load_dtype). attn_implementation: the target's;
    "spechead_sdpa" by default, "eager" for a model class that cannot run sdpa (Gemma-2). revision: the
    target's (a Hub head comes from its default branch; for another, pass its snapshot_download folder).
    cache / max_cache_len: the target's KV cache. calibrate: without tree options, when the head's
    tree.json holds an accuracy table (or the family assumes one here), time this device and use the
    static tree of the best expected speedup (`gen.calibration`). compile / draft_compile: the verify pass
    and the drafter compiled ("auto": `compiling.resolve_compile`); graphs "auto" chose are proven on a
    two-token answer, else decoding is eager with a RuntimeWarning. draft_fp8 / draft_int8: the draft
    layers quantized, still lossless, before calibration (draft_weights.py).
    """
    check_compile(compile)  # (before anything loads: one line in a second)
    check_compile(draft_compile, "draft_compile")
    check_draft_settings(draft_fp8, draft_int8, device)
    torch_dtype = None if dtype == "auto" else load_dtype(dtype, device)  # (a bad name: before any load)
    config = AutoConfig.from_pretrained(target, revision=revision)
    check_attention_only(config, "speculative decoding")  # (a hybrid target: one line before any load)
    if torch_dtype is None:  # auto: float32 on a CPU, else the checkpoint's own
        torch_dtype = load_dtype(dtype, device, getattr(config.get_text_config(), "dtype", None))
    if attn_implementation == TREE_SDPA and not runs_sdpa(config):  # our default, not a user's choice:
        attn_implementation = "eager"  # (Gemma-2) eager attention takes tree masks as well
    # (one line now, not minutes of loading then an out-of-memory traceback: a 70B target on one GPU)
    where = check_device(str(device), "device")
    check_target_fits(target, config, torch_dtype, where)
    # straight onto the device (one device: no dispatch hooks), shard by shard: a GPU machine whose host
    # memory is smaller than the target could not stage it in host memory first
    model = AutoModelForCausalLM.from_pretrained(
        target,
        revision=revision,
        config=config,
        dtype=torch_dtype,
        attn_implementation=attn_implementation,
        device_map=where,
    )
    model = merge_head_adapter(model, drafter).eval()
    on = next(model.parameters()).device
    auto = compile == AUTO
    compile = resolve_compile(compile, on)
    draft_compile = None if draft_compile is None else resolve_compile(draft_compile, on)
    tokenizer = AutoTokenizer.from_pretrained(target, revision=revision)
    built = make_drafter(
        drafter, model, device=device, dtype=torch_dtype, tokenizer=tokenizer, **drafter_options
    )
    weights = quantize_draft(getattr(built, "head", None), on, draft_fp8, draft_int8, drafter)
    # a quantized Medusa drafter is built again: the one built before anchored its device and dtype on
    # what may have been a swapped-out projection, kept alive and stale
    if weights == "int8" and isinstance(built, MedusaDrafter):
        built = built.with_tree(built.choices)
    chose_tree = set(TREE_OPTIONS) & set(drafter_options)
    calibrating = calibrate and isinstance(drafter, str) and hasattr(built, "head") and not chose_tree
    saved = directory.read_tree(directory.resolve(str(drafter))) if calibrating else None  # its tree.json

    def build(compile: bool | str, draft_compile: bool | str | None):
        """The generator over `built`, its tree calibrated here (when asked) as it will run."""
        chosen, calibration, accuracy = built, None, None
        if calibrating:
            timed_as = TimedAs.of(on, compile, draft_compile)
            chosen, calibration, accuracy = calibrated_drafter(model, built, saved, timed_as)
        gen = cls(
            model, tokenizer, chosen, cache=cache, max_cache_len=max_cache_len, compile=compile,
            draft_compile=draft_compile,
        )  # fmt: skip
        gen.calibration, gen.tree_accuracy, gen.draft_weights = calibration, accuracy, weights
        return gen

    if not (auto and compile):
        return build(compile, draft_compile)
    try:  # graphs that "auto" chose, not the caller: proven on a short answer now, else eager decoding
        gen = build(compile, draft_compile)
        gen.generate(input_ids=[0, 1, 2, 3], max_new_tokens=2)
        return gen
    except GraphCaptureError as err:
        warnings.warn(f"compile='auto' decodes eagerly: {err.what}", RuntimeWarning, stacklevel=3)
        if built is not None:
            built.use_compile(False)
        return build(False, draft_compile)  # (None: as compile, eager; a draft_compile given stays)


def calibrated_drafter(
    target, drafter, saved: dict | None, timed_as: TimedAs = EAGER
) -> tuple[Drafter | RowDrafter, dict | None, torch.Tensor | None]:
    """A head's drafter with the static tree of the best expected speedup on the target's device, what was
    measured (None: not calibrated) and the accuracy table [depth, k] that sizes batch trees.

    The table is the saved tree.json's (`saved`) or the family's assumed one, calibrated from on a CPU
    where the family asks (EAGLE's default dynamic tree is sized for a GPU), else kept for batch trees. A
    saved tree tuned on this kind of device stays unless another is clearly faster (no trading places on
    noise). timed_as: the parts compiled as the generator will compile them.
    """
    head, device = drafter.head, next(target.parameters()).device
    fam = family_of(head.config)
    accuracy, source = saved_accuracy(saved), "tree.json"
    if accuracy is None:
        assumed = fam.load("assumed_accuracy")(head)
        if not fam.calibrate_assumed:
            return drafter, None, assumed
        if device.type != "cpu":
            return drafter, None, None
        accuracy, source = assumed, "assumed (no tree.json: run scripts/build_tree.py)"
    keep = saved["choices"] if saved and str(saved.get("device", "")).split(":")[0] == device.type else None
    _, info = calibrated_choices(target, drafter, accuracy, timed_as=timed_as)
    choices, info = decoded_choice(target, drafter, accuracy, info, keep, timed_as=timed_as)
    if info["expected_speedup"] < 1.0:  # the best tree is expected to lose to plain decoding here
        warnings.warn(
            f"on {device}, the best tree for this head is expected at "
            f"{info['expected_speedup']:.2f}x plain decoding (accuracy {source}): decode with drafter=None "
            "to be faster, or keep it to measure",
            stacklevel=3,
        )
    return drafter.with_tree(choices), {"choices": choices, **info, "accuracy_source": source}, accuracy


def drafter_for_batch(
    model, drafter, accuracy: torch.Tensor, batch: int, compile: bool | str, draft_compile: bool | str | None
) -> tuple:
    """(the drafter with the tree measured best for `batch` rows here, None when none is expected to beat
    plain batched decoding; what was measured): generator.BatchTreePicker. B rows' trees are verified in one
    forward of B x N tokens, so trees of up to max(4, 64 // batch) nodes a row are ranked by their parts'
    costs and the best few decoded, each part timed as a generator with these compile settings runs it."""
    timed_as = TimedAs.of(model.device, compile, draft_compile)
    _, info = calibrated_choices(model, drafter, accuracy, max(4, 64 // batch), timed_as, batch)
    choices, info = decoded_choice(model, drafter, accuracy, info, batch=batch, timed_as=timed_as)
    if info["expected_speedup"] > 1:  # drafting must beat plain batched decoding to be worth it
        return drafter.with_tree(choices), {"batch": batch, "choices": choices, **info}
    return None, {"batch": batch, "choices": [], **info}


# The engine's plug-ins: spechead.inference imports this module, so they are in place before any generator
# is built.
generator.LOAD, generator.BATCH_TREE = load_generator, drafter_for_batch
