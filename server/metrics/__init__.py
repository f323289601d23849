"""Metrics: `hooks` (the typed MetricsHooks protocol, NoMetrics, SafeHooks), `prometheus` (the series),
`config` (histogram edges). Needs prometheus-client and nothing else."""
