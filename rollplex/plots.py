"""Training curves as a PNG: mean reward and throughput per step, from verl-named metric dicts.

matplotlib is optional (`pip install 'rollplex[plot]'`): without it nothing is drawn.
"""

from __future__ import annotations

from pathlib import Path


def plot_rewards(history: list[dict], path: Path) -> Path | None:
    """Reward (with the shape-colour task's chance level) and tokens/s per step -> path, or None
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [h["training/global_step"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    ax[0].plot(steps, [h["critic/score/mean"] for h in history], marker="o", ms=3)
    ax[0].axhline(0.25, ls="--", c="gray", lw=1, label="chance")
    ax[0].set(xlabel="step", ylabel="mean reward", title="shape colour: reward", ylim=(0, 1.05))
    ax[0].legend()
    ax[1].plot(steps, [h["perf/throughput"] for h in history], marker="o", ms=3, c="tab:orange")
    ax[1].set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
