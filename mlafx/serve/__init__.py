"""OpenAI-compatible HTTP serving (``mlafx serve``): FastAPI routes over one ``LLM``
driven by a single engine thread. Sits above runtime and export; nothing imports it."""

from mlafx.serve.app import create_app
from mlafx.serve.server import bind, serve

__all__ = ["bind", "create_app", "serve"]
