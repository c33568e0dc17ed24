"""spechead.inference: lossless tree decoding with any drafter (heads, draft models, prompt lookup)."""

from spechead.inference import loading  # noqa: F401  (plugs from_pretrained and the batch trees in)
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams
from spechead.inference.stats import GenerationResult, GenerationStats

__all__ = ["GenerationResult", "GenerationStats", "SamplingParams", "SpeculativeGenerator"]
