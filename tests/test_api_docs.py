"""The API as documented: `/openapi.json` passes openapi-spec-validator and declares every body, parameter
and the bearer scheme; `/docs` renders offline (assets served by the studio, every other host
blocked) in `serve` and `ui` mode; signed output URLs; the client's field path in every 400."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate
from pydantic import ValidationError

from studio.api.app import API_ROUTES, create_app
from studio.api.errors import from_validation_error
from studio.api.protocol import ChatCompletionRequest
from studio.api.signing import URLSigner, load_secret
from studio.api.state import ServingOptions, ServingState
from tests.servers import running_server


@pytest.fixture(scope="module")
def document() -> dict:
    client = TestClient(create_app(ServingState(None, ServingOptions(api_key="k"))))
    response = client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_the_document_passes_openapi_spec_validator(document):
    validate(document)  # raises on an invalid document
    assert document["openapi"].startswith("3.1")


def test_every_route_is_documented_with_bodies_parameters_and_security(document):
    paths = document["paths"]
    for method, path, name, _, auth in API_ROUTES:
        operation = paths[path][method.lower()]
        assert "200" in operation["responses"], name
        assert "schema" in next(iter(operation["responses"]["200"]["content"].values())), name
        for part in re.findall(r"{(\w+)}", path):
            assert any(p["name"] == part and p["in"] == "path" for p in operation["parameters"]), name
        if auth:
            assert operation["security"] == [{"bearer": []}], name
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's API key (--api-key); not needed when none is set",
    }
    chat = paths["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert chat["requestBody"]["content"]["application/json"]["example"]["messages"]
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert chat["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    request = document["components"]["schemas"]["ChatCompletionRequest"]
    assert request["additionalProperties"] is False  # unknown fields are a 400: the document says so
    assert {"messages", "image_reply", "height", "extra_body"} <= set(request["properties"])
    edits = paths["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert edits == {"$ref": "#/components/schemas/ImageEditForm"}
    outputs = paths["/v1/outputs/{name}"]["get"]
    assert {p["name"] for p in outputs["parameters"]} == {"name", "exp", "sig"}
    assert outputs["security"] == [{"bearer": []}, {}]
    assert "image/png" in outputs["responses"]["200"]["content"]
    assert paths["/v1/models/{model}"]["get"]["responses"]["200"]["content"]["application/json"][
        "schema"
    ] == {"$ref": "#/components/schemas/ModelCard"}


def test_docs_pages_point_only_at_the_studio_itself():
    client = TestClient(create_app(ServingState(None, ServingOptions())))
    for page in ("/docs",):
        html = client.get(page).text
        urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", html)
        assert urls, page
        assert all(url.startswith("/") and not url.startswith("//") for url in urls), (page, urls)
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        response = client.get(f"/docs/assets/{asset}")
        assert response.status_code == 200 and len(response.content) > 10_000, asset
    assert client.get("/docs/assets/..%2Fcore.py").status_code == 404


def test_unknown_routes_and_methods_are_openai_errors():
    client = TestClient(create_app(ServingState(None, ServingOptions())))
    missing = client.get("/v1/nothing/here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = client.delete("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        # a streamed image reply sent back as it came, plus a field a client library added
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}, "index": 0}],
            "messages[1].content[0].index",
        ),
        ([{"type": "image_url", "image_url": {"url": 5}}], "messages[1].content[0].image_url.url"),
        ([{"type": "image_url"}], "messages[1].content[0].image_url"),
        ([{"type": "text", "text": None}], "messages[1].content[0].text"),
        (5, "messages[1].content"),
    ],
)
def test_param_is_the_clients_field_path(content, param):
    body = {
        "messages": [
            {"role": "user", "content": "a cat"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": "again"},
        ]
    }
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    error = from_validation_error(caught.value, body)
    assert error.status == 400 and error.param == param, error.message
    assert "str" not in error.param.split(".") and "TextPart" not in error.message


def test_signed_urls_expire_and_resist_tampering(tmp_path):
    signer = URLSigner(load_secret(tmp_path))
    assert (tmp_path / "url-signing.key").stat().st_mode & 0o777 == 0o600
    assert load_secret(tmp_path) == load_secret(tmp_path)  # kept: URLs survive a restart
    name = "a" * 64 + ".png"
    query = dict(part.split("=") for part in signer.query(name, 60, now=1000).split("&"))
    assert query["exp"] == "1060"
    assert signer.problem(name, query["exp"], query["sig"], now=1000) is None
    assert signer.problem(name, query["exp"], query["sig"], now=1061) == "the signed URL has expired"
    assert signer.problem("b" * 64 + ".png", query["exp"], query["sig"], now=1000) is not None
    assert signer.problem(name, "1061", query["sig"], now=1000) is not None
    assert signer.problem(name, None, None) == "the URL is not signed"


# -- offline docs in a browser ----------------------------------------------------------------------


def load_offline(browser, url: str, selector: str) -> tuple[str, list[str]]:
    """Open ``url`` with every request to anything but 127.0.0.1 aborted; the text of ``selector``."""
    context = browser.new_context()
    blocked: list[str] = []

    def route(route):
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector(selector)
    text = page.inner_text("body")
    context.close()
    return text, blocked


@pytest.mark.browser
@pytest.mark.parametrize("mode", ["serve", "ui"])
def test_docs_render_offline(browser, tmp_path, mode):
    args = [mode, "--api-key", "k"] + (["--ar-backend", "transformers"] if mode == "ui" else [])
    with running_server(args, tmp_path / mode) as server:
        text, blocked = load_offline(browser, server.url + "/docs", ".opblock-summary-path")
        for path in (
            "/v1/chat/completions",
            "/v1/images/generations",
            "/v1/models/{model}",
            "/v1/outputs/{name}",
        ):
            assert path in text, path
        assert "Authorize" in text  # the bearer scheme
        assert "Omni Studio API" in text
    assert not blocked, blocked
