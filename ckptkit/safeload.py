"""The one place ckptkit unpickles anything.

A restricted unpickler with an explicit allowlist of globals. Tensors are rebuilt by our own
functions (lazily, as references to storage bytes, or eagerly from bytes we read); the classes a
checkpoint's metadata references (DCP metadata, DeepSpeed's small state classes) become inert
stand-ins that only hold data. Any other global raises UnsafePickleError naming the file and the
global: no checkpoint can run code, and reading needs neither deepspeed nor torch: torch's own
small types become the stand-ins of ckptkit.torch_types, small tensors loaded whole SmallTensors.
"""
from __future__ import annotations

import collections
import io
import pathlib
import pickle
from dataclasses import dataclass
from typing import Any, Callable

from .errors import FormatError, UnsafePickleError, UnsupportedError
from .index.dtypes import LEGACY_STORAGE, TORCH_DTYPE_ATTRS, dtype_name
from .torch_types import DType, GlobalRef, Size, SmallTensor


@dataclass(frozen=True)
class StorageRef:
    """A storage of a torch.save archive, not loaded: its member key, dtype and element count."""

    key: str
    dtype: DType
    numel: int


@dataclass(frozen=True)
class RawStorage:
    """A storage read whole (eager loading of a small pickle): its bytes."""

    data: bytes


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a torch.save archive described without loading it (a view of a storage)."""

    storage: StorageRef
    dtype: DType
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False


class Inert:
    """A foreign object rebuilt as plain data: constructor arguments and pickled state only."""

    _qualname = "Inert"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args
        if kwargs:
            self.__dict__["_kwargs"] = kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __reduce__(self):  # re-emitting a stand-in pickles it as the original class
        return (_inert_rebuild, (self._qualname, self.__dict__.get("_args", ())), self._public_state())

    def _public_state(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_args", "_kwargs")}

    def to_data(self) -> dict:
        """A JSON-friendly view: class name, arguments, state."""
        out: dict[str, Any] = {"__class__": self._qualname}
        if self.__dict__.get("_args"):
            out["args"] = list(self.__dict__["_args"])
        out.update(self._public_state())
        return out

    def __repr__(self) -> str:
        args = self.__dict__.get("_args", ())
        body = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in self._public_state().items()])
        return f"{self._qualname.rsplit('.', 1)[-1]}({body})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __hash__(self) -> int:
        # by class and every hashable field: stand-ins are dict keys in DCP metadata (MetadataIndex),
        # and a hash by class alone makes a dict of thousands of them quadratic
        parts: list[Any] = [self._qualname]
        for name, value in self.__dict__.items():
            try:
                parts.append((name, hash(value)))
            except TypeError:
                continue
        return hash(tuple(parts))


def _inert_rebuild(qualname: str, args: tuple) -> Inert:
    return inert_class(qualname)(*args)


_INERT_CLASSES: dict[str, type] = {}


def inert_class(qualname: str) -> type:
    """The stand-in class for a foreign `module.Name` (one class per name, cached)."""
    cls = _INERT_CLASSES.get(qualname)
    if cls is None:
        cls = type(qualname.rsplit(".", 1)[-1], (Inert,), {"_qualname": qualname})
        _INERT_CLASSES[qualname] = cls
    return cls


# ---- tensor rebuild functions (ours, never torch's) -------------------------------------------

def _make_tensor(storage: Any, dtype: DType, offset: int, size: tuple, stride: tuple,
                 requires_grad: bool) -> Any:
    size, stride = tuple(size), tuple(stride)
    if not isinstance(dtype, DType):
        raise FormatError(f"tensor rebuilt with {dtype!r:.60} where a dtype was expected")
    if isinstance(storage, StorageRef):
        return TensorRef(storage, dtype, int(offset), size, stride, bool(requires_grad))
    if isinstance(storage, RawStorage):
        if any(not isinstance(x, int) or x < 0 for x in (offset, *size, *stride)):
            raise FormatError(f"tensor rebuilt with a malformed view (offset {offset!r:.20}, size {size!r:.40})")
        item = _itemsize(dtype)
        span = 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride))
        if (offset + span) * item > len(storage.data):
            raise FormatError(f"a tensor needs {(offset + span) * item} bytes of a storage that holds "
                              f"{len(storage.data)}")
        return SmallTensor.from_storage(dtype_name(dtype), storage.data, offset, size, stride)
    raise FormatError(f"tensor rebuilt from an unexpected storage object {type(storage).__name__}")


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    return _make_tensor(storage.ref if isinstance(storage, _TypedStorage) else storage,
                        _storage_dtype(storage), storage_offset, size, stride, requires_grad)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                       dtype, metadata=None):
    return _make_tensor(storage.ref if isinstance(storage, _TypedStorage) else storage,
                        dtype, storage_offset, size, stride, requires_grad)


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    if func not in (_rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter):
        raise UnsafePickleError("a tensor subclass was rebuilt through a function outside the allowlist")
    return func(*args)


@dataclass(frozen=True)
class _TypedStorage:
    """What persistent_load returns: the storage plus the dtype its legacy class named."""

    ref: Any
    dtype: DType


def _storage_dtype(storage: Any) -> DType:
    if isinstance(storage, _TypedStorage):
        return storage.dtype
    if isinstance(storage, StorageRef):
        return storage.dtype
    return DType("uint8")


def _itemsize(dtype: DType) -> int:
    try:
        return dtype.itemsize
    except UnsupportedError:
        raise UnsupportedError(f"tensors of dtype {dtype.attr} are not supported") from None


class _StorageType:
    """Stand-in for torch's legacy `torch.FloatStorage`-style classes: only names a dtype."""

    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype


