"""What a team studio's users may read and change (docs/team.md, "What only an admin does" and
"/metrics"), in process: /metrics opens for any account's own key (and the ``--api-key``), stays open
without accounts, refuses no key or a revoked one with an OpenAI-style 401, and lists per-request queue
positions of the reader's own requests only (the admin: all); the refusal a non-admin gets names who may
and who is logged in; the recipe note offers a recipe's pipeline only to those who may switch it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient

from studio.accounts.service import Accounts
from studio.api.app import create_app
from studio.api.state import ServingOptions, ServingState
from studio.controller import Studio
from studio.recipes.recipe import Recipe
from studio.store.store import RunStore
from studio.ui.recipe import SWITCH, describe

pytest_plugins = ["conftest_store"]
PASSWORD = "a long enough password"


class WaitingEngine:
    """What ``GET /metrics`` reads of an engine: two requests waiting at stage 0."""

    in_flight = 2

    def queue_depths(self) -> dict[int, int]:
        return {0: 2}

    def waiting_depths(self) -> dict[int, int]:
        return {0: 2}

    def queue_positions(self) -> dict[str, dict[int, int]]:
        return {"req-of-alice": {0: 1}, "req-of-bob": {0: 2}}

    def decode_paths(self) -> dict[int, str]:
        return {}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_metrics_open_to_each_users_key_with_only_their_own_queue_positions(store: RunStore) -> None:
    state = ServingState(None, ServingOptions())
    state.accounts = Accounts(store)
    state.engine = WaitingEngine()  # only what /metrics reads
    state.board.add("req-of-alice", "api", "user:alice", "a", None)
    state.board.add("req-of-bob", "api", "user:bob", "b", None)
    client = TestClient(create_app(state))
    # Without accounts nothing changes: open, every request's position.
    body = client.get("/metrics").text
    assert 'request_id="req-of-alice"' in body and 'request_id="req-of-bob"' in body

    accounts = state.accounts
    for name in ("alice", "bob", "root"):
        accounts.add_user(name, PASSWORD, admin=name == "root")
    keys = {name: accounts.create_key(name).key for name in ("alice", "bob", "root")}

    refused = client.get("/metrics")
    assert refused.status_code == 401
    error = refused.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "missing_api_key"
    assert "API key" in error["message"]
    assert client.get("/metrics", headers=bearer(keys["alice"][:-2] + "zz")).status_code == 401

    alice = client.get("/metrics", headers=bearer(keys["alice"]))
    assert alice.status_code == 200, alice.text
    # The studio's figures, as everyone sees them; of the per-request rows, only her own.
    assert 'omni_studio_queue_depth{stage="0"} 2.0' in alice.text
    assert "omni_studio_requests_in_flight 2.0" in alice.text
    assert 'request_id="req-of-alice"' in alice.text and "req-of-bob" not in alice.text
    bob = client.get("/metrics", headers=bearer(keys["bob"])).text
    assert 'request_id="req-of-bob"' in bob and "req-of-alice" not in bob
    root = client.get("/metrics", headers=bearer(keys["root"])).text
    assert 'request_id="req-of-alice"' in root and 'request_id="req-of-bob"' in root

    # A revoked key is refused from its next request.
    accounts.revoke_key(keys["bob"].split("_")[1])
    assert client.get("/metrics", headers=bearer(keys["bob"])).status_code == 401

    # The --api-key beside accounts is the operator's: everything.
    state.set_api_key("k-operator")
    operator = client.get("/metrics", headers=bearer("k-operator"))
    assert operator.status_code == 200
    assert 'request_id="req-of-alice"' in operator.text and 'request_id="req-of-bob"' in operator.text
    assert client.get("/metrics", headers=bearer(keys["alice"])).status_code == 200  # still hers too


def fake_studio(store: RunStore | None) -> Any:
    """What :meth:`Studio.admin_refusal` and the recipe note read of a studio."""
    accounts = Accounts(store) if store is not None else None
    studio: Any = SimpleNamespace(
        accounts=accounts,
        admin_user=None,
        model=SimpleNamespace(name="tiny-glm-image"),
        config=SimpleNamespace(config_hash=lambda: "f" * 16),
        builtin_models=lambda: ["tiny-glm-image", "tiny-chat"],
    )
    studio.identity = lambda username: Studio.identity(studio, username)
    studio.admin_refusal = lambda username, action: Studio.admin_refusal(studio, username, action)
    return studio


def test_only_an_admin_may_change_what_everyone_runs(store: RunStore) -> None:
    studio = fake_studio(store)
    # No accounts: everyone may, as before.
    assert studio.admin_refusal(None, "apply a deploy config") is None
    assert studio.admin_refusal("someone", "apply a deploy config") is None
    studio.accounts.add_user("bob", PASSWORD)
    studio.accounts.add_user("root", PASSWORD, admin=True)
    assert studio.admin_refusal("root", "apply a deploy config") is None
    assert (
        studio.admin_refusal("bob", "apply a deploy config")
        == "only an admin can apply a deploy config; logged in as bob"
    )
    assert studio.admin_refusal(None, "switch the model") == (
        "only an admin can switch the model; not logged in to an account"
    )

    # A recipe made with another model: the admin is offered the switch, bob is told who may.
    recipe = Recipe(prompt="p", parameters={"seed": 1}, model="tiny-chat", config_hash="a" * 16, config={})
    text, offered = describe(recipe, studio, {}, studio.admin_refusal("root", SWITCH))
    assert offered and "Use the button below" in text
    text, offered = describe(recipe, studio, {}, studio.admin_refusal("bob", SWITCH))
    assert not offered and "Use the button below" not in text
    assert (
        "Only an admin can switch the studio to a recipe's model and deploy config; logged in as bob." in text
    )


def test_a_shared_studio_keeps_needing_a_key_after_its_last_account_goes(store: RunStore) -> None:
    """`--share` with accounts generates no API key (launch sets ``accounts_required``): removing the last
    account must not open the public API. Unshared, a studio without accounts is open again, as before."""
    for required in (True, False):
        state = ServingState(None, ServingOptions())
        state.accounts = Accounts(store)
        state.accounts_required = required
        client = TestClient(create_app(state))
        state.accounts.add_user("alice", PASSWORD)
        key = state.accounts.create_key("alice").key
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=bearer(key)).status_code != 401
        state.accounts.remove_user("alice")
        if required:
            assert client.get("/v1/models").status_code == 401
            assert client.get("/v1/models", headers=bearer(key)).status_code == 401
            assert client.get("/metrics").status_code == 401
        else:
            assert client.get("/v1/models").status_code != 401
