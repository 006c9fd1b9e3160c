"""Every limit on what a client may send, in one settings object (README "Limits").

The CLI fills it from ``--max-*`` flags; the API checks requests against it before they reach the engine
(400 or 413 naming the field and the limit), and the UI and CLI share the prompt limit through the run
service. The defaults suit a single-user studio; a shared one may want them lower.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

MiB = 1024 * 1024


@dataclass(frozen=True)
class InputLimits:
    """Upper bounds on a request; each one is a ``--max-*`` flag (``--max-body-bytes`` ...)."""

    max_body_bytes: int = field(default=64 * MiB, metadata={"help": "a whole request body (413 past it)"})
    max_json_depth: int = field(default=32, metadata={"help": "nesting of arrays and objects in a JSON body"})
    max_prompt_chars: int = field(
        default=32_000, metadata={"help": "characters of one prompt, message text or negative prompt"}
    )
    max_messages: int = field(default=64, metadata={"help": "chat messages in one request"})
    max_image_bytes: int = field(
        default=32 * MiB, metadata={"help": "one source image, encoded (413 past it)"}
    )
    max_image_pixels: int = field(
        default=4096 * 4096, metadata={"help": "one source image, decoded (413 past it)"}
    )
    max_speech_chars: int = field(
        default=4096, metadata={"help": "characters of the text /v1/audio/speech speaks (input)"}
    )
    max_audio_bytes: int = field(
        default=25 * MiB, metadata={"help": "one input_audio clip, encoded (413 past it)"}
    )
    max_audio_seconds: int = field(
        default=300, metadata={"help": "one input_audio clip, decoded, in seconds (413 past it)"}
    )
    max_n: int = field(default=8, metadata={"help": "outputs per request (n)"})
    max_steps: int = field(default=1000, metadata={"help": "denoising steps (num_inference_steps)"})
    max_image_side: int = field(default=4096, metadata={"help": "width or height of an output image"})
    max_queue: int = field(
        default=64, metadata={"help": "requests queued or running in the engine (429 past it)"}
    )
    max_in_flight_per_client: int = field(
        default=0,
        metadata={
            "help": "requests queued or running per API client or UI session, a cap on one client's share "
            "of a full queue (429 past it); 0: the queue size. Waiting requests are served round-robin "
            "across clients whatever this is"
        },
    )

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            least = 0 if item.name == "max_in_flight_per_client" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                kind = "a non-negative" if least == 0 else "a positive"
                raise ValueError(f"{self.flag(item.name)} must be {kind} integer, got {value!r}")

    @property
    def client_share(self) -> int:
        """Requests one client may have queued or running: ``--max-in-flight-per-client``, else the queue."""
        return min(self.max_in_flight_per_client or self.max_queue, self.max_queue)

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def options(cls) -> list[tuple[str, int, str]]:
        """(field name, default, help) of every limit, for the command line."""
        return [(item.name, item.default, item.metadata["help"]) for item in fields(cls)]  # type: ignore[misc]
