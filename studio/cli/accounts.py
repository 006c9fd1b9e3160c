"""``omni-studio users add|ls|remove|passwd`` and ``omni-studio keys create|ls|revoke``: team accounts in
the run store (docs/team.md).

Passwords come from ``--password-file FILE`` (its first line) or, at a terminal, a prompt; they are never
echoed, printed or logged. A new key is printed once, as the last line of stdout, so a script can take it
with ``tail -n 1``; the store keeps only its sha256.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from studio.errors import UserError
from studio.startup.settings import StudioSettings

USERS_EXAMPLES = (
    "omni-studio users add alice --password-file alice.pw",
    "omni-studio users add root --admin          # asks for the password",
    "omni-studio users ls --json",
)
KEYS_EXAMPLES = (
    "omni-studio keys create --user alice --name laptop   # the key is the last line",
    "omni-studio keys ls --user alice",
    "omni-studio keys revoke 3f2a9c01de",
)


def add_account_commands(command: Callable[..., argparse.ArgumentParser], parents: Callable[[], Any]) -> None:
    """The ``users`` and ``keys`` commands (``command`` makes a command, ``parents`` its storage flags)."""

    def actions(parser: argparse.ArgumentParser, dest: str) -> Callable[..., argparse.ArgumentParser]:
        sub = parser.add_subparsers(dest=dest, metavar="ACTION", required=True)

        def action(name: str, help_text: str) -> argparse.ArgumentParser:
            return sub.add_parser(
                name,
                allow_abbrev=False,
                parents=[parents()],
                help=help_text,
                description=help_text[0].upper() + help_text[1:] + ".",
            )

        return action

    users = actions(
        command("users", "team accounts: add, list, remove, change a password", USERS_EXAMPLES),
        "users_command",
    )
    add = users("add", "add a user (a password-file's first line, or a prompt at a terminal)")
    add.add_argument("name", metavar="NAME", help="1-64 letters, digits and _ . @ -")
    add.add_argument(
        "--admin", action="store_true", help="sees and manages every user's runs and the accounts"
    )
    add.add_argument(
        "--password-file", type=Path, default=None, metavar="FILE", help="read the password here"
    )
    ls = users("ls", "list users (never their passwords)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    remove = users("remove", "remove a user and their keys (their runs stay in the history)")
    remove.add_argument("name", metavar="NAME")
    passwd = users("passwd", "set a user's password")
    passwd.add_argument("name", metavar="NAME")
    passwd.add_argument(
        "--password-file", type=Path, default=None, metavar="FILE", help="read the password here"
    )

    keys = actions(
        command("keys", "per-user API keys: create (shown once), list, revoke", KEYS_EXAMPLES), "keys_command"
    )
    create = keys("create", "make an API key for a user; the key is the last line printed")
    create.add_argument("--user", required=True, metavar="NAME", help="whose key")
    create.add_argument("--name", default=None, metavar="LABEL", help="a label to tell keys apart")
    kls = keys("ls", "list keys: id, user, label, when made and revoked (never the keys)")
    kls.add_argument("--user", default=None, metavar="NAME", help="only this user's keys")
    kls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    revoke = keys("revoke", "revoke a key: a running studio refuses it from its next request")
    revoke.add_argument("key_id", metavar="ID", help="the key's id (keys ls)")


def read_password(path: Path | None, confirm: bool = True) -> str:
    """The password from ``path`` (its first line) or from a prompt at a terminal."""
    if path is not None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UserError(f"--password-file {path}: {exc.strerror or exc}") from exc
        return lines[0] if lines else ""
    if not sys.stdin.isatty():
        raise UserError("give --password-file FILE (no terminal to ask for the password)")
    import getpass

    password = getpass.getpass("Password: ")
    if confirm and getpass.getpass("Again: ") != password:
        raise UserError("the two passwords differ")
    return password


def _open_accounts(settings: StudioSettings) -> Any:
    from studio.accounts.service import Accounts
    from studio.store import StoreError, open_store

    try:
        store = open_store(settings.db_url, settings.data_dir)
    except StoreError as exc:
        raise UserError(str(exc)) from exc
    return store, Accounts(store)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)


def cmd_users(args: argparse.Namespace, settings: StudioSettings) -> int:
    from studio.accounts.passwords import PasswordError
    from studio.store.accounts import AccountError

    store, accounts = _open_accounts(settings)
    try:
        action = args.users_command
        if action == "add":
            password = read_password(args.password_file)
            user = accounts.add_user(args.name, password, admin=args.admin)
            print(f"added user {user.name}" + (" (admin)" if user.admin else ""))
        elif action == "ls":
            users = accounts.users()
            if args.json:
                print(json.dumps([u.to_dict() for u in users], indent=2))
            elif not users:
                print("no users: the studio runs without accounts (omni-studio users add NAME)")
            else:
                rows = [
                    [u.name, "yes" if u.admin else "", str(u.keys), u.created_at.strftime("%Y-%m-%d %H:%M")]
                    for u in users
                ]
                print(_table(rows, ["NAME", "ADMIN", "KEYS", "CREATED (UTC)"]))
        elif action == "remove":
            keys = len(accounts.keys(args.name, include_revoked=False))
            accounts.remove_user(args.name)
            print(
                f"removed user {args.name} and {keys} key{'s' if keys != 1 else ''}; their runs stay in the history"
            )
        elif action == "passwd":
            if accounts.user(args.name) is None:
                raise AccountError(f"no user named {args.name!r}")
            accounts.set_password(args.name, read_password(args.password_file))
            print(f"changed the password of {args.name}")
        return 0
    except (AccountError, PasswordError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    finally:
        store.close()


def cmd_keys(args: argparse.Namespace, settings: StudioSettings) -> int:
    from studio.store.accounts import AccountError, KeyRecord

    store, accounts = _open_accounts(settings)
    try:
        action = args.keys_command
        if action == "create":
            made = accounts.create_key(args.user, args.name)
            label = f" ({made.record.name})" if made.record.name else ""
            print(f"API key {made.record.id} for {made.record.user}{label}; it is shown only now:")
            print(made.key)
        elif action == "ls":
            if args.user is not None and accounts.user(args.user) is None:
                raise AccountError(f"--user: no user named {args.user!r} (omni-studio users ls lists them)")
            keys = accounts.keys(args.user)
            if args.json:
                print(json.dumps([k.to_dict() for k in keys], indent=2))
            elif not keys:
                print("no API keys" + (f" of {args.user}" if args.user else ""))
            else:
                print(_table([k.table_row() for k in keys], list(KeyRecord.TABLE_HEADERS)))
        elif action == "revoke":
            key = accounts.revoke_key(args.key_id)
            print(
                f"revoked API key {key.id} of {key.user}: a running studio refuses it from its next request"
            )
        return 0
    except (AccountError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    finally:
        store.close()
