from dataclasses import dataclass

from sglang.srt.model_executor.forward_batch_info import ForwardMode


@dataclass
class ScheduleBatch:
    forward_mode: ForwardMode = None
    size: int = 0
    duration_ms: float = 1.0  # what the fake device spends on it

    def batch_size(self):
        return self.size
