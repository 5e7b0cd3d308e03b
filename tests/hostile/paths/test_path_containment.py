"""Reads stay inside the checkpoint, only regular files are opened, nothing blocks.

Every case is crafted here as an attacker would: a data file linked to /etc/passwd or to another
user's checkpoint, a DeepSpeed `latest` linked out or full of escape sequences, FIFOs, character
devices and sockets in place of files, tag folders linked out, link loops. Each runs through the
CLI in a subprocess (tests/helpers/hostile.py) with a short timeout, so a hang fails instead of blocking the
suite, and checks the whole contract: exit 2 (verify: 1, the problem listed), one sentence naming
the file, nothing read from outside, source unchanged, nothing left next to OUT. What must keep
working does: links inside SRC, SRC itself a link, the Hugging Face cache layout (snapshot files
linked into blobs/), and --follow-links for links that leave.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
from pathlib import Path

import pytest
import torch

from helpers.hostile import Scene, check_refused, rss_bound, run_ckptkit
from helpers.hf_hub_cache import hf_cache

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fixtures" / "data"
DCP = DATA / "fsdp2_w2"
DS = DATA / "deepspeed" / "z1_fp32_w2"
PLAIN = DATA / "plain_state_dict.pt"
TIMEOUT = 30.0
BUDGET = 512 << 20
COMMANDS = ["inspect", "verify", "consolidate", "reshard", "convert"]
SECRET = "TOP-SECRET-do-not-copy-0123456789"


def args_for(cmd: str, src: Path, out: Path, *extra: str) -> list[str]:
    if cmd == "inspect":
        return ["inspect", str(src), *extra]
    if cmd == "verify":
        return ["verify", "--deep", str(src), *extra]
    if cmd == "consolidate":
        return ["consolidate", str(src), str(out), *extra]
    if cmd == "reshard":
        return ["reshard", str(src), str(out), "--to", "3", *extra]
    return ["convert", str(src), str(out), "--to", "dcp", "--world-size", "3", *extra]


def refused(cmd: str, src: Path, tmp_path: Path, *names: str, extra: tuple = (), watch: Path | None = None):
    """Run `cmd` on `src` and assert the refusal contract; returns the run."""
    out = tmp_path / "outs" / "OUT"
    out.parent.mkdir(exist_ok=True)
    scene = Scene(watch or src, out)
    run = run_ckptkit(*args_for(cmd, src, out, *extra), timeout=TIMEOUT)
    check_refused(run, *names, scene=scene, code=1 if cmd == "verify" else 2, rss_limit=rss_bound(BUDGET, 0))
    assert not out.exists(), run.detail()
    if cmd == "verify":  # the problem list names the file once per problem, never a flood
        assert len(run.stderr.splitlines()) <= 3, run.detail()
    assert SECRET not in run.output, run.detail()
    return run


def ok(*args: str):
    run = run_ckptkit(*[str(a) for a in args], timeout=TIMEOUT)
    assert run.code == 0 and not run.timed_out, run.detail()
    return run


def copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)
    return dst


def secret_file(tmp_path: Path) -> Path:
    p = tmp_path / "elsewhere" / "secret.txt"
    p.parent.mkdir(exist_ok=True)
    p.write_text(f"{SECRET}\n" * 50)
    return p


def consolidated(src: Path, out: Path, *extra: str) -> dict[str, bytes]:
    ok("consolidate", src, out, *extra)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """What consolidate writes from the untouched fixtures (what a link inside SRC must not change)."""
    base = tmp_path_factory.mktemp("pristine")
    return {"dcp": consolidated(DCP, base / "dcp"), "ds": consolidated(DS, base / "ds")}


# ---- 1. a data file linked out of SRC ---------------------------------------------------------


@pytest.mark.parametrize("cmd", COMMANDS)
def test_data_file_linked_to_another_checkpoint_is_refused(tmp_path, cmd):
    """The dangerous case: the linked file is valid (another user's checkpoint), so without the
    check its bytes would land in the output silently."""
    other = copy(DCP, tmp_path / "other_user" / "ckpt")
    src = copy(DCP, tmp_path / "ckpt")
    (src / "__0_0.distcp").unlink()
    (src / "__0_0.distcp").symlink_to(other / "__0_0.distcp")
    run = refused(cmd, src, tmp_path, str(src / "__0_0.distcp"), "--follow-links")
    assert "outside the checkpoint" in run.stderr


@pytest.mark.parametrize("cmd", ["inspect", "consolidate"])
def test_data_file_linked_to_etc_passwd_is_refused(tmp_path, cmd):
    src = copy(DCP, tmp_path / "ckpt")
    (src / "__1_0.distcp").unlink()
    (src / "__1_0.distcp").symlink_to("/etc/passwd")
    run = refused(cmd, src, tmp_path, str(src / "__1_0.distcp"), "--follow-links")
    assert "root:" not in run.output


def test_relative_link_chain_out_is_refused_naming_the_first_link(tmp_path):
    """__0_0.distcp -> hop -> ../elsewhere/...: a chain through SRC that ends outside."""
    src = copy(DCP, tmp_path / "ckpt")
    outside = copy(DCP / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    (src / "hop").symlink_to(Path("..") / outside.name)
    (src / "__0_0.distcp").unlink()
    (src / "__0_0.distcp").symlink_to("hop")
    refused("consolidate", src, tmp_path, str(src / "__0_0.distcp"), "--follow-links")


def test_follow_links_reads_a_link_out(tmp_path, pristine, monkeypatch):
    """--follow-links (and CKPTKIT_FOLLOW_LINKS=1, and follow_links=True in Python) allow the link,
    and the output is what the unlinked checkpoint gives."""
    from ckptkit.errors import UnsafePathError
    from ckptkit.formats.registry import open_checkpoint

    other = copy(DCP, tmp_path / "other")
    src = copy(DCP, tmp_path / "ckpt")
    (src / "__0_0.distcp").unlink()
    (src / "__0_0.distcp").symlink_to(other / "__0_0.distcp")
    ok("inspect", "--follow-links", src)
    assert consolidated(src, tmp_path / "o", "--follow-links") == pristine["dcp"]
    with pytest.raises(UnsafePathError, match="__0_0.distcp"):
        open_checkpoint(str(src))
    assert open_checkpoint(str(src), follow_links=True).index.format == "dcp"
    monkeypatch.setenv("CKPTKIT_FOLLOW_LINKS", "1")
    assert open_checkpoint(str(src)).index.format == "dcp"
    with pytest.raises(UnsafePathError):  # an explicit False wins over the environment
        open_checkpoint(str(src), follow_links=False)


def test_a_local_url_gets_the_same_checks(tmp_path):
    """local:// is the local filesystem through fsspec: the same containment applies."""
    src = copy(DCP, tmp_path / "ckpt")
    (src / "__0_0.distcp").unlink()
    (src / "__0_0.distcp").symlink_to("/etc/passwd")
    out = tmp_path / "outs" / "OUT"
    out.parent.mkdir()
    scene = Scene(src, out)
    run = run_ckptkit("consolidate", f"local://{src}", str(out), timeout=TIMEOUT)
    check_refused(run, str(src / "__0_0.distcp"), "--follow-links", scene=scene)


# ---- 2. DeepSpeed `latest` linked out, or hostile text in it ------------------------------------


@pytest.mark.parametrize("cmd", COMMANDS)
def test_latest_linked_out_is_refused_and_not_printed(tmp_path, cmd):
    src = copy(DS, tmp_path / "ckpt")
    (src / "latest").unlink()
    (src / "latest").symlink_to(secret_file(tmp_path))
    refused(cmd, src, tmp_path, str(src / "latest"), "--follow-links")


@pytest.mark.parametrize("cmd", ["inspect", "consolidate"])
def test_tag_folder_linked_out_is_refused(tmp_path, cmd):
    src = copy(DS, tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(src / "global_step2"), str(elsewhere))
    (src / "global_step2").symlink_to(elsewhere, target_is_directory=True)
    refused(cmd, src, tmp_path, str(src / "global_step2"), "--follow-links")


def test_latest_naming_a_link_to_the_root_folder_is_refused(tmp_path):
    src = copy(DS, tmp_path / "ckpt")
    (src / "latest").write_text("up")
    (src / "up").symlink_to("/", target_is_directory=True)
    refused("inspect", src, tmp_path, str(src / "up"), "--follow-links")


def escape_soup(n: int) -> str:
    unit = "\x1b[2J\x1b[31mPAYLOAD\x1b]0;owned\x07\r\n\u202e\x00"
    return (unit * (n // len(unit) + 1))[:n]


def assert_quoted_briefly(run, src: Path) -> None:
    """At most ~100 escaped characters of the file's content, no raw control character at all."""
    line = run.stderr.strip()
    assert not any(ch in line for ch in "\x1b\x07\r\x00\u202e"), repr(line)
    path_text = len(str(src)) * 2 + 20  # the path may appear twice (file and folder)
    assert len(line) <= path_text + 220, f"{len(line)} characters: {line!r}"
    assert "\\x1b" in line, line  # shown, escaped
    assert line.count("PAYLOAD") <= 2, line


@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate", "convert"])
def test_huge_latest_with_escape_sequences_is_quoted_briefly(tmp_path, cmd):
    src = copy(DS, tmp_path / "ckpt")
    (src / "latest").write_bytes(escape_soup(10 * 1024).encode())
    run = refused(cmd, src, tmp_path, str(src / "latest"))
    if cmd == "verify":
        run.stderr = run.stderr.splitlines()[-1]
    assert_quoted_briefly(run, src)


@pytest.mark.parametrize("text", ["global\x1b[2Jstep2", "x\n" + "A" * 600, "\u202estep2"])
def test_short_hostile_tag_names_are_escaped(tmp_path, text):
    src = copy(DS, tmp_path / "ckpt")
    (src / "latest").write_text(text)
    out = tmp_path / "outs" / "OUT"
    out.parent.mkdir()
    scene = Scene(src, out)
    run = run_ckptkit("consolidate", str(src), str(out), timeout=TIMEOUT)
    check_refused(run, str(src), scene=scene)
    line = run.stderr.strip()
    assert not any(ch in line for ch in "\x1b\n\u202e"), repr(line)
    assert "A" * 120 not in line, line


# ---- 3. FIFOs, devices and sockets: refused at once, never opened for a blocking read -----------


def fifo_at(path: Path) -> Path:
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("cmd", COMMANDS)
def test_fifo_as_dcp_metadata(tmp_path, cmd):
    src = copy(DCP, tmp_path / "ckpt")
    fifo_at(src / ".metadata")
    refused(cmd, src, tmp_path, str(src / ".metadata"), "is a FIFO")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_fifo_as_deepspeed_latest(tmp_path, cmd):
    src = copy(DS, tmp_path / "ckpt")
    fifo_at(src / "latest")
    refused(cmd, src, tmp_path, str(src / "latest"), "is a FIFO")


@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate", "reshard"])
def test_fifo_as_data_file(tmp_path, cmd):
    src = copy(DCP, tmp_path / "ckpt")
    fifo_at(src / "__1_0.distcp")
    refused(cmd, src, tmp_path, str(src / "__1_0.distcp"), "is a FIFO")


@pytest.mark.parametrize("cmd", ["inspect", "consolidate"])
def test_fifo_as_deepspeed_rank_file(tmp_path, cmd):
    src = copy(DS, tmp_path / "ckpt")
    fifo_at(src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    refused(cmd, src, tmp_path, str(src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"), "is a FIFO")


@pytest.mark.parametrize("cmd", ["inspect", "verify", "consolidate", "convert"])
def test_fifo_as_src_itself(tmp_path, cmd):
    src = fifo_at(tmp_path / "model.pt")
    refused(cmd, src, tmp_path, str(src), "is a FIFO", watch=tmp_path / "model.pt")


@pytest.mark.parametrize("cmd", ["inspect", "consolidate"])
def test_follow_links_still_refuses_a_fifo(tmp_path, cmd):
    src = copy(DCP, tmp_path / "ckpt")
    fifo = fifo_at(tmp_path / "pipe")
    (src / "__0_0.distcp").unlink()
    (src / "__0_0.distcp").symlink_to(fifo)
    refused(cmd, src, tmp_path, str(src / "__0_0.distcp"), "is a FIFO", extra=("--follow-links",))


@pytest.mark.parametrize(
    "device,cmd", [("/dev/zero", "inspect"), ("/dev/zero", "consolidate"), ("/dev/urandom", "verify")]
)
def test_character_device_linked_in_is_refused_even_with_follow_links(tmp_path, device, cmd):
    if not os.path.exists(device):
        pytest.skip(f"{device} is not on this machine")
    src = copy(DCP, tmp_path / "ckpt")
    (src / "__0_0.distcp").unlink()
    (src / "__0_0.distcp").symlink_to(device)
    refused(cmd, src, tmp_path, str(src / "__0_0.distcp"), "is a character device", extra=("--follow-links",))


def test_character_device_linked_in_without_follow_links_is_a_link_out(tmp_path):
    src = copy(DCP, tmp_path / "ckpt")
    (src / ".metadata").unlink()
    (src / ".metadata").symlink_to("/dev/zero")
    refused("inspect", src, tmp_path, str(src / ".metadata"), "--follow-links")


@pytest.mark.parametrize("cmd", ["inspect", "consolidate"])
def test_src_linked_to_a_device_is_refused(tmp_path, cmd):
    """SRC itself a link is the user's choice, but what it leads to must still be a regular file."""
    src = tmp_path / "model.pt"
    src.symlink_to("/dev/urandom")
    refused(cmd, src, tmp_path, str(src), "is a character device", watch=src)


@pytest.mark.parametrize("cmd", ["inspect", "consolidate"])
def test_unix_socket_as_data_file(tmp_path, cmd):
    src = copy(DCP, tmp_path / "ckpt")
    (src / "__0_0.distcp").unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(src / "__0_0.distcp"))
    except OSError as exc:  # e.g. a path longer than sun_path allows
        pytest.skip(f"cannot bind a unix socket here ({exc})")
    sock.listen(1)
    try:
        refused(cmd, src, tmp_path, str(src / "__0_0.distcp"), "is a socket")
    finally:
        sock.close()


# ---- folders: listings do not leave SRC or loop -------------------------------------------------


def test_links_to_root_and_loops_in_src_are_harmless(tmp_path, pristine):
    src = copy(DCP, tmp_path / "ckpt")
    (src / "root").symlink_to("/", target_is_directory=True)
    (src / "loop").symlink_to("loop")
    (src / "self").symlink_to(".", target_is_directory=True)
    ok("inspect", src)
    assert consolidated(src, tmp_path / "o") == pristine["dcp"]


def test_latest_naming_a_link_loop(tmp_path):
    src = copy(DS, tmp_path / "ckpt")
    (src / "latest").write_text("spin")
    (src / "spin").symlink_to("spin")
    refused("inspect", src, tmp_path, str(src), "'spin'")


def test_metadata_path_leaving_the_folder_is_refused_even_with_follow_links(tmp_path):
    """A weight map naming ../x is not a link: --follow-links does not allow it."""
    import json

    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": torch.ones(2)}, str(src / "model-1.safetensors"))
    save_file({"b": torch.ones(2)}, str(tmp_path / "stolen.safetensors"))
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "../stolen.safetensors"}})
    )
    refused("consolidate", src, tmp_path, str(src / "model.safetensors.index.json"), extra=("--follow-links",))


# ---- what keeps working ----------------------------------------------------------------------


def test_relative_link_inside_src_works(tmp_path, pristine):
    src = copy(DCP, tmp_path / "ckpt")
    (src / "data").mkdir()
    shutil.move(str(src / "__0_0.distcp"), str(src / "data" / "rank0.bin"))
    (src / "__0_0.distcp").symlink_to(Path("data") / "rank0.bin")
    scene = Scene(src)
    ok("verify", "--deep", src)
    assert consolidated(src, tmp_path / "o") == pristine["dcp"]
    assert scene.source_unchanged()


def test_deepspeed_latest_as_a_link_inside_works(tmp_path, pristine):
    src = copy(DS, tmp_path / "ckpt")
    (src / "latest").rename(src / "latest_tag")
    (src / "latest").symlink_to("latest_tag")
    assert consolidated(src, tmp_path / "o") == pristine["ds"]


def test_src_itself_a_link_works(tmp_path, pristine):
    real = copy(DCP, tmp_path / "data" / "run1" / "ckpt")
    src = tmp_path / "ckpt"
    src.symlink_to(real, target_is_directory=True)
    assert consolidated(src, tmp_path / "o") == pristine["dcp"]
    plain = tmp_path / "model.pt"
    plain.symlink_to(PLAIN)
    ok("inspect", plain)


# ---- the Hugging Face cache layout ---------------------------------------------------------------


def test_hf_cache_snapshot_works_without_follow_links(tmp_path):
    from safetensors.torch import load_file

    snap, tensors = hf_cache(tmp_path)
    scene = Scene(snap.parent.parent)
    run = ok("inspect", snap)
    assert "safetensors" in run.stdout
    ok("verify", "--deep", snap)
    out = tmp_path / "out"
    ok("consolidate", snap, out)
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k
    ok("inspect", snap / "model-00002-of-00002.safetensors")  # one file of the snapshot
    assert scene.source_unchanged()


def test_hf_cache_allows_blobs_only(tmp_path):
    """Inside a snapshot, a link out of the repo (not into its blobs/) is still refused."""
    from safetensors.torch import save_file

    snap, _ = hf_cache(tmp_path)
    stolen = tmp_path / "elsewhere" / "x.safetensors"
    stolen.parent.mkdir()
    save_file({"embed.weight": torch.zeros(8, 4)}, str(stolen))
    (snap / "model-00001-of-00002.safetensors").unlink()
    (snap / "model-00001-of-00002.safetensors").symlink_to(stolen)
    refused("consolidate", snap, tmp_path, str(snap / "model-00001-of-00002.safetensors"), "--follow-links")


def test_hf_cache_whose_blobs_folder_is_a_link_out_is_refused(tmp_path):
    snap, _ = hf_cache(tmp_path)
    blobs = snap.parent.parent / "blobs"
    moved = tmp_path / "elsewhere_blobs"
    shutil.move(str(blobs), str(moved))
    blobs.symlink_to(moved, target_is_directory=True)
    refused("inspect", snap, tmp_path, str(snap), "--follow-links", watch=snap.parent.parent)


# ---- the pieces, directly -----------------------------------------------------------------------


def test_descriptor_swapped_after_the_check_is_refused(tmp_path):
    """The check that counts is on the descriptor actually opened (its real path), not the name."""
    from ckptkit.errors import UnsafePathError
    from ckptkit.storage.paths import Boundary

    src = copy(DCP, tmp_path / "ckpt")
    outside = secret_file(tmp_path)
    boundary = Boundary.of(str(src))
    fd = os.open(outside, os.O_RDONLY)
    with pytest.raises(UnsafePathError, match="outside the checkpoint"):
        boundary.check_opened(fd, str(src / "__0_0.distcp"))
    with pytest.raises(OSError):  # closed by the refusal
        os.fstat(fd)
    inside = os.open(src / "__0_0.distcp", os.O_RDONLY)
    boundary.check_opened(inside, "ok")
    assert stat.S_ISREG(os.fstat(inside).st_mode)
    os.close(inside)


def test_quote_escapes_and_cuts():
    from ckptkit.errors import name_of, quote

    q = quote(escape_soup(10_000).encode())
    assert len(q) <= 110 and q.endswith("...")
    assert not any(ch in q for ch in "\x1b\x07\r\n\x00\u202e")
    assert "\\x1b" in q and "\\u202e" in q
    assert quote(b"\xff\xfeok") == "'\\xff\\xfeok'"
    assert quote("line\nnext") == "'line\\nnext'"
    assert name_of("model.layers.0.weight") == "model.layers.0.weight"
    assert name_of("a\x1b[2Jb") == "'a\\x1b[2Jb'"
    assert len(name_of("k" * 5000)) <= 110


@pytest.mark.parametrize("name", ["a\x00b.safetensors", "a\ud800.safetensors"])
def test_a_name_no_file_can_have_is_refused_as_such(tmp_path, name):
    """A name read from a checkpoint (an index's weight_map, a marker) with a NUL or a lone
    surrogate: no OS call may see it (they raise ValueError or UnicodeEncodeError, not OSError);
    the source refuses it in its own words. A listed name's undecodable bytes stay readable."""
    from ckptkit.errors import CkptkitError
    from ckptkit.storage.source import LocalSource

    (tmp_path / "x.bin").write_bytes(b"1234")
    odd = os.fsdecode(b"\xff.bin")  # an undecodable byte, as os.listdir gives it (surrogateescape)
    (tmp_path / odd).write_bytes(b"5678")
    source = LocalSource(str(tmp_path))
    for call in (lambda: source.size(name), lambda: source.read(name, 0, 1), lambda: source.exists(name)):
        try:
            got = call()
        except CkptkitError as e:
            assert "no file can have" in str(e), e
        else:
            assert got is False, got  # exists() may simply say no
    assert source.read(odd, 0, 4) == b"5678"
