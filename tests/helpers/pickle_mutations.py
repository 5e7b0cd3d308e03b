"""Opcode-level mutations of real pickles (a Hypothesis strategy) and the seeds they start from:
pickles torch's dcp.save, torch.save and DeepSpeed wrote, and a trainer's RNG states."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
import zipfile
from pathlib import Path

import torch
from conftest import DATA
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("CKPTKIT_FUZZ_EXAMPLES", 150))


FUZZ = settings(
    derandomize=True,
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _archive(path: Path) -> tuple[bytes, dict[str, bytes]]:
    """A torch.save file's data.pkl and its storages (key -> bytes)."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        pkl = next(n for n in names if n.endswith("/data.pkl"))
        prefix = pkl[: -len("data.pkl")]
        storages = {n[len(prefix) + 5 :]: zf.read(n) for n in names if n.startswith(prefix + "data/")}
        return zf.read(pkl), storages


def _rng_states() -> io.BytesIO:
    import random

    import numpy as np

    buf = io.BytesIO()
    torch.save(
        {
            "np": np.random.RandomState(1).get_state(),
            "torch": torch.get_rng_state()[:64],
            "py": random.Random(2).getstate(),
            "gen": np.random.default_rng(3).bit_generator.state,
            "step": np.int64(5),
            "arr": np.arange(6, dtype=np.float32).reshape(2, 3),
        },
        buf,
    )
    return buf


def _seeds() -> dict[str, tuple[bytes, dict[str, bytes] | None, bool]]:
    """name -> (pickle, storages of its archive or None, load tensors eagerly)."""
    ds = DATA / "deepspeed" / "z3_bf16_w2" / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch_pkl, torch_st = _archive(DATA / "plain_state_dict.pt")
    ds_pkl, ds_st = _archive(ds)
    rng_pkl, rng_st = _archive(_rng_states())
    return {
        "dcp_metadata": ((DATA / "fsdp2_w2" / ".metadata").read_bytes(), None, False),
        "torch_save": (torch_pkl, torch_st, True),
        "deepspeed_optimizer": (ds_pkl, ds_st, False),
        "rng_states": (rng_pkl, rng_st, True),
    }


SEEDS = _seeds()


def split(data: bytes) -> list[tuple[pickletools.OpcodeInfo, object, bytes]]:
    """The pickle as (opcode, argument, raw bytes of the whole instruction)."""
    ops = list(pickletools.genops(data))
    out = []
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        out.append((op, arg, data[pos:end]))
    return out


_WIDTH = {"uint1": "<B", "uint2": "<H", "int4": "<i", "uint4": "<I", "uint8": "<Q"}


_LENGTH = {
    "unicodestring1": "<B",
    "unicodestring4": "<I",
    "unicodestring8": "<Q",
    "bytes1": "<B",
    "bytes4": "<I",
    "bytes8": "<Q",
    "bytearray8": "<Q",
    "string1": "<B",
    "string4": "<i",
    "long1": "<B",
    "long4": "<i",
}


def encode(op: pickletools.OpcodeInfo, arg: object) -> bytes:
    """One instruction with argument `arg` (of the kind the opcode takes)."""
    code = op.code.encode("latin-1")
    kind = op.arg.name if op.arg else None
    if kind is None:
        return code
    if kind in _WIDTH:
        return code + struct.pack(_WIDTH[kind], arg)
    if kind in ("unicodestring1", "unicodestring4", "unicodestring8"):
        raw = str(arg).encode("utf-8", "surrogatepass")
        return code + struct.pack(_LENGTH[kind], len(raw)) + raw
    if kind in ("bytes1", "bytes4", "bytes8", "bytearray8", "string1", "string4"):
        raw = bytes(arg) if not isinstance(arg, str) else arg.encode("latin-1")
        return code + struct.pack(_LENGTH[kind], len(raw)) + raw
    if kind in ("long1", "long4"):
        raw = pickle.encode_long(int(arg))
        return code + struct.pack(_LENGTH[kind], len(raw)) + raw
    if kind == "float8":
        return code + struct.pack(">d", float(arg))
    if kind == "stringnl_noescape_pair":
        return code + str(arg).replace(" ", "\n", 1).encode() + b"\n"
    return code + str(arg).encode("utf-8", "replace").replace(b"\n", b"") + b"\n"


