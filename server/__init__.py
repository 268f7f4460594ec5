"""kvllm's OpenAI-compatible HTTP server (FastAPI + uvicorn), CLI and load-test client."""


def build_app(*args, **kwargs):
    """See `server.app.build_app` (imported lazily: `import server` must stay light)."""
    from server.app import build_app as _build_app

    return _build_app(*args, **kwargs)


__all__ = ["build_app"]
