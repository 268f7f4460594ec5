"""kvllm's OpenAI-compatible HTTP server (FastAPI + uvicorn), CLI and load-test client.

The package imports nothing: `kvllm serve` (server/cli.py) must configure threads before torch is imported, and the
app is `server.app.build_app`."""
