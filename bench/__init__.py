"""Measurement (ch02 and `make bench`): the load test, the bench, the
transformers peers and the GPU check. Imports common/; never imported by it."""
