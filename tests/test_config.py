"""Deploy configs: the seed file loads unchanged; every problem is reported at once with stage and key."""

from pathlib import Path

import pytest
import yaml

from engine.building import build_pipeline_config, device_problems
from engine.config import (
    DeployConfigError,
    load_deploy_config,
    load_deploy_file,
    parse_deploy_config,
    parse_deploy_file,
    resolve_pipeline_config,
)
from engine.models import describe_model
from engine.paths import DEPLOY_PRESETS_DIR
from engine.pipelines import get_family
from tests.conftest import SEED_DEPLOY

GLM = get_family("glm-image")


def resolve(data, family=GLM):
    deploy, problems = parse_deploy_config(data)
    return resolve_pipeline_config(deploy, family.name, family.templates, "m", "id", prior_problems=problems)


def problems_of(data, family=GLM) -> list[str]:
    with pytest.raises(DeployConfigError) as info:
        resolve(data, family)
    return [str(p) for p in info.value.problems]


def seed() -> dict:
    return yaml.safe_load(SEED_DEPLOY.read_text())


def test_seed_deploy_yaml_loads_unchanged():
    config = build_pipeline_config(describe_model("tiny-glm-image"), SEED_DEPLOY)
    ar, dit = config.stages
    assert (ar.kind, dit.kind) == ("ar", "diffusion")
    assert ar.engine_args.gpu_memory_utilization == 0.5
    assert ar.engine_args.max_model_len == 32768
    assert ar.engine_args.devices == "0"
    assert ar.default_sampling_params == {
        "temperature": 0.9,
        "top_p": 0.75,
        "top_k": 16512,
        "stop_token_ids": [16385],
        "max_tokens": 4353,
        "seed": 42,
        "detokenize": False,
    }
    assert dit.default_sampling_params["num_inference_steps"] == 50
    assert dit.input_processor == "ar2diffusion" and dit.input_sources == (0,)
    assert ar.engine_output_type == "token_ids" and dit.final_output


def test_config_hash_is_stable_and_changes_with_any_setting():
    a = resolve(seed())
    assert a.config_hash() == resolve(seed()).config_hash()
    changed = seed()
    changed["stages"][1]["default_sampling_params"]["num_inference_steps"] = 49
    assert resolve(changed).config_hash() != a.config_hash()
    assert len(a.hash8) == 8


def test_gpu_config_validates_on_a_cpu_machine_but_devices_are_checked_on_request():
    config = resolve(seed())
    problems = device_problems(config)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert [p.stage for p in problems] == [0, 1]
    assert "devices: cpu" in str(problems[0]) and "no GPU" in str(problems[0])


def test_unknown_keys_are_reported_by_name_with_the_allowed_keys():
    data = seed()
    data["stages"][0]["max_num_seq"] = 1
    data["stages"][1]["default_sampling_params"]["num_steps"] = 3
    data["speculative"] = True
    problems = problems_of(data)
    assert any(
        p.startswith("stage 0: max_num_seq: unknown key 'max_num_seq'") and "max_num_seqs" in p
        for p in problems
    )
    assert any(
        p.startswith("stage 1: default_sampling_params.num_steps: unknown key") and "num_inference_steps" in p
        for p in problems
    )
    assert any(p.startswith("config: speculative: unknown key") for p in problems)


def test_wrong_types_and_out_of_range_values():
    data = seed()
    data["stages"][0]["gpu_memory_utilization"] = 1.5
    data["stages"][0]["enforce_eager"] = "yes"
    data["stages"][0]["default_sampling_params"]["top_p"] = 0
    data["stages"][1]["default_sampling_params"]["num_inference_steps"] = "50"
    data["stages"][1]["max_num_seqs"] = 0
    problems = problems_of(data)
    assert len(problems) == 5  # every problem at once
    text = "\n".join(problems)
    assert "stage 0: gpu_memory_utilization: Input should be less than or equal to 1" in text
    assert "stage 0: enforce_eager: Input should be a valid boolean" in text
    assert "stage 0: default_sampling_params.top_p: Input should be greater than 0" in text
    assert "stage 1: default_sampling_params.num_inference_steps: Input should be a valid integer" in text
    assert "stage 1: max_num_seqs: Input should be greater than or equal to 1" in text


