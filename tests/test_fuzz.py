"""Property-based fuzzing (hypothesis) of every endpoint's body, the deploy YAML and modality strings.

Against a live ``omni-studio serve`` (tiny GLM-Image): bodies that are valid in shape with values drawn
from everything JSON can carry (wrong types, huge numbers, NaN, unicode with lone surrogates, NUL and
right-to-left marks, deep nesting, random bytes, multipart edits). Whatever arrives, the server answers
with no 5xx, every error is an OpenAI error body, every generation request becomes exactly one recorded
run, and the server is healthy afterwards. Bounded in examples, never in time: a fixed number of
derandomized examples, so every machine checks the same cases (docs/testing.md).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.servers import running_server

GENERATION_PATHS = ("/v1/chat/completions", "/v1/images/generations", "/v1/images/edits")
EXAMPLES = int(os.environ.get("OMNI_STUDIO_FUZZ_EXAMPLES", "600"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # CI runs the same inputs every time; set OMNI_STUDIO_FUZZ_EXAMPLES to go wider
    suppress_health_check=list(HealthCheck),
    database=None,
)

# Every code point, lone surrogates included (hypothesis leaves them out unless asked).
ANY_CHAR = st.characters(exclude_categories=())
TEXT = st.text(ANY_CHAR, max_size=40) | st.sampled_from(
    ["a red circle on a blue background", "\u202eevil rtl", "nul\x00byte", "lone \ud800 surrogate", "", " "]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**20, max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value (so requests get past validation and run), sometimes anything."""
    return st.one_of(valid, valid, valid, valid, JSON)


# Valid values are small, so valid requests run in well under a second on the tiny model.
GENERATION = {
    "height": field(st.sampled_from([32, 64])),
    "width": field(st.sampled_from([32, 64])),
    "size": field(st.sampled_from(["64x32", "32x64", "auto", "9" * 5000 + "x32", "64x64x64"])),
    "num_inference_steps": field(st.integers(1, 2)),
    "guidance_scale": field(st.floats(0, 5)),
    "negative_prompt": field(TEXT),
    "seed": field(st.integers(0, 2**63 - 1)),
    "n": field(st.integers(1, 2)),
    "preview_every": field(st.integers(0, 2)),
}
IMAGE_URL = st.sampled_from(
    [
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==",
        "data:image/png;base64,!!!!",
        "https://example.invalid/cat.png",
        "file:///etc/passwd",
    ]
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": IMAGE_URL})}
    ),
    JSON,
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["user", "user", "assistant", "system", "developer", "tool"])),
        "content": field(TEXT | st.lists(PART, max_size=3)),
    },
    optional={"name": TEXT, "surprise": JSON},
)
CHAT = st.fixed_dictionaries(
    {"messages": field(st.lists(MESSAGE, min_size=1, max_size=3))},
    optional={
        **GENERATION,
        "model": field(st.sampled_from(["tiny-glm-image", "gpt-4o"])),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "max_tokens": field(st.integers(1, 64)),
        "temperature": field(st.floats(0, 2)),
        "top_p": field(st.floats(0.01, 1)),
        "top_k": field(st.integers(-1, 50)),
        "modalities": field(st.lists(st.sampled_from(["image", "text", "Image", "images", ""]), max_size=2)),
        "extra_body": field(st.fixed_dictionaries({}, optional=GENERATION)),
        "unknown_field": JSON,
    },
)
# Valid throughout (any text, no surrogates): these run, so streams, n > 1 and recording get exercised.
VALID_TEXT = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40).filter(str.strip)
CHAT_VALID = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": VALID_TEXT}), min_size=1, max_size=2
        ),
        "height": st.sampled_from([32, 64]),
        "width": st.sampled_from([32, 64]),
        "num_inference_steps": st.integers(1, 2),
    },
    optional={
        "seed": st.integers(0, 2**63 - 1),
        "n": st.integers(1, 2),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "preview_every": st.integers(0, 1),
    },
)
IMAGES = st.fixed_dictionaries(
    {"prompt": field(TEXT)},
    optional={
        **GENERATION,
        "model": field(st.sampled_from(["tiny-glm-image", "dall-e-3"])),
        "response_format": field(st.sampled_from(["b64_json", "url", "png"])),
        "quality": JSON,
    },
)
DEEP = st.integers(50, 100_000).map(lambda depth: "[" * depth + "]" * depth) | st.integers(50, 100_000).map(
    lambda depth: '{"a":' * depth + "1" + "}" * depth
)
RAW_BODY = st.one_of(
    st.binary(max_size=200),
    DEEP.map(str.encode),
    JSON.map(lambda v: json.dumps(v).encode()),
)


