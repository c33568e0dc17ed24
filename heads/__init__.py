"""spechead.heads: draft-head families (pure nn.Modules) and their save/load.

Every head family module must be imported here: importing it runs @register_head, which is what
lets `load_head` rebuild a saved head of that family; and the formats package, which registers the
import of heads in other projects' layouts (base.register_foreign_loader).
"""

from spechead.heads import (
    attention,  # noqa: F401  (registers the "spechead_sdpa" attention)
    formats,  # noqa: F401  (plugs the reference layouts' import into load_head)
)
from spechead.heads.base import (
    DraftHead,
    HeadConfig,
    known_families,
    load_head,
    register_head,
    resolve_layers,
)
from spechead.heads.dflash import DFlashConfig, DFlashHead
from spechead.heads.directory import CONFIG_NAME, WEIGHTS_NAME
from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.errors import HeadError
from spechead.heads.medusa import MedusaConfig, MedusaHead, ResBlock
from spechead.heads.peagle import PEagleConfig, PEagleHead

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "DFlashConfig",
    "DFlashHead",
    "DraftHead",
    "Eagle3Config",
    "Eagle3Head",
    "EagleConfig",
    "EagleHead",
    "HeadConfig",
    "HeadError",
    "MedusaConfig",
    "MedusaHead",
    "PEagleConfig",
    "PEagleHead",
    "ResBlock",
    "known_families",
    "load_head",
    "register_head",
    "resolve_layers",
]
