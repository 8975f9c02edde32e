"""A decode hook for the scheduler-process tests: records every call, answers control ops."""

import os


class Recorder:
    def __init__(self, log=None):
        self.pid = os.getpid()
        self.log = log if log is not None else []  # ("on" | "after", step) in call order
        self.infos = []
        self.started = None

    def on_decode_step(self, info):
        self.infos.append(info)
        self.log.append(("on", info.step))

    def after_decode_launch(self, info):
        self.log.append(("after", info.step))

    def start_admission(self, tag: str):
        self.started = tag
        return {"tag": tag}

    def update_weights(self, weights_path: str):
        raise ValueError(f"no weights at {weights_path}")

    def metrics(self):
        return {"pid": self.pid, "started": self.started, "steps": [i.step for i in self.infos],
                "batch_sizes": [i.batch_size for i in self.infos], "waiting": [i.num_waiting for i in self.infos],
                "streams": [i.stream for i in self.infos], "calls": [list(x) for x in self.log]}


class NoHook:
    """Not a hook: it has no on_decode_step."""
