"""Request bodies (pydantic, strict types): SGLang's /generate, and /rollout, /train_step, /save, /load.

Strict mode: "1" is not an int and "yes" is not a bool. Unknown fields are rejected where a typo
would silently change behaviour (sampling parameters, /generate, /train_step); dataset rows in
/rollout accept verl's extra columns (ability, index, ...) and ignore them.

SGLang compatibility: sampling parameters and request fields that SGLang has but Rollplex does not
implement (penalties, min_new_tokens, grammars, LoRA, ...) are accepted at their neutral default and
rejected with a clear message otherwise; `sampling_seed` is SGLang's name for `seed`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, create_model, field_validator, model_validator

from ..rl.config import PER_STEP, RLConfig

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# |reward| bound, for client rewards and reward functions' alike (ServerState.train): far past any score a
# task gives, and far from where the advantages' mean and variance overflow float32
MAX_ABS_REWARD = 1e6
Reward = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)]

# SGLang sampling parameters without a Rollplex implementation: accepted only at these values.
NEUTRAL_SAMPLING = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "regex": None, "json_schema": None,
    "ebnf": None, "structural_tag": None, "custom_params": None, "logit_bias": None, "stop_regex": None,
}
IGNORED_SAMPLING = ("stream_interval",)
# SGLang /generate fields without a Rollplex implementation: accepted only at these values.
NEUTRAL_GENERATE = {
    "lora_path": None, "lora_id": None, "custom_logit_processor": None, "return_hidden_states": False,
    "video_data": None, "audio_data": None, "input_embeds": None, "session_params": None,
    "token_ids_logprob": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
}
IGNORED_GENERATE = ("log_metrics", "modalities", "data_parallel_rank", "priority", "no_logs")


def _pop_neutral(data: Any, neutral: dict, ignored: tuple, what: str) -> Any:
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for k in ignored:
        data.pop(k, None)
    for k, default in neutral.items():
        if k in data:
            v = data.pop(k)
            if v is not None and v != default and not (isinstance(v, (list, dict)) and not v and default is None):
                raise ValueError(f"{what} {k!r} is not supported by rollplex (only its default {default!r})")
    return data


class SGLangSamplingParams(BaseModel):
    """SGLang's sampling_params; None means: the server's default."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)

    @model_validator(mode="before")
    @classmethod
    def _sglang_only(cls, data: Any) -> Any:
        data = _pop_neutral(data, NEUTRAL_SAMPLING, IGNORED_SAMPLING, "sampling parameter")
        if isinstance(data, dict) and "sampling_seed" in data:
            if data.get("seed") is not None and data["sampling_seed"] is not None:
                raise ValueError("pass one of seed / sampling_seed")
            data["seed"] = data.pop("sampling_seed")
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    def given(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if v is not None}


def _ids_shape(v: Any) -> str:
    return "batch" if isinstance(v, list) and v and isinstance(v[0], list) else "one"


# one prompt's ids or a batch, told apart by the first element: a plain union would validate a batch as
# one prompt first and build an error per element (seconds for a body of many short lists)
TokenIds = Annotated[Annotated[list[int], Tag("one")] | Annotated[list[list[int]], Tag("batch")],
                     Discriminator(_ids_shape)]


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput (the fields Rollplex implements)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str | list[str] | None = None
    input_ids: TokenIds | None = None
    image_data: str | list[str | list[str] | None] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _sglang_only(cls, data: Any) -> Any:
        return _pop_neutral(data, NEUTRAL_GENERATE, IGNORED_GENERATE, "field")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("pass exactly one of `text` or `input_ids`")
        return self


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[dict]


ImageRef = str | dict


def _image_ref(x: ImageRef) -> str:
    """verl / OpenAI image forms -> a path, URL or base64 string for `processor.load_image`."""
    if isinstance(x, str):
        return x
    if isinstance(x.get("url"), str):
        return x["url"]
    if isinstance(x.get("image_url"), dict) and isinstance(x["image_url"].get("url"), str):
        return x["image_url"]["url"]
    if isinstance(x.get("bytes"), str):
        return x["bytes"]  # base64
    if isinstance(x.get("path"), str):
        return x["path"]
    raise ValueError("an image is a path, base64 string, data URL, or {url|bytes(base64)|path: ...}")


