"""What the fake SGLang Engine generates with, and how its weights and memory behave (tests only).

`TinyRuntime(model_path)` loads the checkpoint as SGLang would and decodes with Rollplex's native engine
over that copy, answering in SGLang's shape (tokenizer_manager's {"text", "output_ids", "meta_info"}),
so the rollout backend's adapter is tested against real tokens and logprobs:

    generate(input_ids, sampling_params, image_data, return_logprob)   one answer per request, in order;
                                    sampling_seed s draws as the native engine's seed s; refused while
                                    the KV cache is released
    update(named_tensors)           HF-named tensors loaded by name into its own copy (copied, never aliased)
    release(tags) / resume(tags)    "weights" released without a host backup lose their contents (NaN
                                    until every tensor is loaded again), as SGLang's memory saver does

SGLang's own copy is what makes the test meaningful: a trainer that forgets to copy its updated policy
in samples from the old (or NaN) weights here.
"""

from __future__ import annotations

import torch

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.models import ModelInputs, hf_to_rollplex, load_model, rollplex_to_hf

SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "ignore_eos",
            "skip_special_tokens", "sampling_seed"}


def _finish(sample) -> dict:
    if sample.finish_reason == "stop":
        return {"type": "stop", "matched": sample.matched_stop}
    if sample.finish_reason == "length":
        return {"type": "length", "length": len(sample.token_ids)}
    return {"type": "abort", "message": "aborted"}


class TinyRuntime:
    def __init__(self, model_path: str, weights_cpu_backup: bool = False):
        self.model = load_model(model_path).eval()
        self.engine = Engine(self.model, None, EngineConfig(max_num_seqs=256, max_model_len=512))
        self.hf = {k: v.detach().clone() for k, v in rollplex_to_hf(self.model.state_dict(), self.model.cfg).items()}
        self.backup = weights_cpu_backup
        self.released: set[str] = set()
        self.loads = 0  # update calls
        self.requests = 0

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, input_ids, sampling_params, image_data=None, return_logprob=False) -> list[dict]:
        if "kv_cache" in self.released:
            raise RuntimeError("generate while SGLang's KV cache is released")
        prompts, params = [], []
        for i, ids in enumerate(input_ids):
            item = image_data[i] if image_data is not None else None
            if item is not None:
                assert item["format"] == "processor_output", item
                prompts.append(ModelInputs(list(ids), pixel_values=item["pixel_values"],
                                           image_grid_thw=item["image_grid_thw"]))
            else:
                prompts.append(ModelInputs(list(ids)))
            sp = dict(sampling_params[i])
            unknown = set(sp) - SAMPLING
            assert not unknown, f"not an SGLang sampling parameter: {unknown}"
            sp["seed"] = sp.pop("sampling_seed", None)
            params.append(SamplingParams(**sp))
        with torch.no_grad():
            outs = self.engine.generate(prompts, params)
        answers = []
        for p, out in zip(prompts, outs):
            for s in out.samples:
                self.requests += 1
                meta = {"id": f"fake-{self.requests}", "finish_reason": _finish(s), "prompt_tokens": len(p.input_ids),
                        "completion_tokens": len(s.token_ids), "cached_tokens": 0}
                if return_logprob:
                    meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(s.logprobs, s.token_ids)]
                    meta["input_token_logprobs"] = []
                answers.append({"text": "", "output_ids": list(s.token_ids), "meta_info": meta})
        return answers

    # ---- weights and memory ---------------------------------------------------------------------------
    def update(self, named_tensors) -> None:
        if "weights" in self.released:
            raise RuntimeError("update_weights_from_tensor while SGLang's weights are released")
        for name, t in named_tensors:
            if name not in self.hf:
                raise KeyError(f"no parameter {name} in SGLang's model")
            self.hf[name] = t.detach().to(self.hf[name].dtype).clone()
        self._load()
        self.loads += 1

    def _load(self) -> None:
        with torch.no_grad():
            for k, v in hf_to_rollplex(self.hf, self.model.cfg).items():
                self.model.state_dict()[k].copy_(v)

    def release(self, tags) -> None:
        self.released |= set(tags)
        if "weights" in tags and not self.backup:  # the memory went back to the device: contents are lost
            for v in self.hf.values():
                v.fill_(float("nan"))
            self._load()

    def resume(self, tags) -> None:
        self.released -= set(tags)
