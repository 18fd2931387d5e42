"""The artifact store commands: publish, promote, list, show, diff, gc.

``--store`` defaults to the config's store for ``publish`` and to ``artifacts/`` (relative
to the working directory) for the others.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, SignOpt, StoreOpt, TrustOpt, human_bytes, print_json
from pipeline.errors import NotFoundError

ModelArg = Annotated[str, typer.Argument(help="Model name (the config's model.name).")]
ChannelOpt = Annotated[
    str | None, typer.Option("--channel", help="A channel name, e.g. prod or staging.")
]


def register(app: typer.Typer, panel: str) -> None:
    app.command("publish", rich_help_panel=panel)(publish)
    app.command("promote", rich_help_panel=panel)(promote)
    app.command("list", rich_help_panel=panel)(list_)
    app.command("show", rich_help_panel=panel)(show)
    app.command("diff", rich_help_panel=panel)(diff)
    app.command("gc", rich_help_panel=panel)(gc)
    app.command("sign", rich_help_panel=panel)(sign)
    app.command("keygen", rich_help_panel=panel)(keygen)
    app.command("pubkey", rich_help_panel=panel)(pubkey)


def _open(url: str | None):
    from pipeline.store import open_store

    return open_store(url)


def publish(
    config: Annotated[Path, typer.Argument(help="Release config (configs/<model>.yaml).")],
    version: Annotated[
        str | None,
        typer.Option("--version", help="Release version (default: UTC date + content digest)."),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help="neuron, cuda or cpu (default: the config's target)."),
    ] = None,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="Concurrent blob uploads.")] = 8,
    shard_count: Annotated[
        int | None,
        typer.Option(
            "--shard-count", min=1, help="Shards that compiled it: names a missing bucket's shard."
        ),
    ] = None,
    store: StoreOpt = None,
    sign: SignOpt = None,
    json: JsonOpt = False,
) -> None:
    """Publish compiled buckets as an immutable release: missing blobs, then the manifest."""
    from pipeline.compile.release import publish_release
    from pipeline.plan.config import load_config
    from pipeline.store.signing import open_signer

    signer = open_signer(sign) if sign else None
    release = load_config(config)
    dest = _open(store) if store else None
    with _progress("uploading", quiet=json) as advance:
        r = publish_release(
            release,
            store=dest,
            version=version,
            backend=backend,
            jobs=jobs,
            progress=advance,
            shard_count=shard_count,
            signer=signer,
        )
    if json:
        print_json(r.to_dict())
        return
    what = "published" if r.created else "already published (identical content)"
    signed = f"; signed by key {r.signed_by[:16]}" if r.signed_by else ""
    typer.echo(
        f"{what}: {r.model} {r.version} in {r.store}: {r.files} files, "
        f"{human_bytes(r.total_bytes)}; uploaded {r.uploaded_files} files "
        f"({human_bytes(r.uploaded_bytes)}) in {r.seconds:.1f} s{signed}"
    )


def promote(
    model: ModelArg,
    version: Annotated[str, typer.Argument(help="The release to point the channel at.")],
    channel: Annotated[str, typer.Option("--channel", help="The channel to move.")],
    store: StoreOpt = None,
    trust: TrustOpt = None,
    json: JsonOpt = False,
) -> None:
    """Point a channel at a release (compare-and-swap; records who, when, the previous and
    the manifest's sha256). With --trust, refuses a release the pods would refuse."""
    from pipeline.store.channels import promote as promote_channel
    from pipeline.store.signing import load_trust

    ch = promote_channel(_open(store), model, version, channel, trust=load_trust(trust))
    if json:
        print_json(ch.model_dump(mode="json"))
        return
    typer.echo(f"{model} {channel}: {ch.previous or '(new)'} → {ch.version} (by {ch.by})")


def list_(
    model: Annotated[str | None, typer.Argument(help="List this model's releases.")] = None,
    store: StoreOpt = None,
    trust: TrustOpt = None,
    json: JsonOpt = False,
) -> None:
    """List models, or one model's releases (newest first) with their channels and who
    signed each (trusted: by a --trust key; untrusted: intact, by another key)."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.store.releases import channels_by_version, list_models, list_releases
    from pipeline.store.signing import load_trust
    from pipeline.store.verified import signature_info

    s = _open(store)
    if model is None:
        rows = []
        for name in list_models(s):
            releases = list_releases(s, name)
            channels = channels_by_version(s, name)
            rows.append(
                {
                    "model": name,
                    "releases": len(releases),
                    "latest": releases[0].version if releases else None,
                    "channels": {c: v for v, cs in channels.items() for c in cs},
                }
            )
        if json:
            print_json(rows)
            return
        if not rows:
            typer.echo(f"no releases in {s.url}")
        for r in rows:
            chans = ", ".join(f"{c}→{v}" for c, v in sorted(r["channels"].items()))
            typer.echo(
                f"{r['model']}: {r['releases']} releases, latest {r['latest']}"
                + (f"; {chans}" if chans else "")
            )
        return
    releases = list_releases(s, model)
    channels = channels_by_version(s, model)
    if not releases and not channels:
        # Nothing under models/MODEL/: most likely a typo, which an empty list would hide.
        # A model whose releases were all deleted but keeps a channel is known: empty list.
        raise _unknown_model(s, model)
    keys = load_trust(trust)
    with ThreadPoolExecutor(16) as pool:
        sigs = list(pool.map(lambda m: signature_info(s, model, m.version, keys), releases))
    rows = [
        {
            "version": m.version,
            "created": m.created,
            "backend": m.backend,
            "buckets": len(m.buckets),
            "bytes": m.total_size,
            "channels": channels.get(m.version, []),
            "signature": sig.to_dict(),
        }
        for m, sig in zip(releases, sigs, strict=True)
    ]
    if json:
        print_json(rows)
        return
    if not rows:
        typer.echo(f"no releases of {model} in {s.url}")
        return
    width = max(len("version"), *(len(r["version"]) for r in rows))
    typer.echo(
        f"{'version':<{width}}  {'created (UTC)':<16}  backend  buckets  {'size':>10}  "
        f"{'signed by':<28}  channels"
    )
    for r, sig in zip(rows, sigs, strict=True):
        line = (
            f"{r['version']:<{width}}  {r['created'][:16].replace('T', ' '):<16}  "
            f"{r['backend']:<7}  {r['buckets']:>7}  {human_bytes(r['bytes']):>10}  "
            f"{sig.line():<28}  "
        )
        typer.echo((line + ", ".join(r["channels"])).rstrip())


def _unknown_model(s, model: str) -> NotFoundError:
    import difflib

    from pipeline.store.releases import list_models

    close = difflib.get_close_matches(model, list_models(s), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return NotFoundError(
        f"model '{model}'",
        f"no releases of {model} in {s.url}",
        f"{hint}'inf2-pipeline list --store {s.url}' lists the models",
    )


def show(
    model: ModelArg,
    version: Annotated[str | None, typer.Argument(help="The release version.")] = None,
    channel: ChannelOpt = None,
    store: StoreOpt = None,
    trust: TrustOpt = None,
    json: JsonOpt = False,
) -> None:
    """Show a release's manifest: facts, signature, buckets and files."""
    from pipeline.errors import InputError
    from pipeline.store.releases import channels_by_version, resolve_release
    from pipeline.store.signing import load_trust
    from pipeline.store.verified import signature_info

    if (version is None) == (channel is None):
        raise InputError(
            "show",
            "give exactly one of VERSION or --channel",
            f"e.g. 'show {model} --channel prod'",
        )
    s = _open(store)
    m = resolve_release(s, model, version, channel)
    channels = channels_by_version(s, model).get(m.version, [])
    sig = signature_info(s, model, m.version, load_trust(trust))
    if json:
        print_json(
            {
                "manifest": m.model_dump(mode="json"),
                "channels": channels,
                "signature": sig.to_dict(),
                "content_digest": m.content_digest(),
                "total_bytes": m.total_size,
            }
        )
        return
    echo = typer.echo
    echo(f"{m.model} {m.version} ({', '.join(channels) or 'no channel'})")
    echo(
        f"created {m.created}; backend {m.backend}; dtype {m.dtype}; "
        f"tp {m.target.get('tp_degree')} on {m.target.get('instance_type')}"
    )
    echo("versions: " + ", ".join(f"{k} {v}" for k, v in m.versions.items()))
    echo(f"flags: {' '.join(m.flags) or '(none)'}; auto_cast_type {m.auto_cast_type}")
    echo(
        f"weights {m.weights_digest[:16]}; content {m.content_digest()[:16]}; "
        f"{human_bytes(m.total_size)}"
    )
    echo(f"signed by: {sig.line()}" + (f", {sig.signer}" if sig.signer else ""))
    echo(f"{'bucket':<14} {'batch':>5} {'seq':>6} {'files':>5} {'size':>11}")
    for name, b in m.buckets.items():
        size = human_bytes(sum(f.size for f in b.files))
        echo(f"{name:<14} {b.batch:>5} {b.seq:>6} {len(b.files):>5} {size:>11}")
    if m.files:
        echo("release files: " + ", ".join(f.path for f in m.files))


def diff(
    model: ModelArg,
    a: Annotated[str, typer.Argument(help="The older release.")],
    b: Annotated[str, typer.Argument(help="The newer release.")],
    store: StoreOpt = None,
    trust: TrustOpt = None,
    json: JsonOpt = False,
) -> None:
    """Compare two releases: buckets and files added, removed, changed; changed facts."""
    from pipeline.store.diff import diff_releases
    from pipeline.store.releases import read_release
    from pipeline.store.signing import load_trust
    from pipeline.store.verified import signature_info

    s = _open(store)
    keys = load_trust(trust)
    d = diff_releases(read_release(s, model, a), read_release(s, model, b))
    sig_a, sig_b = (signature_info(s, model, v, keys) for v in (a, b))
    if json:
        print_json({**d.to_dict(), "signature_a": sig_a.to_dict(), "signature_b": sig_b.to_dict()})
        return
    typer.echo(f"{model} {a} → {b}: {human_bytes(d.bytes_a)} → {human_bytes(d.bytes_b)}")
    same_key = sig_a.key_id == sig_b.key_id
    typer.echo(
        f"  signed by: {sig_a.line()} → {sig_b.line()}" + ("" if same_key else "  (signer changed)")
    )
    if d.identical:
        typer.echo("identical content")
        return
    for key, change in d.facts.items():
        typer.echo(f"  {key}: {change['a']!r} → {change['b']!r}")
    for label, names in (("added", d.buckets_added), ("removed", d.buckets_removed)):
        if names:
            typer.echo(f"  buckets {label}: {', '.join(names)}")
    for name, f in d.buckets_changed.items():
        typer.echo(f"  bucket {name}: " + _files_line(f))
    if d.files:
        typer.echo("  release files: " + _files_line(d.files))
    typer.echo(f"  {d.buckets_unchanged} buckets unchanged")


def _files_line(f) -> str:
    parts = [
        f"{label} {', '.join(paths)}"
        for label, paths in (("changed", f.changed), ("added", f.added), ("removed", f.removed))
        if paths
    ]
    return "; ".join(parts)


def gc(
    model: ModelArg,
    keep: Annotated[int, typer.Option("--keep", min=0, help="Keep the newest N releases.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Report what would go; delete nothing.")
    ] = False,
    grace_hours: Annotated[
        float,
        typer.Option(
            "--grace-hours", min=0, help="Spare unreferenced blobs and cache entries this young."
        ),
    ] = 24.0,
    store: StoreOpt = None,
    json: JsonOpt = False,
) -> None:
    """Delete releases beyond the newest N that no channel points at, then unused blobs."""
    from pipeline.store.gc import gc as run_gc

    r = run_gc(_open(store), model, keep, grace_s=grace_hours * 3600, dry_run=dry_run)
    if json:
        print_json(r.to_dict())
        return
    verb = "would delete" if dry_run else "deleted"
    typer.echo(f"{model}: keep {', '.join(r.kept) or 'none'}")
    typer.echo(
        f"{verb} {len(r.deleted_releases)} releases"
        f"{' (' + ', '.join(r.deleted_releases) + ')' if r.deleted_releases else ''}, "
        f"{len(r.deleted_cache_entries)} cache entries, {len(r.deleted_blobs)} blobs "
        f"({human_bytes(r.freed_bytes)})"
    )
    if r.young_orphans:
        typer.echo(f"spared {r.young_orphans} unreferenced blobs younger than {grace_hours:g} h")


def sign(
    model: ModelArg,
    version: Annotated[str, typer.Argument(help="The release to sign.")],
    key: Annotated[
        str,
        typer.Option("--key", help="kms://alias/NAME, a KMS key ARN, or a PEM private key file."),
    ],
    replace: Annotated[
        bool, typer.Option("--replace", help="Replace a valid signature by another key.")
    ] = False,
    store: StoreOpt = None,
) -> None:
    """Sign a published release's manifest (one published unsigned, or re-signed by a new
    key): pods that trust the key will then pull it."""
    from pipeline.store.publish import sign_release
    from pipeline.store.signing import open_signer

    signer = open_signer(key)
    made = sign_release(_open(store), model, version, signer, replace=replace)
    state = "signed" if made else "already signed"
    typer.echo(f"{state}: {model} {version} by key {signer.key_id[:16]} ({signer.signer})")


def keygen(
    path: Annotated[Path, typer.Argument(help="The private key file to write (PEM).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a key there.")] = False,
) -> None:
    """Make an ECDSA P-256 signing key pair: PATH (mode 0600) and PATH's .pub.pem (for
    --trust). For production releases prefer a KMS key: its private half never leaves KMS."""
    from pipeline.store.signing import PemSigner, write_keypair

    private, public = write_keypair(path, overwrite=overwrite)
    typer.echo(f"wrote {private} and {public} (key {PemSigner(private).key_id[:16]})")


def pubkey(
    key: Annotated[
        str, typer.Argument(help="kms://alias/NAME, a KMS key ARN, or a PEM private key file.")
    ],
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the PEM here (default: stdout).")
    ] = None,
) -> None:
    """Print a signing key's public key (PEM), to pin in the pods' --trust: fetched from KMS
    once here, so a pod verifies with no KMS call."""
    from pipeline._files import atomic_write_bytes
    from pipeline.store.signing import open_signer, public_pem

    signer = open_signer(key)
    pem = public_pem(signer.public_key)
    if out is None:
        typer.echo(pem, nl=False)
        return
    atomic_write_bytes(out, pem.encode())
    typer.echo(f"wrote {out} (key {signer.key_id[:16]})", err=True)


@contextmanager
def _progress(label: str, *, quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A byte counter on a terminal; nothing in CI, when piped, or with --json."""
    if quiet or os.environ.get("CI") or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        *Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn(), transient=True
    ) as bar:
        task = bar.add_task(label, total=None)
        yield lambda n: bar.advance(task, n)
