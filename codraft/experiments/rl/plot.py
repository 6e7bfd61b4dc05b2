"""The RL run's figure: acceptance length, rollout time and reward per RL step, one line per arm."""

from __future__ import annotations

from pathlib import Path

COLORS = {"nospec": "tab:gray", "frozen": "tab:red", "cotrain": "tab:green"}


def plot_arms(arms: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for name, steps in arms.items():
        xs = [s["step"] for s in steps]
        color = COLORS.get(name)
        acc = [(s["step"], s["acceptance_length"]) for s in steps if s["acceptance_length"]]
        if acc:
            a.plot(*zip(*acc, strict=True), marker="o", color=color, label=f"{name} rollouts")
        probe = [(s["step"], s["probe"]["acceptance_length"]) for s in steps]
        probe = [(x, y) for x, y in probe if y is not None]
        if probe:
            a.plot(*zip(*probe, strict=True), ls="--", marker="x", color=color,
                   label=f"{name} greedy probes")  # fmt: skip
        b.plot(xs, [s["rollout_s"] for s in steps], marker="o", color=color, label=name)
        c.plot(xs, [s["reward_mean"] for s in steps], marker="o", color=color, label=name)
    a.set_ylabel("acceptance length\n(tokens / verification)")
    b.set_ylabel("rollout wall time (s)")
    c.set_ylabel("mean reward")
    c.set_xlabel("RL step (policy version)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
