"""OpenAI-compatible HTTP server (FastAPI) over AsyncEngine."""
