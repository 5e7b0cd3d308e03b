"""CRC32 (the zip/IEEE polynomial torch.save records carry), as fast as the machine allows.

python-isal's SIMD implementation is ~6x faster than zlib's here and returns the same values;
it is optional (pip install 'ckptkit[fast]'), zlib is the fallback.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32 as _crc32

    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32 as _crc32

    IMPLEMENTATION = "zlib"


def crc32(data, value: int = 0) -> int:
    return _crc32(data, value)
