"""spechead.inference: lossless tree decoding with any drafter (heads, draft models, prompt lookup)."""

from spechead.inference.generator import GenerationResult, GenerationStats, SpeculativeGenerator
from spechead.inference.sampling import SamplingParams

__all__ = ["GenerationResult", "GenerationStats", "SamplingParams", "SpeculativeGenerator"]
