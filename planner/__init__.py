"""`bucketserve plan`: fit length buckets to recorded traffic (command line, inputs, optional matplotlib
plots) over the pure fitting in buckets/planner.py."""
