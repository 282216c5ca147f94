"""Robust training: a driver per job, an executor per node, detection rules, self-checks.

One subpackage per process, over what they share (docs/fault_tolerance.md):
- `driver/`: the driver (`megascale launch`) keeps the job's state (SQLite), serves its API and
  the executors' heartbeats, runs the detection rules and orchestrates stop -> self-check ->
  evict -> resume;
- `executor/`: one per node (`megascale executor`), starts the node's ranks and reports on them;
- `rank/`: what the training process runs for resilience: the step hook that writes the rank's
  status file and injects test faults, and its side of the executor's pipe;
- `selfcheck/`: the node and network tests a node runs before it is trusted again, and the
  verdict over their reports;
- `common/`: the messages, the API client, the job's secret, the status file, the redis-server.
`tests/test_layering.py` (SUBLAYERS) holds them to common < rank, selfcheck < executor < driver.
"""