def test_ar_sampling_keys_are_checked_against_the_stage_kind():
    data = seed()
    data["stages"][1]["default_sampling_params"]["top_k"] = 5  # an AR key on the diffusion stage
    assert any("stage 1: default_sampling_params.top_k: unknown key" in p for p in problems_of(data))


def test_no_stages():
    assert problems_of({"stages": []}) == ["config: stages: no stages: the list is empty"]


def test_duplicate_ids():
    data = seed()
    data["stages"][1]["stage_id"] = 0
    assert "stage 0: stage_id: duplicate stage id 0" in problems_of(data)


def test_missing_and_self_input_sources():
    data = seed()
    data["stages"][1]["input_sources"] = [7]
    assert any("stage 1: input_sources: input source 7 is not a stage" in p for p in problems_of(data))
    data["stages"][1]["input_sources"] = [1]
    assert any("stage 1: input_sources: a stage cannot take its own output" in p for p in problems_of(data))


def test_no_entry_and_no_terminal_stage():
    data = seed()
    data["stages"][0]["input_sources"] = [1]
    assert any("no entry stage" in p for p in problems_of(data))
    data = seed()
    data["stages"][1]["final_output"] = False
    assert any("no terminal stage" in p for p in problems_of(data))


def test_extra_stage_must_spell_its_kind():
    data = seed()
    data["stages"].append({"stage_id": 2, "input_sources": [1]})
    assert any("stage 2: kind: stage is not in the built-in topology" in p for p in problems_of(data))


def test_kind_cannot_contradict_the_model_family():
    data = seed()
    data["stages"][0]["kind"] = "diffusion"
    assert any("stage 0: kind: this model's stage 0 is 'ar'" in p for p in problems_of(data))


def test_topology_may_be_spelled_out():
    data = seed()
    data["stages"][0].update(kind="ar", input_sources=[], engine_output_type="token_ids", final_output=False)
    data["stages"][1].update(
        kind="diffusion",
        input_sources=[0],
        input_processor="ar2diffusion",
        engine_output_type="image",
        final_output=True,
        final_output_type="image",
    )
    config = resolve(data)
    assert config.config_hash() == resolve(seed()).config_hash()


@pytest.mark.parametrize(
    ("value", "family"),
    [
        ("text", "chat"),
        ("token_ids", "chat"),
        ("token_ids+text", "chat"),
        ("image", "diffusion"),
        ("latent", "diffusion"),
        ("latent+image", "diffusion"),
    ],
)
def test_every_canonical_spelling_passes_validation(value, family):
    config = resolve({"stages": [{"stage_id": 0, "engine_output_type": value}]}, get_family(family))
    assert [(s.stage_id, s.engine_output_type) for s in config.stages] == [(0, value)]


@pytest.mark.parametrize(
    ("value", "unsupported"), [("audio", "audio"), ("text+image", "image"), ("image,text", "image")]
)
def test_a_modality_the_stage_kind_cannot_produce_is_named_with_stage_key_and_allowed_values(
    value, unsupported
):
    # The spelling parses; the capability check names the stage, the key, the kind and what it can produce.
    problems = problems_of({"stages": [{"stage_id": 0, "engine_output_type": value}]}, get_family("chat"))
    assert problems == [
        f"stage 0: engine_output_type: an AR stage cannot produce {unsupported}; "
        "allowed: token_ids, text (or a '+' combination)"
    ]


@pytest.mark.parametrize(
    "value",
    [
        "latents",
        "tokens",
        "images",
        "speech",
        "wav",
        "Image",
        " text",
        "text ",
        "text+",
        "+image",
        "text,,image",
        "",
    ],
)
def test_bad_modality_spellings_fail_validation_listing_valid_names(value):
    problems = problems_of({"stages": [{"stage_id": 0, "engine_output_type": value}]}, get_family("chat"))
    assert len(problems) == 1
    assert problems[0].startswith("stage 0: engine_output_type:")
    assert "valid names are text, image, audio, latent, token_ids" in problems[0]


