"""consolidate writes what from_pretrained needs: config.json, generation config and tokenizer files
found beside the checkpoint, in its trainer folder or in its run folder (or from --config DIR),
copied byte for byte; without a config the summary says so. --strip-prefix/--rename as convert's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckptkit_cli.main import cli
from conftest import DATA, assert_tensor_equal, load_truth

DS = DATA / "deepspeed" / "z2_fp32_w2"


def run(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    return res.exit_code, res.output


def _trainer_layout(tmp_path):
    """An HF output_dir holding checkpoint-2/ (a real DeepSpeed save: latest, global_step2/) with
    side files at all three levels; config.json both in checkpoint-2/ and in the run folder."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoint-2"
    shutil.copytree(DS, ckpt)
    (run_dir / "config.json").write_text(json.dumps({"model_type": "from-run-folder"}))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "from-checkpoint"}))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (ckpt / "global_step2" / "generation_config.json").write_text('{"do_sample": false}')
    (run_dir / "tokenizer.json").write_bytes(b'{"version": "1.0", "x": "\xc3\xa9"}\n')
    (run_dir / "tokenizer.model").write_bytes(bytes(range(256)))
    (run_dir / "additional_chat_templates").mkdir()
    (run_dir / "additional_chat_templates" / "tool.jinja").write_text("{{ x }}")
    (run_dir / "training_args.bin").write_bytes(b"not a side file")
    return run_dir, ckpt


def test_side_files_from_checkpoint_trainer_and_run_folder(tmp_path):
    run_dir, ckpt = _trainer_layout(tmp_path)
    out = tmp_path / "out"
    code, output = run("consolidate", ckpt / "global_step2", out)
    assert code == 0, output
    expected = {
        "generation_config.json": ckpt / "global_step2" / "generation_config.json",  # the folder itself
        "config.json": ckpt / "config.json",  # trainer folder, nearest wins
        "tokenizer.json": run_dir / "tokenizer.json",  # the run folder
        "tokenizer.model": run_dir / "tokenizer.model",
        "additional_chat_templates/tool.jinja": run_dir / "additional_chat_templates" / "tool.jinja",
    }
    for name, source in expected.items():
        assert (out / name).read_bytes() == source.read_bytes(), name
    written = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert written == set(expected) | {"model.safetensors"}  # trainer_state.json, training_args.bin: not side files
    assert f"copied from {ckpt}: config.json" in output
    assert f"copied from {run_dir}: tokenizer.json, tokenizer.model, additional_chat_templates/tool.jinja" in output
    assert "from_pretrained" not in output


