"""pykernels' microbenchmark suite: `python -m bench` (or `make bench`), `pytest bench/`."""
