"""Build a SpeculativeGenerator from names: a target (path or Hub id) and a head, draft model or method.

The wiring layer above the engine: it may import the tuning (tuning/: a head's tree calibrated at load,
re-picked per batch size) that the engine never imports, and plugs it into the engine (`PLUGINS`, at
the end: SpeculativeGenerator.from_pretrained and each new generator's batch_tree_picker).
"""

from __future__ import annotations

import inspect
import json
import re
import warnings
from importlib.resources import files
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spechead.heads import DraftHead, directory, load_head
from spechead.heads.attention import NAME as TREE_SDPA
from spechead.heads.attention import runs_sdpa
from spechead.heads.families import family_of
from spechead.heads.formats import is_head_dir
from spechead.heads.hybrid import check_attention_only
from spechead.inference.compiling import AUTO, check_compile, resolve_compile
from spechead.inference.cuda_graphs import GraphCaptureError
from spechead.inference.devices import check_device, load_dtype
from spechead.inference.draft_weights import (
    asked,
    check_fp8_device,
    check_int8_device,
    check_setting,
    quantize_draft,
)
from spechead.inference.drafters.base import Drafter
from spechead.inference.drafters.draft_model import DraftModelDrafter
from spechead.inference.drafters.layer_skip_file import is_self_spec, make_self_drafter
from spechead.inference.drafters.lookahead import LookaheadDrafter
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
from spechead.inference.generator import PLUGINS
from spechead.inference.memory_fit import check_target_fits
from spechead.inference.tuning.batch_tree import drafter_for_generator
from spechead.inference.tuning.calibrate import EAGER, TimedAs, calibrated_choices, covers, saved_accuracy
from spechead.inference.tuning.pass_timing import IN_SITU_KEEP_MARGIN, in_situ_choice

# DraftModelDrafter's options: chain length, static (width per depth / rank paths) or dynamic trees, rule.
DRAFT_MODEL_OPTIONS = ("num_draft", "width", "depth", "tree", "rule", "top_k", "total_tokens")
# Drafters without weights, by name (options are their constructor's keyword arguments).
BUILTIN_DRAFTERS = {"prompt_lookup": PromptLookupDrafter, "lookahead": LookaheadDrafter}
CASCADE_OPTIONS = ("num_draft", "tiny_draft")
# Drafter options that pick a head's tree (EAGLE: tree, top_k, depth, total_tokens; Medusa: choices).
TREE_OPTIONS = ("tree", "top_k", "depth", "total_tokens", "choices")


def _config_of(name: str, revision: str | None) -> dict:
    """config.json of a local directory or Hub repo ({} when there is none)."""
    local = Path(name).expanduser()
    if local.is_dir():
        file = local / "config.json"
    else:
        from huggingface_hub import hf_hub_download

        try:
            file = Path(hf_hub_download(name, "config.json", revision=revision))
        except Exception as err:  # offline, missing repo: say which name could not be found
            raise ValueError(
                f"{name!r} is not a local directory and could not be fetched from the Hub ({type(err).__name__})"
            ) from None
    return json.loads(file.read_text()) if file.is_file() else {}


def make_drafter(
    spec: str | Drafter | None, target, *, device, dtype, revision=None, **options
) -> Drafter | None:
    """A drafter from a name: None (plain decoding), "prompt_lookup", "lookahead", "cascade[:TINY+MEDIUM]",
    the target itself with layers skipped (`layer_skip[@skip=2+3]`, `early_exit[@layer=4]`, a drafter file
    from scripts/search_skip.py), a head directory/id, or a draft LM."""
    if spec is None or isinstance(spec, Drafter):
        return spec
    if spec in BUILTIN_DRAFTERS:
        return _builtin(spec, options)
    if _is_cascade(spec):
        return load_cascade(spec, device=device, dtype=dtype, revision=revision, **options)
    if is_self_spec(spec):
        return make_self_drafter(spec, target, **options)
    if is_head_dir(_config_of(spec, revision), spec):  # a spechead head, or one in a reference layout
        # target_config: what a reference layout leaves implicit (EAGLE-3 default layers) comes from the target.
        head = load_head(spec, revision=revision, device=device, dtype=dtype, target_config=target.config)
        # A Hub head becomes its local snapshot (tree.json and adapter included) for everything below.
        spec = str(directory.resolve(spec, revision))
        head.attach_target_modules(
            lm_head=target.get_output_embeddings(), embed_tokens=target.get_input_embeddings()
        )
        return drafter_for_head(head, spec, **options)
    unknown = sorted(set(options) - set(DRAFT_MODEL_OPTIONS))
    if unknown:
        raise ValueError(
            f"draft model {spec}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(DRAFT_MODEL_OPTIONS)}"
        )
    # (straight onto the device, as the target: `load_generator`)
    model = AutoModelForCausalLM.from_pretrained(
        spec, revision=revision, dtype=dtype, device_map=torch.device(device)
    )
    return DraftModelDrafter(model, **options)


