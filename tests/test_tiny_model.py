import pytest

from pipeline.plan.checkpoint import read_shape
from pipeline.tiny_model import write_tiny_model


def test_deterministic_bytes(tmp_path):
    a = write_tiny_model(tmp_path / "a", seed=3)
    b = write_tiny_model(tmp_path / "b", seed=3)
    c = write_tiny_model(tmp_path / "c", seed=4)
    read = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_loads_in_transformers_and_runs(tmp_path, arch):
    import torch
    import transformers

    path = write_tiny_model(tmp_path / arch, arch=arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_attention_heads == 8 and model.config.num_key_value_heads == 2
    logits = model(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, 512)
    shape = read_shape(path)
    assert shape.qkv_bias == (arch == "qwen2")
    assert shape.param_count() == sum(p.numel() for p in model.parameters())


def test_writes_a_tokenizer_within_the_model_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert len(tok) <= 512 and tok.eos_token_id == 2 and tok.bos_token_id == 1
    ids = tok("The server batches waiting requests.").input_ids
    assert ids[0] == 1 and max(ids) < 512
    assert tok.decode(ids, skip_special_tokens=True) == "The server batches waiting requests."
    # every id the model can produce is a token of the tokenizer
    assert all(tok.convert_ids_to_tokens(i) for i in range(512))
    small = write_tiny_model(tmp_path / "small", vocab=64)  # too small for the alphabet
    assert not (small / "tokenizer.json").exists()
