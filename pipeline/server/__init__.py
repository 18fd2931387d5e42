"""``inf2-pipeline serve``: an OpenAI-compatible HTTP server over an installed release.

engine.py (the loop over the resident buckets' slots), jobs.py (a request as the engine
holds it, and its events), engine_process.py (it, in a process
of its own), loading.py (the release loaded and warmed), placement.py (waiting requests →
free slots), admission.py, app.py (routes), protocol.py and chat.py (the wire formats),
tokenizer.py, metrics.py (Prometheus). Needs the optional extra ``inf2-pipeline[serve]``;
docs/serve.md.
"""

from pipeline._front_door import front_door

__all__, __getattr__ = front_door(
    __name__,
    {
        "serve": "launch",
        "ServeOptions": "loading",
        "Engine": "engine",
    },
)
