"""A rank's side of resilience, run inside the training process (`megascale train`).

`faults.py`: the per-step hook (progress into the status file, then injected test faults);
`rankctl.py`: the pipe the executor holds (the assignment, `abort`, `rejoin`).
"""
