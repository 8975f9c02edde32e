"""Training curves as a PNG: mean reward and throughput per step, from verl-named metric dicts.

The reward panel's title and its reference line come from the run's data: `reward_labels` names the
data sources of the rows trained on, and draws a chance line only for a task whose chance level is a
fact of the task (the embedded shape-colour task: one of four letters, 0.25). Other data gets its
data_source names and no line. A run that stops at a target (the demo) passes it and its window: the
panel then shows the target as a line and the statistic the run stops on, the mean reward of the last
`window` steps, as a curve beside the per-step rewards.

matplotlib is optional (`pip install 'rollplex[plot]'`): without it nothing is drawn.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .tiny import shape_color

# data_source -> (task name, reward of a policy that answers in the right format without knowing the answer)
KNOWN_TASKS = {shape_color.DATA_SOURCE: ("shape colour", shape_color.CHANCE)}


def reward_labels(data_sources: Iterable[str | None]) -> tuple[str, float | None]:
    """(title, chance level or None) of the reward panel for rows of these data sources."""
    names = sorted({s or "unknown" for s in data_sources})
    if len(names) == 1 and names[0] in KNOWN_TASKS:
        task, chance = KNOWN_TASKS[names[0]]
        return f"{task}: reward", chance
    if not names or names == ["unknown"]:
        return "mean reward", None
    shown = ", ".join(names) if len(names) <= 3 else f"{len(names)} data sources"
    return f"{shown}: reward", None


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the `window` - 1 before it (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def reward_figure(history: list[dict], title: str = "mean reward", chance: float | None = None,
                  target: float | None = None, window: int = 3):
    """The matplotlib Figure: reward per step (with a dashed chance line when `chance` is given; with
    `target`, a dotted target line and the mean of the last `window` steps, which a run stops on) and
    tokens/s per step. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["training/global_step"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    rewards = [h["critic/score/mean"] for h in history]
    ax[0].plot(steps, rewards, marker="o", ms=3, label="reward")
    if target is not None:
        ax[0].plot(steps, running_mean(rewards, window), c="tab:green", lw=1.5, label=f"mean of {window} steps")
        ax[0].axhline(target, ls=":", c="tab:red", lw=1, label=f"target ({target:g})")
    if chance is not None:
        ax[0].axhline(chance, ls="--", c="gray", lw=1, label=f"chance ({chance:g})")
    if chance is not None or target is not None:
        ax[0].legend(fontsize=7)
    # rewards in [0, 1] keep the fixed axis the demo's curves are compared on; other scales get matplotlib's
    if all(0.0 <= r <= 1.0 for r in rewards):
        ax[0].set_ylim(0, 1.05)
    ax[0].set(xlabel="step", ylabel="mean reward", title=title)
    ax[1].plot(steps, [h["perf/throughput"] for h in history], marker="o", ms=3, c="tab:orange")
    ax[1].set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    return fig


def plot_rewards(history: list[dict], path: Path, title: str = "mean reward",
                 chance: float | None = None, target: float | None = None, window: int = 3) -> Path | None:
    """`reward_figure` -> path (PNG), or None when matplotlib is missing."""
    try:
        fig = reward_figure(history, title, chance, target, window)
    except ImportError:
        return None
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
