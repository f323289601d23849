"""The operational commands behind `bucketserve` (server/cli.py): serve, precompile, generate, verify."""
