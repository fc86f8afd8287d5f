"""The CLI's dispatch: a command line imports the module of its command alone (cli.COMMANDS), so a process that
runs `hypafilter lab up` or `hypafilter policysync run` does not pay for the other commands' imports."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest
from hypafilter import cli


def test_the_command_table_is_what_the_modules_register():
    registered = {}
    for name in cli.command_modules():
        module = importlib.import_module(f"hypafilter.cli.{name}")
        sub = argparse.ArgumentParser().add_subparsers(dest="command")
        module.register(sub)
        registered.update(dict.fromkeys(sub.choices, name))
    assert registered == cli.COMMANDS


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_a_commands_parser_alone_is_the_whole_parsers(command, capsys):
    """`hypafilter CMD --help` gives the same text from the command's module alone as from every module."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    whole = capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert capsys.readouterr().out == whole


def test_top_level_help_and_unknown_commands_list_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in cli.COMMANDS), out
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_light_command_does_not_import_the_analysis():
    """A fresh interpreter parsing `lab --help` (what every test's and service's process starts with) imports
    neither numpy nor the analysis package's plan builder."""
    code = (  # stdout: lab's help, then the list
        "import sys\n"
        "from hypafilter import cli\n"
        "try:\n    cli.main(['lab', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('numpy', 'hypafilter.analysis.plan', 'scapy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out
