"""What each global a checkpoint may name may be called with: the grammar of ckptkit's unpickler.

Every allowed global is a value (a dtype, a class that is only data) or a call with a rule. A rule
checks the number and types of its arguments before anything is built (bytearray from bytes, a
latin-1 string or a bounded int; set and frozenset from a list; range of bounded length; complex
from numbers; slice from ints; OrderedDict from nothing or a list of pairs; torch's rebuild
functions from storages, ints and dtypes; pathlib from strings ...) and builds the value with
ckptkit's own code. BUILD (an object's state) is accepted on ckptkit's stand-ins (Inert) only, and
on an OrderedDict as plain attributes (torch's state_dict()._metadata); numpy's dtypes and arrays
are completed by safeload.numpy, never by numpy's __setstate__. Anything else is an
UnsafePickleError naming the global.
"""

from __future__ import annotations

import collections
import pathlib
from typing import Any, Callable

from .. import knobs
from ..errors import FormatError, UnsafePickleError, UnsupportedError, quote
from ..index.dtypes import LEGACY_STORAGE, TORCH_DTYPE_ATTRS
from .inert import Inert, apply_inert_state, inert_class, plain_attrs, qualname_of
from .refs import StorageType
from .rules import Refused, Rule, extra_allowed
from .tensor_rules import checked_ints, rebuild_parameter, rebuild_tensor, rebuild_tensor_v2, rebuild_tensor_v3
from .vm import Placeholder, check_keys
from ..torch_types import DType, GlobalRef, Size, SmallTensor


def _kinds(args: tuple) -> str:
    shown = ", ".join(type(a).__name__ for a in args[:8])  # (a sentence, however many arguments)
    return "(" + shown + (f", ... {len(args) - 8:,} more" if len(args) > 8 else "") + ")"


BYTEARRAY_SIZE = 1 << 20  # bytearray(n): pickles write a bytearray's content, never its size
_NOT_SEEN = object()  # a dict lookup's default that no unpickled value can be


# ---- builtins, collections, pathlib, torch's small types ---------------------------------------


def _set(args: tuple) -> Any:
    if not args:
        return set()
    if len(args) != 1 or type(args[0]) is not list:
        raise Refused("takes nothing or a list")
    check_keys(args[0])
    return set(args[0])


def _frozenset(args: tuple) -> Any:
    return frozenset(_set(args))


def _slice(args: tuple) -> slice:
    if not 1 <= len(args) <= 3 or not all(a is None or type(a) is int for a in args):
        raise Refused("takes 1 to 3 integers or None")
    return slice(*args)


def _complex(args: tuple) -> complex:
    if len(args) > 2 or not all(type(a) in (int, float) for a in args):
        raise Refused("takes at most two numbers")
    try:
        return complex(*args)
    except OverflowError:
        raise Refused("takes numbers that fit a float") from None


def _bytearray(args: tuple) -> bytearray:
    if not args:
        return bytearray()
    if len(args) == 1 and type(args[0]) is bytes:
        return bytearray(args[0])
    if len(args) == 1 and type(args[0]) is int and 0 <= args[0] <= BYTEARRAY_SIZE:
        return bytearray(args[0])
    if len(args) == 2 and type(args[0]) is str and args[1] in ("latin-1", "latin1"):
        return bytearray(_latin1(args[0]))
    raise Refused(f"takes bytes, a latin-1 string or a size of at most {BYTEARRAY_SIZE:,} bytes")


def _bytes(args: tuple) -> bytes:
    if not args:
        return b""
    if len(args) == 1 and type(args[0]) is bytes:
        return args[0]
    raise Refused("takes nothing or bytes")


def _latin1(text: str) -> bytes:
    try:
        return text.encode("latin1")
    except UnicodeEncodeError:
        raise FormatError("a byte string pickled as text holds characters above 255") from None


def _codecs_encode(args: tuple) -> bytes:
    """Protocol 2 pickles bytes as _codecs.encode(str, "latin1"); nothing else is allowed."""
    if len(args) != 2 or type(args[0]) is not str or args[1] not in ("latin1", "latin-1"):
        raise Refused("may only rebuild bytes from a latin1 string")
    return _latin1(args[0])


