"""Stream transforms DCP may apply to items (`transform_descriptors`), decoded on read."""
from __future__ import annotations

from ..errors import FormatError, MissingDependencyError, UnsupportedError


SUPPORTED = ("stream.zstd",)


def check(transforms: tuple[str, ...], what: str) -> None:
    """Refuse unknown transforms when indexing, before any byte is read."""
    for desc in transforms:
        name, _, version = desc.partition("/")
        if name not in SUPPORTED or version.partition(".")[0] != "1":
            raise UnsupportedError(f"{what}: item transform {desc!r} is not supported "
                                   f"(supported: stream.zstd/1)")


def decode(data: bytes, transforms: tuple[str, ...], what: str) -> bytes:
    """Undo DCP's save-side transforms, last applied first."""
    for desc in reversed(transforms):
        name, _, version = desc.partition("/")
        if name == "stream.zstd":
            if version.partition(".")[0] != "1":
                raise UnsupportedError(f"{what}: zstd stream version {version!r} is not supported")
            data = _zstd(data, what)
        else:
            raise UnsupportedError(f"{what}: item transform {desc!r} is not supported")
    return data


def _zstd(data: bytes, what: str) -> bytes:
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        try:
            return zstandard.ZstdDecompressor().stream_reader(data).read()
        except zstandard.ZstdError as exc:
            raise FormatError(f"{what}: damaged zstd stream ({exc})") from None
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14
    except ImportError:
        raise MissingDependencyError(
            f"{what} is zstd-compressed; install the 'zstandard' package to read it") from None
    try:
        return zstd.decompress(data)
    except Exception as exc:
        raise FormatError(f"{what}: damaged zstd stream ({exc})") from None