def is_error_body(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


class Tally:
    """What the fuzzer sent and what came back."""

    def __init__(self) -> None:
        self.sent = 0
        self.generation = 0
        self.by_status: dict[int, int] = {}
        self.server_errors: list[str] = []
        self.bad_bodies: list[str] = []

    def check(self, method: str, path: str, response: httpx.Response, described: str) -> None:
        self.sent += 1
        if method == "POST" and path in GENERATION_PATHS:
            self.generation += 1
        self.by_status[response.status_code] = self.by_status.get(response.status_code, 0) + 1
        text = response.text
        if response.status_code >= 500 or '"internal_error"' in text:
            self.server_errors.append(
                f"{method} {path} {described[:300]} -> {response.status_code} {text[:300]}"
            )
        elif response.status_code >= 400 and not is_error_body(response):
            self.bad_bodies.append(
                f"{method} {path} {described[:300]} -> {response.status_code} {text[:300]}"
            )


def runs_recorded(data_dir: Path) -> int:
    from studio.store import open_store

    store = open_store(None, data_dir)
    try:
        return store.count_runs()
    finally:
        store.close()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("fuzz")
    with running_server(["serve", "--model", "tiny-glm-image"], data_dir) as server:
        yield server


def test_fuzz_endpoints_never_fail_and_lose_nothing(fuzz_server):
    tally = Tally()
    client = httpx.Client(base_url=fuzz_server.url, timeout=60)
    started = time.monotonic()
    image_png = small_png()

    # The fuzzer sends hundreds of refused requests a second, the rate the refusal throttle exists for
    # (tests/test_refusals.py); each request comes as its own client (a bearer token of its own, the
    # server has no key) so every one reaches its handler and must be recorded.
    clients = itertools.count()

    def as_new_client() -> dict[str, str]:
        return {"authorization": f"Bearer fuzz-{next(clients)}"}

    def post_json(path: str, body: object) -> None:
        payload = json.dumps(body, allow_nan=True).encode()  # ensure_ascii: surrogates travel as \ud800
        headers = {"content-type": "application/json", **as_new_client()}
        response = client.post(path, content=payload, headers=headers)
        tally.check("POST", path, response, payload.decode())

    @FUZZ_SETTINGS
    @given(
        st.one_of(
            CHAT.map(lambda b: ("chat", b)),
            CHAT_VALID.map(lambda b: ("chat", b)),
            IMAGES.map(lambda b: ("images", b)),
            st.tuples(st.sampled_from(GENERATION_PATHS[:2]), RAW_BODY).map(lambda t: ("raw", t)),
            st.tuples(
                st.dictionaries(st.sampled_from(["prompt", "n", "size", "seed", "x"]), TEXT), st.booleans()
            ).map(lambda t: ("edit", t)),
        )
    )
    def one_request(case: tuple[str, object]) -> None:
        kind, body = case
        if kind == "chat":
            post_json("/v1/chat/completions", body)
        elif kind == "images":
            post_json("/v1/images/generations", body)
        elif kind == "raw":
            path, raw = body  # type: ignore[misc]
            headers = {"content-type": "application/json", **as_new_client()}
            response = client.post(path, content=raw, headers=headers)
            tally.check("POST", path, response, repr(raw[:200]))
        else:
            fields, with_image = body  # type: ignore[misc]
            files = {"image": ("x.png", image_png if with_image else b"not an image")}
            data = {k: v.encode("utf-8", "surrogatepass") for k, v in fields.items()}
            response = client.post("/v1/images/edits", data=data, files=files, headers=as_new_client())
            tally.check("POST", "/v1/images/edits", response, repr(fields))

    one_request()
    for path in ("/health", "/v1/models", "/v1/nope", "/metrics"):
        tally.check("GET", path, client.get(path), "")
    elapsed = time.monotonic() - started
    print(
        f"\nfuzz: {tally.sent} requests ({tally.generation} generation) in {elapsed:.0f} s; "
        f"by status {dict(sorted(tally.by_status.items()))}"
    )

    assert not tally.server_errors, f"{len(tally.server_errors)} server errors:\n" + "\n".join(
        tally.server_errors[:10]
    )
    assert not tally.bad_bodies, "errors without an OpenAI error body:\n" + "\n".join(tally.bad_bodies[:10])
    assert client.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    while (
        recorded := runs_recorded(fuzz_server.data_dir)
    ) < tally.generation and time.monotonic() < deadline:
        time.sleep(0.5)
    assert recorded == tally.generation, f"{tally.generation} generation requests, {recorded} runs recorded"
    print(f"fuzz: 5xx 0; runs recorded {recorded} = generation requests")


def small_png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.text(ANY_CHAR, max_size=30))
def test_fuzz_modality_strings(text):
    """Any string parses to canonical names or raises ModalityError listing them; nothing else."""
    from engine.modality import ModalityError, OutputModality, parse_output_modalities

    try:
        parsed = parse_output_modalities(text)
    except ModalityError as exc:
        assert "text" in str(exc) and "token_ids" in str(exc)
        return
    assert parsed and all(isinstance(m, OutputModality) for m in parsed)
    assert "+".join(m.value for m in parsed) == text.replace(",", "+")


