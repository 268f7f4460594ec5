"""The server's default sampling parameters: the model's generation config (engine/generation_config.py, vLLM's
``--generation-config``), read once when the app is built and logged as vLLM logs it, so an operator sees at startup
that requests without a temperature will not sample at 1.0."""
from __future__ import annotations

import logging
from typing import Any

from engine.generation_config import sampling_defaults

logger = logging.getLogger("kvllm.server")

def model_sampling_defaults(engine: Any, generation_config: str) -> dict[str, Any]:
    """{SamplingParams field: default} for `engine`'s model under `generation_config` ('auto', 'vllm', a folder)."""
    source = getattr(engine, "model_source", None)  # absent on stand-in engines: no model folder to read
    defaults = sampling_defaults(generation_config, source.model_dir if source is not None else None)
    if defaults:
        origin = "model" if generation_config == "auto" else generation_config
        logger.warning("Default sampling parameters have been overridden by the model's Hugging Face generation "
                       "config (%s); start with `--generation-config vllm` for kvllm's built-in defaults", origin)
        logger.info("Using default chat and completion sampling params from %s: %s", origin, defaults)
    return defaults
