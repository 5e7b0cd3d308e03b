"""safetensors files are read as safetensors.torch.load_file reads them, or refused.

ckptkit's own metadata (`ckptkit.aliases`, `ckptkit.objects` in __metadata__) names tensors
ckptkit's writer stored once; it never replaces a tensor or value a file really holds, nor do
shards give one alias two targets. A header the safetensors library reads otherwise (a key given
twice, bytes no tensor holds) is refused as the library refuses it. Crafted from a Hugging Face
Trainer's model.safetensors and files written by safetensors itself; refusals go through
tests/helpers/hostile.py's whole contract, and what ckptkit reads is compared with load_file bit for bit.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.agreement import HF, assert_same, bits, consolidated, needs, refused_everywhere
from helpers.hostile import run_ckptkit

# ---- safetensors: ckptkit's own metadata never overrides a file's content --------------------


def _hf(tmp: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    needs(HF)
    from safetensors import safe_open

    with safe_open(HF, "pt") as f:
        return load_file(HF), dict(f.metadata() or {})


def _st_file(tmp: Path, meta: dict[str, str], tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """The HF fixture's tensors saved by safetensors itself, with `meta` added to __metadata__."""
    real, base = _hf(tmp)
    path = tmp / "model.safetensors"
    save_file(tensors if tensors is not None else real, path, metadata={**base, **meta})
    return path


def _aliases(**pairs: str) -> dict[str, str]:
    return {"ckptkit.aliases": json.dumps(pairs)}


def test_an_alias_naming_a_tensor_the_file_holds_is_refused(tmp_path):
    src = _st_file(tmp_path, _aliases(**{"lm_head.weight": "model.embed_tokens.weight"}))
    real = load_file(src)
    assert not torch.equal(real["lm_head.weight"], real["model.embed_tokens.weight"])
    refused_everywhere(src, tmp_path, str(tmp_path), "lm_head.weight")


def test_diff_never_calls_an_aliased_file_equal_to_one_that_differs(tmp_path):
    src = _st_file(tmp_path, _aliases(**{"lm_head.weight": "model.embed_tokens.weight"}))
    tied = tmp_path / "tied"
    tied.mkdir()
    real, base = _hf(tmp_path)
    save_file(
        {**real, "lm_head.weight": real["model.embed_tokens.weight"].clone()}, tied / "model.safetensors", metadata=base
    )
    run = run_ckptkit("diff", src, tied / "model.safetensors")
    assert run.code != 0 and "equal" not in run.stdout.lower().split("\n")[-2:], run.detail()


def test_an_alias_whose_target_is_an_alias_is_refused(tmp_path):
    real, _ = _hf(tmp_path)
    kept = {k: v for k, v in real.items() if k != "lm_head.weight"}
    src = _st_file(
        tmp_path, _aliases(**{"tied.weight": "model.embed_tokens.weight", "lm_head.weight": "tied.weight"}), kept
    )
    refused_everywhere(src, tmp_path, str(tmp_path), "lm_head.weight")


def test_a_value_named_like_a_tensor_the_file_holds_is_refused(tmp_path):
    src = _st_file(tmp_path, {"ckptkit.objects": json.dumps({"model.norm.weight": 1})})
    refused_everywhere(src, tmp_path, str(tmp_path), "model.norm.weight")