class RolloutPrompt(BaseModel):
    """Chat `messages` (+ images/videos), a verl row (`prompt`, `data_source`, `reward_model`), or ids."""

    model_config = ConfigDict(extra="ignore", strict=True)
    messages: list[Message] | None = None
    prompt: list[Message] | str | None = None
    input_ids: list[int] | None = None
    images: list[ImageRef] | None = None
    videos: list[list[ImageRef]] | None = None
    data_source: str | None = None
    reward_model: dict | None = None
    ground_truth: Any = None
    extra_info: dict | None = None

    @field_validator("images")
    @classmethod
    def _images(cls, v):
        return None if v is None else [_image_ref(x) for x in v]

    @field_validator("videos")
    @classmethod
    def _videos(cls, v):
        return None if v is None else [[_image_ref(x) for x in frames] for frames in v]

    @model_validator(mode="after")
    def _one_input(self):
        if sum(x is not None for x in (self.messages, self.prompt, self.input_ids)) != 1:
            raise ValueError("a prompt needs exactly one of `messages`, `prompt` (verl row) or `input_ids`")
        if self.input_ids is not None and (self.images or self.videos):
            raise ValueError("`input_ids` prompts cannot carry images; use `messages` or `prompt`")
        return self

    def chat(self) -> list[dict] | None:
        msgs = self.messages if self.messages is not None else self.prompt
        if msgs is None:
            return None
        if isinstance(msgs, str):
            return [{"role": "user", "content": msgs}]
        return [m.model_dump() for m in msgs]

    def truth(self):
        rm = self.reward_model or {}
        return rm.get("ground_truth", self.ground_truth)


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompts: list[RolloutPrompt] = Field(min_length=1)  # at most --max-prompts (limits.py)
    n: int | None = Field(None, ge=1)
    sampling_params: dict | None = None
    for_training: bool = True


def overrides_model(config: type = RLConfig) -> type[BaseModel]:
    """The per-step overrides of a config dataclass as a pydantic model: every field declared with
    `rl.config.per_step`, optional (None: not overridden), within the bounds declared there (floats finite)."""
    hints = typing.get_type_hints(config)
    fields = {}
    for f in dataclasses.fields(config):
        if PER_STEP not in f.metadata:
            continue
        kind = next(a for a in (typing.get_args(hints[f.name]) or (hints[f.name],)) if a is not type(None))
        finite = {"allow_inf_nan": False} if kind is float else {}
        fields[f.name] = (kind | None, Field(None, **f.metadata[PER_STEP], **finite))
    return create_model(f"{config.__name__}Overrides", __config__=ConfigDict(extra="forbid", strict=True), **fields)


RLOverrides = overrides_model()


class TrainStepRequest(RLOverrides):
    """rollout_id (+ more_rollout_ids) + rewards (one per sample) or a reward name, + per-step algorithm
    overrides: RLConfig's fields declared overridable there (`rl.config.per_step`, with their bounds), for
    this step only; adv_estimator gae needs a server started with it (it builds the critic)."""

    rollout_id: str = Field(min_length=1)
    # further retained rollouts trained in the same step, their groups after rollout_id's (dynamic
    # sampling's refill: the client rolls out more prompts until filter_groups keeps train_batch_size groups)
    more_rollout_ids: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=63)
    # with filter_groups: the groups to train, the kept ones trimmed to it; fewer kept is a 400 that asks
    # for more rollouts (every rollout still retained)
    train_batch_size: int | None = Field(None, ge=1, le=1 << 16)
    rewards: list[Reward] | None = None
    # ReMax (adv_estimator remax) with client rewards: the reward of each prompt's greedy response (/rollout's
    # `greedy`), one per prompt, rollout after rollout; with `reward` the server scores them itself
    greedy_rewards: list[Reward] | None = None
    reward: str | None = Field(None, min_length=1)
    # train a rollout sampled from older weights (otherwise 409): its sampling logprobs become the
    # PPO ratio's old logprobs, so the clipped ratio corrects for the policy having moved
    off_policy: bool = False

    @model_validator(mode="after")
    def _one_reward(self):
        if self.rewards is not None and self.reward is not None:
            raise ValueError("pass `rewards` or `reward`, not both")
        if self.greedy_rewards is not None and self.rewards is None:
            raise ValueError("greedy_rewards go with the client's `rewards` (with `reward` the server scores the "
                             "greedy responses)")
        ids = [self.rollout_id, *self.more_rollout_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("a rollout id appears twice in rollout_id / more_rollout_ids")
        return self

    def overrides(self) -> dict:
        """The given overrides, as RLConfig fields."""
        return {k: v for k in RLOverrides.model_fields if (v := getattr(self, k)) is not None}


class SaveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(min_length=1)  # under the server's --checkpoint-root; relative paths start there
    data_state: dict | None = None  # the driver's position (step, epoch...), returned by /load
    overwrite: bool = False  # replace an existing checkpoint at `path` (otherwise 409)


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(min_length=1)
