"""The driver process: one per job, started by `megascale launch` (`cli.py`).

Process and API: `cli.py` (the command; local mode starts executors through `local.py`,
`slowdown.py` slows a simulated node), `driver.py` (the `Driver`), `api_server.py`,
`api_budget.py`, `identity.py`. State: `state.py` (SQLite), `attempt.py`, `progress.py`,
`placement.py`. Detection (pure logic, heartbeats in, findings out): `rules.py`,
`straggler_rule.py`, `silence.py`, `attribution.py`, `evidence.py` (diagnostics in a child).
Recovery: `decide.py`, `recovery_paths.py` (the two paths the driver runs), `selfcheck_plan.py`,
`recovery.py` and `ettr.py` (what recoveries cost).
"""
