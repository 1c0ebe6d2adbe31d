"""The OpenAI-compatible HTTP server over one Session: the app (app.py), its request models and shapes, the reply
readers, the worker, the metrics, and the same app on Ray Serve (ray_serve.py)."""


def __getattr__(name: str):
    """`from specrt.server import create_app`, as before the server had a folder; loaded on use (FastAPI is the
    `serve` extra's)."""
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