def _builtin(name: str, options: dict) -> Drafter:
    """A weightless drafter by name; unknown options raise ValueError naming the valid ones."""
    cls = BUILTIN_DRAFTERS[name]
    valid = [k for k in inspect.signature(cls).parameters]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return cls(**options)


def _is_cascade(spec: str) -> bool:
    return spec == "cascade" or spec.startswith("cascade:")


def cascade_models(spec: str) -> tuple[str, str]:
    """ "cascade:TINY+MEDIUM" -> (TINY, MEDIUM); plain "cascade" = the shipped demo pair (draft, medium)."""
    if spec == "cascade":
        demo = Path(str(files("spechead.data"))) / "demo"
        return str(demo / "draft"), str(demo / "medium")
    tiny, plus, medium = spec.removeprefix("cascade:").partition("+")
    if not plus or not tiny or not medium or "+" in medium:
        raise ValueError(f"cascade drafter {spec!r}: use cascade:TINY+MEDIUM (two model dirs or Hub ids)")
    return tiny, medium


def load_cascade(spec: str, *, device, dtype, revision=None, **options) -> Drafter:
    """A CascadeDrafter from "cascade" (the demo pair) or "cascade:TINY+MEDIUM"; options: CASCADE_OPTIONS."""
    from spechead.inference.drafters.cascade import CascadeDrafter

    unknown = sorted(set(options) - set(CASCADE_OPTIONS))
    if unknown:
        raise ValueError(
            f"cascade drafter: unknown option(s) {', '.join(unknown)}; valid: {', '.join(CASCADE_OPTIONS)}"
        )
    tiny, medium = (
        AutoModelForCausalLM.from_pretrained(
            path, revision=revision, dtype=dtype, device_map=torch.device(device)
        )
        for path in cascade_models(spec)
    )
    return CascadeDrafter(tiny, medium, **options)


def drafter_for_head(head: DraftHead, head_dir: str | None = None, **options) -> Drafter:
    """The drafter of a loaded head (target modules attached), as its family registers it.

    Without tree options, a HEAD_DIR/tree.json from scripts/build_tree.py is the default tree
    (EAGLE: instead of the dynamic tree unless tree/top_k/depth/total_tokens are given).
    """
    fam = family_of(head.config)
    build = fam.load("drafter")
    valid = [name for name in inspect.signature(build).parameters if name != "head"]
    unknown = sorted(set(options) - set(valid))
    if unknown:  # one line naming what this family's drafter takes (a static tree's option differs)
        raise ValueError(
            f"{fam.name} head: unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)} "
            f"(a static tree goes in {fam.tree_option}=)"
        )
    tree = directory.read_tree(head_dir) if head_dir is not None else None
    saved = tree["choices"] if tree else None
    if saved is not None and not set(TREE_OPTIONS) & set(options):
        options = {**options, fam.tree_option: saved}
    return build(head, **options)


def merge_head_adapter(target, head_dir: str):
    """A head that carries a LoRA adapter (Medusa-2) runs on the target with the adapter merged in;
    other heads' targets pass through."""
    if not _config_of(head_dir, None).get("lora_adapter"):
        return target
    # a Hub head: its snapshot holds the adapter files
    adapter = directory.adapter_dir(directory.resolve(head_dir))
    from peft import PeftModel

    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return PeftModel.from_pretrained(target, str(adapter)).merge_and_unload()


