"""`omni-studio validate`: exit 0 with a summary, or non-zero with every problem named by stage and key."""

from pathlib import Path

import pytest
import yaml

from studio.cli import main
from tests.conftest import SEED_DEPLOY


def write(tmp_path: Path, data) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def test_seed_deploy_validates_with_a_summary(capsys):
    assert main(["validate", str(SEED_DEPLOY)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out
    assert "stage 0  ar" in out and "stage 1  diffusion" in out
    assert "processor=ar2diffusion" in out and "config hash" in out


def test_check_devices_reports_missing_gpus_with_a_hint(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["validate", str(SEED_DEPLOY), "--check-devices"]) == 1
    err = capsys.readouterr().err
    assert "stage 0: devices" in err and "stage 1: devices" in err and "devices: cpu" in err


def test_devices_flag_places_every_stage_whatever_the_deploy_config_says(tmp_path, capsys):
    """--devices cpu runs a GPU deploy config unchanged on this CPU (README, "Serving your own model"):
    every stage, listed or not, is placed there; a malformed value names the key and what it takes."""
    gpu_only = write(tmp_path, {"stages": [{"stage_id": 0, "devices": "7"}]})  # no machine here has 8 GPUs
    assert main(["validate", gpu_only, "--check-devices"]) == 1
    assert "stage 0: devices" in capsys.readouterr().err
    assert main(["validate", gpu_only, "--check-devices", "--devices", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("devices=cpu") == 2, out  # stage 1 too, which the document leaves out
    assert main(["validate", gpu_only, "--devices", "a-gpu"]) == 1
    err = capsys.readouterr().err
    assert "devices" in err and "'auto', 'cpu' or GPU indices" in err, err


@pytest.mark.parametrize("spelling", ["text", "token_ids", "text+token_ids", "token_ids,text"])
def test_every_canonical_ar_spelling_is_accepted(tmp_path, spelling, capsys):
    path = write(tmp_path, {"stages": [{"stage_id": 0, "engine_output_type": spelling}]})
    assert main(["validate", path, "--model", "tiny-chat"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("spelling", ["image", "latent", "image+latent", "latent,image"])
def test_every_canonical_diffusion_spelling_is_accepted(tmp_path, spelling, capsys):
    path = write(tmp_path, {"stages": [{"stage_id": 0, "engine_output_type": spelling}]})
    assert main(["validate", path, "--model", "tiny-diffusion"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "spelling",
    [
        "latents",
        "tokens",
        "images",
        "speech",
        "wav",
        "Image",
        "text ",
        " image",
        "text +image",
        "text+",
        "+image",
        "text,,image",
        "",
        "nonsense",
    ],
)
def test_bad_spellings_are_rejected_with_the_valid_names(tmp_path, spelling, capsys):
    path = write(tmp_path, {"stages": [{"stage_id": 0, "engine_output_type": spelling}]})
    assert main(["validate", path, "--model", "tiny-chat"]) == 1
    err = capsys.readouterr().err
    assert "stage 0: engine_output_type" in err
    assert "valid names are text, image, audio, latent, token_ids" in err


def test_duplicate_ids_and_unknown_keys_are_reported_by_name(tmp_path, capsys):
    data = yaml.safe_load(SEED_DEPLOY.read_text())
    data["stages"][1]["stage_id"] = 0
    data["stages"][0]["gpu_mem"] = 0.5
    assert main(["validate", write(tmp_path, data)]) == 1
    err = capsys.readouterr().err
    assert "duplicate stage id 0" in err
    assert "unknown key 'gpu_mem'" in err and "gpu_memory_utilization" in err


def test_unknown_model_is_a_usage_error(tmp_path, capsys):
    assert main(["validate", str(SEED_DEPLOY), "--model", "no-such-model"]) == 2
    assert "neither a built-in model" in capsys.readouterr().err
