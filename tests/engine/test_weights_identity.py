"""The reference engine's model identity (I9): load_model's fingerprint covers every loaded tensor's bytes (not
only the config and the shard headers), ignores paths and shard layout, adds --model-id, and names the generator of
dummy weights."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from kvshare.engine.weights import dummy_weights_identity, load_model
from kvshare.identity import model_fingerprint


def fingerprint_of(model_dir, **kwargs) -> str:
    return load_model(model_dir, "auto", "cpu", torch.float32, **kwargs).fingerprint


def copy_with(tiny_model, target, change=None, shards: int = 1):
    """A copy of the model folder whose weights are re-saved in `shards` files (names in reverse order, so shard
    order differs from name order), after `change(state)` if given."""
    shutil.copytree(tiny_model, target, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(tiny_model / "model.safetensors")
    if change:
        change(state)
    names = sorted(state, reverse=True)
    for i in range(shards):
        part = {name: state[name] for name in names[i::shards]}
        save_file(part, str(target / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"), metadata={"format": "pt"})
    return target


def test_fingerprint_changes_with_one_tensors_bytes_and_only_then(tiny_model, tmp_path):
    def nudge(state):  # one element of one tensor: same names, dtypes, shapes, file size and header
        state["model.layers.1.mlp.down_proj.weight"][7, 3] += 0.5

    reference = fingerprint_of(tiny_model)
    assert fingerprint_of(tiny_model) == reference  # nothing changed
    assert fingerprint_of(copy_with(tiny_model, tmp_path / "copy")) == reference  # other path, re-saved file
    assert fingerprint_of(copy_with(tiny_model, tmp_path / "sharded", shards=3)) == reference  # file order
    assert fingerprint_of(copy_with(tiny_model, tmp_path / "tuned", change=nudge)) != reference


def test_model_id_is_added_to_the_weights_identity_never_instead(tiny_model, tmp_path):
    def nudge(state):
        state["model.norm.weight"][0] = 2.0

    tuned = copy_with(tiny_model, tmp_path / "tuned", change=nudge)
    assert fingerprint_of(tiny_model, model_id="rev-1") != fingerprint_of(tiny_model)
    assert fingerprint_of(tiny_model, model_id="rev-1") != fingerprint_of(tiny_model, model_id="rev-2")
    assert fingerprint_of(tiny_model, model_id="rev-1") != fingerprint_of(tuned, model_id="rev-1")


def test_dummy_identity_names_seed_dtype_and_device_type(tiny_model, monkeypatch):
    h200 = SimpleNamespace(multi_processor_count=132, max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    cpu = dummy_weights_identity(0, torch.bfloat16, torch.device("cpu"))
    cuda = dummy_weights_identity(0, torch.bfloat16, torch.device("cuda"))
    assert cpu != cuda  # torch's CPU and CUDA generators draw other numbers for one seed
    assert cpu != dummy_weights_identity(1, torch.bfloat16, torch.device("cpu"))
    assert cpu != dummy_weights_identity(0, torch.float32, torch.device("cpu"))
    loaded = load_model(tiny_model, "dummy", "cpu", torch.bfloat16, seed=0)
    config = (tiny_model / "config.json").read_bytes()
    assert loaded.fingerprint == model_fingerprint(config, cpu) != model_fingerprint(config, cuda)


def test_serve_model_id_flag_reaches_the_engines_fingerprint(tiny_model, make_engine):
    from kvshare.cli import build
    from kvshare.serve.cli import engine_config

    args = build().parser.parse_args(["serve", "--model", str(tiny_model), "--model-id", "rev-7"])
    assert engine_config(args).model_id == "rev-7"
    plain, named = make_engine(), make_engine(model_id="rev-7")
    assert named.model_fingerprint == fingerprint_of(tiny_model, model_id="rev-7") != plain.model_fingerprint