def load_generator(
    cls,
    target: str,
    drafter: str | Drafter | None = None,
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
    """SpeculativeGenerator for `target` with `drafter` (see make_drafter); options go to the drafter.

    cache / max_cache_len: the target's KV cache back-end (see SpeculativeGenerator). calibrate: when
    no tree option is given and the head directory's tree.json holds an accuracy table (or, for an
    EAGLE head on a CPU, a typical assumed one), time verify and draft costs on this device now and use
    the static tree with the best expected speedup here (`gen.calibration` says what was measured).
    compile, draft_compile: see SpeculativeGenerator (the target's verify pass and the drafter under
    torch.compile; draft_compile alone: the drafter only, the fastest on a CPU). The default "auto" is
    "graphs" on CUDA (the eager passes captured as CUDA graphs: an 8B step 7.5 ms, against 52 ms eager
    on an H200) and False elsewhere (compiling.resolve_compile); compile=False decodes eagerly anywhere.
    Graphs that "auto" chose are proven here on a two-token answer: a model whose passes cannot be
    captured (a host read inside its forward) then decodes eagerly, with a RuntimeWarning saying why.
    draft_fp8: an EAGLE / EAGLE-3 head's per-depth layers in FP8 e4m3 (heads/fp8.py: half the bytes a
    draft depth reads; still lossless), before any calibration, so the tree is measured as it will
    draft; the default "auto" is on for such a head on a GPU with FP8 tensor cores (draft_weights.py:
    H200, a depth-7 8B-wide draft 1.96 -> 1.38 ms). draft_int8: on a CPU, the head's big per-pass layers
    in int8 (heads/int8.py: a quarter of the bytes float32 reads; EAGLE / EAGLE-3 per-depth layers,
    Medusa projections; still lossless); the default "auto" is on for a Medusa head on an AVX512 CPU
    (`int8_by_default`; the demo's Medusa-2: 1.51x -> 1.91x, same tau), off otherwise (an EAGLE-3 draft
    there is bound by its op count, not its bytes: no gain measured).
    dtype: the target's and the head's weights; "auto" (the default): float32 on a CPU, else the
    checkpoint's own dtype (bfloat16 when it names none; devices.load_dtype). attn_implementation:
    the target's; by default "spechead_sdpa" (heads/attention.py: transformers' sdpa, with grouped
    key/value heads inside the kernel for tree passes on a CPU), or "eager" for a model class that
    cannot run sdpa (Gemma-2).
    """
    check_compile(compile)  # (before anything loads: one line in a second)
    check_compile(draft_compile, "draft_compile")
    check_setting("draft_fp8", draft_fp8)
    check_setting("draft_int8", draft_int8)
    if asked(draft_fp8):
        check_fp8_device(torch.device(device))
    if asked(draft_int8):
        check_int8_device(torch.device(device), asked(draft_fp8))
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
    own = isinstance(drafter, str) and (
        drafter in BUILTIN_DRAFTERS or _is_cascade(drafter) or is_self_spec(drafter)
    )
    if isinstance(drafter, str) and not own:  # a head directory may carry an adapter (Medusa-2)
        model = merge_head_adapter(model, drafter)
    model = model.eval()
    on = next(model.parameters()).device
    auto = compile == AUTO
    compile = resolve_compile(compile, on, cache or cls.default_cache)
    draft_compile = None if draft_compile is None else resolve_compile(draft_compile, on)
    tokenizer = AutoTokenizer.from_pretrained(target, revision=revision)
    built = make_drafter(drafter, model, device=device, dtype=torch_dtype, **drafter_options)
    weights = quantize_draft(getattr(built, "head", None), on, draft_fp8, draft_int8, drafter)
    # a quantized Medusa drafter is built again: the one built before anchored its device and dtype on
    # what may have been a swapped-out projection, kept alive and stale
    if weights == "int8" and isinstance(built, MedusaDrafter):
        built = built.with_tree(built.choices)
    chose_tree = set(TREE_OPTIONS) & set(drafter_options)
    calibrating = calibrate and isinstance(drafter, str) and hasattr(built, "head") and not chose_tree
    saved = None
    if calibrating and isinstance(drafter, str):  # (a head directory: its tree.json, if any)
        saved = directory.read_tree(directory.resolve(drafter, revision))

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
        gen.calibration, gen.tree_accuracy = calibration, accuracy
        gen.draft_weights = weights
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
    target, drafter, saved: dict | None, timed_as: TimedAs | None = None
) -> tuple[Drafter, dict | None, torch.Tensor | None]:
    """A head's drafter with the static tree of the best expected speedup measured on the target's device,
    what was measured (None: not calibrated) and the accuracy table [depth, k] that sizes batch trees.

    The table is the saved tree's (`saved`: HEAD/tree.json's fields) or, without one, the family's assumed
    table: calibrated from on a CPU where the family asks for it (EAGLE: its default dynamic tree is
    sized for a GPU), else kept only for batch trees while the default tree stays. A saved tree tuned on
    this kind of device (its "device", written by tree_tuning.tune_tree) stays unless another tree is
    expected clearly faster: near-equal trees would trade places with noise. The part-by-part costs
    (calibrate.py) rank the trees; the best few are then decoded here (pass_timing.py) and the tree whose
    passes pay best is used, the tuned one unless another pays pass_timing.IN_SITU_KEEP_MARGIN more.
    timed_as: the parts compiled as the generator will compile them (calibrate.TimedAs; None: eager).
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
    # a tree tuned on this kind of device (tree_tuning.py saves where) is kept unless clearly beaten
    tuned_here = saved is not None and str(saved.get("device", "")).split(":")[0] == device.type
    keep = saved["choices"] if saved is not None and tuned_here else None
    timed_as = timed_as or EAGER
    _, info = calibrated_choices(target, drafter, accuracy, keep=keep, timed_as=timed_as)
    # the model's best few trees (and the tuned one) decoded here: the pass as decoding pays it
    choices, info["in_situ"] = decoded_choice(target, head, accuracy, info.pop("ranked"), keep, timed_as)
    info["model_speedup"] = info["expected_speedup"]  # what the part-by-part costs expected of their best
    info["expected_speedup"] = info["in_situ"]["expected_speedup"]
    if "kept_saved_tree" in info["in_situ"]:
        info["kept_saved_tree"] = info["in_situ"]["kept_saved_tree"]
    if info["expected_speedup"] < 1.0:  # the best tree is expected to lose to plain decoding here
        warnings.warn(
            f"on {device}, the best tree for this head is expected at "
            f"{info['expected_speedup']:.2f}x plain decoding (accuracy {source}): decode with drafter=None "
            "to be faster, or keep it to measure",
            stacklevel=3,
        )
    calibrated = drafter.with_tree(choices)  # (the drafter's other options, e.g. EAGLE's rule, kept)
    return calibrated, {"choices": choices, **info, "accuracy_source": source}, accuracy


def decoded_choice(
    target,
    head,
    accuracy: torch.Tensor,
    ranked: list[list[list[int]]],
    keep: list[list[int]] | None = None,
    timed_as: TimedAs | None = None,
) -> tuple[list[list[int]], dict]:
    """Of the trees `ranked` (calibrate's best few by part-by-part costs) and `keep` (a tree tuned for this
    kind of device, decoded first and kept unless another is expected IN_SITU_KEEP_MARGIN faster), the one
    whose passes pay best when the head decodes with it here (pass_timing.py; compiled as `timed_as`
    says, None: eager), and what was measured."""
    option = family_of(head.config).tree_option
    candidates = [c for c in ranked if c != keep]
    if keep is not None and covers(accuracy, keep):
        candidates.insert(0, keep)
    build = lambda choices: drafter_for_head(head, None, **{option: choices})  # noqa: E731
    return in_situ_choice(
        target,
        build,
        accuracy,
        candidates,
        keep=keep,
        keep_margin=IN_SITU_KEEP_MARGIN,
        timed_as=timed_as or EAGER,
    )


WORDS = ("dynamic", "iid", "without_replacement", "deterministic")  # option values passed as strings


def drafter_options(spec: str) -> tuple[str, dict]:
    """'PATH@key=value,...' -> (PATH, options). Values: integers, `dynamic`, a draft-model rule
    (`iid`, `without_replacement`, `deterministic`), a width per depth like `4x2x2x1`, or a tree file
    (tree.json or a JSON list of rank paths) for `tree=` (EAGLE, draft model) / `choices=` (Medusa)."""
    path, _, opts = spec.partition("@")
    options: dict = {}
    for item in filter(None, opts.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"drafter option {item!r}: use key=value, e.g. top_k=8 or tree=tree.json")
        if value.lstrip("-").isdigit():
            options[key] = int(value)
        elif value in WORDS or re.fullmatch(r"\d+(x\d+)+", value) or re.fullmatch(r"\d+([+-]\d+)+", value):
            options[key] = value  # a width per depth (4x2x2x1) or layers to skip (2+3+6, 4-7)
        elif Path(value).is_file():
            loaded = json.loads(Path(value).read_text())
            options[key] = loaded["choices"] if isinstance(loaded, dict) else loaded
        else:
            raise ValueError(
                f"drafter option {item!r}: the value must be an integer, dynamic or a tree file, a draft-model "
                f"rule ({', '.join(WORDS[1:])}), a width per depth like 4x2x2x1 or layers like 2+3+6"
            )
    return path, options


# The engine's plug-ins (generator.PLUGINS): spechead.inference imports this module, so they are in place
# before any generator is built.
PLUGINS.load, PLUGINS.batch_tree = load_generator, drafter_for_generator
