"""Reading a checkpoint's weights without loading them: the safetensors headers of each component folder
(the 8-byte little-endian header length and the JSON header of each file, never a tensor; docs/memory.md).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# safetensors dtype names -> bytes per element
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint file that is not what it claims (a broken safetensors header, a missing shard)."""


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str  # safetensors' name: F32, BF16, I64...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * SAFETENSORS_DTYPE_BYTES[self.dtype]


def read_safetensors_header(path: Path) -> list[TensorHeader]:
    """The tensors of a ``.safetensors`` file (name, dtype, shape), read from its header only."""
    path = Path(path)
    with path.open("rb") as file:
        head = file.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {length} is not a safetensors header")
        raw = file.read(length)
    if len(raw) != length:
        raise CheckpointError(f"{path}: the header is cut short ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if dtype not in SAFETENSORS_DTYPE_BYTES or not isinstance(shape, list):
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r} and shape {shape!r}")
        tensors.append(TensorHeader(name, dtype, tuple(int(d) for d in shape)))
    return tensors


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files a loader reads from ``folder``: the shards its index names (a sharded
    checkpoint), else its ``*.safetensors`` files; files of a variant (``*.fp16.safetensors``) only when
    the folder has nothing else (transformers and diffusers load the plain files unless asked)."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    plain_indexes = [p for p in indexes if "." not in p.name.removesuffix(".safetensors.index.json")]
    for index in plain_indexes or indexes:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are not there: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    plain = [f for f in files if "." not in f.name.removesuffix(".safetensors")]
    return plain or files


@dataclass(frozen=True)
class ComponentWeights:
    """One component folder's weights, as its safetensors headers describe them."""

    name: str  # the folder inside the model ('.' for the model's own folder)
    files: tuple[Path, ...]
    tensors: tuple[TensorHeader, ...]

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def file_dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({t.dtype for t in self.tensors}))

    @property
    def file_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def loaded_bytes(self, dtype: torch.dtype) -> int:
        """Bytes once loaded with ``dtype``: floating tensors take it, the others keep theirs."""
        size = torch.tensor([], dtype=dtype).element_size()
        return sum(t.numel * size if t.dtype in FLOAT_DTYPES else t.nbytes for t in self.tensors)


def component_weights(model_path: Path, name: str) -> ComponentWeights | None:
    """The weights in ``model_path/name`` (None when it holds no safetensors file)."""
    folder = Path(model_path) / name
    files = checkpoint_files(folder) if folder.is_dir() else []
    if not files:
        return None
    tensors = tuple(t for f in files for t in read_safetensors_header(f))
    return ComponentWeights(name, tuple(files), tensors)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file's object; empty when the file is missing, unreadable or not a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