_QUANTIZED_STORAGE = {"QInt8Storage": "qint8", "QInt32Storage": "qint32", "QUInt8Storage": "quint8",
                      "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4"}


def _storage_types() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {}
    for name, dtype in {**LEGACY_STORAGE, **_QUANTIZED_STORAGE}.items():
        table[("torch", name)] = _StorageType(DType(dtype))
    table[("torch", "UntypedStorage")] = _StorageType(DType("uint8"))
    table[("torch.storage", "UntypedStorage")] = _StorageType(DType("uint8"))
    return table


_LAYOUT = "torch.serialization._get_layout"


def _get_layout(name: str) -> Any:
    """A layout as torch pickles it (`_get_layout("torch.strided")`), kept as that call."""
    if name not in ("torch.strided", "torch.sparse_coo"):
        raise UnsafePickleError(f"unknown tensor layout {name!r}")
    return inert_class(_LAYOUT)(name)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """copyreg._reconstructor, allowed only for our stand-ins over `object`."""
    if not (isinstance(cls, type) and issubclass(cls, Inert)) or base is not object:
        raise UnsafePickleError("copyreg._reconstructor was asked to build a class outside the allowlist")
    obj = cls.__new__(cls)
    if state is not None:
        obj.__setstate__(state)
    return obj


