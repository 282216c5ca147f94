"""The planner: predict step time, MFU and memory of a model on a cluster, and choose a layout.

cluster (what the machines are) + layout (how the job is cut) -> cost (step terms) and memory
-> search (rank every valid layout) -> placement and ECMP (where ranks go on the network)
-> env (how the network should be configured). See docs/planning.md.
"""
