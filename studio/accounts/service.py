"""Accounts: what the CLI (``omni-studio users|keys``), the API's key check and the UI's login call.

Passwords go in and are hashed here (argon2id, ``passwords.py``); keys are made here and shown once
(``keys.py``). Nothing is cached: every check reads the store, so a key revoked or a user removed from
another process (the CLI beside a running studio) is refused by the next request (docs/team.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from studio.accounts.identity import Identity, check_user_name
from studio.accounts.keys import digest_matches, key_id_of, new_key, secret_digest
from studio.accounts.passwords import hash_password, password_matches, spend_check_time
from studio.store.accounts import AccountError, AccountStore, KeyRecord, UserRecord
from studio.store.store import RunStore

MAX_KEY_NAME = 100


@dataclass(frozen=True)
class NewKey:
    """A key just made: its record and the whole key (shown once, never stored)."""

    record: KeyRecord
    key: str


class Accounts:
    """Users and API keys of one run store."""

    def __init__(self, store: RunStore) -> None:
        self.rows = AccountStore(store)

    # users ----------------------------------------------------------------------------------------

    def configured(self) -> bool:
        """Whether the studio has accounts (then each user sees only their own runs)."""
        return self.rows.any_users()

    def users(self) -> list[UserRecord]:
        return self.rows.list_users()

    def user(self, name: str) -> UserRecord | None:
        return self.rows.get_user(name)

    def add_user(self, name: str, password: str, admin: bool = False) -> UserRecord:
        """A new user (``AccountError``: the name is taken; ``ValueError``: a bad name or password)."""
        check_user_name(name)
        return self.rows.add_user(name, hash_password(password), admin)

    def set_password(self, name: str, password: str) -> None:
        check_user_name(name)
        self.rows.set_password_hash(name, hash_password(password))

    def remove_user(self, name: str) -> None:
        self.rows.remove_user(name)

    def login(self, name: str, password: str) -> Identity | None:
        """The user's identity when ``password`` is theirs; ``None`` otherwise (as slow either way)."""
        stored = self.rows.password_hash(name)
        if stored is None:
            spend_check_time(password)
            return None
        password_hash, admin = stored
        if not password_matches(password_hash, password):
            return None
        return Identity(name, admin, accounts=True)

    # keys -----------------------------------------------------------------------------------------

    def create_key(self, user: str, name: str | None = None) -> NewKey:
        """A new key of ``user`` (``AccountError`` when there is no such user)."""
        if name is not None and len(name) > MAX_KEY_NAME:
            raise ValueError(f"the key's name is {len(name)} characters; at most {MAX_KEY_NAME}")
        key_id, key = new_key()
        record = self.rows.add_key(user, key_id, secret_digest(key), name or None)
        return NewKey(record, key)

    def keys(self, user: str | None = None, include_revoked: bool = True) -> list[KeyRecord]:
        return self.rows.list_keys(user, include_revoked)

    def revoke_key(self, key_id: str, user: str | None = None) -> KeyRecord:
        """Revoke a key (``user``: only one of theirs); refused by a running studio's next request."""
        return self.rows.revoke_key(key_id.strip().lower(), user)

    def identify_key(self, key: str) -> Identity | None:
        """The user whose live key ``key`` is; ``None`` for anything else (unknown, revoked, wrong)."""
        key_id = key_id_of(key)
        if key_id is None:
            return None
        owner = self.rows.key_owner(key_id)
        if owner is None or owner.revoked or not digest_matches(key, owner.secret_sha256):
            return None
        return Identity(owner.user, owner.admin, accounts=True)

    # what a user may see --------------------------------------------------------------------------

    def may_read_output(self, identity: Identity, sha256: str) -> bool:
        """Whether ``identity`` may fetch the output file with this hash (``/v1/outputs``)."""
        if identity.sees_all:
            return True
        return identity.name is not None and self.rows.user_has_output(identity.name, sha256)

    def may_see_run(self, identity: Identity, run_id: str) -> bool:
        return identity.sees_all or self.rows.run_user(run_id) == identity.name


def identity_of_login(accounts: Accounts | None, username: str | None, operator: str | None) -> Identity:
    """Who a UI visitor is: logged in as ``username`` (``None``: no login), where ``operator`` is the
    ``--auth`` login (the admin, in a studio with or without accounts)."""
    team = accounts is not None and accounts.configured()
    if not team:
        return Identity(username, admin=bool(username) and username == operator)
    if username and username == operator:
        return Identity(None, admin=True, accounts=True)
    user = accounts.user(username) if accounts is not None and username else None
    if user is None:
        return Identity(None, admin=False, accounts=True)  # no login (or a removed user): sees no one's runs
    return Identity(user.name, user.admin, accounts=True)


__all__ = ["AccountError", "Accounts", "KeyRecord", "NewKey", "UserRecord", "identity_of_login"]
