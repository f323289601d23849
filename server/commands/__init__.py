"""The operational commands behind `bucketserve` (server/cli.py): serve, precompile, generate, verify, and the
tensor-parallel rank processes (tp_launch, tp_worker, tp_watchdog)."""
