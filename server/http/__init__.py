"""The HTTP layer, in the order a request meets it: app -> routes_* -> protocol_* -> state -> admission ->
(engine) -> runs -> output -> format_*. Imports no torch and no model code."""
