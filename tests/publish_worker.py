"""A publisher process for the crash test: publishes a prepared synthetic release.

    python tests/publish_worker.py DEST_URL DRAFT.json SOURCES_DIR VERSION

DRAFT.json is a manifest (version and time are filled in by publish); SOURCES_DIR holds
each blob as a file named by its digest. Prints ``ready`` just before publishing, so the
test can kill it at a random moment of the publish itself rather than of Python's start.
"""

from __future__ import annotations

import sys
from pathlib import Path

from boto3.s3.transfer import TransferConfig

from pipeline.store import open_store
from pipeline.store.manifest import Manifest
from pipeline.store.publish import publish

# Small parts so that the test's larger blobs go multipart (and a kill can abandon one).
SMALL_PARTS = TransferConfig(
    multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=4
)


def main(dest_url: str, draft: str, sources_dir: str, version: str) -> None:
    kw = {"transfer_config": SMALL_PARTS} if dest_url.startswith("s3://") else {}
    dest = open_store(dest_url, **kw)
    manifest = Manifest.model_validate_json(Path(draft).read_bytes())
    sources = {ref.sha256: Path(sources_dir, ref.sha256) for _, ref in manifest.iter_files()}
    print("ready", flush=True)
    r = publish(dest, manifest, sources, version=version, jobs=4)
    print(f"done {r.uploaded_files} {r.uploaded_bytes}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
