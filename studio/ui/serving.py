"""The Serving tab: fingerprint mode and value (applied at once through the handler rebuild), API key,
the exported endpoint with ready curl and Python snippets, and the share link's status. In a studio with
accounts (docs/team.md) each user makes and revokes their own API keys here (``studio/ui/user_keys.py``),
and only an admin sees or changes the ``--api-key`` and the fingerprint."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from studio.api.fingerprint import FINGERPRINT_MODES, FingerprintError
from studio.controller import API_KEY_ENV, Studio
from studio.ui.accounts_admin import build_accounts_admin
from studio.ui.user_keys import build_user_keys


def fingerprint_line(studio: Studio) -> str:
    value = studio.system_fingerprint
    shown = (
        f"<code id='omni-current-fingerprint'>{html.escape(value)}</code>"
        if value
        else "<code id='omni-current-fingerprint'>none</code>"
    )
    mode = studio.serving.options.fingerprint.mode
    return f"Responses now carry system_fingerprint {shown} (mode <b>{mode}</b>)."


def share_markdown(studio: Studio) -> str:
    share = studio.share
    lines = [f"**Local:** {studio.base_url or '(starting)'} — API at `{studio.base_url.rstrip('/')}/v1`"]
    if not share.requested:
        lines.append(
            "**Share link:** off (start with `--share` to get a public link for the UI and the API)."
        )
    else:
        lines.append(f"**Share link:** {share.url or 'not available'} {share.message}")
        if share.accounts:
            lines.append("**UI login:** each user's own account; API: each user's own key (below).")
        elif share.username:
            lines.append(f"**UI login:** `{share.username}` / `{share.password}`")
        if share.api_key_generated:
            lines.append(
                "**API key** was generated because the API must not be public without one (shown below)."
            )
    return "\n\n".join(lines)


def key_hint_markdown(studio: Studio) -> str:
    """Where the snippets' API key comes from (they never show the key itself)."""
    model = studio.serving.served_model_name
    supported = studio.engine.card.describe()
    about = f"For **{model}**" + (f" (supports {supported})" if supported else "") + ", with its defaults."
    if studio.api_key:
        return (
            about + f" The snippets read the API key from `${API_KEY_ENV}`: `export {API_KEY_ENV}=…` first."
        )
    return about


def _admin_only(studio: Studio, request: gr.Request | None) -> str | None:
    """Why this visitor may not change the studio's settings (``None``: they may): with accounts, only an
    admin may (docs/team.md)."""
    identity = studio.identity(getattr(request, "username", None))
    if identity.accounts and not identity.admin:
        return "Only an admin may change this in a studio with accounts."
    return None


def build_serving_tab(studio: Studio) -> dict[str, Any]:
    current = studio.serving.options.fingerprint
    team = studio.accounts is not None and studio.accounts.configured()
    with gr.Row(equal_height=False):
        with gr.Column():
            gr.Markdown("### Fingerprint")
            mode = gr.Radio(
                list(FINGERPRINT_MODES),
                value=current.mode,
                label="--fingerprint-mode",
                elem_id="omni-fp-mode",
            )
            value = gr.Textbox(
                current.value or "", label="--fingerprint-value (custom mode only)", elem_id="omni-fp-value"
            )
            apply = gr.Button("Apply fingerprint", variant="primary", elem_id="omni-fp-apply")
            fingerprint = gr.HTML(fingerprint_line(studio), elem_id="omni-fp-status")
            gr.Markdown("### API key")
            key = gr.Textbox(
                "" if team else studio.api_key or "",  # with accounts: never in the page of a non-admin
                type="password",
                label="Bearer key required on /v1/* (empty: open)",
                elem_id="omni-api-key",
            )
            set_key = gr.Button("Set API key")
            key_status = gr.Markdown("")
            user_keys = build_user_keys(studio)
            users = build_accounts_admin(studio)
        with gr.Column():
            gr.Markdown("### Endpoint")
            share = gr.Markdown(share_markdown(studio), elem_id="omni-share")
            key_hint = gr.Markdown(key_hint_markdown(studio), elem_id="omni-snippet-key")
            curl_snippet, python_snippet = studio.snippets()
            curl = gr.Code(curl_snippet, language="shell", label="curl", interactive=False)
            python = gr.Code(
                python_snippet, language="python", label="Python (openai SDK)", interactive=False
            )

    def on_apply(mode_v: str, value_v: str, request: gr.Request):
        refused = _admin_only(studio, request)
        if refused:
            return f"<div class='omni-invalid'>{html.escape(refused)}</div>"
        try:
            studio.set_fingerprint(mode_v, value_v.strip() or None if mode_v == "custom" else None)
        except FingerprintError as exc:
            return f"<div class='omni-invalid'>{html.escape(str(exc))}</div>"
        return fingerprint_line(studio)

    apply.click(on_apply, [mode, value], [fingerprint], api_name="set_fingerprint")

    def on_key(key_v: str, request: gr.Request):
        refused = _admin_only(studio, request)
        if refused:
            curl_v, python_v = studio.snippets()
            return refused, curl_v, python_v, key_hint_markdown(studio)
        studio.set_api_key(key_v.strip() or None)
        curl_v, python_v = studio.snippets()
        return (
            (
                "API key set: `/v1/*` now needs `Authorization: Bearer …`."
                if key_v.strip()
                else "No API key: `/v1/*` is open."
            ),
            curl_v,
            python_v,
            key_hint_markdown(studio),
        )

    set_key.click(on_key, [key], [key_status, curl, python, key_hint], api_name="set_api_key")

    def refresh(request: gr.Request):
        curl_v, python_v = studio.snippets()
        return (
            fingerprint_line(studio),
            share_markdown(studio),
            curl_v,
            python_v,
            key_hint_markdown(studio),
            *user_keys["refresh"](request),
            *users["refresh"](request),
        )

    outputs = [
        fingerprint,
        share,
        curl,
        python,
        key_hint,
        *user_keys["refresh_outputs"],
        *users["refresh_outputs"],
    ]
    return {"refresh": refresh, "refresh_outputs": outputs}
