"""A scheduler with SGLang's shape: both event loops launch batches through run_batch, RPCs dispatch by
getattr with keyword parameters, run_scheduler_process builds `Scheduler` by its module-level name.

server_args (a dict): "loop" ("normal" | "overlap"), "script" (batches to run at start:
(mode name, batch size, waiting, device ms) tuples), "device" (a FakeDevice-like object whose `t` the
batches advance), "log" (a list that run_batch appends ("launch", mode, size) to).
port_args: a multiprocessing Connection that brings RpcReqInput, ("script", [...]) and ("shutdown",)
messages, or None: run the initial script and return.
"""

import os
from collections import deque

from sglang.srt.managers.io_struct import RpcReqInput, RpcReqOutput
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode


def _batch(item) -> ScheduleBatch:
    mode, size, waiting, ms = item
    b = ScheduleBatch(forward_mode=ForwardMode[mode], size=size, duration_ms=ms)
    b.waiting = waiting
    return b


class Scheduler:
    def __init__(self, server_args, port_args):
        self.server_args = server_args
        self.conn = port_args
        self.enable_overlap = server_args.get("loop") == "overlap"
        self.forward_stream = "forward-stream"
        self.device = server_args.get("device")
        self.log = server_args.get("log", [])
        self.waiting_queue = []
        self.pending = deque(_batch(x) for x in server_args.get("script", []))
        self.to_process = 0
        self.script_done_reply = False
        self.gracefully_exit = False
        self.last_batch = None
        self.forward_ct = 0

    # ---- requests ----------------------------------------------------------------------------
    def ingest_requests(self):
        if self.conn is None:
            if not self.pending and self.to_process == 0:
                self.gracefully_exit = True
            return
        while self.conn.poll(0 if (self.pending or self.to_process) else None):
            msg = self.conn.recv()
            if isinstance(msg, RpcReqInput):
                self.conn.send(self.handle_rpc_request(msg))
            elif msg[0] == "script":
                self.pending.extend(_batch(x) for x in msg[1])
                self.script_done_reply = True
            elif msg[0] == "shutdown":
                self.gracefully_exit = True
            if self.gracefully_exit or self.pending:
                return

    def handle_rpc_request(self, recv_req: RpcReqInput):
        success, exec = True, None
        try:
            func = getattr(self, recv_req.method)
            if recv_req.parameters is not None:
                func(**recv_req.parameters)
            else:
                func()
        except Exception as e:
            success, exec = False, e
        return RpcReqOutput(success=success, message="" if not exec else str(exec))

    def flush_cache(self, empty_cache: bool = True):
        """SGLang's answer: False (nothing flushed) while requests are queued."""
        self.log.append(("flush_cache", not self.waiting_queue))
        return not self.waiting_queue

    def get_next_batch_to_run(self):
        if not self.pending:
            return None
        batch = self.pending.popleft()
        self.waiting_queue = [None] * batch.waiting
        return batch

    # ---- batches -----------------------------------------------------------------------------
    def run_batch(self, batch, pp_proxy_tensors=None):
        self.forward_ct += 1
        self.log.append(("launch", batch.forward_mode.name, batch.batch_size()))
        if self.device is not None:
            self.device.t += batch.duration_ms
        self.to_process += 1
        return {"forward_ct": self.forward_ct}

    def process_batch_result(self, batch, result):
        self.to_process -= 1
        if self.script_done_reply and not self.pending and self.to_process == 0:
            self.script_done_reply = False
            self.conn.send(("done", self.forward_ct))

    def event_loop_normal(self):
        while True:
            self.ingest_requests()
            if self.gracefully_exit:
                break
            batch = self.get_next_batch_to_run()
            if batch:
                result = self.run_batch(batch)
                self.process_batch_result(batch, result)
            self.last_batch = batch

    def event_loop_overlap(self):
        self.result_queue = deque()
        while True:
            self.ingest_requests()
            if self.gracefully_exit:
                break
            batch = self.get_next_batch_to_run()
            if batch:
                batch_result = self.run_batch(batch)
                self.result_queue.append((batch, batch_result))
            if self.last_batch:
                tmp_batch, tmp_result = self.result_queue.popleft()
                self.process_batch_result(tmp_batch, tmp_result)
            self.last_batch = batch

    def run_event_loop(self):
        if self.enable_overlap:
            self.event_loop_overlap()
        else:
            self.event_loop_normal()


def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer):
    scheduler = Scheduler(server_args, port_args)
    pipe_writer.send({"status": "ready", "scheduler_class": type(scheduler).__name__, "pid": os.getpid()})
    scheduler.run_event_loop()
    return scheduler
