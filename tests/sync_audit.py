"""An audit, on CPU, of the operations that would make the host wait for the device on CUDA.

``SyncAudit`` is a context manager combining a ``TorchFunctionMode`` (the Python-level calls: reads of a
device value, tensors built from host data, host-to-device copies) and a ``TorchDispatchMode`` (the
ATen ops whose output shape depends on device data, which CUDA can only size after a synchronisation).
Everything the code inside the ``with`` block runs is seen, whatever function it is in; nothing is
stubbed. Every violation is recorded with the operation and the innermost ``vllm_evict`` frame.

On a CPU run every tensor lives on the CPU, so the audit tells host tensors from "device" tensors by
their origin: a tensor made from host data without a ``device=`` (``torch.from_numpy``,
``torch.tensor(...)``), and whatever is computed from host tensors only, is a host tensor; every other
tensor stands for a device tensor. Host tensors may be read freely; a host-to-device copy is allowed
only from a staging arena (``vllm_evict.staging``: pinned memory on CUDA) and with ``non_blocking``.

Flagged, as each synchronises on CUDA:

* reading a device value on the host: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()``,
  ``int()``, ``float()``, ``__index__`` (ATen ``_local_scalar_dense``, ``is_nonzero``, ``equal``);
* a device tensor built from Python numbers, lists or numpy arrays (``torch.tensor(x, device=...)``,
  ``torch.as_tensor(x, device=...)``, ``t.new_tensor(x)``), or indexed / assigned with a list or numpy array;
* a copy to the device from host memory that is not a staging arena, or without ``non_blocking``;
* a value written through tensor indices (``t[index] = v``, ``index_put_``) that lives in host memory: a
  Python number (PyTorch makes it a CPU tensor) or a host tensor; ``index_put_`` copies it to the device
  with a blocking copy from pageable memory. A number through plain indices (``t[:, 0] = 0.0``: a fill)
  or an op's scalar argument (``masked_fill(m, 0.0)``, ``index_fill_``) is fine;
* a host tensor with at least one dimension in an op with device tensors (an index tensor, an operand):
  an error on CUDA, or a blocking copy (0-dim host tensors are read as scalars, as CUDA ops do);
* a kernel launch (Triton, under the interpreter on CPU) given a host tensor; the launch itself is not
  audited (the interpreter copies to and from the host, which a compiled kernel does not);
* ops with a data-dependent output shape: ``nonzero`` / ``argwhere``, ``masked_select``, indexing or
  index-assignment with a boolean mask, ``unique`` (all variants), ``repeat_interleave`` without
  ``output_size``, ``bincount``.

Tensors the code under audit receives from outside were made outside the audit: they stand for device
tensors unless ``mark_host`` names them (e.g. vLLM's own CPU-side buffers, which the engine test marks).
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vllm_evict.staging import is_staging

# ATen ops (overload packet names) whose output shape depends on device data.
DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "_unique", "_unique2", "unique_dim",
                  "unique_consecutive", "unique_dim_consecutive", "bincount"}
# ATen ops that return a device value to the host.
DEVICE_READS = {"_local_scalar_dense", "is_nonzero", "equal"}
# Python-level reads of a tensor's data into host memory.
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
BUILDERS = {"tensor", "as_tensor", "asarray"}
# Index-assignment ops, whose ``values`` argument is copied to the device when it lives on the host.
INDEX_PUTS = {"index_put", "index_put_", "_index_put_impl_"}
# Ops that move data between host and device (checked by the function layer) or make host tensors.
TRANSFERS = {"copy_", "_to_copy", "lift_fresh", "lift_fresh_copy", "_local_scalar_dense"}
# Factories: without ``device=`` (or with ``device="cpu"``, a string) they make host tensors.
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "randperm", "linspace", "eye",
             "empty_strided", "scalar_tensor"}


@dataclass(frozen=True)
class Violation:
    op: str
    why: str
    where: str

    def __str__(self) -> str:
        return f"{self.op}: {self.why} (at {self.where})"


def _where() -> str:
    """The innermost frame of vllm_evict (or of the caller when none): where the offending call is."""
    frames = traceback.extract_stack()[:-3]
    ours = [f for f in frames if "/vllm_evict/" in f.filename]
    frame = (ours or frames)[-1]
    return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    flat, _ = tree_flatten(list(values))
    return [v for v in flat if isinstance(v, torch.Tensor)]


def _is_host_data(value: Any) -> bool:
    """A list, tuple or numpy array (data that lives in host memory), not a tensor or a plain number."""
    return isinstance(value, (list, tuple, np.ndarray)) and not (
        isinstance(value, tuple) and all(isinstance(v, (int, slice, type(None), type(Ellipsis)))
                                         or isinstance(v, torch.Tensor) for v in value))


class SyncAudit:
    """``with SyncAudit() as audit: ...`` then ``audit.violations``; ``paused()`` excludes a region
    (e.g. vLLM's own attention forward inside a hook)."""

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self._host: dict[int, weakref.ref] = {}  # id -> weak reference (tensors compare elementwise)
        self._function = _FunctionAudit(self)
        self._dispatch = _DispatchAudit(self)
        self.ops_seen = 0  # ATen ops dispatched while auditing (a test that saw none audited nothing)
        self.launches = 0  # kernel launches seen (their arguments audited, the launch itself not)
        self._kernels = _KernelLaunches(self)

    # ---- host tensors ------------------------------------------------------------------------
    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return (ref is not None and ref() is t) or is_staging(t)

    def mark_host(self, outputs: Any) -> None:
        for t in _tensors([outputs]):
            self._host[id(t)] = weakref.ref(t)

    def unmark(self, outputs: Any) -> None:
        for t in _tensors([outputs]):
            self._host.pop(id(t), None)

    def flag(self, op: str, why: str) -> None:
        self.violations.append(Violation(op, why, _where()))

    # ---- context -----------------------------------------------------------------------------
    def __enter__(self) -> "SyncAudit":
        self._function.__enter__()
        self._dispatch.__enter__()
        self._kernels.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._kernels.remove()
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)

    @property
    def active(self) -> bool:
        return self._function.active

    def paused(self) -> "_Paused":
        return _Paused(self)


