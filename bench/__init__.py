"""Measurement (ch02 and `make bench`): the load test, the bench and its
parts, the peers, the profiles, the experiments and the GPU checks
(bench/README.md lists them). Imports common/; never imported by it."""
