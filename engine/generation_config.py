"""Default sampling parameters from a model's ``generation_config.json`` (vLLM's ``--generation-config``).

``"auto"`` reads the model folder's file, ``"vllm"`` ignores it, any other value is a folder holding one. The
sampling fields the file sets (not null) become the server's defaults for requests that leave them unset, with
Hugging Face's ``max_new_tokens`` renamed ``max_tokens``: vLLM treats it as a server-wide cap on every request's
output length. ``do_sample`` is not read (vLLM ignores it too: a request's temperature decides).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
#: generation_config.json field -> the SamplingParams field it is the default of
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


#: SamplingParams field -> (is the value valid, what it must be)
_CHECKS = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1, "an integer >= -1"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a number > 0"),
    "max_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
}


def sampling_defaults(generation_config: str, model_dir: str | Path | None) -> dict[str, Any]:
    """The default sampling parameters ({SamplingParams field: value}) that `generation_config` ('auto', 'vllm' or
    a folder) gives for the model in `model_dir` (None: a GGUF model, which has no generation_config.json).
    Raises ValueError naming the file and field for a folder without the file or a value out of range."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        if model_dir is None or not (Path(model_dir) / FILE).is_file():
            return {}
        path = Path(model_dir) / FILE
    else:
        path = Path(generation_config).expanduser() / FILE
        if not path.is_file():
            raise ValueError(f"generation_config={generation_config!r}: expected 'auto', 'vllm' or a folder holding "
                             f"{FILE}; {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"generation_config: cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    defaults = {}
    for key, name in FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        ok, rule = _CHECKS[name]
        if not ok(value):
            raise ValueError(f"generation_config: {key} in {path} must be {rule}, got {value!r}")
        defaults[name] = value
    return defaults
