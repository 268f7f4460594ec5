"""kvllm's benchmarks (`python -m bench.NAME`) and the load-test client `kvllm bench serve` (bench/serve_client/)."""
