"""Drafter specs: a head, draft model or method named by a string, and the drafter it builds.

A spec is a name with options after "@" as `key=value` words (`drafter_options`): "prompt_lookup",
"lookahead", "cascade[:TINY+MEDIUM]", a head directory or Hub id, a draft LM, or the target itself:

    layer_skip                      default skip set (`layer_skip.default_skip`)
    layer_skip@skip=2+3+6           skip layers 2, 3 and 6 ("4-7": a range)
    early_exit@layer=4              the first 4 layers, then the final norm and lm_head (default L // 2)
    outputs/skip.json               a drafter file from scripts/search_skip.py (options override its own)
    ...@num_draft=4,width=2x1       any DraftModelDrafter shape option as well
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable, Sequence
from importlib.resources import files
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from spechead.heads import DraftHead, directory, load_head
from spechead.heads.families import Family, family_of
from spechead.heads.formats import is_head_dir
from spechead.inference.drafters.base import Drafter
from spechead.inference.drafters.draft_model import DRAFT_MODEL_OPTIONS, DraftModelDrafter
from spechead.inference.drafters.layer_skip import KINDS, LayerSkipDrafter, read_drafter_file
from spechead.inference.drafters.lookahead import LookaheadDrafter
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter

# Drafters without weights, by name (options are their constructor's keyword arguments).
BUILTIN_DRAFTERS = {"prompt_lookup": PromptLookupDrafter, "lookahead": LookaheadDrafter}
# Drafter options that pick a head's tree (EAGLE: tree, top_k, depth, total_tokens; Medusa: choices).
TREE_OPTIONS = ("tree", "top_k", "depth", "total_tokens", "choices")


def make_drafter(
    spec: str | Drafter | RowDrafter | None, target, *, device, dtype, tokenizer=None, **options
) -> Drafter | RowDrafter | None:
    """The drafter a spec names (module doc; None: plain decoding). tokenizer: the target's (it names a
    z-lab DFlash drafter's mask token when its config gives no id)."""
    if spec is None or isinstance(spec, (Drafter, RowDrafter)):
        return spec
    config = check_options(spec, options)  # (before any weights load)
    if spec in BUILTIN_DRAFTERS:
        return BUILTIN_DRAFTERS[spec](**options)
    if is_cascade(spec):
        from spechead.inference.drafters.cascade import CascadeDrafter

        tiny, medium = (_load_lm(path, device, dtype) for path in cascade_models(spec))
        return CascadeDrafter(tiny, medium, **options)
    if is_self_spec(spec):  # (the one spec that may come with its @options here: `layer_skip@skip=2+3`)
        name, inline = drafter_options(spec)
        return make_self_drafter(name, target, **{**inline, **options})
    if is_head_dir(config, spec):  # a spechead head, or one in a reference layout
        # what a reference layout leaves implicit comes from the target: EAGLE-3's default layers from its
        # config, a z-lab DFlash drafter's mask token from its tokenizer
        head = load_head(
            spec, device=device, dtype=dtype, target_config=target.config, target_tokenizer=tokenizer
        )
        # A Hub head becomes its local snapshot (tree.json and adapter included) for everything below.
        spec = str(directory.resolve(spec))
        # A head of another target: one line naming the size that differs (before attaching its modules).
        text, vocab = target.config.get_text_config(), target.get_output_embeddings().weight.shape[0]
        head.check_target(text.hidden_size, vocab, text.num_hidden_layers)
        head.attach_target_modules(
            lm_head=target.get_output_embeddings(), embed_tokens=target.get_input_embeddings()
        )
        return drafter_for_head(head, spec, **options)
    return DraftModelDrafter(_load_lm(spec, device, dtype), **options)


def _load_lm(name: str, device, dtype) -> PreTrainedModel:
    """A draft LM straight onto the device, as the target (`loading.load_generator`)."""
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=torch.device(device))


def is_cascade(spec: str) -> bool:
    """Whether `spec` names a cascade drafter ("cascade" or "cascade:TINY+MEDIUM")."""
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


def is_self_spec(spec: str) -> bool:
    """True for `layer_skip` / `early_exit` (with or without @options) and their drafter files."""
    name = spec.partition("@")[0]
    return name in KINDS or read_drafter_file(Path(name).expanduser()) is not None


