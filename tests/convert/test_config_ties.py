"""convert honours the weight ties an HF folder records only in config.json (save_pretrained leaves the
tied name out of its files), for the targets whose loaders ask for both names (DCP, torch); the
folders are written by transformers' save_pretrained and read back by transformers and torch."""

from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner

from ckptkit.convert import hf_ties
from ckptkit_cli.main import cli
from helpers.hf_folders import edit_config, gpt2_folder, llama_folder
from helpers.hostile import Scene, check_refused, run_ckptkit

transformers = pytest.importorskip("transformers", reason="the HF folders are written by transformers")

LLAMA_TIE = "lm_head.weight -> model.embed_tokens.weight taken from config.json's tie_word_embeddings"


def _convert(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["convert", *map(str, args)])
    return res.exit_code, res.output


def _truth(folder) -> dict:
    """What transformers itself builds from the folder (the tied head included)."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("hf") / "llama")


def test_the_folder_lacks_the_tied_name(tied_llama):
    from safetensors import safe_open

    with safe_open(tied_llama / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_torch_target_holds_both_names_and_loads_strictly(tied_llama, tmp_path):
    code, out = _convert(tied_llama, tmp_path / "m.pt", "--to", "torch")
    assert code == 0, out
    assert f"1 tied ({LLAMA_TIE})" in out
    model = torch.load(tmp_path / "m.pt", weights_only=True)["model"]
    assert model["lm_head.weight"].data_ptr() == model["model.embed_tokens.weight"].data_ptr()
    fresh = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tied_llama))
    fresh.load_state_dict(model, strict=True)  # a missing lm_head.weight would raise here
    truth = _truth(tied_llama)
    assert sorted(model) == sorted(truth)
    for name, value in truth.items():
        assert torch.equal(model[name], value), name


def test_dcp_target_lists_both_names(tied_llama, tmp_path):
    import torch.distributed.checkpoint as dcp

    code, out = _convert(tied_llama, tmp_path / "d", "--to", "dcp", "--world-size", "2")
    assert code == 0, out
    assert LLAMA_TIE in out
    keys = set(dcp.FileSystemReader(str(tmp_path / "d")).read_metadata().state_dict_metadata)
    assert {"model.lm_head.weight", "model.model.embed_tokens.weight"} <= keys


def test_safetensors_target_writes_the_tie_once(tied_llama, tmp_path):
    from safetensors import safe_open

    code, out = _convert(tied_llama, tmp_path / "st", "--to", "safetensors")
    assert code == 0, out
    assert "(1 tied, written once)" in out and LLAMA_TIE in out
    with safe_open(tmp_path / "st" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # from_pretrained ties it again, as it did for SRC


def test_untied_flag_adds_nothing(tied_llama, tmp_path):
    folder = tmp_path / "untied"
    llama_folder(folder)
    edit_config(folder, tie_word_embeddings=False)
    code, out = _convert(folder, tmp_path / "m.pt", "--to", "torch")
    assert code == 0, out
    assert ", 0 tied;" in out
    assert "lm_head.weight" not in torch.load(tmp_path / "m.pt", weights_only=True)["model"]


def test_absent_flag_takes_the_model_type_default(tmp_path):
    folder = gpt2_folder(tmp_path / "gpt2")
    edit_config(folder, tie_word_embeddings=None)  # as GPT-2's hub config.json: the default, left out
    code, out = _convert(folder, tmp_path / "m.pt", "--to", "torch")
    assert code == 0, out
    assert (
        "lm_head.weight -> transformer.wte.weight taken from the tie_word_embeddings default of "
        "model_type 'gpt2' (config.json does not set it)"
    ) in out
    model = torch.load(tmp_path / "m.pt", weights_only=True)["model"]
    assert torch.equal(model["lm_head.weight"], _truth(folder)["lm_head.weight"])


def test_text_config_flag_is_read(tmp_path):
    folder = llama_folder(tmp_path / "composite")
    edit_config(
        folder, tie_word_embeddings=None, model_type="not-a-model-type", text_config={"tie_word_embeddings": True}
    )
    code, out = _convert(folder, tmp_path / "m.pt", "--to", "torch")
    assert code == 0, out
    assert "taken from config.json's text_config.tie_word_embeddings" in out


def test_unknown_flag_is_said_not_guessed(tmp_path):
    folder = llama_folder(tmp_path / "unknown")
    edit_config(folder, tie_word_embeddings=None, model_type="not-a-model-type")
    code, out = _convert(folder, tmp_path / "m.pt", "--to", "torch")
    assert code == 0, out
    assert "does not say whether LlamaForCausalLM ties its word embeddings" in out and ", 0 tied;" in out


def test_unknown_architecture_is_said_not_guessed(tmp_path):
    folder = llama_folder(tmp_path / "custom")
    edit_config(folder, architectures=["MyOwnForCausalLM"])
    code, out = _convert(folder, tmp_path / "m.pt", "--to", "torch")
    assert code == 0, out
    assert "does not know which tensors MyOwnForCausalLM ties" in out and ", 0 tied;" in out


def test_single_file_source_reads_the_config_beside_it(tied_llama, tmp_path):
    code, out = _convert(tied_llama / "model.safetensors", tmp_path / "m.pt", "--to", "torch")
    assert code == 0, out
    assert LLAMA_TIE in out


def _hostile_config(tmp_path, make) -> tuple:
    """An HF folder whose config.json `make` replaces, and the scene watched across one convert."""
    folder = llama_folder(tmp_path / "bad")
    (folder / "config.json").unlink()
    make(folder / "config.json")
    return folder, Scene(folder, tmp_path / "out")


@pytest.mark.parametrize("kind", ["no-json", "a-list", "fifo", "oversize", "link-out"])
def test_hostile_config_is_one_sentence(tmp_path, kind):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    make = {
        "no-json": lambda p: p.write_text("{not json"),
        "a-list": lambda p: p.write_text("[1, 2]"),
        "fifo": lambda p: os.mkfifo(p),
        "oversize": lambda p: p.write_bytes(b"{" + b" " * (hf_ties.MAX_CONFIG_BYTES + 1) + b"}"),
        "link-out": lambda p: p.symlink_to(outside),
    }[kind]
    folder, scene = _hostile_config(tmp_path, make)
    check_refused(run_ckptkit("convert", str(folder), str(scene.out), "--to", "dcp"), "config.json", scene=scene)


@pytest.mark.parametrize(
    "arch",
    [
        "LlamaForCausalLM",
        "GPT2LMHeadModel",
        "T5ForConditionalGeneration",
        "BertForMaskedLM",
        "GPTNeoXForCausalLM",
        "Qwen2ForCausalLM",
    ],
)
def test_table_pairs_are_transformers_own(arch):
    assert hf_ties.table()["pairs"][arch] == getattr(transformers, arch)._tied_weights_keys


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2", "gemma", "t5", "bert", "mistral"])
def test_table_defaults_are_transformers_own(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert hf_ties.table()["defaults"][model_type] == CONFIG_MAPPING[model_type]().tie_word_embeddings


def test_table_is_from_the_pinned_transformers():
    assert hf_ties.table()["transformers"] == transformers.__version__, (
        "transformers changed: regenerate ckptkit/convert/hf_ties.json with scripts/generate_hf_ties.py"
    )


def test_storage_reader_and_load_fill_the_tied_name(tied_llama):
    """torch's dcp.load through ckptkit.StorageReader, and ckptkit.load, read the folder through
    convert's state, so the tied head is filled (torch's HuggingFaceStorageReader misses it)."""
    import torch.distributed.checkpoint as dcp

    import ckptkit

    truth = _truth(tied_llama)
    config = transformers.AutoConfig.from_pretrained(tied_llama)
    for load in (
        lambda sd: dcp.load(sd, storage_reader=ckptkit.StorageReader(str(tied_llama)), no_dist=True),
        lambda sd: ckptkit.load(sd, str(tied_llama)),
    ):
        torch.manual_seed(99)
        state = {"model": transformers.AutoModelForCausalLM.from_config(config).state_dict()}
        load(state)
        assert sorted(state["model"]) == sorted(truth)
        for name, value in truth.items():
            assert torch.equal(state["model"][name], value), name
