"""Built-in tiny models: built offline, same bytes every build, real HF layouts loaded by from_pretrained."""

import hashlib
from pathlib import Path

import pytest

from engine.models import ModelNotFound, describe_model
from engine.tiny import BUILTIN_MODELS, COMPLETE_MARKER, build_builtin_model, ensure_builtin_model


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != COMPLETE_MARKER
    }


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builds_are_byte_identical(tmp_path, name, model_cache):
    first = build_builtin_model(name, tmp_path / "a")
    second = build_builtin_model(name, tmp_path / "b")
    assert digest(first) == digest(second)
    assert digest(first) == digest(ensure_builtin_model(name, model_cache))  # and equal to the shared cache


def test_glm_image_has_the_real_checkpoint_layout(model_cache):
    path = ensure_builtin_model("tiny-glm-image", model_cache)
    for component in (
        "vision_language_encoder",
        "processor",
        "transformer",
        "vae",
        "text_encoder",
        "tokenizer",
        "scheduler",
    ):
        assert (path / component).is_dir(), component
    assert (path / "model_index.json").is_file()
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size < 5_000_000


def test_describe_model_knows_builtins_and_folders(model_cache, tmp_path):
    assert describe_model("tiny-chat").family.name == "chat"
    assert describe_model(None).name == "tiny-glm-image"
    folder = describe_model(str(ensure_builtin_model("tiny-diffusion", model_cache)))
    assert folder.family.name == "diffusion" and not folder.builtin and folder.identity.startswith("local:")
    with pytest.raises(ModelNotFound, match="neither a built-in model"):
        describe_model(str(tmp_path / "nothing-here"))
