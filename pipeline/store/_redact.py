"""Scrub credential-like text from anything we show, log or store (errors, manifests)."""

from __future__ import annotations

import re

_SECRETS = [
    # AWS access key ids (long-term AKIA, temporary ASIA, role/user ids)
    (re.compile(r"\b(AKIA|ASIA|AROA|AIDA)[A-Z0-9]{12,}\b"), "<access-key-id>"),
    # presigned-URL query parameters and Authorization header fields
    (
        re.compile(r"(X-Amz-(?:Credential|Signature|Security-Token)=)[^&\s\"']+", re.I),
        r"\1<redacted>",
    ),
    (re.compile(r"\b(Signature|Credential|SignedHeaders)=[^,&\s\"']+"), r"\1=<redacted>"),
    # user:password@ in URLs
    (re.compile(r"(://)[^/@\s]+@"), r"\1<user>@"),
]


def scrub(text: str) -> str:
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    return text
