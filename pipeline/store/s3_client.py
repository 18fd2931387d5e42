"""The S3 client and the store URL: ``s3://BUCKET/PREFIX?addressing_style=...`` parsed and
checked, the endpoint and region checked, and the one place clients are made
(``make_client``: botocore's, as boto3 makes them, with our timeouts and standard retries)."""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import parse_qs, urlsplit

import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    InvalidRegionError,
    ProfileNotFound,
)

from pipeline.errors import (
    InputError,
)
from pipeline.store._redact import scrub

ADDRESSING_STYLES = ("auto", "path", "virtual")


def make_client(
    service: str = "s3",
    *,
    endpoint_url: str | None = None,
    addressing_style: str | None = None,
    connect_timeout: float = 10.0,
    read_timeout: float = 60.0,
    max_attempts: int = 5,
    max_pool_connections: int = 64,
) -> Any:
    """The one place clients are made (botocore's, as boto3 would make them).
    ``endpoint_url=None`` lets botocore read ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``
    and the config file itself."""
    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "max_attempts": max_attempts},
        max_pool_connections=max_pool_connections,  # concurrent blobs x parts share one pool
        s3={"addressing_style": addressing_style} if addressing_style else None,
        # SigV4 for presigned URLs too (the ranged GETs of pull): botocore presigns with
        # SigV2 by default in some regions, which S3 refuses for buckets made since 2020
        # (S3 user guide, "Authenticating Requests (AWS Signature Version 2)"). Requests
        # were signed with SigV4 already.
        signature_version="s3v4" if service == "s3" else None,
    )
    try:
        with _SESSION_LOCK:  # sessions are not thread-safe (clients are)
            client = _session().create_client(service, endpoint_url=endpoint_url, config=config)
    except InvalidRegionError as e:
        raise _bad_region(str(e.kwargs.get("region_name"))) from None
    except ProfileNotFound as e:
        raise InputError(
            f"AWS_PROFILE '{e.kwargs.get('profile')}'",
            "no such profile in the AWS config files",
            "name a profile of ~/.aws/config, or unset AWS_PROFILE",
        ) from None
    except ValueError as e:  # a malformed endpoint URL, rejected before any request
        source = _endpoint_source(endpoint_url, service)
        if source is None and "endpoint" in str(e).lower():
            source = ("endpoint_url in the AWS config file", "")
        if source is None:
            raise
        raise _bad_endpoint(*source) from None
    # botocore accepts any scheme and port text here and fails on the first request with a
    # message that names neither the variable nor the fix.
    if not _valid_endpoint(client.meta.endpoint_url):
        source = _endpoint_source(endpoint_url, service)
        raise _bad_endpoint(*(source or ("endpoint_url in the AWS config file", "")))
    return client


def _valid_endpoint(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _endpoint_source(explicit: str | None, service: str) -> tuple[str, str] | None:
    """(where, URL) of the endpoint boto3 uses: the caller's, else the service's variable,
    else AWS_ENDPOINT_URL; None when it can only come from the config file."""
    if explicit is not None:
        return "endpoint URL", explicit
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    for name in (f"AWS_ENDPOINT_URL_{service.upper()}", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):  # boto3 takes an empty variable for an unset one
            return name, os.environ[name]
    return None


def _bad_endpoint(source: str, url: str) -> InputError:
    return InputError(
        f"{source} '{scrub(url)}'" if url else source,
        "not a valid endpoint URL",
        "use http(s)://HOST[:PORT], a host name without '_', e.g. "
        "https://s3.us-east-1.amazonaws.com, or unset it",
    )


def _bad_region(region: str) -> InputError:
    # botocore 1.44 reads AWS_DEFAULT_REGION, then the profile's region; AWS_REGION (which
    # other SDKs read) is named only if a later botocore takes it from there.
    names = ("AWS_DEFAULT_REGION", "AWS_REGION")
    source = next((n for n in names if os.environ.get(n) == region), None) or (
        "region in the AWS config file"
    )
    return InputError(
        f"{source} '{region}'",
        "not a valid AWS region name",
        "use a region code such as us-east-1, or unset it",
    )


_SESSIONS: dict[tuple, botocore.session.Session] = {}


_SESSION_LOCK = threading.Lock()


def _session() -> botocore.session.Session:
    # A fresh session reloads the service models (~150 ms a client), so keep one per AWS
    # environment: the same behaviour as a new session whenever AWS_* variables change.
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    if env not in _SESSIONS:
        _SESSIONS[env] = botocore.session.get_session()
    return _SESSIONS[env]


def parse_s3_url(url: str) -> tuple[str, str, dict[str, str]]:
    """``s3://bucket/some/prefix?addressing_style=path`` -> (bucket, "some/prefix/", options)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise InputError(url, "not an S3 URL", "use s3://BUCKET/PREFIX")
    options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(options) - {"addressing_style"}
    if unknown:
        raise InputError(
            url, f"unknown option {sorted(unknown)[0]!r}", "use ?addressing_style=path"
        )
    style = options.get("addressing_style")
    if style is not None and style not in ADDRESSING_STYLES:
        raise InputError(url, f"addressing_style '{style}'", f"use one of {ADDRESSING_STYLES}")
    why = bucket_name_problem(parts.netloc)
    if why:
        raise InputError(
            f"store {scrub(url)}",
            f"bucket name '{scrub(parts.netloc)}' {why}",
            "a bucket name is 1 to 255 letters, digits, '.', '-' and '_' "
            "(for a new AWS bucket: 3 to 63 lowercase)",
        )
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else "", options


def bucket_name_problem(bucket: str) -> str | None:
    """Why botocore would refuse ``bucket`` (botocore/handlers.py, ``VALID_BUCKET``: 1 to 255
    of letters, digits, '.', '-', '_'), or None. Only that: legacy us-east-1 names and
    S3-compatible stores allow more than AWS's rules for new buckets, and access point ARNs
    are botocore's to check. Said here in one line, where botocore dumps its regex."""
    if bucket.startswith("arn:"):
        return None
    bad = sorted({c for c in bucket if not (c.isascii() and (c.isalnum() or c in "._-"))})
    if bad:
        return f"contains {', '.join(repr(c) for c in bad)}"
    if not 1 <= len(bucket) <= 255:
        return f"is {len(bucket)} characters long"
    return None
