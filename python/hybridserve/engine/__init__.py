"""Engines: the synchronous step loop (LLMEngine), the offline API (LLM) and the
asyncio front (AsyncEngine) the server talks to."""

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm import LLM
from hybridserve.engine.llm_engine import LLMEngine

__all__ = ["EngineArgs", "LLM", "LLMEngine"]
