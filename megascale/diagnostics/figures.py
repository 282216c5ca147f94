"""Writing the analysers' matplotlib figures. matplotlib is imported only when a figure is
drawn, so the driver and the trainer never pay for it."""

from __future__ import annotations

from pathlib import Path


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write as PNG (creating the folder) and free the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
