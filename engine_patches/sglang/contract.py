"""Every SGLang name the Rollplex backend relies on, in one table (`CONTRACT`).

The patch never imports SGLang at module level; what it needs from SGLang is listed here, each entry
with the reason it is needed. `check.py` verifies the table against an SGLang release's source by AST
(without importing SGLang's runtime), and the contract tests run that check on the versions in
`CHECKED_VERSIONS`. A name the patch starts to rely on goes into this table first; the tests also read
the patch's own source and fail when it touches a base-class attribute the table does not list.

Entry kinds (`Relied.kind`):

    class_attr   names are assigned in the class body                         (scope: Class)
    method       names[0] is a method of the class; names[1:] are parameters it takes by these
                 names ("**": it takes **kwargs)                             (scope: Class)
    function     the same for a module-level function                         (scope: "")
    fields       the class (or a base class in the same file) declares these fields or takes them in
                 __init__                                                     (scope: Class)
    any_field    the same for at least one of these names (a field SGLang renamed) (scope: Class)
    calls        the scope calls these callables ("self.run_batch", "Scheduler"; "**parameters": a
                 call that spreads `<x>.parameters` as keyword arguments)     (scope: Class.method | function)
    reads        the scope reads these dotted names                           (scope: Class.method)
    self_attr    the class reads or sets `self.<name>` somewhere              (scope: Class)
    absent       these identifiers occur nowhere in the file (our additions cannot collide)
    str_values   the field's annotation is a dict whose values may be strings (scope: Class)
    strings      these string constants occur in the scope                    (scope: Class.method)
    global       the module assigns these names at its top level              (scope: "")
    constant     a module-level constant has this value                      (scope: "", value)
    server_args  SGLang's server arguments include these names: fields of ServerArgs, or of the
                 argument-group classes it is assembled from in newer releases (SERVER_ARG_FIELDS)

An entry with `since` holds from that release on; older checked releases are not held to it (the
feature that needs it is refused there, e.g. IMAGE_PROMPTS_MIN_VERSION). An entry with `before` holds
in the releases before that one (a name SGLang moved).

This module is import-light (no torch, no SGLang) so CI and the backend selector can read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# the oldest release with everything below (Engine.run_scheduler_process_func first appears in 0.5.7)
MIN_VERSION = "0.5.7"
# releases whose source the contract tests check; docs/SGLANG.md lists them
CHECKED_VERSIONS = ("0.5.7", "0.5.17", "0.5.23")
NEWEST_CHECKED = CHECKED_VERSIONS[-1]
# the oldest checked release whose Qwen-VL processor takes the M-RoPE grids of processor_output images from
# the items (0.5.7 passes the HF processor's output, None for such input, so image tokens would get text
# positions; 0.5.17 and 0.5.23 read the grid from the item); the rollout backend refuses image prompts on
# older releases
IMAGE_PROMPTS_MIN_VERSION = "0.5.17"

ENGINE = "sglang/srt/entrypoints/engine.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
FORWARD = "sglang/srt/model_executor/forward_batch_info.py"
BATCH = "sglang/srt/managers/schedule_batch.py"
CONSTANTS = "sglang/srt/constants.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
QWEN_VL = "sglang/srt/models/qwen2_5_vl.py"
QWEN3_VL = "sglang/srt/models/qwen3_vl.py"
QWEN3 = "sglang/srt/models/qwen3.py"
QWEN2 = "sglang/srt/models/qwen2.py"
VISION_ATTN = "sglang/srt/layers/attention/vision.py"
LAYER_UTILS = "sglang/srt/layers/utils/common.py"
# get_rope: a module before 0.5.17, a package from 0.5.17 on
ROPE_OLD = "sglang/srt/layers/rotary_embedding.py"
ROPE_FACTORY = "sglang/srt/layers/rotary_embedding/factory.py"
TOKENIZER = "sglang/srt/managers/tokenizer_manager.py"
MM_BASE = "sglang/srt/multimodal/processors/base_processor.py"
MM_QWEN_VL = "sglang/srt/multimodal/processors/qwen_vl.py"
SERVER_ARGS = "sglang/srt/server_args.py"
UTILS = "sglang/srt/utils/common.py"
MM_UTILS = "sglang/srt/managers/mm_utils.py"
MM_SCHEDULE = "sglang/srt/managers/mm_schedule.py"
# where newer releases declare ServerArgs' fields (argument-group classes); absent in older ones
SERVER_ARG_FIELDS = tuple(f"sglang/srt/arg_groups/fields/{m}.py" for m in (
    "device", "disagg", "exec_", "lora", "memory", "mm", "model", "observability", "parallel", "schedule",
    "serving", "spec"))
FILES = (ENGINE, SCHEDULER, IO_STRUCT, FORWARD, BATCH, CONSTANTS, SAMPLING, QWEN_VL, TOKENIZER, MM_BASE,
         MM_QWEN_VL, SERVER_ARGS, UTILS, MM_UTILS, MM_SCHEDULE, *SERVER_ARG_FIELDS,
         QWEN3_VL, QWEN3, QWEN2, VISION_ATTN, LAYER_UTILS, ROPE_OLD, ROPE_FACTORY)

# what the patched Scheduler adds: one RPC method and one attribute (the hook driver)
RPC_METHOD = "rollplex_rpc"
DRIVER_ATTR = "rollplex"
# SGLang's memory tags (sglang/srt/constants.py GPU_MEMORY_TYPE_*)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# server arguments the rollout backend sets when it starts SGLang's Engine (plugin.rollout)
MANAGED_SERVER_ARGS = ("model_path", "dtype", "mem_fraction_static", "enable_memory_saver",
                       "enable_weights_cpu_backup", "random_seed")
# server arguments SGLang renamed, {old name: new name, release of the rename}: the Engine passes a tool's
# argument under the name its release has (engine.server_args_for)
SERVER_ARG_RENAMES = {"cuda_graph_max_bs": ("cuda_graph_max_bs_decode", "0.5.17")}
# server arguments the SGLang benches set (rollplex/bench/sglang.py), under their older names
BENCH_SERVER_ARGS = ("load_format", "skip_tokenizer_init", "attention_backend", "mm_attention_backend",
                     "sampling_backend", "disable_cuda_graph", "log_level", "cuda_graph_max_bs")
# sampling parameters the rollout backend sends (outputs.sampling_dict)
ROLLOUT_SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids",
                    "ignore_eos", "skip_special_tokens", "sampling_seed")

# /generate request fields rollplex/server mirrors (schemas.GenerateRequest + NEUTRAL_GENERATE + IGNORED_GENERATE)
GENERATE_FIELDS = (
    "text", "input_ids", "image_data", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "stream",
    "lora_path", "lora_id", "custom_logit_processor", "return_hidden_states", "video_data", "audio_data",
    "input_embeds", "session_params", "token_ids_logprob", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "log_metrics", "modalities", "data_parallel_rank", "priority", "no_logs",
)
# the data-parallel rank's request field under its old and new names (0.5.17 has only routed_dp_rank)
DP_RANK_FIELDS = ("data_parallel_rank", "routed_dp_rank")
# sampling parameters rollplex/server accepts under SGLang's names (schemas.SGLangSamplingParams without
# Rollplex's `seed` alias, + NEUTRAL_SAMPLING + IGNORED_SAMPLING)
SAMPLING_FIELDS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "sampling_seed",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "regex", "json_schema", "ebnf", "structural_tag",
    "custom_params", "logit_bias", "stop_regex",
    "stream_interval",
)


@dataclass(frozen=True)
class Relied:
    kind: str
    file: str
    scope: str
    names: tuple[str, ...]
    why: str
    value: str | None = None
    since: str | None = None  # the first release the entry holds in (None: every checked release)
    before: str | None = None  # the first release it no longer holds in (None: none)

    def __post_init__(self):
        assert self.kind in KINDS, self.kind
        assert self.file in FILES, self.file
        assert self.names, "an entry names at least one thing"
        assert (self.kind == "constant") == (self.value is not None)
        assert self.since is None or release_tuple(self.since) > release_tuple(MIN_VERSION)
        assert self.before is None or release_tuple(self.before) > release_tuple(self.since or MIN_VERSION)

    def applies_to(self, version: str | None) -> bool:
        """Whether a release must hold this entry (None: an unnamed source, held to everything)."""
        if version is None:
            return True
        v = release_tuple(version)
        return ((self.since is None or v >= release_tuple(self.since))
                and (self.before is None or v < release_tuple(self.before)))


def release_tuple(version: str) -> tuple[int, ...]:
    """(0, 5, 23) for "0.5.23", "0.5.23.post1", "0.5.23+local"; () when it does not start with a number."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


