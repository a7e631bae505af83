"""Engines: the synchronous engine (LLMEngine: the input processor, the engine core's
step loop and the output processor, built by engine.builder), the offline API (LLM)
and the asyncio front (AsyncEngine) the server talks to."""

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm import LLM
from hybridserve.engine.llm_engine import LLMEngine

__all__ = ["EngineArgs", "LLM", "LLMEngine"]