class _Paused:
    def __init__(self, audit: SyncAudit) -> None:
        self.audit = audit
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        self._saved.append(self.audit._function.active)
        self.audit._function.active = self.audit._dispatch.active = False

    def __exit__(self, *exc: Any) -> None:
        self.audit._function.active = self.audit._dispatch.active = self._saved.pop()


class _KernelLaunches:
    """While an audit is entered, Triton launches (compiled, or the interpreter's on CPU) have their tensor
    arguments checked (a host tensor given to a kernel); the launch itself runs paused: the interpreter
    reads and writes through host copies, which a compiled kernel on the device does not."""

    def __init__(self, audit: SyncAudit) -> None:
        self.audit = audit
        self._restore: list[tuple[type, Any]] = []

    def install(self) -> None:
        for cls in _launcher_classes():
            original = cls.__dict__["run"]
            self._restore.append((cls, original))
            cls.run = self._checked(original)

    def remove(self) -> None:
        for cls, original in reversed(self._restore):
            cls.run = original
        self._restore.clear()

    def _checked(self, original: Any) -> Any:
        audit = self.audit

        def run(kernel: Any, *args: Any, **kwargs: Any) -> Any:
            if not audit.active:
                return original(kernel, *args, **kwargs)
            audit.launches += 1
            name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
            if any(audit.is_host(t) for t in _tensors([args, kwargs])):
                audit.flag(f"launch {name}", "a host tensor given to a kernel (device kernels read device memory)")
            with audit.paused():
                return original(kernel, *args, **kwargs)
        return run


