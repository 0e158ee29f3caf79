"""bloomnative's LoRA adapters against Hugging Face PEFT on transformers' BloomForCausalLM, the
independent reference: the same logits, adapter gradients and AdamW step for every choice of
target modules, PEFT's initialisation rule, and adapter folders that each side writes and the
other loads (fp32, a tiny BLOOM, adapters with non-zero B)."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bloomnative.adapters import (
    TARGET_MODULES,
    adapter_state_dict,
    apply_lora,
    init_lora,
    load_peft_adapter,
    merge_lora,
    read_peft_adapter,
    save_peft_adapter,
)
from bloomnative.adapters.peft import native_key, peft_key
from bloomnative.config import LoRAConfig
from bloomnative.interop import load_hf_model, save_hf_model
from bloomnative.model import Bloom, BloomArgs
from harness.hf_models import make_hf_bloom, relative_error, save_hf_bloom, tokens, transformers
from harness.peft_reference import loaded_in_peft, peft

SHAPE = dict(hidden_size=32, n_head=4, n_layer=2, vocab_size=128)
RANK, ALPHA = 4, 8.0
TARGET_CHOICES = [[target] for target in TARGET_MODULES] + [list(TARGET_MODULES)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A Hugging Face folder of a random tiny BLOOM."""
    return save_hf_bloom(make_hf_bloom(**SHAPE, seed=5), tmp_path_factory.mktemp("base"))


def peft_bloom(base: Path, targets: list[str], rank: int = RANK, **options):
    """PEFT's LoRA model around transformers' BloomForCausalLM, in eval mode."""
    model = transformers.BloomForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(
        r=rank, lora_alpha=ALPHA, target_modules=targets, task_type="CAUSAL_LM", **options
    )
    return peft.get_peft_model(model, config).eval()


def our_bloom(base: Path, targets: list[str], rank: int = RANK, alpha: float = ALPHA) -> Bloom:
    model = load_hf_model(base)
    apply_lora(model, rank, alpha, 0.0, targets)
    return model.eval()


