"""Request bodies (pydantic, strict types): SGLang's /generate, and /rollout, /train_step, /save, /load.

Strict mode: "1" is not an int and "yes" is not a bool. Unknown fields are rejected where a typo
would silently change behaviour (sampling parameters, /generate, /train_step); dataset rows in
/rollout accept verl's extra columns (ability, index, ...) and ignore them.

SGLang compatibility: sampling parameters and request fields that SGLang has but Rollplex does not
implement (penalties, min_new_tokens, grammars, LoRA, ...) are accepted at their neutral default and
rejected with a clear message otherwise; `sampling_seed` is SGLang's name for `seed`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput (the fields Rollplex implements)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
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


class TrainStepRequest(BaseModel):
    """rollout_id (+ more_rollout_ids) + rewards (one per sample) or a reward name, + per-step algorithm
    overrides."""

    model_config = ConfigDict(extra="forbid", strict=True)
    rollout_id: str = Field(min_length=1)
    # further retained rollouts trained in the same step, their groups after rollout_id's (dynamic
    # sampling's refill: the client rolls out more prompts until filter_groups keeps train_batch_size groups)
    more_rollout_ids: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=63)
    # with filter_groups: the groups to train, the kept ones trimmed to it; fewer kept is a 400 that asks
    # for more rollouts (every rollout still retained)
    train_batch_size: int | None = Field(None, ge=1, le=1 << 16)
    rewards: list[Reward] | None = None
    reward: str | None = Field(None, min_length=1)
    # train a rollout sampled from older weights (otherwise 409): its sampling logprobs become the
    # PPO ratio's old logprobs, so the clipped ratio corrects for the policy having moved
    off_policy: bool = False
    # algorithm overrides for this step only: RLConfig field names (verl's where verl has one), bounded
    # to what a step can use (an lr of 1000 destroys the policy in one step): lr <= 1e-2, a clip range
    # within [0, 1] below and [0, 10] above, coefficients <= 10 (entropy within [-1, 1]), grad_clip <= 1e4,
    # at most 16 epochs x 256 mini-batches, micro-batches of at most 4096 prompts / 65536 samples / 2^24 tokens,
    # gamma and lam within [0, 1], critic_lr <= 1e-2, cliprange_value within (0, 100], a TIS cap within (0, 100],
    # a token-sum divisor within (0, 2^20], an overlong buffer within [0, 2^20] tokens (and max_new_tokens) and its
    # penalty factor within [0, 10]; names of an estimator / loss / filter metric are checked by RLConfig (400 with
    # the allowed values). The LR-schedule unit, the KL controller, the critic's warm-up and checkpoint are startup
    # flags only: they define what persists across steps (adv_estimator gae needs a server started with it: it
    # builds the critic);
    # max_num_gen_batches and filter_groups_partial do not apply to a server (it rolls out nothing itself).
    lr: float | None = Field(None, gt=0.0, le=1e-2, allow_inf_nan=False)
    kl_coef: float | None = Field(None, ge=0.0, le=10.0, allow_inf_nan=False)
    clip_ratio_low: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    clip_ratio_high: float | None = Field(None, ge=0.0, le=10.0, allow_inf_nan=False)
    dual_clip: float | None = Field(None, gt=1.0, le=100.0, allow_inf_nan=False)
    loss_agg_mode: str | None = None
    entropy_coeff: float | None = Field(None, ge=-1.0, le=1.0, allow_inf_nan=False)
    use_kl_loss: bool | None = None
    kl_loss_type: str | None = None
    norm_adv_by_std: bool | None = None
    adv_estimator: str | None = None
    singleton_adv: str | None = None
    gamma: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    lam: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    critic_lr: float | None = Field(None, gt=0.0, le=1e-2, allow_inf_nan=False)
    cliprange_value: float | None = Field(None, gt=0.0, le=100.0, allow_inf_nan=False)
    policy_loss: str | None = None
    loss_agg_norm: float | None = Field(None, gt=0.0, le=float(1 << 20), allow_inf_nan=False)
    tis_imp_ratio_cap: float | None = Field(None, gt=0.0, le=100.0, allow_inf_nan=False)
    kl_penalty: str | None = None
    grad_clip: float | None = Field(None, gt=0.0, le=1e4, allow_inf_nan=False)
    ppo_epochs: int | None = Field(None, ge=1, le=16)
    ppo_mini_batches: int | None = Field(None, ge=1, le=256)
    micro_batch_prompts: int | None = Field(None, ge=1, le=4096)
    micro_batch_samples: int | None = Field(None, ge=1, le=65536)
    micro_batch_max_tokens: int | None = Field(None, ge=1, le=1 << 24)
    overlong_buffer_len: int | None = Field(None, ge=0, le=1 << 20)
    overlong_penalty_factor: float | None = Field(None, ge=0.0, le=10.0, allow_inf_nan=False)
    filter_groups: bool | None = None
    filter_groups_metric: str | None = None

    @model_validator(mode="after")
    def _one_reward(self):
        if self.rewards is not None and self.reward is not None:
            raise ValueError("pass `rewards` or `reward`, not both")
        ids = [self.rollout_id, *self.more_rollout_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("a rollout id appears twice in rollout_id / more_rollout_ids")
        return self

    def overrides(self) -> dict:
        """The given overrides, as RLConfig fields."""
        skip = {"rollout_id", "more_rollout_ids", "train_batch_size", "rewards", "reward", "off_policy"}
        return {k: v for k, v in self.model_dump().items() if k not in skip and v is not None}


class SaveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(min_length=1)  # under the server's --checkpoint-root; relative paths start there
    data_state: dict | None = None  # the driver's position (step, epoch...), returned by /load
    overwrite: bool = False  # replace an existing checkpoint at `path` (otherwise 409)


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(min_length=1)
