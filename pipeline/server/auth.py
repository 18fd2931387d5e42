"""API keys as OpenAI clients send them: ``Authorization: Bearer KEY`` on the ``/v1`` routes.

The probes (``/health``, ``/ready``) and ``/metrics`` stay open, so the kubelet and the
scraper need no secret. The key is compared in constant time (``hmac.compare_digest``), so
a client cannot learn it a byte at a time from how long a refusal takes.
"""

from __future__ import annotations

import hmac

from pipeline.server.protocol import ApiError


def check_key(expected: str | None, authorization: str | None) -> None:
    """Nothing when no key is configured or the header carries it; else a 401."""
    if expected is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise _refused(
            "missing API key: send the header 'Authorization: Bearer YOUR_KEY'"
            " (the openai client's api_key)"
        )
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise _refused("incorrect API key provided")


def _refused(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
