"""Each command's ``--help`` lists only the flags it uses, grouped, each with a one-line description and
an example; flags given before the command still work (``omni-studio --db X history ls``)."""

from __future__ import annotations

import re

import pytest

from studio.cli import build_parser, main

SERVER_FLAGS = (
    "--host",
    "--port",
    "--share",
    "--auth",
    "--api-key",
    "--fingerprint-mode",
    "--served-model-name",
)
QUEUE_FLAGS = ("--max-queue", "--max-in-flight-per-client", "--max-body-bytes", "--max-messages")


def help_of(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def flags(text: str) -> set[str]:
    return set(re.findall(r"^\s+(--[a-z][a-z-]*)", text, re.M))


@pytest.mark.parametrize(
    ("argv", "present", "absent"),
    [
        (("ui",), ("--host", "--port", "--share", "--api-key", "--model", "--max-queue", "--db"), ()),
        (("serve",), ("--host", "--port", "--api-key", "--fingerprint-mode", "--max-queue", "--db"), ()),
        (
            ("run",),
            ("--model", "--deploy-config", "--ar-backend", "--out", "--seed", "--height", "--steps", "--db"),
            SERVER_FLAGS + QUEUE_FLAGS,
        ),
        (
            ("validate",),
            ("--model", "--ar-backend", "--check-devices"),
            (*SERVER_FLAGS, *QUEUE_FLAGS, "--db"),
        ),
        (("history",), ("--db", "--data-dir"), (*SERVER_FLAGS, *QUEUE_FLAGS, "--model")),
        (
            ("history", "ls"),
            ("--db", "--json", "--limit", "--status"),
            (*SERVER_FLAGS, *QUEUE_FLAGS, "--model"),
        ),
        (("history", "show"), ("--db", "--json"), (*SERVER_FLAGS, *QUEUE_FLAGS, "--model")),
        (
            ("replay",),
            ("--filter", "--ids", "--limit", "--params", "--report", "--model", "--deploy-config", "--db"),
            (*SERVER_FLAGS, *QUEUE_FLAGS, "--out", "--seed"),
        ),
        (("history", "export"), ("--db",), (*SERVER_FLAGS, "--model")),
        (("history", "import"), ("--db",), (*SERVER_FLAGS, "--model")),
    ],
)
def test_help_lists_the_flags_the_command_uses(capsys, argv, present, absent):
    text = help_of(capsys, *argv)
    listed = flags(text)
    for flag in present:
        assert flag in listed, f"{' '.join(argv)} --help lacks {flag}"
    for flag in absent:
        assert flag not in listed, f"{' '.join(argv)} --help lists {flag}, which it does not use"
    assert "examples:\n  omni-studio " + argv[0] in text
    assert text.count("\n\n") >= 3  # grouped: usage, description, groups, examples


def test_every_flag_has_a_one_line_description():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    parsers = [parser, *commands.values()]
    parsers += list(commands["history"]._subparsers._group_actions[0].choices.values())  # type: ignore[union-attr]
    for p in parsers:
        for action in p._actions:
            if action.option_strings and action.help is not argparse_suppress():
                assert action.help and "\n" not in action.help, (p.prog, action.option_strings)
        assert p.epilog and p.epilog.startswith("examples:"), p.prog


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


def test_shared_groups_are_titled(capsys):
    text = help_of(capsys, "serve")
    for title in ("model and pipeline:", "serving:", "limits on requests", "storage:"):
        assert title in text
    run = help_of(capsys, "run")
    assert "this run (omitted values: the model's defaults):" in run
    assert "limits on this run's inputs:" in run


def test_flags_before_the_command_still_apply():
    parser = build_parser()
    args = parser.parse_args(["--db", "sqlite:///x.db", "history", "ls"])
    assert args.db == "sqlite:///x.db" and args.history_command == "ls"
    args = parser.parse_args(["history", "ls", "--db", "sqlite:///y.db"])
    assert args.db == "sqlite:///y.db"
    args = parser.parse_args(["--model", "tiny-chat", "run", "hi"])
    assert args.model == "tiny-chat" and args.host == "127.0.0.1"  # defaults still filled for settings


def test_a_server_flag_after_a_command_that_does_not_serve_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "hi", "--port", "1234"])
    assert info.value.code == 2
    assert "unrecognized arguments: --port" in capsys.readouterr().err
