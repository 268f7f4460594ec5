"""Engine drivers shared by test files."""
from __future__ import annotations

import random

from engine import SamplingParams


def run_with_random_aborts(eng, rng: random.Random, num: int, prompt_len: tuple[int, int],
                           output_len: tuple[int, int], abort_every: int) -> list:
    """Submit `num` random greedy requests (ignore_eos; lengths drawn from the half-open ranges), step the engine to
    the end, aborting a random request every `abort_every` steps. Returns the requests."""
    reqs = []
    for i in range(num):
        prompt = [rng.randrange(4, 120) for _ in range(rng.randrange(*prompt_len))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(*output_len), ignore_eos=True)
        req = eng.new_request(prompt, params, f"r{i}")
        eng.add_request(req)
        reqs.append(req)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps % abort_every == 0:
            eng.abort(rng.choice(reqs).request_id)
    return reqs
