"""The canonical tensor index and its geometry.

Import the modules themselves (index.types, index.geometry, ...): this package runs no code, so
that index.dtypes and index.strides, which sit below the stand-ins of torch's types, can be
imported without the index types above them.
"""
