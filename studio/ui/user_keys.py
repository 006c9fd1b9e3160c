"""The Serving tab's "Your API keys": a logged-in user makes and revokes their own keys (docs/team.md).

A new key is shown once, in the page of the user who made it; the store keeps its sha256 only. An admin sees
and may revoke every user's keys. Everything here calls :class:`studio.accounts.service.Accounts`, as the
``omni-studio keys`` command does.
"""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from studio.accounts.identity import Identity
from studio.controller import Studio
from studio.store.accounts import AccountError

KEY_COLUMNS = ["id", "user", "name", "created (UTC)", "revoked"]


def key_rows(studio: Studio, identity: Identity) -> list[list[str]]:
    accounts = studio.accounts
    if accounts is None or not identity.accounts:
        return []
    keys = accounts.keys(None if identity.sees_all else identity.name or " nobody")
    return [k.table_row() for k in keys]


def keys_intro(identity: Identity) -> str:
    if not identity.accounts:
        return (
            "No accounts: the studio has one identity (`--auth`, `--api-key`). Add users with "
            "`omni-studio users add NAME` to give each their own login and keys (docs/team.md)."
        )
    if identity.name is None:
        return "Logged in as the operator (admin): every user's keys are listed; log in as an account to make keys."
    whose = "every user's keys (you are an admin)" if identity.admin else "your keys"
    return f"Logged in as **{html.escape(identity.name)}**: {whose}. A new key is shown once: copy it then."


def _note(text: str, ok: bool) -> str:
    css, ident = ("omni-ok", "omni-keys-done") if ok else ("omni-invalid", "omni-keys-refused")
    return f"<span class='{css}' id='{ident}'>{html.escape(text)}</span>"


def build_user_keys(studio: Studio) -> dict[str, Any]:
    gr.Markdown("### Your API keys")
    intro = gr.Markdown("", elem_id="omni-keys-intro")
    table = gr.Dataframe(
        headers=KEY_COLUMNS, value=[], interactive=False, label="API keys", elem_id="omni-keys-table"
    )
    with gr.Row():
        label = gr.Textbox(label="New key's name (optional)", scale=3, elem_id="omni-key-label")
        create = gr.Button("Create key", scale=1, elem_id="omni-key-create")
    new_key = gr.Textbox(
        label="The new key (shown only now)", interactive=False, elem_id="omni-new-key", buttons=["copy"]
    )
    with gr.Row():
        key_id = gr.Textbox(label="Key id to revoke", scale=3, elem_id="omni-key-id")
        revoke = gr.Button("Revoke key", variant="stop", scale=1, elem_id="omni-key-revoke")
    status = gr.HTML("", elem_id="omni-keys-status")

    def refresh(request: gr.Request) -> tuple[str, list[list[str]]]:
        identity = studio.identity(getattr(request, "username", None))
        return keys_intro(identity), key_rows(studio, identity)

    def on_create(name: str, request: gr.Request):
        identity = studio.identity(getattr(request, "username", None))
        accounts = studio.accounts
        if accounts is None or not identity.accounts or identity.name is None:
            return _note("Log in with an account to make API keys.", False), "", key_rows(studio, identity)
        try:
            made = accounts.create_key(identity.name, name.strip() or None)
        except (AccountError, ValueError) as exc:
            return _note(str(exc), False), "", key_rows(studio, identity)
        message = f"Made key {made.record.id}: copy it now, it is not shown again."
        return _note(message, True), made.key, key_rows(studio, identity)

    def on_revoke(ident: str, request: gr.Request):
        identity = studio.identity(getattr(request, "username", None))
        accounts = studio.accounts
        if accounts is None or not identity.accounts:
            return _note("There are no accounts, so no keys to revoke.", False), key_rows(studio, identity)
        try:
            key = accounts.revoke_key(ident, None if identity.sees_all else identity.name or " nobody")
        except AccountError as exc:
            return _note(str(exc), False), key_rows(studio, identity)
        return _note(f"Revoked key {key.id} of {key.user}: refused from now on.", True), key_rows(
            studio, identity
        )

    create.click(on_create, [label], [status, new_key, table], api_name="create_key")
    revoke.click(on_revoke, [key_id], [status, table], api_name="revoke_key")
    return {"refresh": refresh, "refresh_outputs": [intro, table]}
