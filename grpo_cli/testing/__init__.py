"""What the test suite and the benchmarks share, importable by both without path edits: a real
OpenAI-compatible judge server (judge_server.py, the standard library's HTTP server) and the
statistics that compare sampled token distributions (distributions.py). Nothing of the trainer
imports it."""