def randomize_adapters(model: Bloom, seed: int) -> dict[str, torch.Tensor]:
    """Gives every adapter weight (B included) random values; returns them by name."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter_state_dict(model).values():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return {name: t.clone() for name, t in adapter_state_dict(model).items()}


def peft_parameter_name(native: str) -> str:
    """PEFT's name of an adapter parameter of adapter "default" in its model, written out here
    independently of bloomnative.adapters.peft."""
    layer = native.removeprefix("layers.")
    for ours, theirs in ((".lora_a.", ".lora_A.default."), (".lora_b.", ".lora_B.default.")):
        layer = layer.replace(ours, theirs)
    return "base_model.model.transformer.h." + layer


def peft_adapters(peft_model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in peft_model.named_parameters() if ".lora_" in n}


def copy_into_peft(state: dict[str, torch.Tensor], peft_model) -> dict[str, torch.nn.Parameter]:
    """Gives PEFT's adapters `state`'s values; returns them by bloomnative's names. PEFT must
    have exactly the adapters of `state`."""
    theirs = peft_adapters(peft_model)
    assert sorted(theirs) == sorted(peft_parameter_name(n) for n in state)
    with torch.no_grad():
        for name, value in state.items():
            theirs[peft_parameter_name(name)].copy_(value)
    return {name: theirs[peft_parameter_name(name)] for name in state}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_the_saved_names_are_the_ones_peft_writes(base, tmp_path):
    peft_bloom(base, list(TARGET_MODULES)).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        written = set(f.keys())
    ours = adapter_state_dict(our_bloom(base, list(TARGET_MODULES)))
    assert written == {peft_key(name) for name in ours}
    assert {native_key(key, tmp_path) for key in written} == set(ours)
    assert peft_key("layers.3.self_attention.query_key_value.lora_a.weight") == (
        "base_model.model.transformer.h.3.self_attention.query_key_value.lora_A.weight"
    )


@pytest.mark.parametrize("targets", TARGET_CHOICES, ids=",".join)
def test_logits_gradients_and_an_adamw_step_equal_peft(base, targets):
    ours = our_bloom(base, targets)
    state = randomize_adapters(ours, seed=len(targets))
    theirs = peft_bloom(base, targets)
    their_params = copy_into_peft(state, theirs)
    ids, labels = tokens(SHAPE["vocab_size"], seed=1), tokens(SHAPE["vocab_size"], seed=2)

    our_logits, their_logits = ours(ids), theirs(input_ids=ids).logits
    assert relative_error(our_logits, their_logits) < 1e-5
    causal_lm_loss(our_logits, labels).backward()
    causal_lm_loss(their_logits, labels).backward()
    ours_params = adapter_state_dict(ours)
    for name, param in dict(ours.named_parameters()).items():
        assert param.requires_grad == (name in ours_params), name
        if name in ours_params:
            assert relative_error(param.grad, their_params[name].grad) < 1e-5, name

    trainable = [p for p in ours.parameters() if p.requires_grad]
    torch.optim.AdamW(trainable, lr=1e-2).step()
    torch.optim.AdamW(list(their_params.values()), lr=1e-2).step()
    for name, param in dict(ours.named_parameters()).items():
        if name in ours_params:
            assert not torch.equal(param, state[name]), name
            assert relative_error(param, their_params[name]) < 1e-5, name


def test_the_initialisation_follows_peft_rule(base):
    """A uniform in +-1/sqrt(in) (Kaiming-uniform with a = sqrt(5)), B zero: PEFT's own
    initialisation obeys the same bounds, spread and zeros (the values differ: other RNGs)."""
    rank = 16
    ours = our_bloom(base, list(TARGET_MODULES), rank=rank)
    init_lora(ours, seed=3)
    theirs = peft_bloom(base, list(TARGET_MODULES), rank=rank)
    their_params = {n.replace(".default", ""): p for n, p in peft_adapters(theirs).items()}
    ours_state = adapter_state_dict(ours)
    for target in TARGET_MODULES:
        for state, key in ((ours_state, lambda n: n), (their_params, peft_key)):
            a = [state[key(n)] for n in ours_state if f"{target}.lora_a" in n]
            b = [state[key(n)] for n in ours_state if f"{target}.lora_b" in n]
            bound = 1 / math.sqrt(a[0].shape[1])
            values = torch.cat([t.detach().flatten() for t in a])
            assert values.abs().max() <= bound and values.abs().max() > 0.95 * bound, target
            assert values.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1), target
            assert abs(values.mean().item()) < 0.1 * bound, target
            assert all(torch.count_nonzero(t) == 0 for t in b), target
            assert not torch.equal(a[0], a[1]), target  # each layer draws its own


@pytest.mark.parametrize("targets", [["dense_h_to_4h"], list(TARGET_MODULES)], ids=",".join)
def test_an_exported_adapter_loads_in_peft_with_our_logits(base, tmp_path, capfd, targets):
    ours = our_bloom(base, targets)
    randomize_adapters(ours, seed=7)
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, dropout=0.05, target_modules=targets)
    out = save_peft_adapter(ours, tmp_path / "adapter", lora, base_model_name_or_path=str(base))
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    theirs = loaded_in_peft(base, out, capfd)
    config = theirs.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (RANK, ALPHA, 0.05)
    assert set(config.target_modules) == set(targets)
    assert config.base_model_name_or_path == str(base)
    ids = tokens(SHAPE["vocab_size"], seed=3)
    with torch.no_grad():
        assert relative_error(ours(ids), theirs(input_ids=ids).logits) < 1e-5


def test_the_merged_export_equals_peft_merge_and_unload(base, tmp_path):
    targets = list(TARGET_MODULES)
    ours = our_bloom(base, targets)
    state = randomize_adapters(ours, seed=11)
    theirs = peft_bloom(base, targets)
    copy_into_peft(state, theirs)
    merge_lora(ours)
    out = save_hf_model(ours, tmp_path / "merged")
    expected = theirs.merge_and_unload().state_dict()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(expected) - {"lm_head.weight"}
        for name in f.keys():
            torch.testing.assert_close(f.get_tensor(name), expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
def test_an_adapter_peft_wrote_loads_and_gives_peft_logits(base, tmp_path, use_rslora):
    targets = ["query_key_value", "dense_4h_to_h"]
    theirs = peft_bloom(base, targets, use_rslora=use_rslora)
    generator = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for param in peft_adapters(theirs).values():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    theirs.save_pretrained(tmp_path)

    lora, _ = read_peft_adapter(tmp_path)
    assert (lora.rank, set(lora.target_modules)) == (RANK, set(targets))
    assert lora.alpha == pytest.approx(ALPHA * math.sqrt(RANK) if use_rslora else ALPHA)
    ours = our_bloom(base, lora.target_modules, alpha=lora.alpha)
    assert load_peft_adapter(ours, tmp_path) == lora
    ids = tokens(SHAPE["vocab_size"], seed=4)
    with torch.no_grad():
        assert relative_error(ours(ids), theirs(input_ids=ids).logits) < 1e-5


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def peft_folder(base, tmp_path_factory) -> Path:
    """A QKV adapter of rank RANK that PEFT wrote, with non-zero B."""
    theirs = peft_bloom(base, ["query_key_value"])
    with torch.no_grad():
        for param in peft_adapters(theirs).values():
            param.fill_(0.01)
    folder = tmp_path_factory.mktemp("peft_written")
    theirs.save_pretrained(folder)
    return folder


def copy_of(folder: Path, into: Path, **config_changes) -> Path:
    into.mkdir()
    for path in folder.iterdir():
        (into / path.name).write_bytes(path.read_bytes())
    config = json.loads((into / "adapter_config.json").read_text())
    (into / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return into


def refusal(call, *args) -> str:
    with pytest.raises(ValueError) as error:
        call(*args)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"peft_type": "IA3"}, "peft_type = 'IA3'; only LORA adapters load here"),
        ({"use_dora": True}, "use_dora = true is not supported"),
        ({"rank_pattern": {"h.0": 8}}, 'rank_pattern = {"h.0": 8} is not supported'),
        ({"alpha_pattern": {"h.0": 32}}, 'alpha_pattern = {"h.0": 32} is not supported'),
        ({"modules_to_save": ["lm_head"]}, 'modules_to_save = ["lm_head"] is not supported'),
        ({"bias": "lora_only"}, "bias = 'lora_only': the adapter trained biases"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out = true is not supported"),
        ({"layers_to_transform": [0]}, "layers_to_transform = [0] is not supported"),
        ({"target_modules": ["lm_head"]}, "unknown target module 'lm_head'"),
        ({"target_modules": ".*query_key_value"}, "expected a list of layer names"),
        ({"init_lora_weights": "pissa"}, "rewrote the base model's weights"),
        ({"r": 0}, "r = 0 is not a rank"),
        ({"r": 8}, "rank: 4 here, 8 in adapter_config.json"),
        (
            {"target_modules": ["query_key_value", "dense"]},
            "target modules: query_key_value here, dense, query_key_value in adapter_config.json",
        ),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_a_folder_that_is_not_plain_lora_is_refused_naming_the_key(
    peft_folder, tmp_path, changes, says
):
    folder = copy_of(peft_folder, tmp_path / "changed", **changes)
    message = refusal(read_peft_adapter, folder)
    assert message.startswith(str(folder)) and says in message


def test_pickled_weights_are_never_loaded(peft_folder, tmp_path):
    folder = copy_of(peft_folder, tmp_path / "pickled")
    (folder / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"

    class RunsCode:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (folder / "adapter_model.bin").write_bytes(pickle.dumps({"x": RunsCode()}))
    message = refusal(read_peft_adapter, folder)
    assert "adapter_model.bin: a pickle" in message
    assert "re-save the adapter as safetensors" in message
    assert not marker.exists()


def test_a_tensor_of_another_layer_is_refused_naming_it(peft_folder, tmp_path):
    folder = copy_of(peft_folder, tmp_path / "head")
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(RANK, SHAPE["hidden_size"])
    save_file(tensors, folder / "adapter_model.safetensors")
    message = refusal(read_peft_adapter, folder)
    key = "base_model.model.lm_head.lora_A.weight"
    assert f"{key} is not a LoRA weight of a BLOOM linear layer" in message


def test_a_folder_without_a_config_is_not_an_adapter(tmp_path):
    assert "is not a PEFT adapter folder: no adapter_config.json" in refusal(
        read_peft_adapter, tmp_path
    )


@pytest.mark.parametrize(
    ("model_args", "says"),
    [
        (dict(rank=8), "rank: 4 here, 8 in the model's adapters"),
        (dict(targets=["dense"]), "target modules: query_key_value here, dense in the model's"),
        (
            dict(n_layer=3),
            "adapter weights: 4 here, 6 in the model's adapters; "
            "layers.2.self_attention.query_key_value.lora_a.weight is missing",
        ),
        (dict(hidden_size=64), "query_key_value.lora_a.weight is (4, 32), (4, 64) in the model's"),
        (dict(alpha=16.0), "its adapters scale by alpha/r = 2, the model's adapters by 4"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_loading_into_other_adapters_is_refused_leaving_the_model_as_it_was(
    peft_folder, model_args, says
):
    shape = {**SHAPE, **{k: v for k, v in model_args.items() if k in SHAPE}}
    model = Bloom(BloomArgs(**shape))
    targets = model_args.get("targets", ["query_key_value"])
    apply_lora(model, model_args.get("rank", RANK), model_args.get("alpha", ALPHA), 0.0, targets)
    before = {n: t.clone() for n, t in adapter_state_dict(model).items()}
    message = refusal(load_peft_adapter, model, peft_folder)
    assert message.startswith(str(peft_folder)) and says in message
    assert all(torch.equal(t, before[n]) for n, t in adapter_state_dict(model).items())
