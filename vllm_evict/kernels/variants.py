"""Which compiled variant of a Triton kernel a launch needs, and a recorder of launches.

Triton compiles one variant per combination of: constexpr values, the dtype of each tensor argument,
whether a tensor's address is 16-byte aligned, and, for each integer argument, its width class (32 or
64 bits) and whether it equals 1 or is divisible by 16; arguments a kernel declares unspecialised
(``_common.per_step_jit``) count only by type. ``variant_key`` computes that identity from a launch's
arguments with the same rules, so launches can be compared across steps without a GPU: the tests record
the launches of the Triton interpreter and check that a server's start-up warm-up
(vllm_evict/engine/warmup.py) launched every variant its steps need, and ``benchmarks/triton_aot.py``
compiles the recorded variants for a GPU that is not there.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ._common import unspecialised


def _parameters(kernel: Any) -> list[tuple[str, bool]]:
    """(name, is_constexpr) of every parameter of a ``triton.jit`` kernel (JIT or interpreter)."""
    fn = getattr(kernel, "fn", kernel)
    out = []
    for name, param in inspect.signature(fn).parameters.items():
        annotation = param.annotation
        out.append((name, "constexpr" in str(annotation)))
    return out


def kernel_name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}.{fn.__name__}"


def _int_type(value: int, specialised: bool) -> tuple[str, str]:
    """(type, specialisation) of an integer argument."""
    width = "i32" if -(2**31) <= value < 2**31 else "i64"
    if not specialised:
        return width, "any"
    return width, "=1" if value == 1 else "%16" if value % 16 == 0 else ""


def variant_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """The compile-time identity of ``kernel[grid](*args, **kwargs)``: (kernel, constexprs, argument
    types, their specialisations, launch options). Two launches share a compiled kernel iff equal."""
    ints, pointers = unspecialised(kernel)
    params = _parameters(kernel)
    names = dict(params)
    bound = dict(zip((name for name, _ in params), args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    constexprs, types, specs = [], [], []
    for name, constexpr in params:
        value = bound.get(name)
        if constexpr:
            constexprs.append((name, value))
            continue
        if isinstance(value, torch.Tensor):
            kind = "*" + str(value.dtype).removeprefix("torch.")
            spec = "any" if name in pointers else ("%16" if value.data_ptr() % 16 == 0 else "")
        elif isinstance(value, bool):
            kind, spec = "i1", ""
        elif isinstance(value, int):
            kind, spec = _int_type(value, name not in ints)
        elif isinstance(value, float):
            kind, spec = "fp32", ""
        else:
            kind, spec = repr(value), ""
        types.append((name, kind))
        specs.append((name, spec))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return (kernel_name(kernel), tuple(constexprs), tuple(types), tuple(specs), options)


@dataclass
class Launch:
    kernel: Any
    args: tuple
    kwargs: dict

    @property
    def key(self) -> tuple:
        return variant_key(self.kernel, self.args, self.kwargs)

    def bound(self) -> dict[str, Any]:
        """The launch's arguments by parameter name."""
        names = [name for name, _ in _parameters(self.kernel)]
        return {**dict(zip(names, self.args)), **{k: v for k, v in self.kwargs.items() if k in names}}

    def describe(self) -> dict[str, Any]:
        """A JSON-able description from which ``benchmarks/triton_aot.py`` compiles the variant: tensors
        as their dtype, numbers as they are, constexprs and launch options by name."""
        params = _parameters(self.kernel)
        names = [name for name, _ in params]
        constexprs = {name for name, c in params if c}
        bound = dict(zip(names, self.args))
        bound.update(self.kwargs)
        out: dict[str, Any] = {"kernel": kernel_name(self.kernel), "args": [], "constexprs": {}, "options": {}}
        for name in names:
            value = bound.get(name)
            if name in constexprs:
                out["constexprs"][name] = value
            elif isinstance(value, torch.Tensor):
                out["args"].append({"name": name, "dtype": str(value.dtype).removeprefix("torch.")})
            else:
                out["args"].append({"name": name, "value": value})
        out["options"] = {k: v for k, v in self.kwargs.items() if k not in names}
        return out


@dataclass
class LaunchRecorder:
    """``with LaunchRecorder() as rec: ...`` records every Triton kernel launch (interpreter or JIT),
    then lets each run as usual; ``LaunchRecorder(execute=False)`` records without running (for code
    whose kernels write only scratch, such as the start-up warm-up: under Triton's interpreter on CPU
    running them is most of a test's time, and their variant keys do not depend on what they compute)."""

    execute: bool = True
    launches: list[Launch] = field(default_factory=list)
    _restore: list[tuple[Any, str, Callable]] = field(default_factory=list)

    def __enter__(self) -> "LaunchRecorder":
        import triton.runtime.interpreter as interpreter
        import triton.runtime.jit as jit

        for owner in (interpreter.InterpretedFunction, jit.JITFunction):
            original = owner.run
            self._restore.append((owner, "run", original))

            def run(kernel: Any, *args: Any, _original: Callable = original, **kwargs: Any) -> Any:
                if not kwargs.get("warmup"):
                    launch_kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                    self.launches.append(Launch(kernel, args, launch_kwargs))
                    if not self.execute:
                        return None
                return _original(kernel, *args, **kwargs)

            owner.run = run
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def variants(self) -> dict[tuple, Launch]:
        """One launch per distinct variant key."""
        out: dict[tuple, Launch] = {}
        for launch in self.launches:
            out.setdefault(launch.key, launch)
        return out