def test_backend_key_is_validated():
    data = seed()
    data["stages"][0]["backend"] = "tensorrt"
    assert any(
        "stage 0: backend: Input should be 'auto', 'vllm' or 'transformers'" in p for p in problems_of(data)
    )
    data = seed()
    data["stages"][1]["backend"] = "vllm"
    assert any("stage 1: backend: backend applies to AR stages only" in p for p in problems_of(data))


def test_yaml_errors_and_non_mapping(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n")
    with pytest.raises(DeployConfigError, match="not valid YAML"):
        load_deploy_file(bad)
    with pytest.raises(DeployConfigError, match="must be a mapping"):
        load_deploy_config(["stages"])
    with pytest.raises(DeployConfigError, match="cannot read"):
        load_deploy_file(tmp_path / "missing.yaml")


def test_omitting_stages_uses_the_built_in_topology():
    config = resolve({})
    assert [s.stage_id for s in config.stages] == [0, 1]


def test_key_problems_and_topology_problems_come_in_one_report():
    data = seed()
    data["stages"][0]["tempreature"] = 1.0
    data["stages"][1]["input_sources"] = [3]
    data["stages"][1]["default_sampling_params"]["guidance_scale"] = -1
    problems = problems_of(data)
    assert len(problems) == 3
    assert any("tempreature" in p for p in problems)
    assert any("input source 3 is not a stage" in p for p in problems)
    assert any("guidance_scale" in p for p in problems)


# Config hashes computed before engine args became a typed StageEngineArgs: the canonical JSON (and so the
# hash in fingerprints and recorded history) must not change with the engine's internals. The model
# identity is pinned so library upgrades (which change a built model's identity) leave these alone.
# The tiny GLM presets' hashes changed on purpose: stage 1 went from max_num_seqs 1 to 8, then tiny-glm-shapes'
# to 4 when its DiT moved to a process of its own (docs/batching.md).
PINNED_PRESET_HASHES = {
    "tiny-glm-image": ("glm-image", "2d282bf4a99214adbbb1a4a5f1feca86e2cb1e1fab4fe318a94fcec6a451c000"),
    "tiny-glm-shapes": ("glm-image", "7ff65103f1a43f85c723cf3e828e8df441a1c89c20c5df8875433f753845c9a4"),
    "tiny-chat": ("chat", "877bcc741684e4932544d255ad112ae142ae7d1e83d13857c83c1df8899ce36c"),
    "tiny-diffusion": ("diffusion", "632bde1dbe796d4440d2dbb3b5e1693582c74de3f030121c6ef7e041bc8ce9d8"),
    "glm-image-1gpu": ("glm-image", "25d41fb96a2f6d33ac125b38a88fab9cac950db54f89acebcdff0015720bd768"),
    "glm-image-2gpu": ("glm-image", "8288d26d4b31af0ee918669a0bea95a69c593f0b9545c2670204cca75ceb38b8"),
}


@pytest.mark.parametrize("preset", sorted(PINNED_PRESET_HASHES))
def test_config_hash_of_each_preset_is_pinned(preset):
    family_name, expected = PINNED_PRESET_HASHES[preset]
    family = get_family(family_name)
    deploy, problems = parse_deploy_file(DEPLOY_PRESETS_DIR / f"{preset}.yaml")
    config = resolve_pipeline_config(
        deploy, family.name, family.templates, preset, f"builtin:{preset}:pinned", prior_problems=problems
    )
    assert config.config_hash() == expected


def test_own_process_is_placement_and_leaves_the_hash_alone():
    """Where a stage runs changes no output, so neither the hash nor the fingerprint (docs/batching.md)."""
    family = get_family("glm-image")
    hashes = set()
    for own_process in (True, False, None):
        data = yaml.safe_load((DEPLOY_PRESETS_DIR / "tiny-glm-shapes.yaml").read_text())
        data["stages"][1]["own_process"] = own_process
        deploy, problems = parse_deploy_config(data)
        config = resolve_pipeline_config(
            deploy, family.name, family.templates, "m", "builtin:m:pinned", prior_problems=problems
        )
        assert config.stages[1].engine_args.own_process is own_process
        hashes.add(config.config_hash())
    assert len(hashes) == 1
    _, problems = parse_deploy_config({"stages": [{"stage_id": 0, "own_process": "yes"}]})
    assert any("own_process" in str(p) for p in problems)


def test_config_hash_with_explicit_nulls_and_overrides_is_pinned():
    """A deploy file's ``null`` stays in the resolved config (and its hash) while runners use defaults."""
    deploy, problems = parse_deploy_config(
        {
            "async_chunk": True,
            "stages": [
                {
                    "stage_id": 0,
                    "devices": 0,
                    "max_num_seqs": None,
                    "enforce_eager": None,
                    "max_model_len": 4096,
                    "dtype": "bfloat16",
                },
                {"stage_id": 1, "devices": "cpu", "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2},
            ],
        }
    )
    config = resolve_pipeline_config(deploy, GLM.name, GLM.templates, "x", "id", prior_problems=problems)
    assert (
        config.canonical_json()
        == '{"async_chunk":true,"family":"glm-image","model":{"identity":"id","name":"x"},"stages":[{"backend":"auto","default_sampling_params":{"detokenize":false,"max_tokens":16384},"engine_args":{"devices":"0","dtype":"bfloat16","enable_prefix_caching":false,"enforce_eager":null,"gpu_memory_utilization":0.9,"kv_cache_memory_bytes":null,"max_model_len":4096,"max_num_batched_tokens":null,"max_num_seqs":null,"pipeline_parallel_size":1,"tensor_parallel_size":1,"trust_remote_code":false},"engine_output_type":"token_ids","final_output":false,"final_output_type":null,"input_processor":null,"input_sources":[],"kind":"ar","stage_id":0},{"backend":"auto","default_sampling_params":{"guidance_scale":1.5,"height":1024,"num_inference_steps":50,"width":1024},"engine_args":{"devices":"cpu","dtype":"auto","enable_prefix_caching":false,"enforce_eager":true,"gpu_memory_utilization":0.5,"kv_cache_memory_bytes":null,"max_model_len":null,"max_num_batched_tokens":null,"max_num_seqs":1,"pipeline_parallel_size":1,"tensor_parallel_size":2,"trust_remote_code":false},"engine_output_type":"image","final_output":true,"final_output_type":"image","input_processor":"ar2diffusion","input_sources":[0],"kind":"diffusion","stage_id":1}]}'
    )
    assert config.config_hash() == "d568f4864821e73d82e31f63078a7a871257e56789dfa240ee9aca08f0865a76"
    ar, dit = config.stages
    assert ar.engine_args.max_num_seqs is None and ar.engine_args.batch_size == 1
    assert ar.engine_args.placement.gpus == (0,) and dit.engine_args.placement.is_cpu
    assert config.tensor_parallel_size == 2


def test_shipped_shapes_model_config_hash_is_pinned():
    """tiny-glm-shapes' files ship in the repository, so its full config hash (identity included) is stable."""
    source = describe_model("tiny-glm-shapes")
    assert source.identity == "builtin:tiny-glm-shapes:7ecf37a2c8e6"
    assert (
        build_pipeline_config(source, None).config_hash()
        == "aa1857222cbc1ef4063ca8ac0426d28f7462b8ad47b3b8dc21892202f71d2577"
    )
    assert (
        build_pipeline_config(source, None, "vllm").config_hash()
        == "23b81d36911f4bbbd9ba55295935ab58e785a2ee58ce8b75ab67c33cb99d9ab2"
    )


def test_deploy_text_that_is_a_plain_string_is_not_read_as_a_path(tmp_path):
    """The Pipeline tab validates YAML *text*: a document that is just a path is a config problem, and
    the file it names is not read (it once was: a parsed string went down the deploy-file path)."""
    from engine.building import pipeline_config_from_text

    real = tmp_path / "deploy.yaml"
    real.write_text("stages:\n- stage_id: 0\n  max_num_seqs: 2\n")
    with pytest.raises(DeployConfigError) as caught:
        pipeline_config_from_text(describe_model("tiny-glm-image"), str(real))
    assert "must be a mapping, got str" in caught.value.render()
    for text in ("\ud800", "\x00", "'just text'"):
        with pytest.raises(DeployConfigError):
            pipeline_config_from_text(describe_model("tiny-glm-image"), text)
