"""The self-check process a node runs before it is trusted again (`megascale selfcheck`).

`checks.py`: the node and network tests and their baselines; `cli.py`: the command the executor
(or an operator) runs; `verdict.py`: who failed, over the reports of the nodes checked together
(the driver's and `--judge`'s one verdict). Who checks with whom is the driver's plan
(`driver/selfcheck_plan.py`).
"""
