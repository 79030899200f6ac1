"""The soak: a production-mode ``kvgate serve`` under sustained load from remote workers while its
parts fail and come back, with invariants checked against what each worker was acknowledged.

    python -m scripts.soak [--duration 600] [--workers 16] [--out DIR]     (make soak SOAK_ARGS=...)

``stack``: the throwaway Postgres cluster, the Redis server, the SoftHSM2 token, the OIDC issuer
and the server process, each of the soak's own (never the machine's shared services).
``worker``: one remote worker process (``RemoteGateway``), its randomized operations and the checks
it makes as it runs. ``faults``: the fault schedule and how each fault is made and ended.
``checks``: the invariants over everything the run recorded; ``report``: the JSON report and the
Markdown summary. How to run it and read its report: docs/operations.md, section Soak.
"""