def test_config_dir_replaces_what_is_found(tmp_path):
    run_dir, ckpt = _trainer_layout(tmp_path)
    config = tmp_path / "hf_model"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"model_type": "from-option"}))
    (config / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    code, output = run("consolidate", ckpt, out, "--config", config)
    assert code == 0, output
    assert json.loads((out / "config.json").read_text()) == {"model_type": "from-option"}
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    # config.json named itself
    code, output = run("consolidate", ckpt, tmp_path / "out2", "--config", config / "config.json")
    assert code == 0, output
    assert sorted(os.listdir(tmp_path / "out2")) == ["config.json", "model.safetensors"]


def test_config_dir_without_config_json_is_one_sentence(tmp_path):
    config = tmp_path / "tok_only"
    config.mkdir()
    (config / "tokenizer.json").write_text("{}")
    code, output = run("consolidate", DATA / "fsdp2_w2", tmp_path / "out", "--config", config)
    assert code == 2
    assert output.strip() == (
        f"error: --config {config}: has no config.json (found tokenizer.json); pass the "
        f"folder of the model's Hugging Face config"
    )
    assert not (tmp_path / "out").exists()
    code, output = run("consolidate", DATA / "fsdp2_w2", tmp_path / "m.safetensors", "--config", config)
    assert code == 2 and "OUT must be a folder" in output and len(output.strip().splitlines()) == 1


def test_a_config_that_is_not_json_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(DATA / "fsdp2_w2", folder)
    (folder / "config.json").write_text("{not json")
    code, output = run("consolidate", folder, tmp_path / "out")
    assert code == 2 and f"{folder / 'config.json'}: the model config is not valid JSON" in output
    assert not (tmp_path / "out").exists()


def test_without_config_the_summary_says_from_pretrained_needs_one(tmp_path):
    code, output = run("consolidate", DATA / "fsdp2_w2", tmp_path / "out")
    assert code == 0, output
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    assert (
        "no config.json written (none in " in output
        and "from_pretrained(OUT) will need one; pass --config DIR" in output
    )
    code, output = run("consolidate", DATA / "fsdp2_w2", tmp_path / "m.safetensors")
    assert code == 0 and "from_pretrained needs a folder" in output


def test_a_side_file_linked_outside_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(DATA / "fsdp2_w2", folder)
    secret = tmp_path / "elsewhere.json"
    secret.write_text("{}")
    os.symlink(secret, folder / "config.json")
    code, output = run("consolidate", folder, tmp_path / "out")
    assert code == 2 and "is a link leading to" in output and "--follow-links" in output
    assert not (tmp_path / "out").exists()
    code, output = run("consolidate", folder, tmp_path / "out", "--follow-links")
    assert code == 0 and (tmp_path / "out" / "config.json").read_text() == "{}"


def test_strip_prefix_and_rename_as_convert(tmp_path):
    truth = load_truth("fsdp2_w2")
    model = {k[len("model.") :]: v for k, v in truth.items() if k.startswith("model.")}
    out = tmp_path / "out"
    code, output = run(
        "consolidate",
        DATA / "fsdp2_w2",
        out,
        "--strip-prefix",
        "block.",
        "--rename",
        "embed.=tok_embed.",
        "--rename",
        "norm.=final_norm.",
        "--include-optimizer",
    )
    assert code == 0, output

    def new(name):
        name = name[len("block.") :] if name.startswith("block.") else name
        for old, repl in (("embed.", "tok_embed."), ("norm.", "final_norm.")):
            if name.startswith(old):
                name = repl + name[len(old) :]
        return name

    loaded = load_file(str(out / "model.safetensors"))
    assert set(loaded) == {new(k) for k in model}
    assert any(k.startswith("block.") for k in model)
    for key, value in model.items():
        assert_tensor_equal(loaded[new(key)], value, key)
    optim = load_file(str(out / "optimizer.safetensors"))
    truth_params = {k[len("optim.state.") :].rsplit(".", 1)[0] for k in truth if k.startswith("optim.state.")}
    assert {k[len("state.") :].rsplit(".", 1)[0] for k in optim} == {new(p) for p in truth_params}
    with safe_open(str(out / "optimizer.safetensors"), framework="pt") as f:
        objects = json.loads(f.metadata()["ckptkit.objects"])
    listed = [n for k, v in objects.items() if k.endswith(".params") for n in v]
    assert listed and set(listed) <= set(loaded) and "tok_embed.weight" in listed
    # the same rules through the library, and a collision is one sentence
    code, output = run("consolidate", DATA / "fsdp2_w2", tmp_path / "bad", "--rename", "gate=pos")
    assert code == 2 and "map two model tensors to the same name 'pos'" in output
    code, output = run("consolidate", DATA / "fsdp2_w2", tmp_path / "bad", "--rename", "nosep")
    assert code == 2 and "expected OLD=NEW" in output


def test_reader_default_prefix_applies_unless_the_user_gives_rules(tmp_path, monkeypatch):
    """The hook the Lightning reader fills (its `model.` attribute prefix): used without options,
    replaced by explicit --strip-prefix/--rename."""
    from ckptkit.ops import consolidate as mod

    real = mod.open_checkpoint

    def with_default(*args, **kwargs):
        opened = real(*args, **kwargs)
        opened.index.metadata[mod.DEFAULT_STRIP_KEY] = ["block."]
        return opened

    monkeypatch.setattr(mod, "open_checkpoint", with_default)
    mod.consolidate(str(DATA / "fsdp2_w2"), str(tmp_path / "a"))
    names = set(load_file(str(tmp_path / "a" / "model.safetensors")))
    assert "fc_in.weight" in names and not any(n.startswith("block.") for n in names)
    from ckptkit.convert.names import KeyRules

    mod.consolidate(str(DATA / "fsdp2_w2"), str(tmp_path / "b"), rules=KeyRules(strip=("embed.",)))
    names = set(load_file(str(tmp_path / "b" / "model.safetensors")))
    assert "block.fc_in.weight" in names and "weight" in names


def test_from_pretrained_loads_the_consolidated_model(tmp_path):
    """A tiny Llama saved as accelerate's FSDP trainer folder (DCP of {"model": ...} in
    checkpoint-5/pytorch_model_fsdp_0), config written by transformers beside it, tokenizer in the
    run folder: consolidate, then transformers loads OUT with nothing missing and equal logits."""
    transformers = pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    run_dir = tmp_path / "run"
    trainer = run_dir / "checkpoint-5"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(trainer / "pytorch_model_fsdp_0"), no_dist=True)
    config.save_pretrained(trainer)
    transformers.GenerationConfig(max_new_tokens=3).save_pretrained(trainer)
    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(run_dir)

    out = tmp_path / "out"
    code, output = run("consolidate", trainer / "pytorch_model_fsdp_0", out)
    assert code == 0, output
    # GUARD: transformers 5.x builds a default 7B model from a folder without config.json
    assert (out / "config.json").is_file()
    assert (out / "config.json").read_bytes() == (trainer / "config.json").read_bytes()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    assert loaded.generation_config.max_new_tokens == 3
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("a b")["input_ids"] == [1, 2]


def test_a_fifo_among_the_side_files_is_refused_without_hanging(tmp_path):
    run_dir, ckpt = _trainer_layout(tmp_path)
    (run_dir / "tokenizer.json").unlink()
    os.mkfifo(run_dir / "tokenizer.json")
    code, output = run("consolidate", ckpt, tmp_path / "out")
    assert code == 2 and f"{run_dir / 'tokenizer.json'}: is a FIFO (named pipe), not a regular file; refused" in output
    assert not (tmp_path / "out").exists()
