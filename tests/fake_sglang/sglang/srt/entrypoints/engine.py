"""An Engine with SGLang's shape: launches `self.run_scheduler_process_func` in a spawned process and
reaches it by collective_rpc. `run_script(script)` (in place of generate) runs batches there and waits for their results."""

import multiprocessing as mp

from sglang.srt.managers.io_struct import RpcReqInput, RpcReqOutput
from sglang.srt.managers.scheduler import run_scheduler_process


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

    def resume_memory_occupation(self, tags=None):
        self.memory_calls.append(("resume", tags))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.memory_calls.append(("update", [n for n, _ in named_tensors], flush_cache))

    def shutdown(self):
        if self.proc.is_alive():
            self.send_to_rpc.send(("shutdown",))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
