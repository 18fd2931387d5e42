"""``inf2-pipeline serve``: an OpenAI-compatible HTTP server over an installed release.

app.py (routes, the engine thread, uvicorn), scheduler.py (waiting requests → batches in the
nearest bucket), protocol.py (the completions wire format), tokenizer.py (text in and out),
metrics.py (Prometheus). Needs the optional extra ``inf2-pipeline[serve]``; docs/serve.md.
"""
