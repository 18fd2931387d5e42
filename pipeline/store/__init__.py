"""The artifact store: one layout on local disk and in S3 (see DESIGN.md).

``open_store(url)`` picks the backend from the URL scheme through a registry, so the list
of supported schemes cannot drift from what is implemented.
"""

from __future__ import annotations

from pipeline._front_door import front_door
from pipeline.contracts.store_layout import DEFAULT_STORE
from pipeline.errors import InputError
from pipeline.store.base import Store
from pipeline.store.local import LocalStore


# scheme -> factory(url). S3 registers lazily so `import pipeline.store` stays light.
def _s3(url: str, **kw) -> Store:
    from pipeline.store.s3 import S3Store

    return S3Store.from_url(url, **kw)


REGISTRY = {"file": LocalStore.from_url, "s3": _s3}


def open_store(url: str | None = None, **kw) -> Store:
    """Open ``url``: a plain path, ``file://PATH`` or ``s3://BUCKET/PREFIX`` (default:
    ``DEFAULT_STORE``)."""
    url = url or DEFAULT_STORE
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    try:
        factory = REGISTRY[scheme]
    except KeyError:
        raise InputError(
            url,
            f"unsupported store scheme '{scheme}'",
            f"use one of: a path, {', '.join(s + '://' for s in REGISTRY)}",
        ) from None
    return factory(url, **kw)


_entry_points, __getattr__ = front_door(
    __name__,
    {
        "promote": "channels",
        "list_models": "releases",
        "list_releases": "releases",
        "read_release": "releases",
        "resolve_release": "releases",
        "diff_releases": "diff",
        "sign_release": "publish",
        "load_trust": "signing",
        "open_signer": "signing",
    },
)
__all__ = ["DEFAULT_STORE", "REGISTRY", "Store", "open_store", *_entry_points]
