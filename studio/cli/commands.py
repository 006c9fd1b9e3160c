"""``omni-studio``: :func:`main` (the console entry point) and the table of commands.

The parser and the settings are ``studio/cli/parser.py``; each command lives in its own module of this
package (``run``, ``validate``, ``history``, ``batch``, ``replay``, ``recipe``, ``accounts``: users and keys)."""

from __future__ import annotations

import argparse
import os
import sys

from engine.environment import quiet_libraries
from studio.cli.accounts import cmd_keys, cmd_users
from studio.cli.history import cmd_history
from studio.cli.parser import build_parser, settings_from_args
from studio.cli.run import cmd_run
from studio.cli.validate import cmd_validate
from studio.errors import StartupError, Terminated, UserError
from studio.startup.launch import stop_gracefully_on_sigterm, tune_interpreter
from studio.startup.settings import StudioSettings


def cmd_replay(args: argparse.Namespace, settings: StudioSettings) -> int:
    from studio.cli.replay import replay_command

    return replay_command(args, settings)


def cmd_batch(args: argparse.Namespace, settings: StudioSettings) -> int:
    from studio.cli.batch import run_batch

    return run_batch(args, settings)


def cmd_not_ready(args: argparse.Namespace, settings: StudioSettings) -> int:
    raise UserError(f"'omni-studio {args.command}' is not available in this build yet")


def cmd_ui(args: argparse.Namespace, settings: StudioSettings) -> int:
    from studio.startup.launch import launch_ui

    return launch_ui(settings)


def cmd_serve(args: argparse.Namespace, settings: StudioSettings) -> int:
    from studio.startup.launch import serve_api

    return serve_api(settings)


COMMANDS = {
    "batch": cmd_batch,
    "history": cmd_history,
    "keys": cmd_keys,
    "replay": cmd_replay,
    "run": cmd_run,
    "serve": cmd_serve,
    "ui": cmd_ui,
    "users": cmd_users,
    "validate": cmd_validate,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command or "ui"
    args.command = command
    handler = COMMANDS.get(command, cmd_not_ready)
    if getattr(args, "forwarded_allow_ips", None):  # read by uvicorn (ours in `serve`, Gradio's in `ui`)
        os.environ["FORWARDED_ALLOW_IPS"] = args.forwarded_allow_ips
    quiet_libraries()
    tune_interpreter()
    stop_gracefully_on_sigterm()
    try:
        return handler(args, settings_from_args(args))
    except UserError as exc:
        print(f"omni-studio {command}: error: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"omni-studio {command}: cannot start: {exc}", file=sys.stderr)
        return 1
    except Terminated:
        return 143  # 128 + SIGTERM, after the engine stopped and the recorder wrote what it had
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`omni-studio history ls | head`): stop quietly, as `ls | head` does. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