def _build_allowlist() -> dict[tuple[str, str], Any]:
    allow: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Size"): Size,
        ("torch", "device"): inert_class("torch.device"),
        ("torch.nn.parameter", "Parameter"): inert_class("torch.nn.parameter.Parameter"),
        ("torch", "Tensor"): inert_class("torch.Tensor"),
        ("torch.serialization", "_get_layout"): _get_layout,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "defaultdict"): _plain_defaultdict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): bytearray,
        ("builtins", "range"): range,
        ("_codecs", "encode"): _codecs_encode,
        ("copyreg", "_reconstructor"): _reconstructor,
        ("pathlib", "PosixPath"): pathlib.PurePosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
        ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    }
    for name in ("contiguous_format", "channels_last", "preserve_format", "strided", "sparse_coo"):
        allow[("torch", name)] = GlobalRef("torch", name)
    for name in ("set", "frozenset", "slice", "complex", "bytearray", "range"):
        allow[("__builtin__", name)] = allow[("builtins", name)]  # protocol 2 (torch.save) names
    allow[("__builtin__", "xrange")] = range
    for name in TORCH_DTYPE_ATTRS:
        allow[("torch", name)] = DType(name)
    allow.update(_storage_types())
    for cls in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        qual = f"torch.distributed.checkpoint.metadata.{cls}"
        allow[("torch.distributed.checkpoint.metadata", cls)] = inert_class(qual)
    allow[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = inert_class(
        "torch.distributed.checkpoint.filesystem._StorageInfo")
    return allow


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    """Protocol 2 pickles bytes as _codecs.encode(str, "latin1"); nothing else is allowed."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError("_codecs.encode may only rebuild bytes from a latin1 string")
    return text.encode("latin1")


def _plain_defaultdict(*args: Any) -> dict:
    return {}


def _numpy_allowlist() -> dict[tuple[str, str], Any]:
    """numpy arrays and scalars (RNG states, client state) rebuild without running code."""
    import numpy

    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]

    def reconstruct(cls: Any, *args: Any) -> Any:
        if cls is not numpy.ndarray:
            raise UnsafePickleError("numpy _reconstruct may only build plain ndarrays")
        return multiarray._reconstruct(cls, *args)

    allow: dict[tuple[str, str], Any] = {("numpy", "ndarray"): numpy.ndarray, ("numpy", "dtype"): numpy.dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allow[(module, "_reconstruct")] = reconstruct
        allow[(module, "scalar")] = multiarray.scalar
    return allow


_ALLOWLIST: dict[tuple[str, str], Any] | None = None
_EXTRA: dict[tuple[str, str], Any] = {}


def register_allowed(module: str, name: str, value: Any) -> None:
    """Let a format add inert stand-ins for its own classes (e.g. DeepSpeed's loss scaler)."""
    _EXTRA[(module, name)] = value


def allowlist() -> dict[tuple[str, str], Any]:
    global _ALLOWLIST
    if _ALLOWLIST is None:
        _ALLOWLIST = _build_allowlist()
    return {**_ALLOWLIST, **_EXTRA}


_NUMPY: dict[tuple[str, str], Any] | None = None


def _numpy_global(module: str, name: str) -> Any:
    """numpy's entries, built (importing numpy) only when a pickle names numpy."""
    global _NUMPY
    if _NUMPY is None:
        _NUMPY = _numpy_allowlist()
    return _NUMPY[(module, name)]


# what per-rank torch.save files of FSDP1 LOCAL_STATE_DICT / sharded state dicts reference first
_SHARDED_TENSOR_GLOBALS = {("torch._utils", "_rebuild_wrapper_subclass"),
                           ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: io.BufferedIOBase, file: str,
                 persistent_load: Callable[[Any], Any] | None) -> None:
        super().__init__(data, encoding="utf-8")
        self._file = file
        self._persistent = persistent_load
        self._allowed = allowlist()

    def find_class(self, module: str, name: str) -> Any:
        try:
            if module == "numpy" or module.startswith("numpy."):
                return _numpy_global(module, name)
            return self._allowed[(module, name)]
        except KeyError:
            if (module, name) in _SHARDED_TENSOR_GLOBALS:
                raise UnsupportedError(
                    f"{self._file}: holds torch.distributed ShardedTensor objects, i.e. an FSDP1 "
                    f"LOCAL_STATE_DICT (flat parameters) or a per-rank sharded torch.save; flat parameters "
                    f"cannot be unflattened without the model's FSDP wrapping, so load it into the wrapped "
                    f"model and save again with StateDictType.SHARDED_STATE_DICT through "
                    f"torch.distributed.checkpoint (or FULL_STATE_DICT); nothing was executed") from None
            raise UnsafePickleError(
                f"{self._file}: refusing to unpickle global {module}.{name} "
                f"(not on ckptkit's allowlist; nothing was executed)") from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise FormatError(f"{self._file}: pickle references external storage outside a torch.save archive")
        return self._persistent(pid)


def restricted_loads(data: bytes, file: str,
                     persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle `data` with the allowlist; any failure becomes one sentence naming `file`."""
    try:
        return _RestrictedUnpickler(io.BytesIO(data), file, persistent_load).load()
    except (UnsafePickleError, FormatError, UnsupportedError) as exc:
        if str(exc).startswith(file):
            raise
        raise type(exc)(f"{file}: {exc}") from None
    except RecursionError:
        raise FormatError(f"{file}: pickle is nested too deeply to be a checkpoint") from None
    except Exception as exc:  # malformed pickles raise anything from ValueError to KeyError
        raise FormatError(f"{file}: cannot read pickle ({type(exc).__name__}: {exc})") from None


def storage_pid(pid: Any, file: str) -> tuple[str, DType, int]:
    """Decode torch.save's persistent id ('storage', type, key, location, numel)."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
        raise FormatError(f"{file}: unexpected persistent id {pid!r:.80} in a torch.save archive")
    _, storage_type, key, _location, numel = pid
    if not isinstance(storage_type, _StorageType):
        raise FormatError(f"{file}: persistent id names an unknown storage type {storage_type!r:.60}")
    key = key.decode() if isinstance(key, bytes) else str(key)
    return key, storage_type.dtype, int(numel)


def typed_storage(ref: Any, dtype: DType) -> _TypedStorage:
    return _TypedStorage(ref, dtype)
