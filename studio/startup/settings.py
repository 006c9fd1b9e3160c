"""What the studio runs with: one typed, frozen object built once from the command line.

``studio.cli`` builds :class:`StudioSettings` from argv (and the environment, through the default data
dir); everything below the command line (launcher, API, UI, run store) reads this object and never the
parsed arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from studio.startup.limits import InputLimits

if TYPE_CHECKING:
    from studio.api.fingerprint import FingerprintSettings


@dataclass(frozen=True)
class StudioSettings:
    """Model, serving and storage settings of one studio process (``omni-studio --help`` lists them)."""

    data_dir: Path  # resolved once (``--data-dir``, else ``$OMNI_STUDIO_DATA_DIR``, else the XDG default)
    model: str | None = None  # a built-in model name or a local HF-format folder; None: the default model
    deploy_config: str | None = None  # the path as given (error messages quote it)
    ar_backend: str | None = None
    devices: str | None = None  # --devices: every stage placed here, whatever the deploy config says
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    auth: tuple[str, str] | None = None  # UI login (USER, PASS)
    api_key: str | None = None
    # Checked by the CLI for the serving commands; None: the default mode (full). Not imported here: the
    # API package is not needed by the commands that do not serve (history, validate).
    fingerprint: FingerprintSettings | None = None
    db_url: str | None = None  # SQLAlchemy URL of the run store; None: SQLite in the data dir
    limits: InputLimits = field(default_factory=InputLimits)  # what a request may carry (--max-* flags)
    image_reply: str = "content"  # chat images: list content, or "images" (message.images): --image-reply
    output_url_ttl: int = 3600  # seconds a signed /v1/outputs URL works (with an API key): --output-url-ttl
    # Past one machine (docs/distributed.md): stages as Ray actors on this cluster (--ray-address), and
    # the output files in an object store (--outputs s3://bucket/prefix, with --outputs-option KEY=VALUE).
    ray_address: str | None = None
    outputs: str | None = None  # None: <data_dir>/outputs
    outputs_options: tuple[tuple[str, str], ...] = ()

    def deploy_text(self) -> str | None:
        """The deploy YAML the studio started with (shown and edited in the Pipeline tab)."""
        return Path(self.deploy_config).read_text() if self.deploy_config is not None else None