def new_argument(op: pickletools.OpcodeInfo, draw) -> object:
    kind = op.arg.name
    if kind in _WIDTH:
        bits = {"<B": 8, "<H": 16, "<i": 31, "<I": 32, "<Q": 64}[_WIDTH[kind]]
        low = -(1 << 31) if kind == "int4" else 0
        return draw(st.one_of(st.integers(low, min(1 << bits, 1 << 63) - 1), st.sampled_from([0, 1, 2, 255])))
    if kind.startswith("unicodestring") or kind.startswith("string"):
        return draw(
            st.one_of(
                st.text(max_size=40),
                st.sampled_from(["os", "system", "numpy", "dtype", "V8", "O8", "torch.strided", "latin1", "utf-8"]),
            )
        )
    if kind.startswith("bytes") or kind == "bytearray8":
        return draw(st.binary(max_size=64))
    if kind in ("long1", "long4"):
        return draw(st.one_of(st.integers(-(1 << 70), 1 << 70), st.sampled_from([2**63, 2**61 - 1, -1, 10**18])))
    if kind == "float8":
        return draw(st.floats(allow_nan=True, allow_infinity=True))
    if kind == "stringnl_noescape_pair":
        return draw(st.sampled_from(DANGEROUS + ALLOWED))
    return draw(st.sampled_from(["0", "1", "-1", "99999999999", "1e999", "abc", "0x10"]))


DANGEROUS = [
    "os system",
    "posix system",
    "builtins eval",
    "builtins exec",
    "builtins getattr",
    "builtins __import__",
    "subprocess Popen",
    "torch load",
    "torch.storage _load_from_bytes",
    "pickle loads",
    "builtins open",
    "shutil rmtree",
    "numpy load",
    "numpy.lib.npyio load",
]


ALLOWED = [
    "numpy.core.multiarray _reconstruct",
    "numpy._core.multiarray scalar",
    "numpy dtype",
    "numpy ndarray",
    "__builtin__ bytearray",
    "builtins range",
    "__builtin__ set",
    "builtins frozenset",
    "builtins complex",
    "collections OrderedDict",
    "collections defaultdict",
    "copyreg _reconstructor",
    "_codecs encode",
    "torch._utils _rebuild_tensor_v2",
    "torch._tensor _rebuild_from_type_v2",
    "torch Size",
    "torch.distributed.checkpoint.metadata Metadata",
    "torch float32",
    "pathlib PosixPath",
    "__builtin__ bytes",
]


BARE = [
    b"b",
    b"R",
    b"\x81",
    b"\x92",
    b"2",
    b"0",
    b"1",
    b"(",
    b"a",
    b"e",
    b"s",
    b"u",
    b"t",
    b"\x85",
    b"\x86",
    b"\x87",
    b"]",
    b"}",
    b"\x8f",
    b"\x90",
    b"\x91",
    b".",
    b"\x94",
    b"\x93",
    b"Q",
    b"N",
    b"l",
    b"d",
    b"o",
]


@st.composite
def mutated(draw, seed: bytes) -> bytes:
    """`seed` with 1 to 4 opcode-level mutations."""
    ops = [raw for _, _, raw in split(seed)]
    infos = split(seed)
    for _ in range(draw(st.integers(1, 4))):
        n = len(ops)
        i = draw(st.integers(0, n - 1))
        kind = draw(st.sampled_from(["drop", "dup", "swap", "arg", "global", "length", "bare", "get"]))
        if kind == "drop" and n > 1:
            del ops[i]
            del infos[i]
        elif kind == "dup":
            ops.insert(i, ops[i])
            infos.insert(i, infos[i])
        elif kind == "swap":
            j = draw(st.integers(0, n - 1))
            ops[i], ops[j] = ops[j], ops[i]
            infos[i], infos[j] = infos[j], infos[i]
        elif kind == "arg" and infos[i][0].arg is not None:
            op = infos[i][0]
            try:
                ops[i] = encode(op, new_argument(op, draw))
            except (struct.error, ValueError, OverflowError):
                pass
        elif kind == "global":
            name = draw(st.sampled_from(DANGEROUS + ALLOWED))
            call = draw(
                st.sampled_from(
                    [b"", b")R", b"N\x85R", b"K\x05\x85R", b"J\x00/YY\x85R", b"(K\x01K\x02tR", b")\x81", b"}b", b"Nb"]
                )
            )
            ops.insert(i, b"c" + name.replace(" ", "\n").encode() + b"\n" + call)
            infos.insert(i, infos[i])
        elif kind == "length":
            op = infos[i][0]
            if op.arg is not None and op.arg.name in _LENGTH:
                fmt = _LENGTH[op.arg.name]
                width = struct.calcsize(fmt)
                limit = (1 << (8 * width - (1 if fmt.endswith("i") else 0))) - 1
                value = draw(st.one_of(st.integers(0, limit), st.sampled_from([limit, limit // 2, 0, 1 << 31])))
                ops[i] = ops[i][:1] + struct.pack(fmt, min(value, limit)) + ops[i][1 + width :]
        elif kind == "bare":
            ops.insert(i, draw(st.sampled_from(BARE)))
            infos.insert(i, infos[i])
        elif kind == "get":
            ops.insert(
                i,
                b"h" + bytes([draw(st.integers(0, 255))])
                if draw(st.booleans())
                else b"j" + struct.pack("<I", draw(st.integers(0, 1 << 20))),
            )
            infos.insert(i, infos[i])
    return b"".join(ops)
