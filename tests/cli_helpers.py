"""Asserting the CLI's error contract on a Typer ``CliRunner`` result."""

from __future__ import annotations


def one_line(r, code: int, *needles: str) -> str:
    """Exit ``code``, no exception escaped, one ``error: `` line on stderr holding each of
    ``needles``; returns that line."""
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    err = r.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in r.output, err
    for needle in needles:
        assert needle in err, err
    return err
