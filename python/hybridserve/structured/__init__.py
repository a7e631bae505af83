"""Constrained decoding: JSON schemas, regexes, choices, grammars and tool-call
structural tags, compiled with xgrammar and applied as token masks before sampling.

``StructuredOutputsParams`` (the request side) imports nothing heavy; the engine builds
:class:`hybridserve.structured.engine_hook.StructuredDecoding` with its first
constrained request.
"""

from hybridserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