def _launcher_classes() -> list[type]:
    """Triton's kernel classes whose ``run`` launches a kernel (none when Triton is not installed)."""
    classes = []
    for module, name in (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction")):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        if "run" in cls.__dict__:
            classes.append(cls)
    return classes


class _FunctionAudit(TorchFunctionMode):
    def __init__(self, audit: SyncAudit) -> None:
        super().__init__()
        self.audit = audit
        self.active = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        audit = self.audit
        name = getattr(func, "__name__", str(func))
        # The engine names its device with a torch.device; the string "cpu" means host memory.
        device_given = kwargs.get("device") is not None and kwargs.get("device") != "cpu"
        if name in FACTORIES and not device_given:
            out = func(*args, **kwargs)
            audit.mark_host(out)
            return out
        if name in BUILDERS or name == "new_tensor":
            data = args[int(name == "new_tensor")] if len(args) > int(name == "new_tensor") else kwargs.get("data")
            on_device = device_given or name == "new_tensor"
            if on_device and not isinstance(data, torch.Tensor):
                audit.flag(name, "a device tensor built from host data (a blocking host-to-device copy)")
            elif on_device and audit.is_host(data):
                audit.flag(name, "a host tensor copied to the device by a constructor (blocking)")
            out = func(*args, **kwargs)
            if on_device:
                audit.unmark(out)
            elif not isinstance(data, torch.Tensor) or audit.is_host(data):
                audit.mark_host(out)
            return out
        if name in ("to", "cuda", "copy_"):
            return self._transfer(name, func, args, kwargs)
        if name in HOST_READS:
            if args and isinstance(args[0], torch.Tensor) and not audit.is_host(args[0]):
                audit.flag(name, "reads a device value on the host (a synchronisation)")
            return func(*args, **kwargs)
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
            index = args[1] if len(args) > 1 else None
            if _is_host_data(index) and args and not audit.is_host(args[0]):
                audit.flag(name, "indexes a device tensor with a host list or array (a blocking copy)")
            if name == "__setitem__" and len(args) > 2 and not audit.is_host(args[0]):
                value = args[2]
                if _is_host_data(value) or (isinstance(value, torch.Tensor) and audit.is_host(value)
                                            and value.dim() > 0):
                    audit.flag(name, "assigns host data into a device tensor (a blocking copy)")
        out = func(*args, **kwargs)
        inputs = _tensors([args, kwargs])
        if inputs and all(audit.is_host(t) for t in inputs):
            audit.mark_host(out)  # computed from host tensors only: still host memory
        return out

    def _transfer(self, name: str, func: Any, args: tuple, kwargs: dict) -> Any:
        audit = self.audit
        if name == "copy_":
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            to_device = not audit.is_host(dst)
            source = src
            if not to_device and isinstance(src, torch.Tensor) and not audit.is_host(src):
                audit.flag(name, "copies a device tensor into host memory (a synchronisation)")
        else:
            source = args[0]
            non_blocking = bool(kwargs.get("non_blocking", False) or any(a is True for a in args[1:]))
            target = kwargs.get("device")
            if target is None:
                target = next((a for a in args[1:] if isinstance(a, (torch.device, str, int))
                               and not isinstance(a, bool)), None)
            # The engine names its device with a torch.device; "cpu" as a string means host memory (on a
            # CPU run both are the CPU, so the intent is read from how the target is written).
            to_device = name == "cuda" or isinstance(target, torch.device) or (
                isinstance(target, (str, int)) and str(target) != "cpu")
            if isinstance(target, str) and target == "cpu" and not audit.is_host(source):
                audit.flag(name, "copies a device tensor to host memory (a synchronisation)")
        if to_device and isinstance(source, torch.Tensor) and audit.is_host(source) and source.dim() >= 0:
            if not is_staging(source):
                audit.flag(name, "copies to the device from pageable host memory (not a staging arena)")
            elif not non_blocking:
                audit.flag(name, "a blocking host-to-device copy")
        out = func(*args, **kwargs)
        if name == "copy_":
            if not to_device:
                audit.mark_host(out)
        elif not to_device and audit.is_host(source):
            audit.mark_host(out)  # a dtype change of a host tensor stays on the host
        else:
            audit.unmark(out)
        return out


class _DispatchAudit(TorchDispatchMode):
    def __init__(self, audit: SyncAudit) -> None:
        super().__init__()
        self.audit = audit
        self.active = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active:
            return out
        audit = self.audit
        audit.ops_seen += 1
        name = func.overloadpacket.__name__
        inputs = _tensors([args, kwargs])
        on_device = [t for t in inputs if not audit.is_host(t)]
        if name == "lift_fresh" or name == "lift_fresh_copy":
            audit.mark_host(out)  # made from host data (the function layer unmarks it if sent to a device)
        elif on_device:
            if name in DEVICE_READS:
                audit.flag(name, "reads a device value on the host (a synchronisation)")
            elif name in DATA_DEPENDENT:
                audit.flag(name, "an output shape that depends on device data (a synchronisation)")
            elif name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
                audit.flag(name, "repeat_interleave without output_size (a synchronisation)")
            elif name in ("index", "_unsafe_index", *INDEX_PUTS) and any(
                    isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                    for i in (args[1] if len(args) > 1 else kwargs.get("indices", ())) or ()):
                audit.flag(name, "boolean-mask indexing (an output shape that depends on device data)")
            elif name in INDEX_PUTS and len(args) > 2 and audit.is_host(args[2]):
                audit.flag(name, "writes a host value through tensor indices (a Python number or a host tensor: "
                                 "index_put_ copies it to the device, a blocking copy)")
            elif name not in TRANSFERS and any(audit.is_host(t) and t.dim() > 0 for t in inputs):
                audit.flag(name, "mixes a host tensor with device tensors (an error on CUDA, or a blocking copy)")
        elif inputs and name not in ("lift_fresh", "lift_fresh_copy"):
            audit.mark_host(out)
        return out
