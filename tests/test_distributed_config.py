"""Past one machine, without a cluster: the deploy keys for Ray placement and vLLM's scale-out (checked with
errors naming the key), their place in the config hash, the CLI flags, and output files in an object store
(moto's S3 server on 127.0.0.1). The Ray cluster tests are in tests/test_ray.py (docs/distributed.md)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.building import build_pipeline_config
from engine.config import DeployConfigError
from engine.engine import build_engine
from engine.models import describe_model
from studio.cli import main
from tests.servers import s3_server

SHAPES = describe_model("tiny-glm-shapes")


def problems(deploy: dict) -> list[str]:
    with pytest.raises(DeployConfigError) as info:
        build_pipeline_config(SHAPES, deploy)
    return [str(p) for p in info.value.problems]


def test_placement_keys_are_checked_with_the_key_and_the_allowed_values() -> None:
    found = problems(
        {
            "ray": {"adress": "auto", "max_restarts": -2},
            "stages": [{"stage_id": 1, "num_replicas": 0, "resources": {"GPU": 1}}],
        }
    )
    assert any(
        "ray.adress: unknown key 'adress'; allowed keys: address, max_restarts, namespace, start_timeout_s"
        in p
        for p in found
    ), found
    assert any("ray.max_restarts" in p and "greater than or equal to -1" in p for p in found), found
    assert any(p.startswith("stage 1: num_replicas") for p in found), found
    assert any("stage 1: resources" in p and "ask for GPUs with devices" in p for p in found), found
    bad_amount = problems({"stages": [{"stage_id": 1, "resources": {"node_b": 0}}]})
    assert any("resource 'node_b' must be a positive number" in p for p in bad_amount), bad_amount


def test_vllm_scale_out_keys_are_checked() -> None:
    found = problems(
        {
            "stages": [
                {
                    "stage_id": 0,
                    "backend": "transformers",
                    "tensor_parallel_size": 2,
                    "distributed_executor_backend": "ray",
                },
                {"stage_id": 1, "distributed_executor_backend": "mp"},
            ]
        }
    )
    assert (
        "stage 0: tensor_parallel_size: tensor_parallel_size 2 needs vLLM; use backend: vllm (or auto), or tensor_parallel_size: 1"
        in found
    )
    assert any(p.startswith("stage 0: distributed_executor_backend: is vLLM's executor") for p in found)
    assert any(
        p.startswith("stage 1: distributed_executor_backend: applies to AR stages on vLLM") for p in found
    )
    few_gpus = problems({"stages": [{"stage_id": 0, "devices": "0", "tensor_parallel_size": 2}]})
    assert few_gpus == [
        "stage 0: tensor_parallel_size: tensor_parallel_size 2 x pipeline_parallel_size 1 needs 2 GPUs but "
        "devices '0' lists 1; list 2 GPUs (e.g. devices: '0,1') or set distributed_executor_backend: ray to "
        "let vLLM place its workers on the Ray cluster"
    ]
    unknown = problems({"stages": [{"stage_id": 0, "distributed_executor_backend": "slurm"}]})
    assert unknown == [
        "stage 0: distributed_executor_backend: Input should be 'ray', 'mp' or 'uni' (got 'slurm')"
    ]
    # With Ray, vLLM places its workers itself: more workers than local GPUs is fine, and the stage keeps
    # what was asked (vLLM gets 2 tensor-parallel workers on its Ray executor, GPU 0 listed locally).
    on_ray = build_pipeline_config(
        SHAPES,
        {
            "stages": [
                {
                    "stage_id": 0,
                    "devices": "0",
                    "tensor_parallel_size": 2,
                    "distributed_executor_backend": "ray",
                }
            ]
        },
    )
    args = on_ray.stage(0).engine_args
    assert (args.tensor_parallel, args.pipeline_parallel) == (2, 1)
    assert args.distributed_executor_backend == "ray" and args.placement.gpus == (0,)


def test_placement_stays_out_of_the_snapshot_and_the_hash() -> None:
    plain = build_pipeline_config(SHAPES, None)
    placed = build_pipeline_config(
        SHAPES,
        {
            **_preset(),
            "ray": {"address": "auto", "namespace": "team-a"},
            "stages": [
                {**_preset()["stages"][0], "resources": {"node_a": 1}},
                {**_preset()["stages"][1], "num_replicas": 2, "resources": {"dit": 1}},
            ],
        },
    )
    # Where a stage runs changes no output: the snapshot (and so the hash and PNG recipes) is the same.
    assert placed.to_dict() == plain.to_dict() and placed.config_hash() == plain.config_hash()
    assert placed.stage(1).engine_args.replicas == 2 and placed.stage(1).engine_args.resources == {"dit": 1.0}
    assert "replicas=2" in placed.summary() and "resources=dit:1" in placed.summary()  # validate shows it
    assert placed.ray is not None and placed.ray.namespace == "team-a"


def _preset() -> dict:
    import yaml

    from engine.paths import DEPLOY_PRESETS_DIR

    return yaml.safe_load((DEPLOY_PRESETS_DIR / "tiny-glm-shapes.yaml").read_text())


def test_a_ray_section_without_an_address_is_refused_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(DeployConfigError) as info:
        build_engine("tiny-glm-shapes", {**_preset(), "ray": {"namespace": "x"}}, data_dir=tmp_path)
    assert "ray.address" in str(info.value) and "--ray-address" in str(info.value)


def test_cli_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for command in ("serve", "ui"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert (
            "--ray-address ADDR" in out and "--outputs URL|DIR" in out and "--outputs-option KEY=VALUE" in out
        )
    deploy = tmp_path / "ray.yaml"
    deploy.write_text(
        "ray: {address: auto}\nstages:\n- {stage_id: 1, num_replicas: 2, resources: {dit: 1}}\n"
    )
    assert main(["validate", str(deploy), "--model", "tiny-glm-shapes"]) == 0
    assert main(["history", "ls", "--data-dir", str(tmp_path), "--outputs-option", "endpoint_url"]) != 0
    assert "--outputs-option takes KEY=VALUE" in capsys.readouterr().err


@pytest.mark.vllm
def test_vllm_gets_the_scale_out_args(model_cache: Path) -> None:
    pytest.importorskip("vllm")
    from engine.models import materialize
    from engine.pipelines.glm_image.ar_vllm import VllmGlmImageARStage

    source = materialize(SHAPES, model_cache)
    config = build_pipeline_config(
        source,
        {
            "stages": [
                {
                    "stage_id": 0,
                    "backend": "vllm",
                    "devices": "cpu",
                    "tensor_parallel_size": 2,
                    "pipeline_parallel_size": 2,
                    "distributed_executor_backend": "ray",
                }
            ]
        },
    )
    import torch

    stage = VllmGlmImageARStage(config.stage(0), source.path, torch.device("cpu"))
    args = stage.engine_args("inproc")
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
    assert args.distributed_executor_backend == "ray"


# -- output files in an object store ---------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint():
    with s3_server("shared") as endpoint:
        yield endpoint


def test_output_files_in_an_object_store_are_shared_between_studios(s3_endpoint: str, tmp_path: Path) -> None:
    from studio.store.object_files import ObjectStoreFiles, open_output_files

    options = [("endpoint_url", s3_endpoint)]
    one = open_output_files(tmp_path / "one", "s3://shared/outputs", options)
    two = open_output_files(tmp_path / "two", "s3://shared/outputs", options)
    assert isinstance(one, ObjectStoreFiles)
    data = b"\x89PNG not really"
    sha, path = one.write(data)
    assert path.read_bytes() == data and sha == hashlib.sha256(data).hexdigest()
    assert one.fs.cat_file(f"shared/outputs/{sha[:2]}/{sha}.png") == data
    # The other studio has nothing cached: the path fetches it (and find does too).
    assert two.path(sha).read_bytes() == data
    shutil.rmtree(two.root)
    assert two.find(sha) is not None and two.find(sha).read_bytes() == data  # type: ignore[union-attr]
    # Bytes in the store that do not match their name are never served.
    bogus = hashlib.sha256(b"other").hexdigest()
    one.fs.pipe_file(one.remote_path(bogus), b"tampered")
    assert not two.path(bogus).exists()
    one.remove(sha)
    shutil.rmtree(two.root)
    assert not two.path(sha).exists()
    # A local folder and the default stay plain folders.
    assert type(open_output_files(tmp_path, str(tmp_path / "out"))).__name__ == "OutputFiles"


def test_prune_sweeps_orphaned_objects_from_the_object_store(s3_endpoint: str, tmp_path: Path) -> None:
    """An object left in the bucket by a crash between upload and row goes with ``history prune``; objects
    a run refers to, and new ones (their row may be about to be written), stay."""
    from studio.store import open_store
    from studio.store.object_files import open_output_files

    files = open_output_files(tmp_path, "s3://shared/prune", [("endpoint_url", s3_endpoint)])
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}", tmp_path, files) as store:
        run_id = store.create_run(source="api", prompt="kept", model="m", request={}, parameters={})
        used = store.add_output(run_id, 0, b"referenced", "text/plain")
        store.finish_run(run_id, "succeeded")
        orphan, _ = files.write(b"left by a crash")
        assert store.prune_files() == (0, 0)  # everything is new
        time.sleep(1.1)  # S3 reports whole seconds
        assert store.prune_files(min_age_seconds=1) == (
            1,
            2 * len(b"left by a crash"),
        )  # object + cached copy
        assert not files.fs.exists(files.remote_path(orphan)) and files.find(orphan) is None
        assert files.fs.exists(files.remote_path(used, "text/plain"))
        assert store.file_path(used, "text/plain").read_bytes() == b"referenced"


def test_an_unusable_object_store_fails_at_start_naming_it(s3_endpoint: str, tmp_path: Path) -> None:
    from studio.store.errors import StoreError
    from studio.store.object_files import open_output_files

    with pytest.raises(StoreError) as info:
        open_output_files(tmp_path, "s3://no-such-bucket/x", [("endpoint_url", s3_endpoint)])
    assert "s3://no-such-bucket/x" in str(info.value) and "AWS_ENDPOINT_URL" in str(info.value)


def test_ray_is_not_imported_without_a_ray_address():
    """Embedded mode stays free of Ray: importing the studio and the engine never loads it."""
    code = (
        "import sys, engine.engine, studio.cli, studio.startup.launch, studio.store.object_files; "
        "print(json.dumps(sorted(m for m in ('ray', 's3fs') if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []
