"""bench_serve.py's figures read from the server's /metrics: quantiles of what a histogram
observed between two scrapes, as Prometheus' ``histogram_quantile`` reads them."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_serve

NAME = "inf2_serve_time_to_first_token_seconds"


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    r = CollectorRegistry()
    return r, Histogram(NAME, "ttft", buckets=(0.001, 0.002, 0.005, 0.01), registry=r)


def _scrape(r: CollectorRegistry) -> str:
    return generate_latest(r).decode()


def test_quantiles_count_only_what_came_between_the_scrapes_and_interpolate():
    r, h = _histogram()
    for _ in range(50):
        h.observe(0.009)  # before the first scrape: not this replay's
    before = _scrape(r)
    for v in [0.0015] * 50 + [0.004] * 49 + [0.008]:
        h.observe(v)
    after = _scrape(r)
    # half of 100 at rank 50: the top of the (0.001, 0.002] bucket, which holds 50
    assert bench_serve.histogram_quantile(before, after, NAME, 0.5) == pytest.approx(0.002)
    # rank 99 is the 49th of 49 in (0.002, 0.005]
    assert bench_serve.histogram_quantile(before, after, NAME, 0.99) == pytest.approx(0.005)
    # rank 25, halfway into the first bucket's 50: interpolated from 0.001 to 0.002
    assert bench_serve.histogram_quantile(before, after, NAME, 0.25) == pytest.approx(0.0015)


def test_a_quantile_past_the_largest_bound_is_that_bound_and_none_without_observations():
    r, h = _histogram()
    before = _scrape(r)
    assert bench_serve.histogram_quantile(before, before, NAME, 0.5) is None
    for _ in range(10):
        h.observe(3.0)
    assert bench_serve.histogram_quantile(before, _scrape(r), NAME, 0.99) == 0.01


def test_the_first_token_histograms_resolve_milliseconds():
    """The server's own buckets: a GPU's first tokens (3-20 ms) fall in buckets no wider
    than 5 ms, so a p99 read from them is within a few ms of the truth."""
    from prometheus_client.parser import text_string_to_metric_families

    from pipeline.server.metrics import Metrics

    body, _ = Metrics().exposition()

    def bounds(name: str) -> list[float]:
        return sorted(
            float(s.labels["le"])
            for f in text_string_to_metric_families(body.decode())
            for s in f.samples
            if s.name == name + "_bucket"
        )

    ttft = bounds(NAME)
    fine = [b for b in ttft if b <= 0.03]
    assert fine[0] <= 0.001
    assert all(b - a <= 0.005 + 1e-9 for a, b in itertools.pairwise(fine))
    coarse = [b for b in ttft if b <= 0.25]  # a long prompt's, or a loaded host's
    assert all(b - a <= 0.05 + 1e-9 for a, b in itertools.pairwise(coarse))
    assert bounds("inf2_serve_queue_time_seconds") == ttft
    assert bounds("inf2_serve_time_to_first_token_written_seconds") == ttft


def test_every_metric_is_documented():
    """docs/serve.md's table names every family /metrics exposes: one set of names."""
    from pipeline.server.metrics import Metrics

    doc = (Path(__file__).resolve().parent.parent / "docs" / "serve.md").read_text()
    names = [family.name for family in Metrics().registry.collect()]
    assert len(names) > 15
    for name in names:  # a counter's family is named without the _total it is exposed with
        assert f"`{name}`" in doc or f"`{name}_total`" in doc, name


def test_the_start_up_is_read_by_phase_from_the_servers_gauge():
    """What the bench records of each server's start: ``inf2_serve_startup_seconds`` by
    phase, as the server exposes it."""
    from pipeline.server.metrics import Metrics

    m = Metrics()
    for phase, s in {"load": 12.25, "warm": 40.5, "total": 61.0}.items():
        m.startup.labels(phase=phase).set(s)
    text = _scrape(m.registry)
    assert bench_serve.startup_seconds(text) == {"load": 12.25, "warm": 40.5, "total": 61.0}
    assert bench_serve.startup_seconds(_scrape(_histogram()[0])) == {}


def test_each_round_s_p99_is_divided_by_the_lone_request_s_p99_of_that_round(capsys):
    def way(name: str, p99s: list[float]) -> dict:
        return {"way": name, "concurrency": 32, "every_round": [{"ttft_p99_s": x} for x in p99s]}

    ways = [way("lone", [0.004, 0.005]), way("serve/4p", [0.010, 0.016])]
    bench_serve.print_round_ratios(ways, {"lone": "lone request (serve)"})
    out = capsys.readouterr().out
    rows = out.splitlines()[2:]
    assert len(rows) == 1 and "serve/4p" in rows[0] and rows[0].endswith("2.50× 3.20×")
    # one round: the table's own columns already say it
    bench_serve.print_round_ratios([way("lone", [0.004]), way("serve/4p", [0.01])], {})
    assert capsys.readouterr().out == ""
