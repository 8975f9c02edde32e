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
    samples        prompts x n of one request: 400 (with max_model_len and the rid cap, this bounds the
                   answer's size before any work)
    stop / ids     stop strings per prompt and characters per string, stop token ids per prompt: 400
                   (each engine step checks every stop of every running sample)
    rid            characters of a request id (repeated in every sample's answer): 400
    JSON shape     '[' and '{' bytes of a body (an upper bound on its arrays and objects), counted in one
                   pass over the bytes before parsing: 413; what parsing and validating costs grows with it
    timeouts       request headers (from the connection's start, or the end of the previous answer),
                   and the body: the connection is closed (headers) or answered 408 (body)
    connections    open HTTP connections; one over the cap is closed as it is accepted (http.py)

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
    # ---- per-request work and the HTTP surface (app.py, http.py, sglang.py)
    max_samples: int = 16384  # prompts x n of one /generate or /rollout
    max_stop: int = 64  # stop strings of one prompt
    max_stop_chars: int = 256  # characters of one stop string
    max_stop_token_ids: int = 256  # stop token ids of one prompt
    max_rid_chars: int = 256  # characters of one /generate rid
    max_json_containers: int = 1 << 16  # '[' + '{' bytes of a request body
    header_timeout_s: float = 30.0  # to receive a request's headers
    body_timeout_s: float = 120.0  # to receive a request's body
    max_connections: int | None = None  # open HTTP connections; None: half the process's descriptor limit

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompts", "max_image_bytes", "max_image_pixels", "max_prompt_pixels",
                     "max_video_frames", "max_request_pixels", "max_client_rollout_bytes", "max_retained_bytes",
                     "max_samples", "max_stop_chars", "max_rid_chars", "max_json_containers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("max_stop", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be >= 1 (or None: derived from max_model_len)")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be >= 1 (or None: derived from the descriptor limit)")

    def connections(self) -> int:
        """The connection cap: max_connections, or half the soft limit on open descriptors (the rest is the
        model's files, the listening socket, threads' pipes, ...)."""
        if self.max_connections is not None:
            return self.max_connections
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 16) // 2)

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
    """Characters of every text field of chat messages: the role, string contents, and the `type` and
    `text` of content items (all of them reach the chat template; images are bounded by media.py)."""
    total = 0
    for m in messages or ():
        total += len(m["role"]) if isinstance(m.get("role"), str) else 0
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(x[k]) for x in content if isinstance(x, dict)
                         for k in ("type", "text") if isinstance(x.get(k), str))
    return total


def check_samples(limits: ServerLimits, prompts: int, n: int) -> None:
    if prompts * n > limits.max_samples:
        raise ValueError(f"{prompts} prompts x n={n} = {prompts * n} samples in one request; this server takes at "
                         f"most {limits.max_samples} ({flag('max_samples')}): split the batch")


def check_stops(limits: ServerLimits, stop: list[str], stop_token_ids: list[int], where: str) -> None:
    """The stop conditions of one prompt: each engine step checks all of them for every running sample."""
    if len(stop) > limits.max_stop:
        raise ValueError(f"{where}.stop: {len(stop)} stop strings; this server takes at most {limits.max_stop} "
                         f"({flag('max_stop')})")
    longest = max(map(len, stop), default=0)
    if longest > limits.max_stop_chars:
        raise ValueError(f"{where}.stop: a stop string of {longest} characters; this server takes at most "
                         f"{limits.max_stop_chars} ({flag('max_stop_chars')})")
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise ValueError(f"{where}.stop_token_ids: {len(stop_token_ids)} ids; this server takes at most "
                         f"{limits.max_stop_token_ids} ({flag('max_stop_token_ids')})")


def check_rid(limits: ServerLimits, rid: str | None, where: str) -> None:
    if rid is not None and len(rid) > limits.max_rid_chars:
        raise ValueError(f"{where}: a rid of {len(rid)} characters; this server takes at most "
                         f"{limits.max_rid_chars} ({flag('max_rid_chars')})")


def count_containers(body: bytes) -> int:
    """'[' and '{' bytes of a JSON body: at least its arrays and objects (brackets inside strings count
    too). A C-speed pass over the bytes, so it is cheap enough to run before parsing."""
    return body.count(b"[") + body.count(b"{")


def containers_message(limits: ServerLimits, count: int) -> str:
    return (f"request body has {count} '[' / '{{' (JSON arrays and objects), over the limit of "
            f"{limits.max_json_containers} ({flag('max_json_containers')}): split the request")
