"""Where a model's files are: `ModelSource` names the model and tokenizer as given (``"smollm2"``, a local path, or
a Hugging Face Hub id such as ``Qwen/Qwen3-0.6B``) and `resolve()` turns Hub ids into local snapshot folders of the
Hugging Face cache, as vLLM does: huggingface_hub downloads what is missing when online; with ``HF_HUB_OFFLINE=1``
it uses the cache alone. ``revision`` and ``download_dir`` (the cache folder) are vLLM's flags of the same names.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

SMOLLM2 = "smollm2"
#: Files fetched from a Hub repository: configs (config, generation and tokenizer configs, the safetensors index),
#: tokenizer files, chat templates, and the safetensors weights (kvllm loads no other weight format from the Hub).
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja", "*.tiktoken")
TOKENIZER_FILES = tuple(p for p in MODEL_FILES if p != "*.safetensors")


def is_hub_id(name: str) -> bool:
    """A Hub repository id: not 'smollm2', no existing local path, and a valid ``org/name`` (or ``name``)."""
    if name == SMOLLM2 or Path(name).expanduser().exists():
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve(name: str, *, revision: str | None = None, cache_dir: str | None = None, weights: bool = True,
            what: str = "model") -> str:
    """A local path for `name`: itself when it is 'smollm2' or exists locally, else the snapshot folder of the Hub
    repository `name` at `revision` (downloaded into `cache_dir`, default the HF cache, unless HF_HUB_OFFLINE=1).
    ``weights=False`` fetches the tokenizer and config files only. Raises ValueError naming `what`."""
    if name == SMOLLM2 or Path(name).expanduser().exists():
        return name
    if not is_hub_id(name):
        raise ValueError(f"{what}={name!r} is not a model: expected 'smollm2', a .gguf file, a directory holding one "
                         f".gguf file, a local Hugging Face directory with config.json and *.safetensors, or a "
                         f"Hugging Face Hub id such as 'Qwen/Qwen3-0.6B' (no such path exists)")
    from huggingface_hub import constants, snapshot_download

    try:
        folder = snapshot_download(name, revision=revision, cache_dir=cache_dir,
                                   allow_patterns=list(MODEL_FILES if weights else TOKENIZER_FILES))
    except Exception as err:  # offline cache miss, unknown repo or revision, gated repo, network failure
        at = f" at revision {revision!r}" if revision else ""
        cache = cache_dir or constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            why = (f"it is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 forbids downloading it; "
                   f"download it once online (or unset HF_HUB_OFFLINE)")
        else:
            why = f"could not be fetched from the Hugging Face Hub into {cache}: {type(err).__name__}: {err}"
        raise ValueError(f"{what}={name!r}{at} is not a local path, and as a Hugging Face Hub id {why}") from err
    path = Path(folder)
    if weights and not ((path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        raise ValueError(f"{what}={name!r} ({folder}) is not a model kvllm can load from the Hub: it needs "
                         f"config.json and *.safetensors weights")
    return folder


@dataclass(frozen=True)
class ModelSource:
    """A model and its tokenizer as the user named them, and where their files come from (vLLM's flags of the same
    names). ``tokenizer=None`` uses the model's own tokenizer."""
    model: str = SMOLLM2
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    trust_remote_code: bool = False

    def resolve(self) -> "ModelSource":
        """The same source with local paths only: Hub ids become snapshot folders of the HF cache (fetched now if
        needed). A tokenizer revision without a tokenizer means the model repository's tokenizer at that revision."""
        tokenizer = self.tokenizer
        if tokenizer is None and self.tokenizer_revision is not None and is_hub_id(self.model):
            tokenizer = self.model
        model = resolve(self.model, revision=self.revision, cache_dir=self.download_dir)
        if tokenizer is not None:
            tokenizer = resolve(tokenizer, revision=self.tokenizer_revision, cache_dir=self.download_dir,
                                weights=False, what="tokenizer")
        return replace(self, model=model, tokenizer=tokenizer, revision=None, tokenizer_revision=None)

    @property
    def model_dir(self) -> Path | None:
        """The local folder of a Hugging Face model (after `resolve`); None for 'smollm2' and .gguf files."""
        path = Path(self.model).expanduser()
        return path if self.model != SMOLLM2 and path.is_dir() else None