def _range(args: tuple) -> range:
    if not 1 <= len(args) <= 3 or not all(type(a) is int for a in args) or (len(args) == 3 and args[2] == 0):
        raise Refused("takes 1 to 3 integers (a step other than 0)")
    value = range(*args)
    try:
        n = len(value)
    except OverflowError:
        n = None
    if n is None or n > knobs.MAX_PICKLE_EXPANDED:
        raise Refused(f"may hold at most {knobs.MAX_PICKLE_EXPANDED:,} numbers (ckptkit.knobs.MAX_PICKLE_EXPANDED)")
    return value


def _ordered_dict(args: tuple) -> collections.OrderedDict:
    if not args:
        return collections.OrderedDict()
    if len(args) != 1 or type(args[0]) is not list:
        raise Refused("takes nothing or a list of pairs")
    pairs = args[0]
    if not all(type(p) in (tuple, list) and len(p) == 2 for p in pairs):
        raise Refused("takes nothing or a list of pairs")
    check_keys([p[0] for p in pairs])
    return collections.OrderedDict(pairs)


def _defaultdict(args: tuple) -> dict:
    """collections.defaultdict(factory): a plain dict (the factory is never called)."""
    if len(args) > 1 or (args and args[0] is not None and not isinstance(args[0], type)):
        raise Refused("takes nothing, None or a class")
    return {}


PATH_CHARS = 4096  # a path's parts together (PATH_MAX): pathlib's work grows with each part's length


def _path(cls: type) -> Rule:
    def rule(args: tuple) -> Any:
        if len(args) > PATH_CHARS or not all(type(a) is str for a in args):
            raise Refused("takes strings")
        if (
            sum(map(len, args)) > PATH_CHARS
        ):  # (one long string fetched thousands of times costs its pickle 2 bytes each)
            raise Refused(f"takes parts of at most {PATH_CHARS:,} characters in all")
        return cls(*args)

    return rule


def _size(args: tuple) -> Size:
    if not args:
        return Size()
    if len(args) != 1:
        raise Refused("takes one tuple of integers")
    return Size(checked_ints(args[0], "torch.Size", low=-(1 << 63)))


def _device(args: tuple) -> Any:
    if (
        not 1 <= len(args) <= 2
        or type(args[0]) is not str
        or len(args[0]) > 64
        or (len(args) == 2 and args[1] is not None and type(args[1]) is not int)
    ):
        raise Refused("takes a device type and an index")
    return inert_class("torch.device")(*args)


LAYOUT = "torch.serialization._get_layout"


def _get_layout(args: tuple) -> Any:
    """A layout as torch pickles it (`_get_layout("torch.strided")`), kept as that call."""
    if len(args) != 1 or args[0] not in ("torch.strided", "torch.sparse_coo"):
        raise Refused("takes 'torch.strided' or 'torch.sparse_coo'")
    return inert_class(LAYOUT)(args[0])


def _reconstructor(args: tuple) -> Any:
    """copyreg._reconstructor, allowed only for our stand-ins over `object`."""
    if len(args) != 3:
        raise Refused("takes 3 arguments")
    cls, base, state = args
    if not (isinstance(cls, type) and issubclass(cls, Inert)) or base is not object:
        raise Refused("may only build ckptkit's stand-ins")
    obj = cls.__new__(cls)
    if state is not None:
        apply_inert_state(obj, state)
    return obj


def _inert(cls: type) -> Rule:
    def rule(args: tuple) -> Any:
        if len(args) > 4096:
            raise Refused("takes at most 4096 arguments")
        return cls(*args)

    return rule


# ---- state (BUILD) -----------------------------------------------------------------------------

ORDERED_DICT_ATTRS = frozenset(dir(collections.OrderedDict))


# ---- the table ---------------------------------------------------------------------------------


