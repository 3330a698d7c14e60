"""The benchmarks (`make bench`, or `python -m bench --out bench-out`): each measured against its
peer in the same run. They stand outside the installed package and may import any part of it
(the load benchmark drives the HTTP server and client). Run them from the repository root.
"""
