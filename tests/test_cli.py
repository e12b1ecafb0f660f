import pytest

from rolloutgate.cli import SUBCOMMANDS, build_parser


def test_every_subcommand_is_listed_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(only="__none__")
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out
