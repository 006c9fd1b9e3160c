"""Memory before loading (docs/memory.md): each stage's weights from the safetensors headers, the KV cache of
AR stages, a margin, per device; what the estimate says against what loading really takes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from engine.building import build_pipeline_config
from engine.kv_cache import kv_bytes_per_token
from engine.memory_estimate import (
    CheckpointError,
    DeviceBudget,
    checkpoint_files,
    component_weights,
    estimate_memory,
    read_safetensors_header,
    text_config,
)
from engine.memory_estimate.activations import PROCESS_RUNTIME_CPU
from engine.models import describe_model, materialize
from tests.conftest import REPO_ROOT, tiny_deploy

MIB, GIB = 1 << 20, 1 << 30
PLENTY = DeviceBudget(1 << 40, 1 << 40)  # a pretend device that holds anything


def built(model: str, model_cache: Path):
    return materialize(describe_model(model), model_cache)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a loaded module's checkpoint tensors (state_dict, each storage once: tied weights share)."""
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in module.state_dict().values()}.values())


# -- reading the headers --------------------------------------------------------------------------


def test_header_of_a_handmade_file_gives_every_tensor_dtype_and_shape(tmp_path):
    tensors = {
        "w": torch.zeros(3, 5, dtype=torch.float32),
        "b": torch.zeros(7, dtype=torch.bfloat16),
        "h": torch.zeros(2, 2, 2, dtype=torch.float16),
        "ids": torch.zeros(4, dtype=torch.int64),
        "scalar": torch.tensor(1.0),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    headers = {t.name: t for t in read_safetensors_header(tmp_path / "model.safetensors")}
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
    assert set(headers) == set(tensors)  # __metadata__ is not a tensor
    for name, tensor in tensors.items():
        assert headers[name].shape == tuple(tensor.shape)
        assert names[headers[name].dtype] == tensor.dtype
        assert headers[name].nbytes == tensor.numel() * tensor.element_size()

    weights = component_weights(tmp_path, ".")
    assert weights is not None
    assert weights.params == sum(t.numel() for t in tensors.values())
    assert weights.file_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    # Loaded as bfloat16, every floating tensor takes 2 bytes; the int64 ids keep their 8.
    floats = sum(t.numel() for n, t in tensors.items() if n != "ids")
    assert weights.loaded_bytes(torch.bfloat16) == floats * 2 + 4 * 8


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    save_file({"a": torch.zeros(10, 10)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(4, dtype=torch.float16)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"stray": torch.zeros(1000)}, str(tmp_path / "consolidated.safetensors"))  # not in the index
    index = {
        "metadata": {"total_size": 408},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [f.name for f in checkpoint_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    weights = component_weights(tmp_path, ".")
    assert weights is not None and weights.params == 104 and weights.file_bytes == 400 + 8

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        checkpoint_files(tmp_path)


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b"not json!!!!")
    with pytest.raises(CheckpointError, match="model.safetensors: the header is not JSON"):
        read_safetensors_header(tmp_path / "model.safetensors")


# -- the estimate against a real load -------------------------------------------------------------


def test_weights_equal_the_bytes_of_the_modules_each_stage_loads(glm_engine):
    """tiny-glm-image: stage 0 loads the AR model, stage 1 the DiT, VAE and glyph encoder (not the AR half)."""
    estimate = estimate_memory(glm_engine.config, glm_engine.model.path, budgets={"cpu": PLENTY})
    by_stage = {s.stage_id: s for s in estimate.stages}
    assert [c.name for c in by_stage[0].components] == ["vision_language_encoder"]
    assert by_stage[0].weights == module_bytes(glm_engine.runners[0].model)
    pipe = glm_engine.runners[1].pipeline
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    assert {c.name for c in by_stage[1].components} == set(modules)
    assert by_stage[1].weights == sum(module_bytes(m) for m in modules.values())
    for component in by_stage[1].components:
        assert component.loaded_bytes(by_stage[1].dtype) == module_bytes(modules[component.name])


MEASURE = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch, yaml
    from engine import build_engine

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def touch(engine):
        # Weights loaded in their file's dtype on a CPU are the safetensors file, mapped: its pages join the
        # RSS when read, as serving reads them. Read every one once.
        for runner in engine.runners.values():
            pipe = getattr(runner, "pipe", None)
            modules = [getattr(runner, "model", None)] + (list(pipe.components.values()) if pipe else [])
            for module in modules:
                if isinstance(module, torch.nn.Module):
                    for tensor in module.state_dict().values():
                        tensor.sum()

    model, deploy = sys.argv[1], yaml.safe_load(sys.argv[2])
    warm = build_engine(model, deploy)  # every import and lazy module a load touches, done once
    touch(warm)
    gc.collect()
    before = rss()
    engine = build_engine(model, deploy)  # the same stages again: only their own memory is new
    touch(engine)
    gc.collect()
    print(json.dumps({"increase": rss() - before}))
    engine.close()
    warm.close()
    """
)


def measured_increase(model: str, deploy: dict) -> int:
    """RSS a second engine of ``model`` adds to a process that already built one (so imports are done)."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, model, yaml.safe_dump(deploy)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(json.loads(done.stdout.strip().splitlines()[-1])["increase"])


needs_proc = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="RSS read from /proc")


@needs_proc
def test_the_total_covers_what_loading_tiny_glm_image_takes(model_cache):
    """The bound (docs/memory.md): what loading adds to the process's RSS is at most the estimate's total.
    KV cache and activations are allocated while running, not at load, so the total is an upper bound here."""
    deploy = tiny_deploy("tiny-glm-image")
    source = built("tiny-glm-image", model_cache)
    estimate = estimate_memory(build_pipeline_config(source, deploy), source.path, budgets={"cpu": PLENTY})
    total = sum(s.total for s in estimate.stages)
    increase = measured_increase("tiny-glm-image", deploy)
    assert 0 < increase <= total, (increase, total)


def write_chat_model(folder: Path, tokenizer_from: Path) -> None:
    """A ~110 MB Llama chat model (random weights): big enough that its weights dominate the RSS of loading."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    small = json.loads((tokenizer_from / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=small["vocab_size"],
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        eos_token_id=small["eos_token_id"],
        pad_token_id=small["pad_token_id"],
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


@needs_proc
def test_estimate_brackets_the_rss_of_loading_a_model_whose_weights_dominate(tmp_path, model_cache):
    """weights <= RSS increase of loading <= total: the weights part is what loading takes at least, and
    the margin covers the rest (tokenizer, allocator, copies made while loading)."""
    folder = tmp_path / "chat-110mb"
    folder.mkdir()
    write_chat_model(folder, built("tiny-chat", model_cache).path)
    deploy = {"stages": [{"stage_id": 0, "backend": "transformers", "max_model_len": 256, "max_num_seqs": 1}]}
    config = build_pipeline_config(describe_model(str(folder)), deploy)
    estimate = estimate_memory(config, folder, budgets={"cpu": PLENTY})
    (stage,) = estimate.stages
    assert stage.weights > 100 * MIB
    increase = measured_increase(str(folder), deploy)
    assert stage.weights <= increase <= stage.total, (stage.weights, increase, stage.total)


# -- the KV cache and what to change --------------------------------------------------------------


def chat_estimate(model_cache: Path, budget: DeviceBudget, **stage0: object):
    source = built("tiny-chat", model_cache)
    config = build_pipeline_config(source, tiny_deploy("tiny-chat", stage0=dict(stage0)))
    return estimate_memory(config, source.path, budgets={"cpu": budget})


def test_a_kv_cache_too_big_for_the_device_names_max_model_len_and_max_num_seqs(model_cache):
    small = DeviceBudget(1 * GIB, 2 * GIB)  # a pretend 1 GiB free
    estimate = chat_estimate(model_cache, small, max_model_len=65536, max_num_seqs=64)
    (stage,) = estimate.stages
    config = json.loads((built("tiny-chat", model_cache).path / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    assert stage.kv_bytes == per_token * 65536 * 64  # float32 (dtype auto)

    (problem,) = estimate.problems()
    assert problem.stage == 0 and problem.key == "memory"
    message = problem.message
    # 2.4 GiB for the stage and 512 MiB for the process it runs in
    assert message.startswith("needs 2.9 GiB on cpu which has 1.0 GiB available")
    length = re.search(r"lower max_model_len from 65536 to (\d+) \(saves ([\d.]+) GiB\)", message)
    seqs = re.search(r"lower max_num_seqs from 64 to (\d+) \(saves ([\d.]+) GiB\)", message)
    assert length and seqs, message
    # Each suggestion, applied alone, fits.
    assert not chat_estimate(model_cache, small, max_model_len=int(length[1]), max_num_seqs=64).problems()
    assert not chat_estimate(model_cache, small, max_model_len=65536, max_num_seqs=int(seqs[1])).problems()
    # The same config on a device that has room is no problem.
    assert not chat_estimate(model_cache, PLENTY, max_model_len=65536, max_num_seqs=64).problems()


def test_vllm_on_a_gpu_keeps_to_gpu_memory_utilization(model_cache):
    """vLLM takes gpu_memory_utilization of the GPU at start: the stage must fit inside it (a pretend GPU)."""
    source = built("tiny-glm-image", model_cache)
    deploy = tiny_deploy(
        "tiny-glm-image",
        stage0={
            "backend": "vllm",
            "devices": "0",
            "gpu_memory_utilization": 0.1,
            "max_model_len": 65536,
            "max_num_seqs": 64,
        },
        stage1={"devices": "0"},
    )
    config = build_pipeline_config(source, deploy)
    gpu = DeviceBudget(16 * GIB, 16 * GIB)
    estimate = estimate_memory(config, source.path, budgets={"cuda:0": gpu, "cpu": PLENTY})
    problems = {p.key: p for p in estimate.problems()}
    assert set(problems) == {"gpu_memory_utilization"}, problems
    message = problems["gpu_memory_utilization"].message
    assert "vLLM keeps to gpu_memory_utilization 0.1 of its 16.0 GiB (1.6 GiB)" in message
    wanted = re.search(r"raise gpu_memory_utilization from 0.1 to (0\.\d+)", message)
    assert wanted, message
    deploy["stages"][0]["gpu_memory_utilization"] = float(wanted[1])
    raised = estimate_memory(build_pipeline_config(source, deploy), source.path, budgets={"cuda:0": gpu})
    assert not raised.problems()


def test_glm_image_kv_bytes_come_from_the_nested_text_config(model_cache):
    path = built("tiny-glm-image", model_cache).path / "vision_language_encoder" / "config.json"
    config = json.loads(path.read_text())
    text = config["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    expected = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 2
    assert kv_bytes_per_token(text_config(config), torch.bfloat16) == expected


def test_kv_bytes_from_the_json_config_agree_with_the_loaded_config(model_cache):
    """The estimate reads the text config from config.json without transformers; its per-token KV bytes
    equal those of the config transformers (and the vLLM stage, engine/stages/ar_vllm.py) loads."""
    from transformers import AutoConfig

    for model, component in (("tiny-glm-image", "vision_language_encoder"), ("tiny-chat", ".")):
        folder = built(model, model_cache).path / component
        ours = text_config(json.loads((folder / "config.json").read_text()))
        theirs = AutoConfig.from_pretrained(folder).get_text_config()
        for dtype in (torch.float32, torch.bfloat16):
            assert kv_bytes_per_token(ours, dtype) == kv_bytes_per_token(theirs, dtype)


# -- the command ----------------------------------------------------------------------------------


def run_validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "studio.cli", "validate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )


def test_validate_check_devices_prints_the_table(tmp_path):
    done = run_validate(str(REPO_ROOT / "assets/deploy/tiny-glm-image.yaml"), "--check-devices")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    head = next(line for line in lines if line.startswith("stage "))
    assert head.split() == [
        "stage", "component", "params", "dtype", "weights", "KV", "cache", "extra", "margin", "total", "device"
    ]  # fmt: skip
    table = lines[lines.index(head) + 1 :]
    table = table[: next(i for i, line in enumerate(table) if not re.match(r"^(\d+ | )", line))]
    components = {(line.split()[0] if line[0].isdigit() else ""): [] for line in table}
    stage = ""
    for line in table:
        cells = line.split()
        stage = cells.pop(0) if line[0].isdigit() else stage
        components.setdefault(stage, []).append(cells[0])
    assert components["0"] == ["vision_language_encoder"]
    assert sorted(components["1"]) == ["text_encoder", "transformer", "vae"]
    assert any(re.match(r"^cpu: stage\(s\) 0, 1 need .* available: fits$", line) for line in lines), lines
    assert "valid" in done.stdout

    # Without --check-devices nothing is estimated.
    plain = run_validate(str(REPO_ROOT / "assets/deploy/tiny-glm-image.yaml"))
    assert plain.returncode == 0 and "KV cache" not in plain.stdout


def test_validate_check_devices_fails_a_config_that_does_not_fit(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("stages:\n- stage_id: 0\n  max_model_len: 1048576\n  max_num_seqs: 1024\n")
    done = run_validate(str(big), "--model", "tiny-chat", "--check-devices")
    assert done.returncode == 1, done.stdout
    assert "does NOT fit" in done.stdout
    assert re.search(r"stage 0: memory: needs [\d.]+ GiB on cpu which has [\d.]+ GiB available", done.stderr)
    assert "lower max_model_len from 1048576 to" in done.stderr
    assert "lower max_num_seqs from 1024 to" in done.stderr


# -- what a stage holds beyond its checkpoint (docs/memory.md, "What is counted") ------------------


def glm_estimate(model_cache: Path, **stages: dict):
    source = built("tiny-glm-image", model_cache)
    config = build_pipeline_config(source, tiny_deploy("tiny-glm-image", **stages))
    return source.path, estimate_memory(config, source.path, budgets={"cpu": PLENTY})


def test_vllm_on_a_cpu_counts_the_packed_embedding_and_head_and_its_token_buffer(model_cache):
    path, estimate = glm_estimate(
        model_cache, stage0={"backend": "vllm", "devices": "cpu", "max_num_batched_tokens": 2048}
    )
    stage = estimate.stages[0]
    text = json.loads((path / "vision_language_encoder" / "config.json").read_text())["text_config"]
    embedding = text["vocab_size"] * text["hidden_size"] * 4  # float32 (dtype auto)
    head = text["vision_vocab_size"] * text["hidden_size"] * 4
    assert stage.copies == embedding + head
    assert stage.buffers == 2048 * text["hidden_size"] * 4
    assert stage.total == stage.weights + stage.kv_bytes + stage.extra + stage.margin
    assert stage.extra == stage.copies + stage.buffers
    # On transformers there are no such copies; vLLM on a GPU keeps no CPU copy either.
    _, plain = glm_estimate(model_cache, stage0={"backend": "transformers", "devices": "cpu"})
    assert plain.stages[0].copies == plain.stages[0].buffers == 0


def measure_tool(*args: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "tools.real_width.measure_memory", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@needs_proc
def test_vllm_cpu_gemm_packing_keeps_a_copy_of_vocabulary_layers_only():
    """What the copies term rests on: vLLM's CPU GEMM dispatch replaces a linear layer's weight by its
    packed copy, but keeps an embedding's / LM head's weight beside it (measured on a 64 MiB weight)."""
    pytest.importorskip("vllm")
    phases = measure_tool("vllm-pack", "--rows", "4096", "--cols", "4096")  # 64 MiB of float32
    names = [p["phase"] for p in phases]
    assert names == [
        "start",
        "weight made",
        "dispatch_cpu_unquantized_gemm(remove_weight=True)",
        "weight made",
        "dispatch_cpu_unquantized_gemm(remove_weight=False)",
    ]
    _, made_linear, linear, made_vocab, vocab = phases
    assert linear["kept_mib"] == 0 and vocab["kept_mib"] == 64
    assert abs(linear["rss_mib"] - made_linear["rss_mib"]) < 16, (made_linear, linear)  # replaced
    assert 56 <= vocab["rss_mib"] - made_vocab["rss_mib"] <= 80, (made_vocab, vocab)  # one more copy


def test_diffusion_work_from_the_dit_and_vae_configs(model_cache):
    """The working memory of stage 1 at its default size, from the tiny DiT's and VAE's config.json."""
    path, estimate = glm_estimate(model_cache, stage1={"max_num_seqs": 2})
    stage = estimate.stages[1]
    work = stage.work
    assert work is not None and (work.height, work.width, work.batch) == (64, 64, 2)  # the tiny deploy's
    dit = json.loads((path / "transformer" / "config.json").read_text())
    vae = json.loads((path / "vae" / "config.json").read_text())
    scale = 2 ** (len(vae["block_out_channels"]) - 1)  # 8: three downsamplings
    tokens = (64 // (scale * dit["patch_size"])) ** 2
    width = dit["num_attention_heads"] * dit["attention_head_dim"]
    assert work.dit_forward == tokens * 4 * (2 * 4 * width + 6 * width)  # FF 4x width, float32
    assert work.dit_source_cache == 2 * dit["num_layers"] * tokens * width * 4  # keys + values, I2I
    # The decoder's largest map: [8, 8, 16, 16] reversed; the 16 channels (blocks of 16) at 32x32 enter the
    # third level, the 8 channels (a block of 16) at 64x64 the last: 16 x 64 x 64.
    assert vae["block_out_channels"] == [8, 8, 16, 16]
    assert work.vae_decode == 4 * 16 * 64 * 64 * 4
    assert work.bytes == 2 * max(work.dit_forward + work.dit_source_cache, work.vae_decode)
    assert stage.extra == work.bytes
    assert stage.total == stage.weights + stage.extra + stage.margin


VAE_DECODE = textwrap.dedent(
    """
    import json, sys, torch
    from diffusers import AutoencoderKL

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    vae = AutoencoderKL.from_pretrained(sys.argv[1]).eval()
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    peaks = {}
    with torch.inference_mode():
        vae.decode(torch.randn(1, vae.config.latent_channels, 8, 8))  # lazy initialisation, small
        for size in map(int, sys.argv[2:]):
            latents = torch.randn(1, vae.config.latent_channels, size // scale, size // scale)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            before = status("VmRSS")
            vae.decode(latents)
            peaks[size] = status("VmHWM") - before
            del latents
    print(json.dumps(peaks))
    """
)


def measure_vae_decode(path: Path, sizes: tuple[int, ...], env: dict[str, str]) -> dict[int, int]:
    """The peak RSS above the loaded VAE of a decode at each of ``sizes`` (size x size), one after the
    other in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", VAE_DECODE, str(path / "vae"), *map(str, sizes)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(size): int(peak) for size, peak in peaks.items()}


# glibc's dynamic mmap threshold keeps freed blocks of up to 32 MiB on its heap, so the RSS peak of a decode
# whose maps are that small carries a varying amount of freed memory (measured 191-248 MiB run to run at
# 1024x1024 on one machine, 294 MiB on another: the margin's part, docs/memory.md). A fixed threshold hands
# every tensor of 128 KiB or more back at once, so the RSS follows the live tensors the term counts.
LIVE_TENSORS = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
# The convolutions' layouts are oneDNN's choice by CPU: blocks of 16 channels with AVX-512, of 8 with AVX2
# only. Both are measured on any machine that has AVX-512 (oneDNN's own switch caps what it uses).
KERNEL_KINDS = {"this CPU's": {}, "AVX2's": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}


@needs_proc
@pytest.mark.parametrize("kernels", sorted(KERNEL_KINDS))
def test_the_vae_decode_term_bounds_a_measured_decode(model_cache, kernels):
    """The tiny VAE decoding 1024x1024 and 2048x2048: the peak of its live tensors above the loaded model
    is at most the term and more than half of it (the term is not a loose bound), with either kind of
    convolution kernel; with the allocator's defaults (each size in a fresh process, this CPU's kernels)
    the peak stays inside the term plus the stage's margin."""
    sizes = (1024, 2048)
    live = measure_vae_decode(
        built("tiny-glm-image", model_cache).path, sizes, {**LIVE_TENSORS, **KERNEL_KINDS[kernels]}
    )
    for size in sizes:
        path, estimate = glm_estimate(
            model_cache,
            stage1={"default_sampling_params": {"guidance_scale": 1.5, "height": size, "width": size}},
        )
        stage = estimate.stages[1]
        work = stage.work
        assert work is not None and work.height == size
        assert work.vae_decode / 2 < live[size] <= work.vae_decode, (size, live[size], work.vae_decode)
        if KERNEL_KINDS[kernels]:
            continue
        (resident,) = measure_vae_decode(path, (size,), {}).values()
        assert live[size] / 2 < resident <= work.vae_decode + stage.margin, (size, resident, stage.margin)


def test_each_process_on_the_cpu_adds_its_runtime(model_cache):
    _, together = glm_estimate(model_cache, stage0={"devices": "cpu"}, stage1={"devices": "cpu"})
    claims = sum(s.claim(PLENTY) for s in together.stages)
    assert together.processes("cpu") == 1
    assert together.need("cpu") == claims + PROCESS_RUNTIME_CPU
    _, apart = glm_estimate(
        model_cache, stage0={"devices": "cpu"}, stage1={"devices": "cpu", "own_process": True}
    )
    assert apart.processes("cpu") == 2  # the engine's (stage 0) and stage 1's own
    assert apart.need("cpu") == claims + 2 * PROCESS_RUNTIME_CPU
