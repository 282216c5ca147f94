"""The executor process: one per node (`megascale executor`, `cli.py`).

`executor.py` registers with the driver, heartbeats the node's report and runs the commands
that come back; `ranks.py` holds the node's rank processes (warm standbys, assigned ranks and
their pipes). It talks to the driver through `common.api` only, and starts ranks and self-checks
as processes.
"""
