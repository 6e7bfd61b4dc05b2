"""Draw docs/deploy-diagram.png: how codraft's pieces talk on Kubernetes.

    python k8s/diagram.py            # writes docs/deploy-diagram.png

Boxes are objects of the manifests in k8s/ (names as rendered); arrows are connections, labelled
with port and protocol; the dashed frames are what the NetworkPolicies admit.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "deploy-diagram.png"
COLORS = {
    "client": "#e8e8e8",
    "server": "#cfe3ff",
    "learner": "#d7f2d0",
    "service": "#fff2c2",
    "storage": "#f6d9d0",
    "config": "#ece0f7",
}


def box(ax, x, y, w, h, title, lines=(), kind="server"):
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            fc=COLORS[kind],
            ec="#444444",
            lw=1.2,
        )
    )
    ax.text(x + w / 2, y + h - 0.18, title, ha="center", va="top", fontsize=10, weight="bold")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.52 - 0.27 * i, line, ha="center", va="top", fontsize=8)


def arrow(ax, start, end, label, color="#222222", style="-|>", rad=0.0, at=0.5, dy=0.12):
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle=style,
            mutation_scale=14,
            lw=1.4,
            color=color,
            connectionstyle=f"arc3,rad={rad}",
        )
    )
    x = start[0] + (end[0] - start[0]) * at
    y = start[1] + (end[1] - start[1]) * at + dy
    ax.text(
        x,
        y,
        label,
        ha="center",
        va="bottom",
        fontsize=8,
        color=color,
        bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1},
    )


def draw(out: Path = OUT) -> Path:
    fig, ax = plt.subplots(figsize=(15, 9.2))
    ax.set_xlim(0, 15)
    ax.set_ylim(0, 9.2)
    ax.axis("off")
    ax.set_title("codraft on Kubernetes (namespace codraft)", fontsize=14, weight="bold")

    # Clients and the OpenAI Service.
    box(ax, 0.2, 7.2, 2.9, 1.4, "rollout workers", ["any OpenAI client"], "client")
    box(
        ax,
        0.2,
        4.9,
        2.9,
        1.5,
        "RL trainer",
        ["pushes policy weights", "(rl-trainer-access)"],
        "client",
    )
    box(ax, 3.9, 7.4, 2.6, 1.1, "Service codraft-server", ["ClusterIP :8000 (http)"], "service")
    box(ax, 3.9, 4.9, 2.6, 1.5, "Service", ["codraft-server-control", "headless :8001"], "service")

    # Server pods.
    box(
        ax,
        7.3,
        4.6,
        3.3,
        4.1,
        "Deployment codraft-server",
        [
            "replicas N (PDB: 1 down at most)",
            "codraft serve = vLLM + plugin",
            ":8000 OpenAI API",
            ":8001 control, Bearer token",
            "  /v1/draft /v1/policy /v1/tap",
            "  /metrics /health /ready",
            "1 GPU per pod",
        ],
        "server",
    )

    # Learner pods and their headless Service.
    box(
        ax,
        7.3,
        0.6,
        3.3,
        3.1,
        "StatefulSet codraft-learner",
        [
            "pods learner-0 .. learner-(M-1)",
            "torchrun, G ranks per pod",
            "rank 0: ZeroMQ PULL :5557",
            ":9100 /metrics /health",
            "c10d rendezvous on learner-0",
        ],
        "learner",
    )
    box(
        ax,
        11.5,
        0.5,
        3.3,
        1.5,
        "Service codraft-learner",
        ["headless, not-ready pods too", ":29400 rdzv  :5557 tap"],
        "service",
    )

    # Storage and configuration.
    box(
        ax,
        11.5,
        4.7,
        3.3,
        1.7,
        "PVC codraft-checkpoints",
        ["ReadWriteMany, /checkpoints", "learner writes, server reads"],
        "storage",
    )
    box(
        ax,
        11.5,
        7.0,
        3.3,
        1.6,
        "PVC codraft-models",
        [
            "gpu overlays: /models/target,",
            "read-only by both pods;",
            "cpu-demo: model in the image",
        ],
        "storage",
    )
    box(
        ax,
        11.5,
        2.5,
        3.3,
        1.6,
        "ConfigMap codraft-config",
        ["$(VAR)s in every command line", "Secret codraft-control-token"],
        "config",
    )
    box(
        ax,
        0.2,
        0.6,
        5.8,
        2.6,
        "NetworkPolicies (ingress)",
        [
            "server :8000  <- anyone",
            "server :8001  <- learner pods only",
            "  (+ labelled RL trainers with the component)",
            "learner :5557 <- server pods only",
            "learner, any port <- learner pods (NCCL)",
            "learner :9100 <- anyone (metrics)",
        ],
        "config",
    )

    # Connections.
    arrow(ax, (3.1, 7.9), (3.9, 7.95), "HTTP")
    arrow(ax, (6.5, 7.95), (7.3, 7.95), ":8000")
    arrow(ax, (3.1, 5.6), (3.9, 5.6), "POST /v1/policy")
    arrow(ax, (6.5, 5.6), (7.3, 5.6), ":8001 to every pod", at=0.5)
    arrow(
        ax,
        (8.4, 3.7),
        (6.3, 4.9),
        "POST /v1/draft {path}",
        color="#1d6b1d",
        rad=-0.15,
        at=0.55,
        dy=-0.05,
    )
    arrow(
        ax,
        (9.6, 4.6),
        (9.6, 3.7),
        "ZeroMQ PUSH tap\n-> rank 0",
        color="#1f4fa3",
        at=0.5,
        dy=-0.25,
    )
    arrow(ax, (10.6, 1.3), (11.5, 1.3), "DNS", style="<|-|>")
    arrow(ax, (10.6, 3.3), (11.5, 4.9), "writes ckpt-N/draft", color="#8a3b12", at=0.5, dy=-0.1)
    arrow(ax, (11.5, 5.8), (10.6, 5.8), "reads the posted path", color="#8a3b12")
    arrow(ax, (11.5, 7.8), (10.6, 7.8), "model", color="#8a3b12")
    arrow(ax, (11.5, 3.0), (10.6, 2.5), "env, token (both pods)", color="#5b3a85", at=0.0, dy=-0.5)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(draw())
