"""Who an API request is: the ``--api-key``, a user's own key (docs/team.md), or nobody.

Without accounts and without ``--api-key`` the API is open, as it always was. With ``--api-key`` that key
is needed (the operator's: it sees everything). With accounts a key is needed too: a user's own key acts as
that user (their runs are recorded as theirs; ``/v1/outputs`` serves them only their own files), and
``--api-key``, when set, still works as the admin's. Keys are looked up in the run store on every request,
so a key revoked from the CLI is refused by a running studio's next request. Wrong keys are throttled per
(address, presented key) by the limiter in ``auth.py``: the right key from the same address works at once.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import Request

from studio.accounts.identity import Identity, act_as, current_identity
from studio.accounts.service import Accounts
from studio.api.auth import TooManyFailures, credential_client, limiter_for, secrets_equal
from studio.api.errors import APIError


class _KeyOptions(Protocol):
    @property
    def api_key(self) -> str | None: ...


class ServingState(Protocol):
    """What the checks read of ``studio.api.state.ServingState`` (which calls them)."""

    accounts: Accounts | None

    @property
    def options(self) -> _KeyOptions: ...


def accounts_on(state: ServingState) -> bool:
    """Whether the studio behind ``state`` has accounts (read from the store: users added while it runs
    count at once). A studio shared with accounts (``accounts_required``) keeps needing a user's key even
    when its last account is removed: its public link was given no generated key to fall back on."""
    if getattr(state, "accounts_required", False):
        return True
    accounts = getattr(state, "accounts", None)
    return accounts is not None and accounts.configured()


def authenticate(state: ServingState, request: Request) -> Identity | None:
    """Check the request's key and make its identity the current one (``studio.accounts.identity``).

    401 without a key where one is needed or with a wrong one; 429 for a wrong key that failed too often
    from this address. Returns the identity (``None``: an open API, nobody in particular).
    """
    key = state.options.api_key
    team = accounts_on(state)
    if not key and not team:
        act_as(None)
        return None
    header = request.headers.get("authorization", "")
    if not header:
        raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'", None, "missing_api_key")
    limiter = limiter_for(state)
    client = credential_client(request.scope, header)
    wait = limiter.retry_after(client)
    if wait is not None:
        raise TooManyFailures(wait)
    scheme, _, token = header.partition(" ")
    token = token.strip()
    identity: Identity | None = None
    if scheme.lower() == "bearer":
        if key and secrets_equal(token, key):
            identity = Identity(None, admin=True, accounts=team)
        elif team and state.accounts is not None:
            identity = state.accounts.identify_key(token)
    if identity is None:
        limiter.record_failure(client)
        raise APIError(401, "Incorrect API key provided", None, "invalid_api_key")
    act_as(identity)
    return identity


def check_output_visible(state: ServingState, sha256: str, name: str) -> None:
    """404 when the current request's user may not read this output file (another user's: docs/team.md).

    The same answer as for a file that does not exist: a user cannot tell another user's files from none.
    """
    identity = current_identity()
    accounts = getattr(state, "accounts", None)
    if identity is None or accounts is None or identity.sees_all:
        return
    if not accounts.may_read_output(identity, sha256):
        raise APIError(404, f"No output file named {name!r}", "name", "file_not_found")
