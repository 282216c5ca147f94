"""Troubleshooting tools: per-rank timers, collector and store, straggler detection, timeline,
hang watchdog and analyser, and the HTML report (`megascale report RUN_DIR`)."""
