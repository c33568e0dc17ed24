"""`train.py`'s entry point: compose the Hydra config, turn it into typed settings, train.

This is the only place that sees a DictConfig. Bad input of any kind ends as one `error: ...` line
on stderr and exit status 2, never a traceback: the command line is composed and checked here
(`check_command_line`) before @hydra.main runs, since Hydra reports an unknown key or group option
in several lines with exit status 1 and creates the output directory itself.
"""

from __future__ import annotations

import errno
import os
import sys
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spechead.configs import register_resolvers
from spechead.data.errors import DataError
from spechead.heads.errors import HeadError
from spechead.heads.files import unwritable_reason
from spechead.training.errors import TrainError
from spechead.training.settings import TrainSettings, from_dict

if TYPE_CHECKING:
    from spechead.training.decode_eval import DecodeEval, TreeTune

USER_ERRORS = (TrainError, DataError, HeadError)
GROUPS = ("head", "model", "data", "trainer", "logger")  # config groups a command line may pick
WRITE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EFBIG,
    errno.EACCES,
}  # a failed write, not a bug


def settings_from_config(cfg: DictConfig) -> TrainSettings:
    """Resolve interpolations and check every key; config problems become TrainError."""
    missing = _missing(OmegaConf.to_container(cfg, resolve=False))
    if missing:
        raise TrainError(f"{missing[0]} is required: set {missing[0]}=...")
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        hint = f"set {key}=..." if key else "check the config"
        raise TrainError(f"{str(err).splitlines()[0]} ({hint})") from None
    return from_dict(resolved)


def _missing(node: object, prefix: str = "") -> list[str]:
    """Full keys of the mandatory values (`???`) still unset in a plain, unresolved container."""
    if isinstance(node, dict):
        keys = [k for k in node if not (prefix == "" and k == "hydra")]
        return [m for k in keys for m in _missing(node[k], f"{prefix}{k}.")]
    return [prefix[:-1]] if node == "???" else []


def group_options(group: str) -> list[str]:
    """The options of a config group: the YAML files under configs/GROUP."""
    folder = files("spechead.configs") / group
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def check_overrides(overrides: list[str]) -> DictConfig | None:
    """Compose `train` with command-line overrides; a bad one raises TrainError naming it.

    Checks group options (`head=eagle4`) and keys given without `+` (`trainer.lrr=1`) before Hydra
    does, so the message is one line with the valid choices. None for a sweep (Hydra's -m business).
    """
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise TrainError(
            _one_line(err) + " (overrides look like key=value, e.g. trainer.max_steps=100)"
        ) from None
    if any(o.is_sweep_override() for o in parsed):
        return None
    mine = [o for o in parsed if not o.key_or_group.startswith("hydra")]
    picks = [o for o in mine if o.key_or_group in GROUPS and not o.is_delete()]
    for o in picks:
        options = group_options(o.key_or_group)
        if o.value() not in options:
            raise TrainError(
                f"{o.input_line}: {o.key_or_group} has no option {o.value()!r} "
                f"(valid {o.key_or_group} options: {', '.join(options)})"
            )
    with initialize_config_module("spechead.configs", version_base=None):
        base = OmegaConf.to_container(
            compose("train", overrides=[o.input_line for o in picks]), resolve=False
        )
        for o in mine:
            if o.key_or_group not in GROUPS and not (o.is_add() or o.is_force_add() or o.is_delete()):
                _check_key(base, o.key_or_group, o.input_line)
        try:
            return compose("train", overrides=[o.input_line for o in mine])
        except HydraException as err:
            raise TrainError(_one_line(err)) from None


def _check_key(cfg: dict, key: str, line: str) -> None:
    """Raise TrainError when dotted `key` is not in `cfg` (unresolved containers), listing the keys that are."""
    node, parts = cfg, key.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        if not isinstance(node, dict):
            raise TrainError(f"{line}: {where} is a value, not a section with keys")
        keys = list(node)
        if part not in keys:
            if not where:
                raise TrainError(
                    f"{line}: there is no config group or section {part!r} (groups: {', '.join(GROUPS)})"
                )
            raise TrainError(
                f"{line}: unknown key {key} (valid keys for {where}: {', '.join(map(str, keys))})"
            )
        node = node[part]


