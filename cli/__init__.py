"""The click application behind the `ckptkit` command (installed as the package ckptkit_cli)."""
