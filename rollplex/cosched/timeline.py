"""The phase timeline: what ran when, as a Chrome/Perfetto trace and a PNG.

Spans are (lane, name, start, end, args) in seconds from the timeline's origin. Host-timed spans
(phases) come from `perf_counter`; device-timed spans (decode steps, admitted chunks) are recorded as
CUDA events while the work runs and resolved to times once, at the end (`resolve`), so recording
never makes the host wait. On CPU, device spans are host times.

    write_trace(path)  Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev)
    plot(path)         decode step time and admitted work over the rollout (matplotlib, optional)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Span:
    lane: str  # "phase", "decode", "cosched"
    name: str
    start: float  # seconds from the origin
    end: float
    args: dict = field(default_factory=dict)


class Timeline:
    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.t0 = time.perf_counter()
        self.origin = None
        if self.cuda:
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
        self.spans: list[Span] = []
        self._pending: list[tuple[str, str, object, object, dict]] = []

    def now(self):
        """A mark on the current stream (CUDA event) or the host clock."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def host_span(self, lane: str, name: str, start: float, end: float, **args) -> None:
        """A span timed on the host with perf_counter (absolute values)."""
        self.spans.append(Span(lane, name, start - self.t0, end - self.t0, args))

    def device_span(self, lane: str, name: str, start, end, **args) -> None:
        """A span between two marks from `now()` (resolved later)."""
        self._pending.append((lane, name, start, end, args))

    def resolve(self) -> None:
        """Turn pending device marks into times (waits for them)."""
        for lane, name, a, b, args in self._pending:
            if self.cuda:
                b.synchronize()
                # device and host clocks share the origin: both marks were taken at construction
                s, e = self.origin.elapsed_time(a) / 1e3, self.origin.elapsed_time(b) / 1e3
            else:
                s, e = a - self.t0, b - self.t0
            self.spans.append(Span(lane, name, s, e, args))
        self._pending.clear()

    def write_trace(self, path: str | Path) -> Path:
        self.resolve()
        lanes = {lane: i for i, lane in enumerate(dict.fromkeys(s.lane for s in self.spans))}
        events = [{"name": s.name, "ph": "X", "ts": s.start * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6,
                   "pid": 0, "tid": lanes[s.lane], "args": s.args} for s in self.spans]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
                   for lane, i in lanes.items()]
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path

    def plot(self, path: str | Path, title: str = "rollout with co-scheduled prefix work") -> Path | None:
        """Decode step time and admitted prefix work per step -> PNG; None without matplotlib."""
        self.resolve()
        return plot_spans(self.spans, Path(path), title)


class DecodeMarks:
    """A decode-loop hook (engine/hooks.py) that puts each decode step on a timeline's "decode" lane: the
    span from one step's launch to the next's, with its running batch size (`close` resolves them)."""

    def __init__(self, timeline: Timeline):
        self.timeline = timeline
        self._marks: list[tuple[int, int, object]] = []

    def on_decode_step(self, info) -> None:
        self._marks.append((info.step, info.batch_size, self.timeline.now()))

    def close(self) -> None:
        """The spans between consecutive steps (the last step's end is the mark made now)."""
        if not self._marks:
            return
        self._marks.append((-1, 0, self.timeline.now()))
        for (step, bs, m), nxt in zip(self._marks, self._marks[1:]):
            self.timeline.device_span("decode", f"step {step}", m, nxt[2], batch_size=bs)
        self._marks.clear()


def load_trace(path: str | Path) -> list[Span]:
    data = json.loads(Path(path).read_text())
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    return [Span(names.get(e["tid"], str(e["tid"])), e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                 e.get("args", {})) for e in data["traceEvents"] if e["ph"] == "X"]


def plot_spans(spans: list[Span], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    dec = sorted((s for s in spans if s.lane == "decode"), key=lambda s: s.start)
    work = [s for s in spans if s.lane in ("cosched", "fused")]
    phases = [s for s in spans if s.lane == "phase"]
    fig, ax = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if dec:
        ax[0].plot([s.start for s in dec], [(s.end - s.start) * 1e3 for s in dec], lw=0.8, label="decode step")
        loaded = [s for s in dec if s.args.get("admitted_ms", 0) > 0]
        if loaded:
            ax[0].scatter([s.start for s in loaded], [(s.end - s.start) * 1e3 for s in loaded], s=4, c="tab:red",
                          label="step with prefix work beside it", zorder=3)
        ax2 = ax[0].twinx()
        ax2.plot([s.start for s in dec], [s.args.get("batch_size", 0) for s in dec], c="gray", lw=0.6, ls="--")
        ax2.set_ylabel("running sequences", color="gray")
    ax[0].set(ylabel="ms", title=title)
    ax[0].legend(loc="upper left", fontsize=8)
    colors = {}
    for s in work:
        kind = s.name.split("/")[0]
        c = colors.setdefault(kind, f"C{len(colors) + 2}")
        ax[1].barh(1, s.end - s.start, left=s.start, height=0.8, color=c)
    for s in phases:
        ax[1].barh(0, s.end - s.start, left=s.start, height=0.8, alpha=0.5)
        ax[1].text(s.start, 0, s.name, fontsize=7, va="center")
    ax[1].set_yticks([0, 1], ["phases", "fused groups" if any(s.lane == "fused" for s in work) else "prefix work"])
    ax[1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    """`python -m rollplex.cosched.timeline TRACE.json OUT.png`: draw a written trace."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m rollplex.cosched.timeline", description=main.__doc__)
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--title", default="rollout with co-scheduled prefix work")
    args = ap.parse_args(argv)
    out = plot_spans(load_trace(args.trace), Path(args.png), args.title)
    print(out if out is not None else "matplotlib is not installed: pip install 'rollplex[plot]'")


if __name__ == "__main__":
    main()
