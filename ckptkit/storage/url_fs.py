"""fsspec filesystems for the URLs given as SRC or OUT, and their failures as one sentence.

fsspec raises whatever its backends raise: ValueError for a protocol it does not know,
ImportError for a backend whose package is not installed, and anything at all from the calls that
reach the storage (botocore's NoCredentialsError, aiohttp's refused connections, zip:// with no
archive opening the current folder). None of these is a bug in ckptkit, so each becomes one
sentence naming the URL and the backend's own message. Only calls into fsspec are wrapped: an
error raised by ckptkit's own code stays a bug (exit 3).
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import CkptkitError
from ..text import escape

MESSAGE_LIMIT = 200  # characters of a backend's message shown (a server's reply can be long)


def filesystem(url: str, error: type[CkptkitError]) -> tuple[Any, str]:
    """fsspec's filesystem and path for `url` (SRC and OUT alike). A protocol fsspec does not know,
    a backend package that is not installed (named, as fsspec's known_implementations names it) or
    a backend that refuses the URL is `error` naming the URL."""
    try:
        import fsspec
    except ImportError:
        raise error(
            f"{url}: URLs are read and written through fsspec, which is not installed (pip install fsspec)"
        ) from None
    try:
        return fsspec.core.url_to_fs(url)
    except MemoryError:
        raise
    except ImportError as exc:
        raise error(f"{url}: {_missing_backend(url, exc)}") from exc
    except Exception as exc:
        unknown = unknown_protocols(url)
        if unknown:
            raise error(f"{url}: {_unknown_protocol(unknown[0])}") from exc
        raise error(f"{url}: fsspec cannot open this URL ({backend_message(exc)})") from exc


def protocols_of(url: str) -> list[str]:
    """The protocols a (possibly chained, `a::b://...`) URL names, outermost first."""
    parts = url.split("::")
    found = []
    for i, part in enumerate(parts):
        protocol, sep, _ = part.partition("://")
        if sep:
            found.append(protocol)
        elif i < len(parts) - 1:
            found.append(part)
    return found


def unknown_protocols(url: str) -> list[str]:
    """The protocols of `url` that fsspec knows no implementation of."""
    from fsspec.registry import known_implementations, registry

    return [p for p in protocols_of(url) if p not in known_implementations and p not in registry]


def _unknown_protocol(protocol: str) -> str:
    from fsspec.registry import known_implementations

    said = f"the protocol {escape(protocol)[:40]}:// is not known to fsspec"
    close = difflib.get_close_matches(protocol, list(known_implementations), n=1)
    if close:
        package = _package_of(close[0])
        return f"{said} (did you mean {close[0]}://{f', from the {package} package' if package else ''}?)"
    return f"{said} (no installed package provides it)"


def _package_of(protocol: str) -> str | None:
    """The package fsspec's known_implementations names for `protocol` (None: fsspec itself)."""
    from fsspec.registry import known_implementations

    spec = known_implementations.get(protocol) or {}
    package = str(spec.get("class", "")).split(".")[0]
    return package if package and package != "fsspec" else None


def _missing_backend(url: str, exc: ImportError) -> str:
    """Which package a URL's protocol needs, as fsspec's known_implementations says."""
    for protocol in protocols_of(url):
        package = _package_of(protocol)
        if package and importlib.util.find_spec(package) is None:
            return (
                f"fsspec reads and writes {protocol}:// with the {package} package, which is not "
                f"installed (pip install {package})"
            )
    return f"a package this URL needs is not installed ({backend_message(exc)})"


def backend_message(exc: BaseException) -> str:
    """A backend's error as a message shows it: its type and text, escaped and cut short."""
    text = escape(" ".join(str(exc).split()))
    if len(text) > MESSAGE_LIMIT:
        text = text[:MESSAGE_LIMIT] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextmanager
def backend_errors(label: str, doing: str, error: type[CkptkitError], missing: str | None = None) -> Iterator[None]:
    """Around calls into an fsspec filesystem only: whatever the backend raises (credentials,
    network, permissions) is `error` saying `label`: `doing` failed, with the backend's message;
    with `missing`, a FileNotFoundError is `error` saying `label`: `missing`. ckptkit's own
    errors, interrupts and MemoryError pass through."""
    try:
        yield
    except (CkptkitError, MemoryError):
        raise
    except FileNotFoundError as exc:
        if missing is None:
            raise error(f"{label}: {doing} failed ({backend_message(exc)})") from exc
        raise error(f"{label}: {missing}") from None
    except Exception as exc:
        raise error(f"{label}: {doing} failed ({backend_message(exc)})") from exc


def failure_behind(exc: FileNotFoundError) -> BaseException | None:
    """The error a backend turned into FileNotFoundError when it was not absence: HTTP's `info`
    reports a refused connection as FileNotFoundError caused by it. None: really not found."""
    seen: set[int] = set()
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
            return cause
        status = getattr(cause, "status", None)
        if isinstance(status, int) and status not in (404, 410):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None