STAGE_KEYS = ["stage_id", "kind", "max_num_seqs", "devices", "engine_output_type", "input_sources", "backend"]


DEPLOY_DOCUMENTS = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {
            "stages": st.lists(
                st.dictionaries(st.sampled_from(STAGE_KEYS) | TEXT, JSON, max_size=4), max_size=3
            )
        }
    ),
)


def check_deploy_document(document: object) -> None:
    """``document`` (as YAML) is a valid config, or a DeployConfigError whose every problem names a stage
    of the document (its ``stage_id``, or ``#index`` when it has no usable one; ``None`` for the top level)
    and a key that is there (or ``stage_id``, the one required key); nothing else."""
    import yaml

    from engine.building import pipeline_config_from_text
    from engine.config import DeployConfigError, PipelineConfig
    from engine.models import describe_model

    text = yaml.safe_dump(document, allow_unicode=False)
    source = describe_model("tiny-glm-image")
    try:
        config = pipeline_config_from_text(source, text)
    except DeployConfigError as exc:
        assert exc.problems, "a DeployConfigError without a problem"
        stages = document.get("stages") if isinstance(document, dict) else None
        stages = stages if isinstance(stages, list) else []
        for problem in exc.problems:
            assert problem.message.strip() and str(problem) in exc.render()
            if problem.stage is None:
                where = document
            elif isinstance(problem.stage, int):
                given_ids = [s.get("stage_id") for s in stages if isinstance(s, dict)]
                assert problem.stage in given_ids, f"{problem}: no stage has that id in {given_ids}"
                where = stages[given_ids.index(problem.stage)]
            else:
                assert problem.stage.startswith("#"), problem
                index = int(problem.stage[1:])
                assert 0 <= index < len(stages), f"{problem}: the document has {len(stages)} stages"
                where = stages[index]
            keys = [k for k in where if isinstance(k, str)] if isinstance(where, dict) else []
            named = problem.key == "" or (problem.key == "stage_id" and where is not document)
            named = named or any(problem.key == k or problem.key.startswith(k + ".") for k in keys)
            assert named, f"{problem}: {problem.key!r} is none of the keys given there ({keys})"
        return
    assert isinstance(config, PipelineConfig) and config.stages
    given_ids = {s["stage_id"] for s in (document or {}).get("stages") or [] if isinstance(s, dict)}
    assert given_ids <= {stage.stage_id for stage in config.stages}


