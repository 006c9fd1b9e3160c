"""Team accounts in the run store: users and their API keys, as rows (docs/team.md).

This module stores and reads what it is given: a password's argon2id hash, a key's sha256. Hashing,
checking and making keys is :mod:`studio.accounts`'s. Every method is one short transaction on the
:class:`RunStore`'s database (SQLite or PostgreSQL), so the CLI in one process and a running studio in
another see each other's changes at once (a revoked key is refused by the next request).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import exists, func, inspect, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from studio.store.models import ApiKey, Output, Run, User, table_of, utcnow
from studio.store.records import iso
from studio.store.schema import create_store_engine, default_url
from studio.store.store import RunStore

_users, _keys = table_of(User), table_of(ApiKey)


def accounts_exist(url: str | None, data_dir: Path) -> bool:
    """Whether the run store at ``url`` (default: the data dir's SQLite) has accounts, read without opening
    the store (no migration, no journal replay): what start-up asks before it settles the share login.
    A database that cannot be read answers no: the store's own opening then reports why."""
    engine = create_store_engine(url or default_url(Path(data_dir).expanduser()))
    try:
        with engine.connect() as connection:
            if "users" not in inspect(connection).get_table_names():
                return False
            return bool(connection.scalar(select(exists().where(_users.c.id.is_not(None)))))
    except SQLAlchemyError:
        return False
    finally:
        engine.dispose()


class AccountError(ValueError):
    """An account or key that does not exist, or a name that is taken or not allowed."""


@dataclass(frozen=True)
class UserRecord:
    """A user as lists show them (never the password hash)."""

    name: str
    admin: bool
    created_at: datetime
    keys: int = 0  # live (unrevoked) keys

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "admin": self.admin, "created_at": iso(self.created_at), "keys": self.keys}


@dataclass(frozen=True)
class KeyRecord:
    """An API key as lists show it: its id and label, never its secret."""

    id: str
    user: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    TABLE_HEADERS = ("ID", "USER", "NAME", "CREATED (UTC)", "REVOKED")

    def table_row(self) -> list[str]:
        """The key as a row of :attr:`TABLE_HEADERS` (``keys ls``, the Serving tab)."""
        revoked = self.revoked_at.strftime("%Y-%m-%d %H:%M") if self.revoked_at else ""
        return [self.id, self.user, self.name or "", self.created_at.strftime("%Y-%m-%d %H:%M"), revoked]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "user": self.user,
            "name": self.name,
            "created_at": iso(self.created_at),
            "revoked_at": iso(self.revoked_at),
        }


@dataclass(frozen=True)
class KeyOwner:
    """What a request's key lookup needs: the stored digest and the user behind it."""

    secret_sha256: str
    user: str
    admin: bool
    revoked: bool


