"""Reading request traces: lengths from one or two columns, and each bad input named."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import (
    EmptyTraceError,
    InputError,
    TraceColumnError,
    TraceNotFoundError,
    TraceValueError,
)
from pipeline.plan.traces import read_lengths

REAL_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/AzureLLMInferenceTrace_conv.csv"
runner = CliRunner()


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def test_one_column_and_plus_column_without_trailing_newline(tmp_path):
    path = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\nt0,374,44\nt1,396,109")
    assert read_lengths(path, "ContextTokens") == [374, 396]
    assert read_lengths(path, "ContextTokens", "GeneratedTokens") == [418, 505]


def test_blank_lines_bom_quotes_and_spaces_are_tolerated(tmp_path):
    text = '\ufeff"id", prompt ,out\n"a,b", 12 ,"3"\n\nc,0,0\n\n'
    assert read_lengths(write(tmp_path, text), "prompt", "out") == [15, 0]


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="shared traces not checked out beside repo")
def test_real_azure_trace_matches_its_readme():
    lengths = read_lengths(REAL_TRACE, "ContextTokens")
    assert len(lengths) == 19_366 and min(lengths) == 2 and max(lengths) == 14_050


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ("", EmptyTraceError, "empty file"),
        ("\n\n", EmptyTraceError, "empty file"),
        ("a,ContextTokens\n", EmptyTraceError, "no requests"),
        ("a,b\n1,2\n", TraceColumnError, "no column 'ContextTokens' (columns are: a, b)"),
        ("a,ContextTokens\nx,12\ny,1.5\n", TraceValueError, "trace.csv:3: ContextTokens: '1.5'"),
        ("a,ContextTokens\nx,12\ny,-4\n", TraceValueError, "trace.csv:3: ContextTokens: -4 is"),
        ("a,ContextTokens\nx,1_000\n", TraceValueError, "'1_000' is not an integer"),
        ("a,ContextTokens\nx\n", TraceValueError, "trace.csv:2: ContextTokens: missing value"),
        ("a,ContextTokens\nx,\n", TraceValueError, "missing value"),
    ],
)
def test_bad_trace_is_a_typed_input_error(tmp_path, text, error, message):
    with pytest.raises(error) as e:
        read_lengths(write(tmp_path, text), "ContextTokens")
    assert isinstance(e.value, InputError) and e.value.exit_code == 2
    assert message in str(e.value)


def test_error_fields_name_the_columns_and_the_line(tmp_path):
    with pytest.raises(TraceColumnError) as e:
        read_lengths(write(tmp_path, "a,b\n1,2\n"), "a", "c")
    assert e.value.columns == ("a", "b")
    with pytest.raises(TraceValueError) as v:
        read_lengths(write(tmp_path, "a,b\n1,2\n\n3,x\n"), "a", "b")
    assert v.value.line == 4


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(TraceNotFoundError, match="no such file"):
        read_lengths(tmp_path / "absent.csv", "a")
    with pytest.raises(TraceNotFoundError, match="is a directory"):
        read_lengths(tmp_path, "a")


def test_binary_file_is_not_utf8(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_bytes(b"a,b\n\xff\xfe,1\n")
    with pytest.raises(TraceValueError, match="not UTF-8"):
        read_lengths(path, "a")


@pytest.mark.parametrize(
    ("text", "column", "message"),
    [
        (None, "ContextTokens", "no such file"),
        ("", "ContextTokens", "empty file"),
        ("a,b\n1,2\n", "ContextTokens", "columns are: a, b"),
        ("a,ContextTokens\nx,abc\n", "ContextTokens", ":2: ContextTokens: 'abc' is not an integer"),
        ("a,ContextTokens\nx,-1\n", "ContextTokens", ":2: ContextTokens: -1 is negative"),
    ],
)
def test_bad_trace_through_the_cli_is_one_line_exit_2(tmp_path, text, column, message):
    path = tmp_path / "absent.csv" if text is None else write(tmp_path, text)
    r = runner.invoke(app, ["buckets", "fit", str(path), "--column", column, "--max-buckets", "4"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in r.output and r.stdout == ""
