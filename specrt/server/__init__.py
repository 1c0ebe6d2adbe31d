"""The OpenAI-compatible HTTP server over one Session: the app (app.py), its request models and shapes, the reply
readers, the worker, the metrics, and the same app on Ray Serve (ray_serve.py)."""
