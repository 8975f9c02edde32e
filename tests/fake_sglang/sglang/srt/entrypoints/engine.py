"""An Engine with SGLang's shape: launches `self.run_scheduler_process_func` in a spawned process and
reaches it by collective_rpc. `run_script(script)` runs scripted batches there and waits for their results.
Weight updates go as SGLang's do: serialized, then the tokenizer manager's request on `self.loop`.

Started with `model_path`, it also generates with tiny_runtime.TinyRuntime (Rollplex's engine over its
own copy of the checkpoint, answers in SGLang's shape), and its weight and memory calls act on that
copy. Each `generate` also runs the matching prefill and decode batches through the scheduler process,
so its hook sees the rollout's decode steps. `async_generate` (on `self.loop`) answers a batch request
after 20 ms per token of its longest `max_new_tokens`, so requests sent together answer in the order
of their lengths, as from a scheduler decoding them side by side.
"""

import asyncio
import multiprocessing as mp

from sglang.srt.managers.io_struct import RpcReqInput, RpcReqOutput, UpdateWeightsFromTensorReqInput
from sglang.srt.managers.scheduler import run_scheduler_process
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.utils.common import MultiprocessingSerializer


class Engine:
    run_scheduler_process_func = staticmethod(run_scheduler_process)

    def __init__(self, **kwargs):
        self.server_args = kwargs
        self.memory_calls = []
        ctx = mp.get_context("spawn")
        self.send_to_rpc, child = ctx.Pipe()
        reader, writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=self.run_scheduler_process_func,
                                args=(kwargs, child, 0, 0, 0, None, writer), daemon=True)
        self.proc.start()
        if not reader.poll(120):
            self.proc.kill()
            raise RuntimeError("the scheduler process did not start")
        self.scheduler_info = reader.recv()
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = TokenizerManager(self)
        self.runtime = None
        if kwargs.get("model_path") is not None:
            from tiny_runtime import TinyRuntime

            self.runtime = TinyRuntime(kwargs["model_path"], kwargs.get("enable_weights_cpu_backup", False))

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, return_logprob=False):
        sampling_params = self._batch(prompt, input_ids, sampling_params)
        answers = self.runtime.generate(input_ids, sampling_params, image_data, return_logprob)
        lens = [len(a["output_ids"]) for a in answers]
        script = [("EXTEND", len(lens), 0, 1.0)]
        script += [("DECODE", sum(n > k for n in lens), 0, 1.0) for k in range(1, max(lens))]
        self.run_script(script)
        return answers

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                             return_logprob=False):
        sampling_params = self._batch(prompt, input_ids, sampling_params)
        await asyncio.sleep(0.02 * max(sp["max_new_tokens"] for sp in sampling_params))
        return self.runtime.generate(input_ids, sampling_params, image_data, return_logprob)

    def _batch(self, prompt, input_ids, sampling_params) -> list:
        """One sampling-params dict per request of a batch of input_ids (what the fake takes)."""
        if self.runtime is None:
            raise RuntimeError("this fake engine was started without model_path")
        if prompt is not None or input_ids is None or not isinstance(input_ids[0], list):
            raise NotImplementedError("the fake takes a batch of input_ids")
        return [sampling_params] * len(input_ids) if isinstance(sampling_params, dict) else sampling_params

    def collective_rpc(self, method: str, **kwargs):
        obj = RpcReqInput(method=method, parameters=kwargs)
        self.send_to_rpc.send(obj)
        recv_req = self.send_to_rpc.recv()
        assert isinstance(recv_req, RpcReqOutput)
        assert recv_req.success, recv_req.message

    def run_script(self, script):
        self.send_to_rpc.send(("script", list(script)))
        return self.send_to_rpc.recv()

    def release_memory_occupation(self, tags=None):
        self.memory_calls.append(("release", tags))
        if self.runtime is not None:
            self.runtime.release(tags)

    def resume_memory_occupation(self, tags=None):
        self.memory_calls.append(("resume", tags))
        if self.runtime is not None:
            self.runtime.resume(tags)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[MultiprocessingSerializer.serialize(
            named_tensors)], load_format=load_format, flush_cache=flush_cache)
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_tensor(obj, None))

    def shutdown(self):
        self.loop.close()
        if self.proc.is_alive():
            self.send_to_rpc.send(("shutdown",))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