def _shards(
    tmp: Path,
    meta_a: dict[str, str],
    meta_b: dict[str, str],
    weight_map: Callable[[dict[str, str]], dict[str, str]] = lambda m: m,
) -> Path:
    """The HF fixture in two shards written by safetensors, with an index; `meta_*` added to each."""
    real, base = _hf(tmp)
    d = tmp / "hf"
    d.mkdir()
    names = sorted(real)
    half = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for (file, keys), meta in zip(half.items(), (meta_a, meta_b)):
        save_file({k: real[k] for k in keys}, d / file, metadata={**base, **meta})
    wm = weight_map({k: f for f, keys in half.items() for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


def test_an_alias_naming_a_tensor_another_shard_holds_is_refused(tmp_path):
    alias = _aliases(**{"model.norm.weight": "model.layers.0.input_layernorm.weight"})
    d = _shards(tmp_path, alias, alias)
    refused_everywhere(d, tmp_path, "model.norm.weight")


def test_shards_giving_one_alias_two_targets_are_refused(tmp_path):
    d = _shards(
        tmp_path, _aliases(**{"tied.weight": "lm_head.weight"}), _aliases(**{"tied.weight": "model.norm.weight"})
    )
    refused_everywhere(d, tmp_path, "tied.weight")


def test_a_weight_map_naming_the_wrong_shard_is_refused(tmp_path):
    def moved(wm: dict[str, str]) -> dict[str, str]:
        wm["lm_head.weight"] = next(f for f in sorted(set(wm.values())) if f != wm["lm_head.weight"])
        return wm

    d = _shards(tmp_path, {}, {}, moved)
    refused_everywhere(d, tmp_path, "lm_head.weight")


def test_aliases_ckptkit_writes_still_read_as_their_tensors(tmp_path):
    """A tied tensor stored once with its alias (ckptkit's writer's own form) reads as the tensor."""
    real, _ = _hf(tmp_path)
    kept = {k: v for k, v in real.items() if k != "lm_head.weight"}
    src = _st_file(tmp_path, _aliases(**{"lm_head.weight": "model.embed_tokens.weight"}), kept)
    got = consolidated(src, tmp_path)
    truth = load_file(src)
    assert_same(truth, got)
    aliased = got.get("lm_head.weight", got["model.embed_tokens.weight"])
    assert bits(aliased) == bits(truth["model.embed_tokens.weight"])


# ---- safetensors: a header the library reads otherwise ---------------------------------------


def _raw_header(tmp: Path, edit: Callable[[str, dict], str], tail: bytes = b"") -> Path:
    """The HF fixture with its header text rewritten by `edit(text, header)` (and `tail` appended)."""
    needs(HF)
    raw = HF.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].decode().rstrip()
    new = edit(text, json.loads(text)).encode()
    new += b" " * (-len(new) % 8)
    path = tmp / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :] + tail)
    return path


def _duplicate_tensor(text: str, header: dict) -> str:
    info = header["model.norm.weight"]
    other = header["model.layers.1.post_attention_layernorm.weight"]
    return text[:-1] + ',"model.norm.weight":' + json.dumps({**info, "data_offsets": other["data_offsets"]}) + "}"


def _duplicate_field(field: str, value) -> Callable[[str, dict], str]:
    return lambda text, header: _rebuilt(header, "model.norm.weight", field, value)


def _rebuilt(header: dict, name: str, field: str, value) -> str:
    """The header with tensor `name`'s object giving `field` a second time, as `value`."""
    parts = []
    for k, v in header.items():
        body = json.dumps(v)
        if k == name:
            body = body[:-1] + f', "{field}": {json.dumps(value)}}}'
        parts.append(json.dumps(k) + ":" + body)
    return "{" + ",".join(parts) + "}"


def _duplicate_alias_key(text: str, header: dict) -> str:
    aliases = '{"tied.weight": "lm_head.weight", "tied.weight": "model.norm.weight"}'
    meta = {**header["__metadata__"], "ckptkit.aliases": aliases}
    return json.dumps({**header, "__metadata__": meta})


def _all_moved_on(text: str, header: dict) -> str:
    """Every tensor 8 bytes further on (the file 8 bytes longer): bytes [0, 8) no tensor holds."""
    for k, v in header.items():
        if k != "__metadata__":
            v["data_offsets"] = [o + 8 for o in v["data_offsets"]]
    return json.dumps(header)


def _one_dropped(text: str, header: dict) -> str:
    """A tensor in the middle left out of the header: its bytes stay, no tensor holds them."""
    del header["model.layers.0.input_layernorm.weight"]
    return json.dumps(header)


HEADER_ATTACKS = {
    "tensor_named_twice": (_duplicate_tensor, b""),
    "data_offsets_given_twice": (_duplicate_field("data_offsets", [26880, 26944]), b""),
    "dtype_given_twice": (_duplicate_field("dtype", "I32"), b""),
    "alias_given_twice_in_ckptkit_metadata": (_duplicate_alias_key, b""),
    "bytes_after_the_last_tensor": (lambda text, header: text, b"\0" * 8),
    "a_gap_before_the_first_tensor": (_all_moved_on, b"\0" * 8),
    "a_gap_between_two_tensors": (_one_dropped, b""),
}


@pytest.mark.parametrize("case", sorted(HEADER_ATTACKS))
def test_safetensors_headers_the_library_reads_otherwise_are_refused(tmp_path, case):
    edit, tail = HEADER_ATTACKS[case]
    src = _raw_header(tmp_path, edit, tail)
    if case != "alias_given_twice_in_ckptkit_metadata":
        with pytest.raises(Exception):  # noqa: B017 - the library's own refusal, whatever its type
            load_file(src)
    refused_everywhere(src, tmp_path, str(src))
