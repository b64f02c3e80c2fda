"""Operator tools: watch running mmlane processes through their stats and control sockets.

    mmlane stats     print the Stats snapshots (one per process with --once, JSON with --json)
    mmlane top       a live table of every process and the latency of every lane
    mmlane health    ping every control socket; exit 0 only when all serve
    mmlane exporter  serve the latest snapshots to Prometheus

Each tool finds its processes the same way (`discovery`): the addresses given with --connect,
or the socket files under a run directory. They only read: nothing here changes a role.
"""