def _storage_types() -> dict[tuple[str, str], Any]:
    quantized = {
        "QInt8Storage": "qint8",
        "QInt32Storage": "qint32",
        "QUInt8Storage": "quint8",
        "QUInt4x2Storage": "quint4x2",
        "QUInt2x4Storage": "quint2x4",
    }
    table: dict[tuple[str, str], Any] = {}
    for name, dtype in {**LEGACY_STORAGE, **quantized}.items():
        table[("torch", name)] = StorageType(DType(dtype))
    table[("torch", "UntypedStorage")] = StorageType(DType("uint8"))
    table[("torch.storage", "UntypedStorage")] = StorageType(DType("uint8"))
    return table


def rebuild_from_type_v2_marker(args: tuple) -> Any:  # replaced by RestrictedGrammar.call
    raise Refused("is handled by the grammar")


def build_table() -> tuple[dict[tuple[str, str], Any], dict[int, tuple[Any, Rule]]]:
    """(module, name) -> value, and id(value) -> (value, rule) for the values that may be called."""
    values: dict[tuple[str, str], Any] = {}
    rules: dict[tuple[str, str], Rule] = {}

    def add(module: str, name: str, value: Any, rule: Rule | None = None) -> None:
        values[(module, name)] = value
        if rule is not None:
            rules[(module, name)] = rule

    add("torch._utils", "_rebuild_tensor_v2", rebuild_tensor_v2, rebuild_tensor_v2)
    add("torch._utils", "_rebuild_tensor_v3", rebuild_tensor_v3, rebuild_tensor_v3)
    add("torch._utils", "_rebuild_tensor", rebuild_tensor, rebuild_tensor)
    add("torch._utils", "_rebuild_parameter", rebuild_parameter, rebuild_parameter)
    add("torch._utils", "_rebuild_parameter_with_state", rebuild_parameter, rebuild_parameter)
    add("torch._tensor", "_rebuild_from_type_v2", rebuild_from_type_v2_marker, rebuild_from_type_v2_marker)
    add("torch", "Size", Size, _size)
    add("torch", "device", inert_class("torch.device"), _device)
    add("torch.nn.parameter", "Parameter", inert_class("torch.nn.parameter.Parameter"))
    add("torch", "Tensor", inert_class("torch.Tensor"))
    add("torch.serialization", "_get_layout", _get_layout, _get_layout)
    add("collections", "OrderedDict", collections.OrderedDict, _ordered_dict)
    add("collections", "defaultdict", collections.defaultdict, _defaultdict)
    add("_codecs", "encode", _codecs_encode, _codecs_encode)
    add("copyreg", "_reconstructor", _reconstructor, _reconstructor)
    for module in ("builtins", "__builtin__"):  # protocol 2 (torch.save) writes Python 2 names
        add(module, "set", set, _set)
        add(module, "frozenset", frozenset, _frozenset)
        add(module, "slice", slice, _slice)
        add(module, "complex", complex, _complex)
        add(module, "bytearray", bytearray, _bytearray)
        add(module, "bytes", bytes, _bytes)
        add(module, "range", range, _range)
    add("__builtin__", "xrange", range, _range)
    for name, cls in (
        ("PosixPath", pathlib.PurePosixPath),
        ("PurePosixPath", pathlib.PurePosixPath),
        ("WindowsPath", pathlib.PureWindowsPath),
        ("PureWindowsPath", pathlib.PureWindowsPath),
    ):
        add("pathlib", name, cls, _path(cls))
    for name in ("contiguous_format", "channels_last", "preserve_format", "strided", "sparse_coo"):
        add("torch", name, GlobalRef("torch", name))
    for name in TORCH_DTYPE_ATTRS:
        add("torch", name, DType(name))
    values.update(_storage_types())
    for cls in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        add("torch.distributed.checkpoint.metadata", cls, inert_class(f"torch.distributed.checkpoint.metadata.{cls}"))
    # the save plans Megatron-Core's torch_dist backend keeps in `Metadata.all_local_plans`: plain
    # dataclasses (and one Enum) of names, offsets and sizes, rebuilt as data like the classes above
    for cls in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"):
        add("torch.distributed.checkpoint.planner", cls, inert_class(f"torch.distributed.checkpoint.planner.{cls}"))
    add(
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        inert_class("torch.distributed.checkpoint.filesystem._StorageInfo"),
    )
    # a bag of attributes: training scripts save their parsed command line (Megatron-DeepSpeed's
    # `args` in every model-states file, Lightning's hyperparameters); kept as data, re-emitted as is
    add("argparse", "Namespace", inert_class("argparse.Namespace"))
    calls: dict[int, tuple[Any, Rule]] = {}
    for key, rule in rules.items():
        calls[id(values[key])] = (values[key], rule)
    return values, calls


