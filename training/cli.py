"""`train.py`'s entry point: compose the Hydra config, turn it into typed settings, train.

This is the only place that sees a DictConfig. Bad input of any kind ends as one `error: ...` line
on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spechead.configs import register_resolvers
from spechead.data.errors import DataError
from spechead.heads.errors import HeadError
from spechead.training.errors import TrainError
from spechead.training.settings import TrainSettings, from_dict

if TYPE_CHECKING:
    from spechead.training.decode_eval import DecodeEval

USER_ERRORS = (TrainError, DataError, HeadError)


def settings_from_config(cfg: DictConfig) -> TrainSettings:
    """Resolve interpolations and check every key; config problems become TrainError."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        hint = f"set {key}=..." if key else "check the config"
        raise TrainError(f"{str(err).splitlines()[0]} ({hint})") from None
    return from_dict(resolved)


register_resolvers()


def main(decode_eval: DecodeEval | None = None) -> None:
    """Parse the command line with Hydra and train; `decode_eval` is handed to the trainer as is."""

    @hydra.main(version_base=None, config_path="pkg://spechead.configs", config_name="train")
    def run(cfg: DictConfig) -> None:
        from spechead.training.trainer import train  # heavy imports only once the config is valid

        try:
            train(settings_from_config(cfg), decode_eval)
        except USER_ERRORS as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    run()
