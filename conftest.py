# Repo root on sys.path so tests and benchmarks import the in-place build (`make build`).
