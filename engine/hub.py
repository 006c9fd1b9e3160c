"""Models by Hugging Face Hub id: ``--model ORG/NAME[@REVISION]``, resolved through the Hub cache.

Everything goes through huggingface_hub's own functions and constants, so ``HF_HOME``, ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and ``HF_TOKEN`` mean here what they mean to every other HF tool. A
snapshot already in the cache is used as it is, with no network (a branch or tag through the cache's
``refs/<name>``, a commit by its ``snapshots/<sha>`` folder); one that is not is downloaded into the cache
(progress bars on stderr; files already there are kept) unless ``HF_HUB_OFFLINE`` is set. The model's
identity names the commit it resolved to, so the config hash changes when the files do. README.md,
"Serving your own model".

huggingface_hub is imported on first use only: commands that never meet a hub id do not pay for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

COMMIT = re.compile(r"[0-9a-f]{40}")
CACHE_PREFIX = "models--"  # huggingface_hub's repo_folder_name() for a model: models--ORG--NAME


class HubModelUnavailable(Exception):
    """A hub model neither in the cache nor downloadable; the message says why and which cache was read."""


@dataclass(frozen=True)
class HubModel:
    """A hub model resolved to a complete snapshot in the cache."""

    repo_id: str  # ORG/NAME: the default served name
    commit: str  # the 40-hex commit the revision resolved to
    path: Path  # <HF_HUB_CACHE>/models--ORG--NAME/snapshots/<commit>

    @property
    def identity(self) -> str:
        return f"hub:{self.repo_id}@{self.commit}"


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``ORG/NAME[@REVISION]`` as (repo id, revision or None); None when ``text`` is not one."""
    repo_id, at, revision = text.partition("@")
    if (at and not revision) or repo_id.count("/") != 1:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def hub_cache_dir() -> Path:
    """The Hub cache huggingface_hub reads (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_snapshot(path: Path) -> HubModel | None:
    """The hub model whose cache snapshot folder ``path`` is (None for any other folder), so that a snapshot
    handed on by path (to a stage's own process, or a model switch) keeps its name and identity."""
    snapshots = path.parent
    if snapshots.name != "snapshots" or not snapshots.parent.name.startswith(CACHE_PREFIX):
        return None
    if not COMMIT.fullmatch(path.name):
        return None
    # repo ids never hold "--" (validate_repo_id), so the folder name maps back to exactly one id
    repo_id = snapshots.parent.name[len(CACHE_PREFIX) :].replace("--", "/")
    return HubModel(repo_id, path.name, path)


def resolve_hub_model(repo_id: str, revision: str | None = None) -> HubModel:
    """The cached snapshot of ``repo_id`` at ``revision`` (default branch when None), downloading it into
    the cache first when it is not there and HF_HUB_OFFLINE is not set.

    Raises :class:`HubModelUnavailable` naming the cache it looked in.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    asked = revision or constants.DEFAULT_REVISION
    wanted = f"{repo_id}@{asked}"
    try:
        folder = snapshot_download(repo_id, revision=asked, cache_dir=cache, local_files_only=True)
        return _snapshot(repo_id, Path(folder))
    except IncompleteSnapshotError:
        in_cache = f"the Hugging Face cache {cache} holds only part of {wanted} (an interrupted download)"
    except LocalEntryNotFoundError:
        in_cache = f"the Hugging Face cache {cache} has no snapshot of {wanted}"
    if constants.HF_HUB_OFFLINE:
        raise HubModelUnavailable(
            f"{in_cache}; HF_HUB_OFFLINE is set, so nothing was downloaded "
            f"(unset it to download, or fetch the model first: hf download {repo_id}"
            + (f" --revision {revision}" if revision else "")
            + ")"
        )
    from tqdm import tqdm  # plain tqdm: a download shows its bars even where library bars are switched off

    hub = constants.ENDPOINT
    try:
        folder = snapshot_download(repo_id, revision=asked, cache_dir=cache, tqdm_class=tqdm)
    except RevisionNotFoundError as exc:
        raise HubModelUnavailable(f"{in_cache}; {hub} has no revision {asked!r} of {repo_id}") from exc
    except GatedRepoError as exc:
        raise HubModelUnavailable(
            f"{in_cache}; {repo_id} on {hub} is gated: accept its terms on its page and set HF_TOKEN"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise HubModelUnavailable(
            f"{in_cache}; {hub} has no model {repo_id} (a private one needs HF_TOKEN)"
        ) from exc
    except LocalEntryNotFoundError as exc:  # the hub did not answer: say what the connection said
        cause = exc.__cause__ or exc
        raise HubModelUnavailable(
            f"{in_cache}; {hub} could not be reached to download it ({_first_line(cause)})"
        ) from exc
    except Exception as exc:  # HTTP errors, a full disk...: the model cannot be had
        raise HubModelUnavailable(
            f"{in_cache}; downloading it from {hub} failed ({_first_line(exc)})"
        ) from exc
    return _snapshot(repo_id, Path(folder))


def _snapshot(repo_id: str, folder: Path) -> HubModel:
    if not COMMIT.fullmatch(folder.name):  # snapshot_download names the folder by its commit
        raise HubModelUnavailable(f"{folder} is not a snapshot folder of the Hugging Face cache")
    return HubModel(repo_id, folder.name, folder)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
