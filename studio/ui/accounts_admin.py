"""The Serving tab's "Accounts" for an admin (docs/team.md): every user, add one, remove one.

Only an admin's events act (a user's get a refusal naming why); the work is
:class:`studio.accounts.service.Accounts`'s, as for ``omni-studio users``. A password typed here is hashed
(argon2id) and the box is cleared; it is never shown again or logged.
"""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from studio.accounts.passwords import PasswordError
from studio.controller import Studio
from studio.store.accounts import AccountError

USER_COLUMNS = ["name", "admin", "keys", "created (UTC)"]


def user_rows(studio: Studio, request: gr.Request | None) -> list[list[str]]:
    identity = studio.identity(getattr(request, "username", None))
    accounts = studio.accounts
    if accounts is None or not identity.accounts or not identity.admin:
        return []
    return [
        [u.name, "yes" if u.admin else "", str(u.keys), u.created_at.strftime("%Y-%m-%d %H:%M")]
        for u in accounts.users()
    ]


def _note(text: str, ok: bool) -> str:
    css, ident = ("omni-ok", "omni-users-done") if ok else ("omni-invalid", "omni-users-refused")
    return f"<span class='{css}' id='{ident}'>{html.escape(text)}</span>"


def build_accounts_admin(studio: Studio) -> dict[str, Any]:
    with gr.Accordion("Accounts (admins)", open=False, elem_id="omni-users"):
        table = gr.Dataframe(
            headers=USER_COLUMNS, value=[], interactive=False, label="Users", elem_id="omni-users-table"
        )
        with gr.Row():
            name = gr.Textbox(label="Name", scale=2, elem_id="omni-user-name")
            password = gr.Textbox(
                label="Password (8+ characters)", type="password", scale=2, elem_id="omni-user-password"
            )
            admin = gr.Checkbox(label="admin", scale=1, elem_id="omni-user-admin")
        with gr.Row():
            add = gr.Button("Add user", elem_id="omni-user-add")
            remove = gr.Button("Remove user (and their keys)", variant="stop", elem_id="omni-user-remove")
        status = gr.HTML("", elem_id="omni-users-status")

    def refused(request: gr.Request | None) -> str | None:
        identity = studio.identity(getattr(request, "username", None))
        if studio.accounts is None or not identity.accounts:
            return "There are no accounts yet: add the first with `omni-studio users add NAME --admin`."
        if not identity.admin:
            return "Only an admin may manage accounts."
        return None

    def on_add(name_v: str, password_v: str, admin_v: bool, request: gr.Request):
        problem = refused(request)
        if problem is None:
            assert studio.accounts is not None
            try:
                user = studio.accounts.add_user(name_v.strip(), password_v, admin=bool(admin_v))
            except (AccountError, PasswordError, ValueError) as exc:
                problem = str(exc)
            else:
                note = _note(f"Added user {user.name}" + (" (admin)." if user.admin else "."), True)
                return note, "", user_rows(studio, request)
        return _note(problem, False), "", user_rows(studio, request)

    def on_remove(name_v: str, request: gr.Request):
        problem = refused(request)
        who = name_v.strip()
        if problem is None and who == getattr(request, "username", None):
            problem = "You cannot remove the account you are logged in with."
        if problem is None:
            assert studio.accounts is not None
            try:
                studio.accounts.remove_user(who)
            except AccountError as exc:
                problem = str(exc)
            else:
                return _note(f"Removed user {who}; their runs stay in the history.", True), user_rows(
                    studio, request
                )
        return _note(problem, False), user_rows(studio, request)

    add.click(on_add, [name, password, admin], [status, password, table], api_name="add_user")
    remove.click(on_remove, [name], [status, table], api_name="remove_user")

    def refresh(request: gr.Request) -> tuple[list[list[str]]]:
        return (user_rows(studio, request),)

    return {"refresh": refresh, "refresh_outputs": [table]}