class AccountStore:
    """Users and API keys in a :class:`RunStore`'s database."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def _read(self) -> Any:
        return self.store.engine.connect()

    # users ----------------------------------------------------------------------------------------

    def any_users(self) -> bool:
        """Whether accounts are configured (one indexed probe: asked per request by a running studio)."""
        with self._read() as connection:
            found = bool(connection.scalar(select(exists().where(_users.c.id.is_not(None)))))
            connection.commit()
        return found

    def list_users(self) -> list[UserRecord]:
        live = (
            select(_keys.c.user_id, func.count().label("n"))
            .where(_keys.c.revoked_at.is_(None))
            .group_by(_keys.c.user_id)
            .subquery()
        )
        statement = (
            select(_users.c.name, _users.c.admin, _users.c.created_at, func.coalesce(live.c.n, 0))
            .outerjoin(live, live.c.user_id == _users.c.id)
            .order_by(_users.c.name)
        )
        with self._read() as connection:
            rows = connection.execute(statement).all()
            connection.commit()
        return [UserRecord(name, bool(admin), created, int(keys)) for name, admin, created, keys in rows]

    def get_user(self, name: str) -> UserRecord | None:
        with self._read() as connection:
            row = connection.execute(
                select(_users.c.name, _users.c.admin, _users.c.created_at).where(_users.c.name == name)
            ).first()
            connection.commit()
        return None if row is None else UserRecord(row.name, bool(row.admin), row.created_at)

    def password_hash(self, name: str) -> tuple[str, bool] | None:
        """The stored hash of ``name``'s password and their admin flag; ``None`` when there is no such user."""
        with self._read() as connection:
            row = connection.execute(
                select(_users.c.password_hash, _users.c.admin).where(_users.c.name == name)
            ).first()
            connection.commit()
        return None if row is None else (row.password_hash, bool(row.admin))

    def add_user(self, name: str, password_hash: str, admin: bool) -> UserRecord:
        created = utcnow()
        try:
            with self.store.write_transaction() as connection:
                connection.execute(
                    _users.insert(),
                    {"name": name, "password_hash": password_hash, "admin": admin, "created_at": created},
                )
        except IntegrityError:
            raise AccountError(f"a user named {name!r} exists already") from None
        return UserRecord(name, admin, created)

    def set_password_hash(self, name: str, password_hash: str) -> None:
        with self.store.write_transaction() as connection:
            changed = connection.execute(
                _users.update().where(_users.c.name == name).values(password_hash=password_hash)
            ).rowcount
        if not changed:
            raise AccountError(f"no user named {name!r}")

    def remove_user(self, name: str) -> None:
        """Delete ``name`` and their keys (their runs stay, still theirs)."""
        with self.store.write_transaction() as connection:
            user_id = connection.scalar(select(_users.c.id).where(_users.c.name == name))
            if user_id is None:
                raise AccountError(f"no user named {name!r}")
            # Explicitly, not only by ON DELETE CASCADE: SQLite enforces it only with foreign keys on.
            connection.execute(_keys.delete().where(_keys.c.user_id == user_id))
            connection.execute(_users.delete().where(_users.c.id == user_id))

    # keys -----------------------------------------------------------------------------------------

    def add_key(self, user: str, key_id: str, secret_sha256: str, name: str | None) -> KeyRecord:
        created = utcnow()
        with self.store.write_transaction() as connection:
            user_id = connection.scalar(select(_users.c.id).where(_users.c.name == user))
            if user_id is None:
                raise AccountError(f"no user named {user!r}")
            connection.execute(
                _keys.insert(),
                {
                    "id": key_id,
                    "user_id": user_id,
                    "name": name,
                    "secret_sha256": secret_sha256,
                    "created_at": created,
                },
            )
        return KeyRecord(key_id, user, name, created, None)

    def list_keys(self, user: str | None = None, include_revoked: bool = True) -> list[KeyRecord]:
        statement = (
            select(
                _keys.c.id, _users.c.name.label("user"), _keys.c.name, _keys.c.created_at, _keys.c.revoked_at
            )
            .join(_users, _users.c.id == _keys.c.user_id)
            .order_by(_users.c.name, _keys.c.created_at, _keys.c.id)
        )
        if user is not None:
            statement = statement.where(_users.c.name == user)
        if not include_revoked:
            statement = statement.where(_keys.c.revoked_at.is_(None))
        with self._read() as connection:
            rows = connection.execute(statement).all()
            connection.commit()
        return [KeyRecord(r.id, r.user, r.name, r.created_at, r.revoked_at) for r in rows]

    def revoke_key(self, key_id: str, user: str | None = None) -> KeyRecord:
        """Mark a key revoked (``user``: only if it is theirs); raises :class:`AccountError`."""
        found = [k for k in self.list_keys(user) if k.id == key_id]
        if not found:
            whose = f" of {user}" if user is not None else ""
            raise AccountError(f"no API key{whose} with id {key_id!r}")
        key = found[0]
        if key.revoked:
            return key
        at = utcnow()
        with self.store.write_transaction() as connection:
            connection.execute(
                _keys.update().where(_keys.c.id == key_id, _keys.c.revoked_at.is_(None)).values(revoked_at=at)
            )
        return KeyRecord(key.id, key.user, key.name, key.created_at, at)

    def key_owner(self, key_id: str) -> KeyOwner | None:
        """The digest, user and state of the key with this id (one primary-key lookup per request)."""
        with self._read() as connection:
            row = connection.execute(
                select(_keys.c.secret_sha256, _keys.c.revoked_at, _users.c.name, _users.c.admin)
                .join(_users, _users.c.id == _keys.c.user_id)
                .where(_keys.c.id == key_id)
            ).first()
            connection.commit()
        if row is None:
            return None
        return KeyOwner(row.secret_sha256, row.name, bool(row.admin), row.revoked_at is not None)

    # what a user may see --------------------------------------------------------------------------

    def user_has_output(self, user: str, sha256: str) -> bool:
        """Whether one of ``user``'s runs has an output file with this hash (``/v1/outputs``)."""
        statement = select(
            exists().where(Output.sha256 == sha256, Output.run_id == Run.id, Run.user_name == user)
        )
        with self._read() as connection:
            found = bool(connection.scalar(statement))
            connection.commit()
        return found

    def run_user(self, run_id: str) -> str | None:
        """The account a run belongs to (``None``: none, or no such run)."""
        with self._read() as connection:
            found = connection.scalar(select(Run.user_name).where(Run.id == run_id))
            connection.commit()
        return found
