"""Who a request or a UI event acts as, and what they may see (docs/team.md, "Isolation").

Without accounts every caller is one identity and sees everything, as before accounts existed. With
accounts a user sees their own runs, jobs, queue entries and output files; an admin account, the
``--api-key`` and the ``--auth`` login (the operator's) see and manage everything.

The API's key check sets the identity of the request it checks (:func:`act_as`, a context variable: the
handler runs in the same context, and tasks it starts copy it), so the run path records the owner
without every endpoint passing it along. The UI passes its visitor's identity explicitly.
"""

from __future__ import annotations

import re
from contextvars import ContextVar, Token
from dataclasses import dataclass

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
# No account has this name (names start with a letter or digit): the filter of someone who may see no
# account's runs (a visitor without a login, in a studio that has accounts).
NOBODY = " nobody"


def check_user_name(name: str) -> str:
    """``name`` when it may name an account; ``ValueError`` naming the rule otherwise."""
    if not NAME_PATTERN.fullmatch(name or ""):
        raise ValueError(
            f"user name {name!r} is not allowed: 1-64 letters, digits and _ . @ -, starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class Identity:
    """An account (``name``) or the operator (``name`` None, ``admin`` True), in a studio with or without
    accounts."""

    name: str | None = None
    admin: bool = False
    accounts: bool = False  # whether the studio has accounts at all

    @property
    def sees_all(self) -> bool:
        """Whether this identity sees every run, job and queue entry."""
        return not self.accounts or self.admin

    @property
    def run_user(self) -> str | None:
        """The ``RunFilter.user`` that narrows lists to what this identity may see (``None``: all)."""
        if self.sees_all:
            return None
        return self.name or NOBODY

    @property
    def owner(self) -> str | None:
        """The Queue panel's owner name of this account (``user:NAME``)."""
        return f"user:{self.name}" if self.name else None

    def may_see(self, user: str | None) -> bool:
        """Whether a run (or job) of account ``user`` is visible to this identity."""
        return self.sees_all or (self.name is not None and user == self.name)

    def label(self) -> str:
        if self.name:
            return f"{self.name} (admin)" if self.admin else self.name
        return "the operator (admin)" if self.admin else "anonymous"


def user_of_owner(owner: str | None) -> str | None:
    """The account in a Queue owner name (``user:NAME``), else ``None``."""
    if owner and owner.startswith("user:"):
        return owner[len("user:") :]
    return None


_CURRENT: ContextVar[Identity | None] = ContextVar("omni_studio_identity", default=None)


def current_identity() -> Identity | None:
    """The identity the running request acts as (``None``: none was set: no accounts, or not a request)."""
    return _CURRENT.get()


def current_user() -> str | None:
    """The account the running request acts as, if any."""
    identity = _CURRENT.get()
    return identity.name if identity is not None else None


def act_as(identity: Identity | None) -> Token[Identity | None]:
    """Make ``identity`` the current request's (until :func:`stop_acting` with the token, or the request's
    context ends)."""
    return _CURRENT.set(identity)


def stop_acting(token: Token[Identity | None]) -> None:
    _CURRENT.reset(token)
