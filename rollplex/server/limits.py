"""What one request may ask of the server: sizes checked before any work is spent on them.

    ServerLimits  (ServerConfig.limits; one flag per field: --max-body-bytes, --max-prompts, ...)
    body bytes     413 from the ASGI middleware (app.py), on Content-Length and while the body streams in,
                   before anything is parsed
    prompts        per /generate batch or /rollout: 400
    prompt chars   per text prompt (a /rollout prompt's message texts together), checked on the event loop
                   before tokenising: a huge prompt is refused in microseconds instead of occupying an
                   intake thread; default: CHARS_PER_TOKEN characters per token of --max-model-len
    token ids      an `input_ids` prompt longer than --max-model-len: 400 before it is validated id by id
    image bytes / pixels, pixels per prompt and per request, frames per video: media.py, on the intake
                   thread, from each image's header before its pixels are decoded
    retained bytes one client's retained rollouts, and all clients' (store.py): a client's own oldest
                   are evicted to fit, never another client's

Every message names the limit and its flag, so a client knows what to send instead.
"""

from __future__ import annotations

from dataclasses import dataclass

# generous: BPE tokens of natural text and code average 3-5 characters; a prompt that needs more than this
# many characters per token of max_model_len cannot fit once tokenised
CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 64 << 20  # a request body (JSON, images as base64 included)
    max_prompts: int = 1024  # prompts in one /generate batch or /rollout
    max_prompt_chars: int | None = None  # characters of one text prompt; None: CHARS_PER_TOKEN x max_model_len
    max_image_bytes: int = 32 << 20  # one encoded image or video frame (base64-decoded, or a file's size)
    max_image_pixels: int = 50_000_000  # width x height of one decoded image or frame, read from its header
    max_prompt_pixels: int = 256_000_000  # all images and frames of one prompt together
    max_video_frames: int = 768  # frames of one video
    # ---- decode work per request, retained rollouts' bytes ----
    max_request_pixels: int = 1_000_000_000  # all images and frames of one request, read from their headers
    max_client_rollout_bytes: int = 8 << 30  # one client's retained rollouts (its oldest evicted to fit)
    max_retained_bytes: int = 32 << 30  # every client's retained rollouts together (a rollout over it: 507)

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompts", "max_image_bytes", "max_image_pixels", "max_prompt_pixels",
                     "max_video_frames", "max_request_pixels", "max_client_rollout_bytes", "max_retained_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be >= 1 (or None: derived from max_model_len)")

    def prompt_chars(self, max_model_len: int) -> int:
        """The character limit of one text prompt for an engine of `max_model_len` tokens."""
        return self.max_prompt_chars if self.max_prompt_chars is not None else CHARS_PER_TOKEN * max_model_len


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_count(limits: ServerLimits, count: int, what: str) -> None:
    if count > limits.max_prompts:
        raise ValueError(f"{count} {what} in one request; this server takes at most {limits.max_prompts} "
                         f"({flag('max_prompts')}): split the batch")


def check_text(limits: ServerLimits, max_model_len: int, chars: int, where: str) -> None:
    cap = limits.prompt_chars(max_model_len)
    if chars > cap:
        raise ValueError(f"{where}: {chars} characters of prompt text exceed the limit of {cap} "
                         f"({flag('max_prompt_chars')}; a prompt must fit max_model_len={max_model_len} tokens)")


def check_ids(max_model_len: int, count: int, where: str) -> None:
    if count > max_model_len:
        raise ValueError(f"{where}: {count} prompt token ids exceed max_model_len={max_model_len}")


def chat_chars(messages: list[dict] | None) -> int:
    """Characters of the text in chat messages (string contents and the `text` of content items)."""
    total = 0
    for m in messages or ():
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(x["text"]) for x in content if isinstance(x, dict) and isinstance(x.get("text"), str))
    return total
