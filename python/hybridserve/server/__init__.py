"""The HTTP front: an OpenAI-compatible aiohttp server over the AsyncEngine."""
