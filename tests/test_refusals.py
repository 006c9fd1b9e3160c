"""The refused-body budget: a client flooding refused bodies gets 429s before its bodies are read; others
and well-formed requests are untouched (studio/api/refusals.py)."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from studio.api.refusals import RefusalBudget, RefusalThrottle

CHAT = "/v1/chat/completions"


def app_with_budget(budget: RefusalBudget, bodies_read: list[int]) -> RefusalThrottle:
    """A stand-in API: bodies over 100 bytes are refused (400), others answered (200)."""
    api = FastAPI()

    @api.post(CHAT)
    async def chat(request: Request) -> JSONResponse:
        body = await request.body()
        bodies_read.append(len(body))
        if len(body) > 100:
            return JSONResponse({"error": {"message": "too long", "param": "messages"}}, status_code=400)
        return JSONResponse({"ok": True})

    @api.post("/v1/other")
    async def other(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"error": {"message": "no"}}, status_code=400)

    return RefusalThrottle(api, budget)


def run(budget: RefusalBudget, steps: list[tuple[str, str, int]]) -> tuple[list[httpx.Response], list[int]]:
    bodies_read: list[int] = []
    app = app_with_budget(budget, bodies_read)

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answers = []
            for path, key, size in steps:
                headers = {"authorization": f"Bearer {key}"} if key else {}
                answers.append(await client.post(path, content=b"x" * size, headers=headers))
            return answers

    return asyncio.run(scenario()), bodies_read


def test_a_client_past_its_refused_bytes_gets_429_before_its_body_is_read():
    budget = RefusalBudget(rate=100, burst=5000)
    answers, read = run(
        budget,
        [
            (CHAT, "", 3000),  # refused: 3000 of 5000 spent
            (CHAT, "", 3000),  # refused: 1000 bytes of debt
            (CHAT, "", 3000),  # not read: 429
            (CHAT, "", 50),  # a well-formed request of the same client waits off the debt too
            (CHAT, "other-key", 3000),  # another client (its own key): its own budget
            (CHAT, "other-key", 50),
            ("/v1/other", "", 3000),  # not a generation route: never throttled
        ],
    )
    statuses = [a.status_code for a in answers]
    assert statuses == [400, 400, 429, 429, 400, 200, 400]
    throttled = answers[2]
    error = throttled.json()["error"]
    assert error["code"] == "too_many_refused" and error["type"] == "rate_limit_error"
    assert int(throttled.headers["retry-after"]) == 10  # 1000 bytes of debt at 100 bytes/s
    assert throttled.headers["connection"] == "close"
    assert read == [3000, 3000, 3000, 50]  # the two 429s read nothing (the last two: the other key)


def test_well_formed_requests_never_spend_the_budget():
    budget = RefusalBudget(rate=1, burst=100)
    answers, _ = run(budget, [(CHAT, "", 60)] * 20)
    assert {a.status_code for a in answers} == {200}


def test_the_budget_refills_with_time():
    budget = RefusalBudget(rate=1000, burst=1000)
    budget.charge("c", 1500)
    assert budget.retry_after("c") == 1
    budget._buckets["c"] = (-500, budget._buckets["c"][1] - 1.0)  # one second later
    assert budget.retry_after("c") == 0


def test_a_refused_request_is_recorded_with_its_long_strings_cut():
    from studio.store.recorder import REFUSED_TEXT_KEPT, compact_payload

    prompt = "cat " * 250_000
    kept = compact_payload({"messages": [{"role": "user", "content": prompt}], "seed": 3}, REFUSED_TEXT_KEPT)
    content = kept["messages"][0]["content"]
    assert content.startswith(prompt[:REFUSED_TEXT_KEPT])
    assert "1000000 characters in all" in content and len(content) < REFUSED_TEXT_KEPT + 200
    assert kept["seed"] == 3
    assert compact_payload({"prompt": "short"}, REFUSED_TEXT_KEPT) == {"prompt": "short"}
