"""
The observability room: what the server tells its operators.

C{logs} and C{logwriter} (events.jsonl, the console, saved programs),
C{metrics} (Prometheus), C{status} (the status page), C{retention} (pruning
old runs) and C{sdnotify} (systemd readiness).
"""
