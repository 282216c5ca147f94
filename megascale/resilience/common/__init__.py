"""What the resilience processes share: the messages and the API client, the job's secret, the
rank status file, and the job's redis-server.

`protocol.py` holds the schemas of every message between driver, executors, operators and ranks;
`api.py` the HTTPS client executors and operators call the driver with; `credentials.py` the
job's tokens and TLS certificate; `rankstatus.py` the tiny file a rank writes and its executor
reads; `redis_server.py` the store server the launcher (or `megascale train --nproc`) starts.
Nothing here imports the driver, executor, rank or self-check packages.
"""
