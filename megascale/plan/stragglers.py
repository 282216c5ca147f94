"""Stragglers and jitter: N ranks in lockstep wait for the slowest, so a step grows with N.

Every rank's busy time in a step is the planned time times a factor X drawn from a per-rank
distribution (clock and thermal variation, OS noise, a GC pause, a slower host). Collectives and
pipeline hops make every rank wait for the slowest, so the step's busy time is the expected
maximum of N draws, `E[max X_1..X_N]` times the planned time; the straggler term is the excess,
`(E[max] - 1) * busy`.

The distribution is either the empirical one of a measured run -- each rank's compute time in a
step over the mean of its stage peers in that step, read from the run's timer database; for K
sorted samples drawn with replacement `E[max of N] = sum_k x_k ((k/K)^N - ((k-1)/K)^N)` exactly --
or a model of two parts:
  * jitter, normal with coefficient of variation `cv` (a system constant: GC, host work):
    `E[max] = 1 + cv * e_N`, `e_N` the expected maximum of N standard normals;
  * slow hosts, a fraction `p` of the fleet's hosts running `d` slower all the time (a cluster
    constant; MegaScale 6.3 found hosts ~10% slower): a job on H hosts meets at least one with
    probability `1 - (1 - p)^H`, and then runs `d` slower.
The two add: `E[max] = 1 + cv * e_N + d * (1 - (1 - p)^H)` (exact when either is zero; otherwise
an upper bound that is tight while cv << d).
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from megascale.config.fields import ConfigError


@lru_cache(maxsize=1)
def _normal_grid() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, log phi(x), log Phi(x) on [-9, 10] in steps of 1/2000."""
    x = np.linspace(-9.0, 10.0, 38001)
    log_pdf = -0.5 * x * x - 0.5 * math.log(2 * math.pi)
    log_cdf = np.log(np.maximum([0.5 * math.erfc(-v / math.sqrt(2)) for v in x], 1e-300))
    return x, log_pdf, log_cdf


@lru_cache(maxsize=1024)
def expected_max_std_normal(n: int) -> float:
    """E[max of n iid N(0, 1)] = integral of x n phi(x) Phi(x)^(n-1) dx (trapezoid rule)."""
    if n <= 1:
        return 0.0
    x, log_pdf, log_cdf = _normal_grid()
    y = x * n * np.exp(log_pdf + (n - 1) * log_cdf)
    return float(np.sum(y[1:] + y[:-1]) * (x[1] - x[0]) / 2)


def expected_max_empirical(samples: tuple[float, ...], n: int) -> float:
    """E[max of n draws with replacement] from the samples, exactly."""
    xs = sorted(samples)
    k = len(xs)
    if k == 0:
        raise ValueError("no samples")
    return sum(x * ((i / k) ** n - ((i - 1) / k) ** n) for i, x in enumerate(xs, 1))


@dataclass(frozen=True)
class SlowHosts:
    """A fraction of the fleet's hosts that run slower all the time (cluster constant)."""

    fraction: float = 0.0
    slowdown: float = 0.0

    def expected_excess(self, hosts: int) -> float:
        return self.slowdown * (1.0 - (1.0 - self.fraction) ** hosts)


@dataclass(frozen=True)
class Jitter:
    """Per-rank busy-time factor: normal with `cv`, or measured ratios (mean 1) from a run."""

    cv: float = 0.0
    samples: tuple[float, ...] = ()
    source: str = "none"

    def expected_max(self, ranks: int, hosts: int = 1, slow: SlowHosts = SlowHosts()) -> float:
        """E[max of `ranks` factors] on `hosts` hosts (1.0 without jitter or slow hosts)."""
        if self.samples:
            return expected_max_empirical(self.samples, ranks)
        return 1.0 + self.cv * expected_max_std_normal(ranks) + slow.expected_excess(hosts)

    def describe(self) -> str:
        if self.samples:
            spread = float(np.std(self.samples))
            return f"measured ({self.source}): {len(self.samples)} samples, sd {spread:.3f}"
        return f"normal, cv {self.cv:.3f}"


def jitter_from_run(db_path: str | Path, warmup_steps: int = 1) -> Jitter:
    """Each (step, rank)'s compute time over its pipeline-stage peers' mean in that step."""
    path = Path(db_path)
    if not path.is_file():
        raise ConfigError(f"{path}: no timer database (run `megascale report RUN_DIR` first)")
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT step, pp, compute FROM rank_steps WHERE compute > 0 ORDER BY step").fetchall()
    except sqlite3.Error as exc:
        raise ConfigError(f"{path}: not a megascale timer database ({exc})") from exc
    finally:
        conn.close()
    steps = sorted({r[0] for r in rows})[warmup_steps:]
    groups: dict[tuple[int, int], list[float]] = {}
    for step, pp, compute in rows:
        if step in steps:
            groups.setdefault((step, pp), []).append(compute)
    ratios = [c / (sum(g) / len(g)) for g in groups.values() if len(g) > 1 for c in g]
    if not ratios:
        raise ConfigError(
            f"{path}: needs >= 2 ranks per stage and >= {warmup_steps + 1} steps of compute spans to measure jitter"
        )
    return Jitter(samples=tuple(ratios), source=str(path))
