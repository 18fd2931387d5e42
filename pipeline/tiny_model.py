"""A small, deterministic, random-weight decoder checkpoint for demos and tests.

No model hub is needed: the same arguments always give the same bytes (for one torch
version), and ``transformers.AutoModelForCausalLM`` loads the result.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from pipeline.errors import InputError
from pipeline.plan.checkpoint import ARCHITECTURES, ModelShape

# A tiny model is for tests and demos (the default has ~0.2M parameters). The cap keeps a typo
# (--hidden 10000000) from ending in a torch allocation traceback after minutes of swapping:
# 100M parameters is 400 MB of fp32 weights, held twice while saving.
MAX_TINY_PARAMS = 100_000_000
# torch.manual_seed's range (it maps negative seeds into the 64-bit unsigned range).
_SEED_RANGE = (-(2**63), 2**64 - 1)

# Enough text for a BPE vocabulary of a few hundred tokens; any text would do. Trained
# offline (no hub), so the demo can serve text prompts.
_CORPUS = """\
Static shapes pay off when requests are grouped into the nearest bucket.
A compiled graph serves every request whose prompt and answer fit its sequence length.
The server batches waiting requests, pads them to the bucket, and streams tokens back.
Inferentia2 runs ahead-of-time compiled graphs with fixed shapes on its NeuronCores.
The init container pulls the release, verifies every byte, and installs it atomically.
Greedy decoding picks the most likely next token at every step, so answers are reproducible.
A tiny random model writes words that mean nothing, which is fine for a demo of the plumbing.
Buckets trade compile hours against padding: too few waste compute, too many waste memory.
Each release is a manifest of content-addressed blobs, published only when every bucket is there.
Time to first token, time per output token and the whole request are measured by the server.
When the queue is full the server answers with a retry hint instead of dropping the request.
On shutdown it stops accepting, finishes what is in flight, and then exits cleanly.
Tensor parallelism splits attention heads across cores; grouped query attention shares keys.
The quick brown fox jumps over the lazy dog while the scheduler waits a few milliseconds.
"""
# A small chat template in the shape of Llama's (each turn <s>role: text</s>; no newlines,
# which the tiny alphabet lacks), so the demo and the tests chat; an answer ends at </s>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
# Ids 0..3, matching the config's pad/bos/eos ids below.
_SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
MIN_TOKENIZER_VOCAB = 128  # the character alphabet and the special tokens need ~100 ids


def write_tiny_tokenizer(out: Path, vocab: int) -> None:
    """A BPE tokenizer trained on ``_CORPUS`` with at most ``vocab`` tokens (so every id it
    produces is one the model knows): tokenizer.json, tokenizer_config.json and its chat
    template, loadable with ``transformers.AutoTokenizer``. Like Llama's, it prepends
    ``<s>``."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(_SPECIAL),
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def tiny_param_count(
    *,
    arch: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int | None = None,
) -> int:
    """Parameters of the model ``write_tiny_model`` would write, counted before allocating."""
    return ModelShape(
        model_type=arch,
        hidden=hidden,
        layers=layers,
        q_heads=heads,
        kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate=intermediate or 2 * hidden,
        vocab=vocab,
        tied_embeddings=False,
        qkv_bias=ARCHITECTURES[arch].qkv_bias,
    ).param_count()


def write_tiny_model(
    out: Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 8,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int | None = None,
    max_positions: int = 4096,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write config.json, model.safetensors, generation_config.json and (for vocabularies of
    at least ``MIN_TOKENIZER_VOCAB``) a small tokenizer into ``out``."""
    for name, v in (
        ("layers", layers),
        ("hidden", hidden),
        ("heads", heads),
        ("kv-heads", kv_heads),
        ("vocab", vocab),
    ):
        if v < 1:
            raise InputError(f"--{name}", f"must be ≥ 1, got {v}", None)
    if hidden % heads:
        raise InputError(
            "--hidden",
            f"{hidden} is not divisible by {heads} heads",
            "pick hidden = heads × head_dim",
        )
    if arch not in ARCHITECTURES:
        raise InputError(
            "--arch", f"unknown architecture '{arch}'", f"use {', '.join(ARCHITECTURES)}"
        )
    if heads % kv_heads:
        raise InputError(
            "--kv-heads", f"{heads} query heads are not a multiple of {kv_heads}", None
        )
    if intermediate is not None and intermediate < 1:
        raise InputError("intermediate", f"must be ≥ 1, got {intermediate}", None)
    if not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        raise InputError("--seed", f"{seed} is out of range", "use a seed in 0..2**64-1")
    params = tiny_param_count(
        arch=arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        intermediate=intermediate,
    )
    if params > MAX_TINY_PARAMS:
        raise InputError(
            "tiny model",
            f"{layers} layers, hidden {hidden} and vocab {vocab} make {params:,} parameters "
            f"({params * 4 / 2**30:,.1f} GiB in fp32)",
            f"a tiny model is for tests and demos: at most {MAX_TINY_PARAMS:,} parameters "
            f"({MAX_TINY_PARAMS * 4 // 10**6} MB); lower --layers, --hidden or --vocab",
        )
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InputError(
            str(out), "directory exists and is not empty", "pass --overwrite or another DIR"
        )

    import torch
    import transformers

    cls = getattr(transformers, f"{ARCHITECTURES[arch].hf_prefix}Config")
    config = cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        # A wide init keeps logits well separated, so greedy tokens are robust to fp noise.
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.do_sample = False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".incomplete", dir=out.parent))
    try:
        # A one-file checkpoint: transformers' "Writing model shards" bar is noise on stderr.
        bar = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bar:
                transformers.utils.logging.enable_progress_bar()
        if vocab >= MIN_TOKENIZER_VOCAB:
            write_tiny_tokenizer(tmp, vocab)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
