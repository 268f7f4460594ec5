"""`kvllm bench serve`: a load-test client for any OpenAI-compatible server, modelled on `vllm bench serve`
(dataset.py, client.py, stats.py, report.py; cli.py holds the options and the run)."""
from bench.serve_client.cli import add_cli_args, build_parser, main, run_benchmark
from bench.serve_client.client import RequestResult, arrival_times
from bench.serve_client.dataset import sample_random
from bench.serve_client.stats import calculate_metrics

__all__ = ["add_cli_args", "build_parser", "main", "run_benchmark", "RequestResult", "arrival_times", "sample_random",
           "calculate_metrics"]
