"""Single-purpose measurements: ``python -m bench.micro.tune`` (launch tuning), ``call_cost`` (host time per call),
``host_cache`` (the host buffer's set-up) and ``manager`` (the scheduler's bookkeeping)."""
