"""Bucket fitting: exact optimality against brute force, speed, target efficiency, baselines,
and the ``buckets fit`` command (JSON shape, --out round trip, --plot, bad input)."""

import bisect
import itertools
import json
import random
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import InputError
from pipeline.plan.config import load_grid
from pipeline.plan.fit import MAX_TARGET_BUCKETS, fit, pow2_buckets

runner = CliRunner()


def computed(lengths, grid):
    """Σ smallest bucket ≥ each length: the brute-force scorer, independent of pipeline.plan.fit."""
    grid = sorted(grid)
    return sum(grid[bisect.bisect_left(grid, n)] for n in lengths)


def brute_force(lengths, k, m):
    """Least computed tokens over every grid of ≤ k multiples of m holding every length."""
    top = max(-(-max(lengths) // m) * m, m)
    below = range(m, top, m)
    return min(
        computed(lengths, [*others, top])
        for r in range(k)
        for others in itertools.combinations(below, r)
    )


def random_case(seed, top=32):
    rng = random.Random(seed)
    m = rng.choice([1, 1, 2, 3, 4, 8])
    n = rng.randint(1, 25)
    # Clustered lengths (like real traffic) half the time, spread out otherwise.
    centre = rng.randint(0, top)
    lengths = [
        min(top, max(0, int(rng.gauss(centre, 5)))) if seed % 2 else rng.randint(0, top)
        for _ in range(n)
    ]
    max_len = rng.choice([None, None, m * rng.randint(1, top // m)])
    return lengths, rng.randint(1, 4), m, max_len


@pytest.mark.parametrize("seed", range(240))
def test_fit_matches_brute_force_on_small_random_inputs(seed):
    lengths, k, m, max_len = random_case(seed)
    accepted = [n for n in lengths if max_len is None or n <= max_len]
    if not accepted:
        with pytest.raises(InputError, match="--max-len"):
            fit(lengths, max_buckets=k, multiple_of=m, max_len=max_len)
        return
    r = fit(lengths, max_buckets=k, multiple_of=m, max_len=max_len)
    assert r.rejected == len(lengths) - len(accepted) and r.accepted == len(accepted)
    assert len(r.buckets) <= k and all(b % m == 0 and b > 0 for b in r.buckets)
    assert r.buckets == sorted(set(r.buckets)) and r.buckets[-1] >= max(accepted)
    assert max_len is None or r.buckets[-1] <= max_len
    assert computed(accepted, r.buckets) == brute_force(accepted, k, m)
    assert r.efficiency == pytest.approx(sum(accepted) / computed(accepted, r.buckets))


@pytest.mark.parametrize("seed", range(60))
def test_target_efficiency_gives_the_fewest_buckets(seed):
    lengths, _, m, _ = random_case(seed, top=20)
    lengths = [n + 1 for n in lengths]  # non-zero, so every target in (0, 1] has meaning
    target = random.Random(seed).choice([0.5, 0.7, 0.8, 0.9, 0.95])
    # Every distinct rounded length a bucket: the best any grid of multiples of m can do.
    ceiling = sum(lengths) / sum(max(-(-n // m) * m, m) for n in lengths)
    if ceiling < target:
        with pytest.raises(InputError, match="out of reach"):
            fit(lengths, target_efficiency=target, multiple_of=m)
        return
    r = fit(lengths, target_efficiency=target, multiple_of=m)
    assert r.efficiency >= target
    fewest = next(
        (k for k in range(1, 6) if sum(lengths) / brute_force(lengths, k, m) >= target), None
    )
    if fewest is not None:
        assert len(r.buckets) == fewest
    else:  # beyond brute force's reach: one bucket fewer (optimal, tested above) falls short
        assert len(r.buckets) > 5
        assert fit(lengths, max_buckets=len(r.buckets) - 1, multiple_of=m).efficiency < target


def test_twenty_thousand_requests_sixteen_buckets_under_two_seconds():
    rng = random.Random(0)
    # Every length distinct-ish over a wide range: the most candidates, the slowest case.
    lengths = [rng.randint(1, 32_768) for _ in range(20_000)]
    # CPU time, not wall time: on a 2-core machine that other processes keep busy, the wall
    # clock measured the neighbours (2.7 s once under two busy loops), not fit.
    start = time.process_time()
    r = fit(lengths, max_buckets=16)
    elapsed = time.process_time() - start
    assert len(r.buckets) == 16 and r.efficiency > r.baselines["pow2"].efficiency
    assert elapsed < 2.0, f"fit took {elapsed:.2f} s of CPU"


def test_efficiency_never_falls_as_buckets_are_added():
    rng = random.Random(1)
    lengths = [int(rng.lognormvariate(6, 1)) for _ in range(2_000)]
    effs = [fit(lengths, max_buckets=k, multiple_of=16).efficiency for k in range(1, 12)]
    assert effs == sorted(effs) and effs[-1] > effs[0]


def test_more_buckets_than_candidates_uses_every_candidate():
    r = fit([5, 5, 9, 130], max_buckets=8, multiple_of=8)
    assert r.buckets == [8, 16, 136]
    assert r.efficiency == pytest.approx(149 / (8 + 8 + 16 + 136))


def test_baselines_score_the_same_requests():
    r = fit([100, 300, 1000, 5000], max_buckets=2, max_len=4096)
    assert r.rejected == 1 and r.accepted == 3
    pow2, single = r.baselines["pow2"], r.baselines["single"]
    assert list(pow2.buckets) == [128, 256, 512, 1024]
    assert pow2.efficiency == pytest.approx(1400 / (128 + 512 + 1024))
    assert list(single.buckets) == [1000]
    assert single.efficiency == pytest.approx(1400 / 3000)
    assert r.buckets == [300, 1000] and r.efficiency == pytest.approx(1400 / 1600)


@pytest.mark.parametrize(
    ("longest", "grid"),
    [(1, [128]), (128, [128]), (129, [128, 256]), (4096, [128, 256, 512, 1024, 2048, 4096])],
)
def test_pow2_baseline_runs_up_to_the_first_power_holding_the_longest(longest, grid):
    assert pow2_buckets(longest) == grid


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_buckets": 0}, "--max-buckets"),
        ({"target_efficiency": 1.5}, "not in (0, 1]"),
        ({"target_efficiency": 0.0}, "not in (0, 1]"),
        ({"max_buckets": 2, "multiple_of": 0}, "--multiple-of"),
        ({"max_buckets": 2, "multiple_of": 64, "max_len": 1000}, "use 960 or 1024"),
        ({"max_buckets": 2, "max_len": 10}, "all 3 requests are longer than 10"),
        ({"max_buckets": 2, "target_efficiency": 0.9}, "exactly one"),
        ({"target_efficiency": 1.0, "multiple_of": 64}, "out of reach"),
    ],
)
def test_bad_fit_arguments_are_input_errors(kwargs, message):
    with pytest.raises(InputError) as e:
        fit([100, 200, 300], **kwargs)
    assert message in str(e.value)


def test_target_needing_too_many_buckets_is_refused():
    lengths = list(range(1, 2 * MAX_TARGET_BUCKETS))
    with pytest.raises(InputError, match=f"more than {MAX_TARGET_BUCKETS} buckets"):
        fit(lengths, target_efficiency=1.0)


# --- the command -------------------------------------------------------------------------


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    rng = random.Random(7)
    rows = [f"t{i},{int(rng.lognormvariate(6.5, 0.8))},{rng.randint(1, 400)}" for i in range(500)]
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows))
    return path


def fit_cli(*args):
    return runner.invoke(app, ["buckets", "fit", *[str(a) for a in args]])


def test_json_has_exactly_the_documented_shape(trace):
    r = fit_cli(trace, "--column", "ContextTokens", "--max-buckets", 4, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert list(data) == ["buckets", "efficiency", "rejected", "baselines"]
    assert list(data["baselines"]) == ["pow2", "single"]
    for b in data["baselines"].values():
        assert list(b) == ["buckets", "efficiency"]
    assert len(data["buckets"]) == 4 and data["rejected"] == 0
    assert data["efficiency"] > data["baselines"]["single"]["efficiency"]


def test_plus_column_max_len_and_target_through_the_cli(trace):
    r = fit_cli(
        trace,
        "--column",
        "ContextTokens",
        "--plus-column",
        "GeneratedTokens",
        "--target-efficiency",
        0.9,
        "--multiple-of",
        32,
        "--max-len",
        2048,
        "--json",
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["efficiency"] >= 0.9 and data["rejected"] > 0
    assert all(b % 32 == 0 and b <= 2048 for b in data["buckets"])


def test_human_output_names_buckets_efficiency_and_baselines(trace):
    r = fit_cli(trace, "--column", "ContextTokens", "--max-buckets", 3, "--max-len", 4000)
    assert r.exit_code == 0, r.output
    assert "3 buckets" in r.stdout and "efficiency:" in r.stdout
    assert "vs pow2 [128" in r.stdout and "vs single" in r.stdout and "rejected:" in r.stdout


def test_out_writes_a_grid_that_loads_with_the_given_batch_sizes(trace, tmp_path):
    out = tmp_path / "buckets" / "fitted.yaml"
    args = (trace, "--column", "ContextTokens", "--max-buckets", 5, "--multiple-of", 64)
    r = fit_cli(*args, "--out", out, "--batch-sizes", "8,1,4", "--json")
    assert r.exit_code == 0, r.output
    grid = load_grid(out)
    assert grid.batch_sizes == [1, 4, 8]
    assert grid.sequence_lengths == json.loads(r.stdout)["buckets"]
    assert "buckets fit" in out.read_text().splitlines()[0]
    assert fit_cli(*args, "--out", out).exit_code == 0
    assert load_grid(out).batch_sizes == [1]


def test_plot_writes_a_png(trace, tmp_path):
    png = tmp_path / "plot.png"
    r = fit_cli(trace, "--column", "ContextTokens", "--max-buckets", 4, "--plot", png)
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib_names_the_extra(trace, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    r = fit_cli(
        trace, "--column", "ContextTokens", "--max-buckets", 2, "--plot", tmp_path / "p.png"
    )
    assert r.exit_code == 2 and "inf2-pipeline[plot]" in r.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "exactly one of --max-buckets and --target-efficiency"),
        (["--max-buckets", 2, "--target-efficiency", 0.9], "exactly one"),
        (["--max-buckets", 0], "--max-buckets"),
        (["--max-buckets", 2, "--batch-sizes", "1,x"], "--batch-sizes: '1,x'"),
        (["--max-buckets", 2, "--batch-sizes", "1,1"], "--batch-sizes: [1] repeated"),
        (["--max-buckets", 2, "--batch-sizes", "0"], "--batch-sizes: 0 is not ≥ 1"),
        (["--max-buckets", 2, "--max-len", 1], "all 500 requests are longer than 1"),
        (["--target-efficiency", 2], "not in (0, 1]"),
    ],
)
def test_bad_options_are_one_line_exit_2(trace, tmp_path, args, message):
    out = tmp_path / "never.yaml"
    r = fit_cli(trace, "--column", "ContextTokens", "--out", out, *args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not out.exists()


def test_prefill_lengths_save_the_most_positions_given_each_buckets_own():
    """Prompts of 10 in a 64 bucket and of 40 in the same bucket: one extra length picks 16
    (saves 48 per short prompt) over 48 (saves 16 per long one); a second picks 48; a third
    saves nothing and is not added. Prompts whose request fits no bucket are left out."""
    from pipeline.plan.fit import fit_prefill_lengths

    prompts = [10] * 5 + [40] * 5 + [500]
    needs = [20] * 5 + [60] * 5 + [900]
    assert fit_prefill_lengths(prompts, needs, [64], 0, 16) == ([], 250 / 640)
    assert fit_prefill_lengths(prompts, needs, [64], 1, 16)[0] == [16]
    lengths, eff = fit_prefill_lengths(prompts, needs, [64], 3, 16)
    assert lengths == [16, 48] and eff == 250 / (5 * 16 + 5 * 48)
    # a bucket's own length already serves its prompts: nothing to add below a 16 bucket
    assert fit_prefill_lengths([10] * 3, [12] * 3, [16, 64], 2, 16)[0] == []


def test_buckets_fit_writes_prefill_lengths_into_the_grid(tmp_path):
    trace = tmp_path / "t.csv"
    rows = [(10, 5)] * 50 + [(40, 20)] * 50 + [(200, 50)] * 10
    trace.write_text("ContextTokens,GeneratedTokens\n" + "".join(f"{c},{g}\n" for c, g in rows))
    out = tmp_path / "grid.yaml"
    args = ["buckets", "fit", str(trace), "--column", "ContextTokens", "--plus-column"]
    args += ["GeneratedTokens", "--max-buckets", "2", "--multiple-of", "16", "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    grid = load_grid(out)
    assert grid.sequence_lengths == [64, 256]
    assert grid.prefill_lengths and all(n < 256 for n in grid.prefill_lengths)
    assert "prefill lengths (fitted to ContextTokens)" in r.output
    r = CliRunner().invoke(app, [*args, "--prefill-buckets", "0"])
    assert r.exit_code == 0 and load_grid(out).prefill_lengths == []
