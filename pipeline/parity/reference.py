"""The parity reference: the eager Hugging Face model in fp32, from the checkpoint the release
was compiled from or from the release's own weights with the GQA padding undone."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pipeline.contracts.graph_abi import WEIGHTS_FILE
from pipeline.errors import BackendUnavailableError, InputError, IntegrityError
from pipeline.install.installed import BUCKETS
from pipeline.store.manifest import Manifest


class Reference:
    """The eager Hugging Face model in fp32 (see the module docstring for its weights)."""

    def __init__(
        self,
        release_dir: Path,
        manifest: Manifest,
        device: str,
        checkpoint: Path | None,
        option: str = "--checkpoint",
    ) -> None:
        """``option``: the command's flag that gave ``checkpoint``, named in its errors."""
        self.release_dir = release_dir
        self.manifest = manifest
        self.device = device
        self.checkpoint = Path(checkpoint) if checkpoint else None
        if self.checkpoint is not None:
            check_checkpoint(self.checkpoint, release_dir, manifest, option)
        config = json.loads((release_dir / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self._model: Any = None

    def describe(self) -> dict[str, str]:
        if self.checkpoint is not None:
            weights = f"checkpoint `{self.checkpoint}` (weights digest matches the manifest)"
        else:
            weights = "the release's weights.safetensors, GQA padding undone, upcast"
        model = self._model
        name = type(model).__name__ if model is not None else "?"
        return {"model_class": name, "dtype": "float32", "device": self.device, "weights": weights}

    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], Any]:
        """``steps + 1`` greedy tokens after ``prompt`` and the fp32 logits that chose each
        ([steps + 1, V] on the CPU).

        Each step reruns the whole sequence (no cache to get wrong, and no dependence on the
        cache API of the installed transformers), and projects only the last position, so
        the vocabulary-sized logits are never materialised for the whole prompt."""
        import torch

        model = self.model()
        body, head = model.get_decoder(), model.get_output_embeddings()
        seq = list(prompt)
        rows = []
        for _ in range(steps + 1):
            hidden = body(input_ids=torch.tensor([seq], device=self.device)).last_hidden_state
            rows.append(head(hidden[0, -1]).float())
            seq.append(int(rows[-1].argmax()))
        return seq[len(prompt) :], torch.stack(rows).cpu()

    def model(self) -> Any:
        if self._model is None:
            self._model = self._load().to(self.device).eval()
        return self._model

    def _load(self) -> Any:
        import torch
        import transformers

        transformers.logging.disable_progress_bar()  # a report, not a download
        auto = transformers.AutoModelForCausalLM
        if self.checkpoint is not None:
            return auto.from_pretrained(self.checkpoint, dtype=torch.float32)
        config = transformers.AutoConfig.from_pretrained(self.release_dir)
        state = release_state_dict(self.release_dir, self.manifest)
        # The concrete class: only it loads from a state dict without a checkpoint path.
        model_class = auto._model_mapping[type(config)]
        return model_class.from_pretrained(
            None, config=config, state_dict=state, dtype=torch.float32
        )


def check_checkpoint(
    checkpoint: Path, release_dir: Path, manifest: Manifest, option: str = "--checkpoint"
) -> None:
    """The checkpoint must be the one the release was compiled from: same weights digest,
    same config.json (as JSON)."""
    from pipeline.contracts.digests import digest, model_config_digest, weights_digest

    found = weights_digest(checkpoint)
    if found != manifest.weights_digest:
        raise InputError(
            f"{option} {checkpoint}",
            f"weights digest {found[:12]} differs from the release's "
            f"{manifest.weights_digest[:12]}",
            "pass the checkpoint this release was compiled from",
        )
    config = release_dir / "config.json"
    if config.is_file() and model_config_digest(checkpoint) != digest(
        json.loads(config.read_text())
    ):
        raise InputError(
            f"{option} {checkpoint}",
            "its config.json differs from the release's",
            "pass the checkpoint this release was compiled from",
        )


_ATTN = re.compile(r"\.self_attn\.([qkvo])_proj\.(weight|bias)$")


def release_state_dict(release_dir: Path, manifest: Manifest) -> dict[str, Any]:
    """A bucket's weights.safetensors as the original model's fp32 state dict: the GQA head
    padding undone (each original head taken from the first slot that holds it)."""
    from safetensors.torch import load_file

    from pipeline.contracts.checkpoint_layout import unfuse_checkpoint
    from pipeline.plan.checkpoint import read_shape
    from pipeline.plan.gqa import GqaPlan

    name = sorted(manifest.buckets)[0]
    if not any(ref.path == WEIGHTS_FILE for ref in manifest.buckets[name].files):
        raise InputError(
            f"release {manifest.model} {manifest.version}",
            f"its buckets carry no {WEIGHTS_FILE} to rebuild the reference from",
            "pass --checkpoint DIR, the checkpoint the release was compiled from",
        )
    shape = read_shape(release_dir)
    plan = GqaPlan(**manifest.gqa)
    state = unfuse_checkpoint(load_file(str(release_dir / BUCKETS / name / WEIGHTS_FILE)))
    state.pop("rope_inv_freq", None)  # the compiled graphs' own buffer, not Hugging Face's
    return {k: _unpad(k, v, shape.head_dim, plan).float() for k, v in state.items()}


def _unpad(name: str, tensor: Any, head_dim: int, plan: Any) -> Any:
    import torch

    m = _ATTN.search(name)
    if not m or (m.group(1) == "o" and m.group(2) == "bias"):
        return tensor
    proj = m.group(1)
    dim = 1 if proj == "o" else 0
    q_side = proj in ("q", "o")
    sources = plan.q_slot_sources() if q_side else plan.kv_slot_sources()
    heads = plan.q_heads if q_side else plan.kv_heads
    size = tensor.shape[dim]
    if size == heads * head_dim:
        return tensor  # not padded (tp 1, or heads already divide)
    if size != len(sources) * head_dim:
        raise IntegrityError(
            name,
            f"{size} rows/columns fit neither {heads} heads nor the plan's {len(sources)} slots",
            "the weights do not match the manifest's GQA plan",
        )
    slots = [sources.index(h) for h in range(heads)]
    return torch.cat([tensor.narrow(dim, s * head_dim, head_dim) for s in slots], dim=dim)


def reference_device(reference: str) -> str:
    import torch

    if reference not in ("auto", "cpu", "cuda"):
        raise InputError("--reference", f"unknown device '{reference}'", "use auto, cpu or cuda")
    if reference == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if reference == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError(
            "--reference cuda",
            "no CUDA GPU visible (torch.cuda.is_available() is False)",
            "use --reference cpu",
        )
    return reference
