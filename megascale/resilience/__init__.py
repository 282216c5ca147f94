"""Robust training: a driver per job, an executor per node, detection rules, self-checks.

The driver (`driver.py`) keeps the job's state (`state.py`, SQLite), serves its API and the
executors' heartbeats (`api.py`), runs the detection rules (`rules.py`) and orchestrates
stop -> self-check (`selfcheck_plan.py`, `selfcheck.py`) -> evict -> resume (`placement.py`).
Executors (`executor.py`) start a node's ranks and report on them; ranks tell their executor
how far they are through a tiny status file (`rankstatus.py`), written by the one hook the
trainer calls each step (`faults.py`, which also injects test faults). docs/fault_tolerance.md.
"""
