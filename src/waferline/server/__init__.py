"""The OpenAI-compatible HTTP server: app (FastAPI), protocol (request models, errors), metrics, commands (CLI)."""
