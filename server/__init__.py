"""bucketserve's server: `cli` (the `bucketserve` command), `config` (settings), `compose` (the composition
root), and four groups that change separately:

- `server.http`: the Starlette app, one module per API family, request models, the one output path.
  No torch, no model code: it drives the engine through `server.engine.interface.EngineAPI`.
- `server.engine`: the engine thread, the model it drives, per-step sampling. No Starlette, no pydantic.
- `server.metrics`: the typed hooks (`MetricsHooks`, `SafeHooks`) and the Prometheus series.
- `server.commands`: serve, precompile, generate, verify.

tests/test_import_directions.py keeps these directions.
"""