REBUILDERS = (rebuild_tensor_v2, rebuild_tensor_v3, rebuild_parameter)
TENSOR_TYPES = ("torch.Tensor", "torch.nn.parameter.Parameter")

# what per-rank torch.save files of FSDP1 LOCAL_STATE_DICT / sharded state dicts reference first
_SHARDED_TENSOR_GLOBALS = {
    ("torch._utils", "_rebuild_wrapper_subclass"),
    ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"),
}

_TABLE: tuple[dict, dict] | None = None


def table() -> tuple[dict[tuple[str, str], Any], dict[int, tuple[Any, Rule]]]:
    global _TABLE
    if _TABLE is None:
        _TABLE = build_table()
    return _TABLE


class RestrictedGrammar:
    """ckptkit's grammar for one pickle of one file (see the module docstring)."""

    def __init__(self, file: str, persistent_load: Callable[[Any], Any] | None) -> None:
        self._file = file
        self._persistent = persistent_load
        values, calls = table()
        self._values = values
        self._extra = extra_allowed()
        self._calls = dict(calls)  # grows by the stand-in classes this pickle calls
        self._stand_ins: dict[int, type] = {}
        self._names: dict[int, str] = {}
        self._numpy: Any = None

    # -- globals --
    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        value = self._extra.get(key, self._values.get(key, _MISSING))
        if value is _MISSING and (module == "numpy" or module.startswith("numpy.")):
            value = self._numpy_grammar().values.get(key, _MISSING)
        if value is _MISSING:
            if key in _SHARDED_TENSOR_GLOBALS:
                raise UnsupportedError(
                    f"{self._file}: holds torch.distributed ShardedTensor objects, i.e. an FSDP1 "
                    f"LOCAL_STATE_DICT (flat parameters) or a per-rank sharded torch.save; flat parameters "
                    f"cannot be unflattened without the model's FSDP wrapping, so load it into the wrapped "
                    f"model and save again with StateDictType.SHARDED_STATE_DICT through "
                    f"torch.distributed.checkpoint (or FULL_STATE_DICT); nothing was executed"
                )
            raise UnsafePickleError(
                f"refusing to unpickle global {quote(f'{module}.{name}')} (not on ckptkit's "
                f"allowlist; nothing was executed)"
            )
        self._names.setdefault(id(value), f"{module}.{name}")
        return value

    def _numpy_grammar(self) -> Any:
        if self._numpy is None:
            from . import numpy as numpy_grammar

            self._numpy = numpy_grammar.grammar()
        return self._numpy

    def _name(self, value: Any) -> str:
        name = self._names.get(id(value))
        if name is not None:
            return name
        if isinstance(value, type):
            return getattr(value, "_qualname", value.__name__)
        return f"a {type(value).__name__}"

    def _refuse(self, func: Any, args: tuple, why: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"refusing to call {quote(self._name(func))} with {_kinds(args)}: {why} (outside "
            f"ckptkit's grammar for it; nothing was executed)"
        )

    # -- calls --
    def _rule(self, func: Any) -> Rule | None:
        if isinstance(func, type) and issubclass(func, Inert):
            rule = _inert(func)
            self._calls[id(func)] = (func, rule)
            return rule
        if self._numpy is not None:
            return self._numpy.rule(func)
        return None

    def call(self, func: Any, args: tuple) -> Any:
        entry = self._calls.get(id(func))
        rule = entry[1] if entry is not None and entry[0] is func else self._rule(func)
        if rule is None:
            raise UnsafePickleError(
                f"refusing to call {quote(self._name(func))} (not a callable of ckptkit's "
                f"grammar; nothing was executed)"
            )
        try:
            if rule is rebuild_from_type_v2_marker:
                return self.rebuild_from_type_v2(args)
            return rule(args)
        except Refused as exc:
            raise self._refuse(func, args, str(exc)) from None

    def rebuild_from_type_v2(self, args: tuple) -> Any:
        """torch._tensor._rebuild_from_type_v2(func, new_type, args, state): only our rebuilders."""
        if len(args) != 4 or type(args[2]) is not tuple:
            raise Refused("takes a rebuild function, a tensor class, its arguments and a state")
        func, new_type, inner, _state = args
        if func not in REBUILDERS or not (
            isinstance(new_type, type) and issubclass(new_type, Inert) and qualname_of(new_type) in TENSOR_TYPES
        ):
            raise UnsafePickleError(
                "a tensor subclass was rebuilt through a function outside the allowlist "
                f"({quote(self._name(func))} for {quote(self._name(new_type))})"
            )
        try:
            return func(inner)
        except Refused as exc:
            raise self._refuse(func, inner, str(exc)) from None

    def new(self, cls: Any, args: tuple, kwargs: dict | None) -> Any:
        if self._stand_ins.get(id(cls), _NOT_SEEN) is cls and not kwargs:  # (None is no stand-in)
            return cls.__new__(cls)
        if isinstance(cls, type) and issubclass(cls, Inert):
            self._stand_ins[id(cls)] = cls
            if kwargs and not all(type(k) is str for k in kwargs):
                raise UnsafePickleError(
                    f"refusing to create {quote(qualname_of(cls))} with keyword arguments that are not names"
                )
            return cls.__new__(cls)
        if cls is complex:
            try:
                return _complex(args)
            except Refused as exc:
                raise self._refuse(cls, args, str(exc)) from None
        raise UnsafePickleError(
            f"refusing to create an object of {quote(self._name(cls))} (NEWOBJ is allowed on "
            f"ckptkit's stand-ins only; nothing was executed)"
        )

    def build(self, obj: Any, state: Any) -> Any:
        if isinstance(obj, Inert):
            Inert.__setstate__(obj, state)  # (the grammar's BUILD, whoever unpickles a stand-in)
            return obj
        if type(obj) is collections.OrderedDict:  # torch's state_dict() carries `_metadata`
            obj.__dict__.update(plain_attrs(state, ORDERED_DICT_ATTRS, "an OrderedDict"))
            return obj
        if isinstance(obj, Placeholder) and self._numpy is not None:
            return self._numpy.build(obj, state)
        raise UnsafePickleError(
            f"refusing to set the state of {quote(self._name(obj))} (BUILD is allowed on "
            f"ckptkit's stand-ins only; nothing was executed)"
        )

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise FormatError("pickle references external storage outside a torch.save archive")
        return self._persistent(pid)

    atoms = frozenset({DType, GlobalRef, StorageType})

    def children(self, value: Any) -> Any:
        if isinstance(value, Inert):
            return [*value.__dict__.keys(), *value.__dict__.values()]
        if type(value) is Size:
            return value
        return None

    def is_costly(self, t: type) -> bool:
        """May values of type `t` cost more than their inputs (see cost), or be placeholders?"""
        if t in (range, bytes, bytearray, SmallTensor) or issubclass(t, Placeholder):
            return True
        return self._numpy is not None and self._numpy.is_costly(t)

    def cost(self, value: Any) -> tuple[int, int]:
        t = type(value)
        if t is range:
            return len(value), 0
        if t is bytearray or t is bytes:
            return 0, len(value)
        if t is SmallTensor:  # a view's bytes are gathered when asked for: count what they will be
            nbytes = getattr(value, "nbytes", None)
            return 0, nbytes if type(nbytes) is int else len(value.data)
        if self._numpy is not None:
            return self._numpy.cost(value)
        return 0, 0


_MISSING = object()