def test_deploy_documents_known_outcomes():
    """The property's verdicts on documents whose outcome is known: it accepts a valid config and names
    the stage and key of each problem (so a wrong stage or key in a problem fails the fuzz test below)."""
    import yaml

    from engine.building import pipeline_config_from_text
    from engine.config import DeployConfigError
    from engine.models import describe_model

    preset = (Path(__file__).parent.parent / "assets" / "deploy" / "tiny-glm-image.yaml").read_text()
    source = describe_model("tiny-glm-image")
    assert pipeline_config_from_text(source, preset).stages
    for document in (None, {}, {"stages": [{"stage_id": 0, "max_num_seqs": 2}]}):
        check_deploy_document(document)
    refused = {
        "[]": (None, ""),
        "{colour: 1}": (None, "colour"),
        "stages: [{stage_id: 0, max_num_seqs: many}]": (0, "max_num_seqs"),
        "stages: [{stage_id: 1, colour: red}]": (1, "colour"),
        "stages: [{kind: ar}]": ("#0", "stage_id"),
    }
    for text, (stage, key) in refused.items():
        with pytest.raises(DeployConfigError) as caught:
            pipeline_config_from_text(source, text)
        assert [(p.stage, p.key) for p in caught.value.problems] == [(stage, key)], text
        check_deploy_document(yaml.safe_load(text))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(DEPLOY_DOCUMENTS)
def test_fuzz_deploy_yaml(document):
    """Any YAML document is a valid config or a DeployConfigError naming stage and key; nothing else."""
    check_deploy_document(document)


# -- schemathesis over the OpenAPI document --------------------------------------------------------

# A fixed number of derandomized cases per operation, with no deadline: every machine, fast or slow, sends
# the same requests (set OMNI_STUDIO_SCHEMATHESIS_EXAMPLES to go wider).
SCHEMATHESIS_EXAMPLES = int(os.environ.get("OMNI_STUDIO_SCHEMATHESIS_EXAMPLES", "30"))


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """Tight limits: whatever valid request schemathesis builds from the document runs in a fraction of a
    second (a 4096x4096 image is a 400 here, not minutes of work)."""
    args = [
        "serve",
        "--model",
        "tiny-glm-image",
        "--max-image-side",
        "64",
        "--max-steps",
        "2",
        "--max-n",
        "2",
    ]
    args += ["--max-prompt-chars", "200", "--max-messages", "4"]
    with running_server(args, tmp_path_factory.mktemp("schemathesis")) as server:
        yield server


def test_schemathesis_over_the_openapi_document(small_server):
    """The same cases on every machine, generated from ``/openapi.json`` for every operation; no 5xx, and
    every response of an operation matches a status the document declares for it."""
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance

    schema = schemathesis.openapi.from_url(small_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 14  # 9 OpenAI-style routes (speech too) and the 5 job routes (docs/jobs.md)
    cases: dict[str, int] = {}
    statuses: dict[int, int] = {}
    failures: list[str] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=SCHEMATHESIS_EXAMPLES,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
            phases=[Phase.explicit, Phase.generate],
        )
        def check(case):
            response = case.call(base_url=small_server.url, timeout=60)
            cases[case.operation.label] = cases.get(case.operation.label, 0) + 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            try:
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance])
            except Exception as exc:  # collected: one report for the whole run
                failures.append(f"{case.operation.label}: {str(exc)[:300]}")

        check()
    print(f"schemathesis: {sum(cases.values())} cases, statuses {statuses}, per operation {cases}")
    assert set(cases) == {operation.label for operation in operations}  # every operation was called
    assert sum(cases.values()) >= len(operations) * 5
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(small_server.url + "/health").json()["status"] == "ok"