KINDS = ("class_attr", "method", "function", "fields", "any_field", "calls", "reads", "self_attr", "absent",
         "str_values",
         "strings", "constant", "server_args", "global")

CONTRACT: tuple[Relied, ...] = (
    # ---- the engine: launching the patched scheduler, control RPCs, memory, weights ------------------
    Relied("class_attr", ENGINE, "Engine", ("run_scheduler_process_func",),
           "the Engine subclass points it at the module-level shim that runs the patched Scheduler"),
    Relied("reads", ENGINE, "Engine.__init__", ("self.run_scheduler_process_func",),
           "Engine.__init__ launches what the instance holds, so an instance-level shim bound to a hook spec is used"),
    Relied("method", ENGINE, "Engine", ("__init__", "**"),
           "the subclass passes the server arguments through as keywords"),
    Relied("method", ENGINE, "Engine", ("generate", "prompt", "sampling_params", "input_ids", "image_data",
                                        "return_logprob"),
           "the rollout's requests: templated prompts or token ids, images, sampling parameters, logprobs"),
    Relied("method", ENGINE, "Engine", ("async_generate", "prompt", "sampling_params", "input_ids", "image_data",
                                        "return_logprob"),
           "a rollout that reports its groups as they finish sends each prompt's samples as one batch request"),
    Relied("self_attr", ENGINE, "Engine", ("loop",),
           "the event loop Engine.generate runs its requests on; the grouped rollout runs its batch requests there"),
    Relied("method", ENGINE, "Engine", ("collective_rpc", "method", "**"),
           "control RPCs reach every scheduler process (start/stop admission, metrics, prefix states, weights)"),
    Relied("method", ENGINE, "Engine", ("release_memory_occupation", "tags"),
           "leaving the rollout phase releases SGLang's KV cache, CUDA graphs and weights by tag"),
    Relied("method", ENGINE, "Engine", ("resume_memory_occupation", "tags"),
           "entering the rollout phase resumes them"),
    Relied("method", ENGINE, "Engine", ("update_weights_from_tensor", "named_tensors", "load_format", "flush_cache"),
           "the trained policy's weights are copied into SGLang's model before each rollout"),
    Relied("method", ENGINE, "Engine", ("shutdown",), "the rollout backend's close() stops SGLang's processes"),
    # ---- SGLang in its own process (remote.py): weights serialized in the trainer's process -----------
    Relied("calls", ENGINE, "Engine.update_weights_from_tensor",
           ("UpdateWeightsFromTensorReqInput", "self.tokenizer_manager.update_weights_from_tensor",
            "self.loop.run_until_complete"),
           "the engine process sends the trainer's pre-serialized weights the way Engine.update_weights_from_tensor "
           "sends its own: one request to the tokenizer manager, on the engine's loop"),
    Relied("calls", ENGINE, "Engine", ("MultiprocessingSerializer.serialize",),
           "the payload is SGLang's serialization of the (name, tensor) list, one per TP rank"),
    Relied("self_attr", ENGINE, "Engine", ("tokenizer_manager",), "the engine process reaches it for that request"),
    Relied("calls", UTILS, "MultiprocessingSerializer.serialize", ("ForkingPickler",),
           "that serialization is a ForkingPickler dump (CUDA tensors as IPC handles), which the trainer's process "
           "makes without importing SGLang"),
    Relied("fields", IO_STRUCT, "UpdateWeightsFromTensorReqInput", ("serialized_named_tensors", "load_format",
                                                                    "flush_cache"),
           "the weight update request the engine process builds"),
    Relied("server_args", SERVER_ARGS, "ServerArgs", ("tp_size",),
           "one serialized payload per tensor-parallel rank"),
    Relied("server_args", SERVER_ARGS, "ServerArgs", MANAGED_SERVER_ARGS,
           "the rollout backend starts the Engine on the policy's checkpoint with these server arguments"),
    Relied("server_args", SERVER_ARGS, "ServerArgs", tuple(a for a in BENCH_SERVER_ARGS if a not in SERVER_ARG_RENAMES),
           "the SGLang benches start the Engine with these (dummy weights, token ids, the attention backends)"),
    *(Relied("server_args", SERVER_ARGS, "ServerArgs", (old,), f"a bench argument, renamed {new} in {since}",
             before=since) for old, (new, since) in SERVER_ARG_RENAMES.items()),
    *(Relied("server_args", SERVER_ARGS, "ServerArgs", (new,), f"the bench argument {old}, renamed", since=since)
      for old, (new, since) in SERVER_ARG_RENAMES.items()),
    Relied("constant", CONSTANTS, "", ("GPU_MEMORY_TYPE_KV_CACHE",), "memory tag of the KV cache", "kv_cache"),
    Relied("constant", CONSTANTS, "", ("GPU_MEMORY_TYPE_WEIGHTS",), "memory tag of the weights", "weights"),
    Relied("constant", CONSTANTS, "", ("GPU_MEMORY_TYPE_CUDA_GRAPH",), "memory tag of the CUDA graphs",
           "cuda_graph"),
    Relied("fields", IO_STRUCT, "ReleaseMemoryOccupationReqInput", ("tags",), "release takes a tag list"),
    Relied("fields", IO_STRUCT, "ResumeMemoryOccupationReqInput", ("tags",), "resume takes a tag list"),
    # ---- the scheduler process: the shim swaps the Scheduler class in --------------------------------
    Relied("function", SCHEDULER, "", ("run_scheduler_process",),
           "the shim runs SGLang's own scheduler process function (arguments passed through unchanged)"),
    Relied("calls", SCHEDULER, "run_scheduler_process", ("Scheduler",),
           "it builds the scheduler by the module-level name the shim rebinds in the child process"),
    # ---- the decode hook --------------------------------------------------------------------------
    Relied("method", SCHEDULER, "Scheduler", ("run_batch", "batch"),
           "wrapped: every batch launch passes through it, with the batch first"),
    Relied("method", SCHEDULER, "Scheduler", ("event_loop_normal",), "the event loop without overlap"),
    Relied("method", SCHEDULER, "Scheduler", ("event_loop_overlap",), "the event loop with overlap scheduling"),
    Relied("calls", SCHEDULER, "Scheduler.event_loop_normal", ("self.run_batch",),
           "it launches batches through run_batch, so the wrapper sees each decode launch"),
    Relied("calls", SCHEDULER, "Scheduler.event_loop_overlap", ("self.run_batch",),
           "it launches batches through run_batch, so the wrapper sees each decode launch"),
    Relied("self_attr", SCHEDULER, "Scheduler", ("waiting_queue",), "DecodeStepInfo.num_waiting is its length"),
    Relied("self_attr", SCHEDULER, "Scheduler", ("enable_overlap",),
           "with overlap the forward runs on forward_stream, where decode steps are timed"),
    Relied("self_attr", SCHEDULER, "Scheduler", ("forward_stream",), "the stream decode runs on with overlap"),
    Relied("method", FORWARD, "ForwardMode", ("is_decode",), "decode launches are told apart from prefill"),
    Relied("fields", BATCH, "ScheduleBatch", ("forward_mode",), "the batch's forward mode"),
    Relied("method", BATCH, "ScheduleBatch", ("batch_size",), "DecodeStepInfo.batch_size"),
    Relied("absent", SCHEDULER, "Scheduler", (RPC_METHOD, DRIVER_ATTR),
           "the names the patched Scheduler adds do not shadow SGLang's"),
    # ---- control RPCs -----------------------------------------------------------------------------
    Relied("method", SCHEDULER, "Scheduler", ("flush_cache",),
           "the patched scheduler clears the multimodal embedding cache when SGLang flushes its caches (a weight "
           "update flushes): encodings of the old policy's vision tower must not serve a repeated image"),
    Relied("global", MM_UTILS, "", ("embedding_cache",), "the multimodal embedding cache the flush clears",
           before="0.5.23"),
    Relied("global", MM_SCHEDULE, "", ("embedding_cache",), "the multimodal embedding cache the flush clears "
           "(moved out of mm_utils)", since="0.5.23"),
    Relied("method", SCHEDULER, "Scheduler", ("handle_rpc_request", "recv_req"),
           "collective_rpc arrives here in each scheduler process"),
    Relied("calls", SCHEDULER, "Scheduler.handle_rpc_request", ("getattr", "**parameters"),
           "it calls the scheduler's method named by the request with the parameters as keywords"),
    Relied("fields", IO_STRUCT, "RpcReqInput", ("method", "parameters"), "the RPC request"),
    Relied("str_values", IO_STRUCT, "RpcReqInput", ("parameters",),
           "RPC parameters are flat strings (paths of the files that carry payloads and results)"),
    Relied("fields", IO_STRUCT, "RpcReqOutput", ("success", "message"),
           "the RPC reply has no payload: results come back through files"),
    # ---- the weight layout ------------------------------------------------------------------------
    Relied("method", QWEN_VL, "Qwen2_5_VLForConditionalGeneration", ("load_weights", "weights"),
           "update_weights_from_tensor hands the named tensors to the model's loader"),
    Relied("strings", QWEN_VL, "Qwen2_5_VLForConditionalGeneration.load_weights",
           (".q_proj", ".k_proj", ".v_proj", "gate_proj", "up_proj"),
           "it fuses split q/k/v and gate/up weights: Rollplex sends HF names (rollplex_to_hf)"),
    # ---- the Qwen3-VL weight layout (tests/test_sglang_qwen3_vl.py runs load_weights' own source) --------
    Relied("method", QWEN3_VL, "Qwen3VLForConditionalGeneration", ("load_weights", "weights"),
           "update_weights_from_tensor hands the named tensors to the Qwen3-VL model's loader"),
    Relied("strings", QWEN3_VL, "Qwen3VLForConditionalGeneration.load_weights",
           (".q_proj", ".k_proj", ".v_proj", "gate_proj", "up_proj", "model.language_model.", "model.",
            "model.visual.", "visual.", "attn.qkv.", "attn.qkv_proj.", "model.embed_tokens.weight",
            "lm_head.weight"),
           "it takes the released names (model.language_model.*, model.visual.*), fuses the text side's split "
           "q/k/v and gate/up, takes the tower's fused attn.qkv, and skips names it does not know: Rollplex "
           "sends exactly the released names (rollplex_to_hf)"),
    Relied("calls", QWEN3_VL, "Qwen3VLForConditionalGeneration.load_weights",
           ("self.named_parameters", "get_layer_id", "name.replace"),
           "names are matched against the model's own parameters after the renames (the loader test runs this "
           "method's source against the parameters below)"),
    Relied("self_attr", QWEN3_VL, "Qwen3VLForConditionalGeneration", ("visual", "model", "lm_head"),
           "the model's parameters are visual.*, model.* and lm_head.* (the embedding itself when tied)"),
    Relied("self_attr", QWEN3_VL, "Qwen3VLMoeVisionModel",
           ("patch_embed", "pos_embed", "blocks", "merger", "deepstack_merger_list"),
           "the vision tower's parameters: patch embedding, learned positions, blocks, merger, DeepStack mergers"),
    Relied("self_attr", QWEN3_VL, "Qwen3VLVisionPatchEmbed", ("proj",),
           "the patch embedding is a Conv3d-shaped proj.weight [hidden, C, T, P, P] with a bias"),
    Relied("self_attr", QWEN3_VL, "Qwen3_VisionBlock", ("norm1", "norm2", "attn", "mlp"), "a vision block"),
    Relied("self_attr", QWEN3_VL, "Qwen3_VisionMLP", ("linear_fc1", "linear_fc2"), "the vision MLP (no gate)"),
    Relied("self_attr", QWEN3_VL, "Qwen3VLMoeVisionPatchMerger", ("norm", "linear_fc1", "linear_fc2"),
           "the merger and each DeepStack merger"),
    Relied("self_attr", VISION_ATTN, "VisionAttention", ("qkv_proj", "proj"),
           "the tower's attention: fused qkv_proj (loaded from attn.qkv) and proj"),
    Relied("self_attr", QWEN3, "Qwen3Attention", ("qkv_proj", "o_proj", "q_norm", "k_norm"),
           "the text attention: fused qkv_proj, o_proj and the q/k RMSNorms"),
    Relied("self_attr", QWEN3, "Qwen3DecoderLayer", ("self_attn", "mlp", "input_layernorm",
                                                    "post_attention_layernorm"), "a text layer"),
    Relied("self_attr", QWEN2, "Qwen2MLP", ("gate_up_proj", "down_proj"), "the text MLP (Qwen3MLP is Qwen2MLP)"),
    Relied("self_attr", QWEN2, "Qwen2Model", ("embed_tokens", "layers", "norm"), "the text model"),
    Relied("function", LAYER_UTILS, "", ("get_layer_id", "weight_name"),
           "the loader reads a name's layer index with it (the loader test runs its source too)"),
    Relied("strings", ROPE_OLD, "get_rope", ("mrope_section", "mrope_interleaved"),
           "interleaved M-RoPE is on only where config.json's rope_scaling says mrope_interleaved (write_model_dir "
           "writes it, as the released checkpoints do)", before="0.5.17"),
    Relied("strings", ROPE_FACTORY, "get_rope", ("mrope_section", "mrope_interleaved"),
           "interleaved M-RoPE is on only where config.json's rope_scaling says mrope_interleaved (get_rope moved "
           "into a package)", since="0.5.17"),
    Relied("strings", MM_QWEN_VL, "QwenVLImageProcessor", ("qwen3_vl",),
           "the Qwen-VL processor serves Qwen3-VL (model_type qwen3_vl): processor_output items as for Qwen2.5-VL"),
    Relied("calls", MM_QWEN_VL, "QwenVLImageProcessor", ("self._compute_image_only_mrope_positions_from_offsets",),
           "Qwen3-VL image-only prompts get M-RoPE positions from each item's offsets and image_grid_thw; a "
           "processor_output item with several images falls back to get_rope_index on the items' grids",
           since=IMAGE_PROMPTS_MIN_VERSION),
    Relied("calls", MM_QWEN_VL, "QwenVLImageProcessor.process_mm_data_async", ("self._is_preprocessed_input",),
           "Qwen3-VL requests with processor_output images take the uncached path (the one that reads the items' "
           "grids), not the cached image-artifact path", since="0.5.23"),
    # ---- the rollout's requests and answers (outputs.py) ------------------------------------------------
    Relied("fields", SAMPLING, "SamplingParams", ROLLOUT_SAMPLING,
           "every sample is its own request (n = 1) with a seed: the native engine's sampling parameters"),
    Relied("strings", TOKENIZER, "TokenizerManager._handle_batch_output",
           ("text", "output_ids", "meta_info", "finish_reason", "prompt_tokens"),
           "each answer is {text, output_ids, meta_info: {finish_reason, prompt_tokens, ...}}"),
    Relied("strings", TOKENIZER, "TokenizerManager.add_logprob_to_meta_info", ("output_token_logprobs",),
           "the sampled tokens' logprobs come back in meta_info"),
    Relied("method", TOKENIZER, "TokenizerManager",
           ("detokenize_logprob_tokens", "token_logprobs_val", "token_logprobs_idx"),
           "output_token_logprobs entries are (logprob, token id, text) triples"),
    Relied("method", BATCH, "Req", ("output_ids_through_stop",),
           "output_ids run through the stop token, the sampled EOS included, as the native engine's"),
    Relied("strings", BATCH, "FINISH_MATCHED_TOKEN.to_json", ("type", "stop", "matched"),
           "a stop token ends a sample: {type: stop, matched: token id}"),
    Relied("strings", BATCH, "FINISH_MATCHED_STR.to_json", ("type", "stop", "matched"),
           "a stop string ends a sample: {type: stop, matched: the string}"),
    Relied("strings", BATCH, "FINISH_LENGTH.to_json", ("type", "length"), "max_new_tokens ends a sample"),
    Relied("strings", BATCH, "FINISH_ABORT.to_json", ("type", "abort"), "an aborted sample"),
    Relied("strings", MM_BASE, "BaseMultimodalProcessor", ("processor_output",),
           "an image prompt's preprocessed images go as one processor_output item, not re-processed"),
    Relied("strings", MM_BASE, "BaseMultimodalProcessor.__init__", ("pixel_values", "image_grid_thw"),
           "the processor_output item carries the prompt's pixel_values and image_grid_thw"),
    Relied("calls", MM_QWEN_VL, "QwenVLImageProcessor", ("self._get_grid_from_output_or_items",),
           "M-RoPE positions of processor_output images come from the item's image_grid_thw (in "
           "process_mm_data_async in 0.5.17, in _process_mm_data_uncached in 0.5.23)",
           since=IMAGE_PROMPTS_MIN_VERSION),
    # ---- what rollplex/server mirrors ---------------------------------------------------------------
    Relied("fields", IO_STRUCT, "GenerateReqInput", tuple(f for f in GENERATE_FIELDS if f not in DP_RANK_FIELDS),
           "rollplex/server's /generate accepts these SGLang request fields"),
    Relied("any_field", IO_STRUCT, "GenerateReqInput", DP_RANK_FIELDS,
           "rollplex/server's /generate accepts (and ignores) data_parallel_rank; 0.5.17 names it routed_dp_rank, "
           "0.5.23 takes both"),
    Relied("fields", SAMPLING, "SamplingParams", SAMPLING_FIELDS,
           "rollplex/server's sampling_params accepts these SGLang names"),
)
