"""Parameter names across backends: wrapper prefixes dropped, user prefixes and renames applied.

Wrappers leave marks in names (DDP and DeepSpeed `module.`, FSDP1 `_fsdp_wrapped_module.`,
activation checkpointing `_checkpoint_wrapped_module.`, torch.compile `_orig_mod.`). They are
dropped so that the same model lines up whatever wrapped it. `model.` is a real module name in
many models (Hugging Face), so it is only stripped or added when the user asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UsageError

WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
LEADING_WRAPPERS = ("module.",)  # stripped only when every model name carries it


@dataclass
class KeyRules:
    """How source names become target names, applied in this order: wrapper marks dropped,
    `strip` prefixes removed, `renames` (OLD=NEW, on name prefixes) applied, `add` prepended."""

    strip: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    add: str = ""
    drop_leading: tuple[str, ...] = field(default_factory=tuple)

    @staticmethod
    def parse_renames(rules: tuple[str, ...] | list[str]) -> tuple[tuple[str, str], ...]:
        out = []
        for rule in rules:
            old, sep, new = rule.partition("=")
            if not sep or not old:
                raise UsageError(f"--rename {rule!r}: expected OLD=NEW (OLD a name prefix, NEW may be empty)")
            out.append((old, new))
        return tuple(out)

    def for_names(self, names: list[str]) -> "KeyRules":
        """These rules plus the leading wrappers every one of `names` carries (DDP's `module.`)."""
        leading = tuple(p for p in LEADING_WRAPPERS if names and all(n.startswith(p) for n in names))
        return KeyRules(self.strip, self.renames, self.add, leading)

    def apply(self, name: str) -> str:
        for infix in WRAPPER_INFIXES:
            name = name.replace("." + infix, ".")
            if name.startswith(infix):
                name = name[len(infix) :]
        for prefix in self.drop_leading + self.strip:
            if name.startswith(prefix):
                name = name[len(prefix) :]
        for old, new in self.renames:
            if name.startswith(old):
                name = new + name[len(old) :]
        return self.add + name
