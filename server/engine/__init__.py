"""The engine: `interface` (what the HTTP layer may use: EngineAPI, Tokenizer, records, errors; torch-free),
`engine` (the thread), `active_request`, `model` (EngineModel: weights, runner, warm-up, one step),
`step_sampling`."""
