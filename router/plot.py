"""Draw quality against strong-call share, with the random and oracle baselines."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from router.metrics import RoutingCurve, apgr, routing_curve


def plot_curves(path: str | Path, curves: dict[str, RoutingCurve], weak: np.ndarray, strong: np.ndarray,
                title: str = "Router quality") -> None:
    """Write a PNG (atomically). `curves` maps a label to a router's curve; the oracle and random
    baselines are added from the labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    weak = np.asarray(weak, dtype=bool)
    strong = np.asarray(strong, dtype=bool)
    oracle = routing_curve(strong.astype(int) - weak.astype(int), weak, strong)
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for label, c in curves.items():
        ax.plot(c.share * 100, c.quality * 100, lw=2, label=f"{label} (APGR {apgr(c):.3f})")
    any_curve = next(iter(curves.values()), oracle)
    ax.plot([0, 100], [any_curve.weak_quality * 100, any_curve.strong_quality * 100], "--", color="grey",
            label="random (APGR 0.500)")
    ax.plot(oracle.share * 100, oracle.quality * 100, ":", color="black", label=f"oracle (APGR {apgr(oracle):.3f})")
    ax.axhline(any_curve.weak_quality * 100, color="tab:red", lw=0.8, alpha=0.5)
    ax.axhline(any_curve.strong_quality * 100, color="tab:green", lw=0.8, alpha=0.5)
    ax.set_xlabel("calls to the strong model (%)")
    ax.set_ylabel("quality: share answered correctly (%)")
    ax.set_title(title)
    ax.set_xlim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