def check_output_dir(path: str) -> None:
    """TrainError unless `path` is (or can become) a writable directory; creates nothing."""
    reason = unwritable_reason(path)
    if reason:
        raise TrainError(f"trainer.output_dir={path} is not a writable directory ({reason}): pick another")


def check_command_line(overrides: list[str]) -> TrainSettings | None:
    """Compose and check the command line as @hydra.main will; None when Hydra's own flags are used."""
    if any(arg.startswith("-") for arg in overrides):
        return None  # --help, --cfg, -m ...: Hydra's business
    cfg = check_overrides(overrides)
    if cfg is None:
        return None
    settings = settings_from_config(cfg)
    check_output_dir(settings.trainer.output_dir)
    return settings


def startup_line(s: TrainSettings) -> str:
    """What runs, and which tuning file (if any) changed the trainer defaults."""
    tuning = f"{s.tuning} (command-line trainer.* still win)" if s.tuning else "none (trainer defaults)"
    return (
        f"config: head={s.head.name} model={s.model.name} ({s.model.path}) data={s.data.name} "
        f"tuning={tuning} -> {s.trainer.output_dir}"
    )


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


register_resolvers()


def new_dirs(path: str) -> list[Path]:
    """`path` and those of its ancestors that do not exist yet, deepest first."""
    new, current = [], Path(path).expanduser().absolute()
    while not current.exists() and current != current.parent:
        new.append(current)
        current = current.parent
    return new


def remove_if_empty(dirs: list[Path]) -> None:
    """Remove the directories of `new_dirs` that a failed run left empty (Hydra creates its run dir at start)."""
    for d in dirs:
        try:
            d.rmdir()  # only ever an empty one
        except OSError:
            return


def main(decode_eval: DecodeEval | None = None, tune_tree: TreeTune | None = None) -> None:
    """Parse the command line with Hydra and train; the decoding hooks are handed to the trainer as they are.

    A failed run leaves no output directory it created and found nothing to write into; Ctrl-C ends with
    one line naming the last checkpoint (exit 130)."""
    try:
        settings = check_command_line(sys.argv[1:])
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    created = new_dirs(settings.trainer.output_dir) if settings else []

    @hydra.main(version_base=None, config_path="pkg://spechead.configs", config_name="train")
    def run(cfg: DictConfig) -> None:
        from spechead.training import checkpoint  # heavy imports only once the config is valid
        from spechead.training.trainer import train

        main_process = os.environ.get("RANK", "0") == "0"
        settings = None
        try:
            settings = settings_from_config(cfg)
            if main_process:
                print(startup_line(settings), flush=True)
            train(settings, decode_eval, tune_tree)
        except USER_ERRORS as err:
            _fail(f"error: {err}", 2, created)
        except OSError as err:  # a write that failed mid-run (disk full, read-only): the work so far is kept
            if err.errno not in WRITE_ERRNOS or settings is None:
                raise
            where = checkpoint.resume_hint(Path(settings.trainer.output_dir))
            _fail(f"error: could not write {err.filename or 'a file'} ({err.strerror}): {where}", 2, created)
        except KeyboardInterrupt:
            out = Path(settings.trainer.output_dir if settings else cfg.trainer.output_dir)
            _fail(f"interrupted: {checkpoint.resume_hint(out)}" if main_process else "", 130, created)

    run()


def _fail(line: str, status: int, created: list[Path]) -> None:
    """Print `line` (if any) on a line of its own, remove the output directories this run created and left
    empty, exit `status`."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):  # a progress bar cut short (the training loop's)
        bar.close()
    if line:
        print(line, file=sys.stderr)
    remove_if_empty(created)
    sys.exit(status)
