"""The parser every pdserve command uses: no flag prefixes, one-line errors with the closest flag."""

from __future__ import annotations

import pytest

from services.common.cli_args import ArgParser, suggest_flag


def _parser() -> ArgParser:
    p = ArgParser(prog="pdserve x")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=5)
    return p


def _error(p: ArgParser, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        p.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_a_prefix_is_refused_with_the_flag_it_abbreviates(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error(_parser(), ["--prefil", "2"], capsys) == (
        "pdserve x: error: unrecognized argument --prefil (did you mean --prefill?); --help lists the flags")


def test_an_unknown_flag_with_a_value_and_more_unknowns(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error(_parser(), ["--max-restart=3", "--bogus"], capsys) == (
        "pdserve x: error: unrecognized argument --max-restart (and 1 more) (did you mean --max-restarts?); "
        "--help lists the flags")


def test_nothing_close_gets_no_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error(_parser(), ["--zzz"], capsys) == (
        "pdserve x: error: unrecognized argument --zzz; --help lists the flags")
    assert suggest_flag("--bogus", ["--host", "--prefill"]) is None


def test_a_bad_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error(_parser(), ["--prefill", "two"], capsys) == (
        "pdserve x: error: argument --prefill: invalid int value: 'two'; --help lists the flags")


def test_subcommands_refuse_prefixes_and_suggest_their_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    p = ArgParser(prog="pdserve")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("run").add_argument("--decode", type=int)
    assert _error(p, ["run", "--decod", "1"], capsys) == (
        "pdserve: error: unrecognized argument --decod (did you mean --decode?); --help lists the flags")
