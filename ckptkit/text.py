"""Text from a checkpoint made safe to show on a terminal.

Tensor names, object values and file names come from files anyone may have crafted. Printed as
they are, a newline forges a line ("/path: ok"), a carriage return overwrites one, an escape
sequence retitles or clears the terminal and a bidi override reverses what is read. `escape`
writes every such character as a visible escape instead: \\n, \\r, \\t, \\x1b, \\u202e (Python's
spelling, without quotes). Printable text, backslashes included, is left as it is, so escaping
text that was already escaped (errors.quote) changes nothing.
"""

from __future__ import annotations

import unicodedata

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# control, format (bidi overrides, zero-width), surrogate, private-use, unassigned, line and
# paragraph separators: nothing a reader should have to trust
_UNSAFE = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"))


def escape(text: str) -> str:
    """`text` with every control or invisible format character written as an escape."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(escape_char(ch) for ch in text)


def escape_char(ch: str) -> str:
    """One character as `escape` shows it (itself when it is safe to print)."""
    named = _NAMED.get(ch)
    if named is not None:
        return named
    if unicodedata.category(ch) not in _UNSAFE:
        return ch
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape): show the byte
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
