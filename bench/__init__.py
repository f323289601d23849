"""Load generator and report for OpenAI-compatible servers (`bucketserve bench`).

Pure client code: HTTP/SSE with httpx, plots with matplotlib. It never imports `server`, `models` or
torch, so it can benchmark any server from any machine.
"""
