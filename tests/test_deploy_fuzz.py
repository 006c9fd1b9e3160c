"""No engine error from a deploy config or a sampling outcome: partial and full deploy configs of the
trained tiny-glm-shapes x request sizes either draw a picture of the size asked, or are refused with a
config problem or a request error naming the field (what the API turns into a 4xx) — never an engine
failure (a 500). Bounded: a few examples, each building an engine."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import GenerationParams, GenerationRequest, build_engine
from engine.config import DeployConfigError
from engine.request import RequestError

SIDES = st.sampled_from([64, 96, 128, 192, 256])

AR_PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0.0, 0.7, 1.0]),
        "top_k": st.sampled_from([1, 10, -1]),
        "max_tokens": st.sampled_from([50, 400, 4353]),
    },
)
DIT_PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "height": SIDES,
        "width": SIDES,
        "num_inference_steps": st.integers(1, 3),
        "guidance_scale": st.sampled_from([1.0, 2.5]),
    },
)


@st.composite
def deploy_configs(draw: st.DrawFn) -> dict:
    stages = []
    for stage_id, params in ((0, AR_PARAMS), (1, DIT_PARAMS)):
        if draw(st.booleans()):
            stage: dict = {"stage_id": stage_id}
            sampling = draw(params)
            if sampling:
                stage["default_sampling_params"] = sampling
            if stage_id == 1:
                stage["own_process"] = False  # a child process per example would cost seconds each
            stages.append(stage)
    return {"stages": stages} if stages else {}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=deploy_configs(), height=st.none() | SIDES, width=st.none() | SIDES)
def test_no_engine_error_from_a_deploy_config_or_a_size(
    tmp_path: Path, config: dict, height: int | None, width: int | None
) -> None:
    try:
        engine = build_engine("tiny-glm-shapes", config or None, data_dir=tmp_path / "data")
    except DeployConfigError:
        return  # a config problem, named per stage and key (tests/test_config.py)
    try:
        params = GenerationParams(seed=1, height=height, width=width, num_inference_steps=1)
        try:
            resolved = engine.resolve(
                GenerationRequest("a red circle on a blue background, top left", params)
            )
        except RequestError as exc:
            assert exc.field in ("height", "width", "max_tokens"), exc
            return
        result = engine.run(resolved.request)  # raises on an engine failure
        stage = resolved.stage_params[1]
        assert result.images[0].size == (stage["width"], stage["height"])
    finally:
        engine.close()