def make_self_drafter(name: str, target: PreTrainedModel, **options) -> LayerSkipDrafter:
    """A LayerSkipDrafter on `target` from a kind or drafter file `name` (a spec without its @options)
    and options (short names `skip` / `layer` too; they override the file's)."""
    total = len(target.get_decoder().layers)
    data: dict | None = {"drafter": name} if name in KINDS else read_drafter_file(Path(name).expanduser())
    assert data is not None  # the caller's is_self_spec(spec) read it
    if data.get("num_layers") not in (None, total):
        raise ValueError(
            f"drafter file {name} was made for a target with {data['num_layers']} layers, this one has "
            f"{total}: run scripts/search_skip.py on this target"
        )
    kind = data["drafter"]
    short, layer_key = ("skip", "skip_layers") if kind == "layer_skip" else ("layer", "exit_layer")
    settings = {k: data[k] for k in (layer_key, *DRAFT_MODEL_OPTIONS) if k in data}
    _check_names(f"{kind} drafter", set(options) - {layer_key}, (short, *DRAFT_MODEL_OPTIONS))
    settings.update({layer_key if k == short else k: v for k, v in options.items()})
    if kind == "early_exit":
        settings.setdefault("exit_layer", total // 2)
    return LayerSkipDrafter(target, **settings)


def drafter_for_head(head: DraftHead, head_dir: str | None = None, **options) -> Drafter | RowDrafter:
    """The drafter of a loaded head (target modules attached), as its family registers it; without tree
    options its HEAD_DIR/tree.json (scripts/build_tree.py) is the tree (for EAGLE: not the dynamic one)."""
    fam = family_of(head.config)
    options = head_options(fam, options)
    tree = directory.read_tree(head_dir) if head_dir is not None else None
    if tree is not None and not set(TREE_OPTIONS) & set(options):
        options = {**options, fam.tree_option: tree["choices"]}
    return fam.load("drafter")(head, **options)


def head_options(fam: Family, options: dict) -> dict:
    """`options` as a `fam` head's drafter takes them (a static tree as `tree=` or `choices=` goes in the
    family's own option); ValueError naming the valid ones for any other option."""
    valid = [name for name in inspect.signature(fam.load("drafter")).parameters if name != "head"]
    given = [name for name in ("tree", "choices") if name in options]
    if len(given) == 2:
        raise ValueError(f"{fam.name} head: a static tree goes in tree= or choices=, not both")
    if given and given[0] not in valid and fam.tree_option in valid:
        options = {fam.tree_option if k == given[0] else k: v for k, v in options.items()}
    _check_names(f"{fam.name} head", options, valid)
    return options


def check_spec(spec: str) -> None:
    """ValueError (one line, naming the valid ones) unless a spec's options are what its drafter takes,
    before any weights load; a layer-skip spec is checked against its target when it loads."""
    check_options(*drafter_options(spec))


def check_options(path: str, options: dict) -> dict:
    """`check_spec` of a spec without its @options; the config.json it read ({}: a method's spec)."""
    if path in BUILTIN_DRAFTERS:
        _check_names(path, options, list(inspect.signature(BUILTIN_DRAFTERS[path]).parameters))
    elif is_cascade(path):
        _check_names("cascade drafter", options, ("num_draft", "tiny_draft"))
    elif not is_self_spec(path):
        file = Path(path).expanduser() / "config.json"
        if not file.parent.is_dir():  # a Hub repo
            from huggingface_hub import hf_hub_download

            try:
                file = Path(hf_hub_download(path, "config.json"))
            except Exception as err:  # offline, missing repo: say which name could not be found
                raise ValueError(
                    f"{path!r} is not a local directory and could not be fetched from the Hub ({type(err).__name__})"
                ) from None
        config = json.loads(file.read_text()) if file.is_file() else {}
        if not is_head_dir(config, path):
            _check_names(f"draft model {path}", options, DRAFT_MODEL_OPTIONS)
        elif "family" in config:  # (a reference layout's family is known once it loads)
            head_options(family_of(config), options)
        return config
    return {}


def _check_names(what: str, options: Iterable[str], valid: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"{what}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")


WORDS = ("dynamic", "iid", "without_replacement", "deterministic")  # option values passed as strings


def drafter_options(spec: str) -> tuple[str, dict]:
    """'PATH@key=value,...' -> (PATH, options). Values: integers, `dynamic`, a draft-model rule, a width
    per depth like `4x2x2x1`, layers like 2+3+6, or a tree file (tree.json or a JSON list of rank paths)."""
    path, _, opts = spec.partition("@")
    options: dict = {}
    for item in filter(None, opts.split(",")):
        key, sep, value = (part.strip() for part in item.partition("="))
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
