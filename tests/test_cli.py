"""The command line without a Kubo node: --version, and help text for every flag."""

from __future__ import annotations

import argparse

import pytest

from gridgraph.cli import main, parser, version


def test_version_is_printed(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"gridgraph {version()}" != "gridgraph "
    assert version()[0].isdigit()


def commands(top: argparse.ArgumentParser, path: str = "gridgraph"):
    """Every (command path, parser) under `top`, itself included."""
    yield path, top
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


def test_every_flag_of_every_command_has_help():
    found = 0
    for path, command in commands(parser()):
        for action in command._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                found += 1
                assert action.help, f"{path} {action.option_strings[0]} has no help text"
    assert found >= 19  # worker's limits, status, ipfs up/down, --version ...
