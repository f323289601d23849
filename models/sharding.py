"""Tensor-parallel loading through transformers' `DistributedConfig`, and the checks around it.

Before loading (`check_shardable`): the model has a tensor-parallel plan; its attention and KV head counts
and every dimension the plan shards divide by the TP size; the checkpoint holds whole tensors (a checkpoint
saved from one rank's shards would be sharded a second time). After loading (`check_sharding`): every
parameter is sharded exactly once as the plan says: the placement the plan's style gives, a global shape
equal to the unsharded model's and a local piece of 1/tp of it; nothing the plan shards is left whole.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.mesh import MeshError

log = logging.getLogger(__name__)

# Placement of (weight, bias) per style: ("shard", dim), ("replicate", None). Unknown styles get the
# shape checks only.
_STYLE_PLACEMENTS: dict[str, tuple[tuple[str, int | None], tuple[str, int | None]]] = {
    "colwise": (("shard", 0), ("shard", 0)),
    "colwise_rep": (("shard", 0), ("shard", 0)),
    "colwise_gather_output": (("shard", 0), ("shard", 0)),
    "rowwise": (("shard", 1), ("replicate", None)),
    "rowwise_rep": (("shard", 1), ("replicate", None)),
    "rowwise_split_input": (("shard", 1), ("replicate", None)),
    "embedding_rowwise": (("shard", 0), ("replicate", None)),
}


@dataclass(frozen=True)
class ShardLayout:
    """What the unsharded model looks like: parameter shapes (from a meta-device copy) and the TP plan."""

    shapes: dict[str, tuple[int, ...]]
    plan: dict[str, str]  # module name pattern ("model.layers.*.self_attn.q_proj") -> style

    def style_of(self, param: str) -> str | None:
        module = param.rsplit(".", 1)[0]
        generic = re.sub(r"\.\d+(?=\.|$)", ".*", module)
        return self.plan.get(generic)

    def expected(self, param: str) -> tuple[str, int | None] | None:
        """("shard", dim) / ("replicate", None) for a parameter the plan covers; None when it does not."""
        style = self.style_of(param)
        if style is None:
            return None
        placements = _STYLE_PLACEMENTS.get(style)
        if placements is None:
            return ("unknown", None)
        return placements[1] if param.endswith(".bias") else placements[0]


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def shard_layout(config: Any) -> ShardLayout:
    """Build the model on the meta device (no memory) to read its full shapes and its tensor-parallel plan."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    plan = dict(getattr(meta, "_tp_plan", None) or {})
    if not plan:
        raise MeshError(f"{type(meta).__name__} has no tensor-parallel plan in transformers: it cannot be served "
                        "with --tensor-parallel-size > 1")
    return ShardLayout({n: tuple(p.shape) for n, p in meta.named_parameters()}, plan)


def check_shardable(config: Any, layout: ShardLayout, tp_size: int) -> None:
    """Every head count and every dimension the plan shards must divide by tp_size (names the numbers)."""
    text = _text_config(config)
    problems = []
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value % tp_size:
            problems.append(f"{name} {value} is not divisible by the tensor-parallel size {tp_size}")
    for param, shape in layout.shapes.items():
        want = layout.expected(param)
        if want is not None and want[0] == "shard" and want[1] is not None and shape[want[1]] % tp_size:
            problems.append(f"{param} dimension {want[1]} ({shape[want[1]]}, style {layout.style_of(param)}) is "
                            f"not divisible by the tensor-parallel size {tp_size}")
    if problems:
        raise MeshError("the model cannot be split across the mesh: " + "; ".join(problems))


def check_checkpoint_whole(path: str, layout: ShardLayout) -> None:
    """Refuse a checkpoint whose tensors are smaller than the model's: a shard saved from one rank of a
    tensor-parallel model (loading it with a TP plan would shard it a second time)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                full = layout.shapes.get(name)
                if full is None:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != full:
                    raise MeshError(f"checkpoint tensor {name} in {file.name} has shape {list(shape)} but the model "
                                    f"needs {list(full)}: the checkpoint is already sharded (saved from one rank?); "
                                    "load the whole checkpoint")


def load_sharded(path: str, dtype: str, tp_size: int) -> torch.nn.Module:
    """Load `path` split across the joined mesh with the model's own plan (transformers' DistributedConfig);
    same attention and inference mode as models.loading.load_model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from models.attention import register
    from models.loading import DTYPES

    config = AutoConfig.from_pretrained(path)
    layout = shard_layout(config)
    check_shardable(config, layout, tp_size)
    check_checkpoint_whole(path, layout)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=register(),
                                                 distributed_config=DistributedConfig(tp_size=tp_size))
    model.eval()
    model.requires_grad_(False)
    check_sharding(model, layout, tp_size)
    return model


def check_sharding(model: torch.nn.Module, layout: ShardLayout, tp_size: int) -> None:
    """Every parameter sharded exactly once, as the plan says. Raises MeshError listing each problem."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    problems = []
    for name, param in model.named_parameters():
        full = layout.shapes.get(name)
        want = layout.expected(name)
        if not isinstance(param, DTensor):
            if want is not None and want[0] == "shard":
                problems.append(f"{name} is left whole {list(param.shape)} but the plan shards it "
                                f"({layout.style_of(name)}: dim {want[1]})")
            elif full is not None and tuple(param.shape) != full:
                problems.append(f"{name} has shape {list(param.shape)}, the model needs {list(full)}")
            continue
        placements = tuple(param.placements)
        local = tuple(param.to_local().shape)
        if full is not None and tuple(param.shape) != full:
            problems.append(f"{name} is sharded more than once: its global shape {list(param.shape)} is not the "
                            f"model's {list(full)}")
            continue
        if len(placements) != 1:
            problems.append(f"{name} has placements {placements} on a 1-D tensor-parallel mesh")
            continue
        placement = placements[0]
        if want is None:
            if isinstance(placement, Shard):
                problems.append(f"{name} is sharded ({placement}) but the plan does not shard it")
            continue
        if want[0] == "shard":
            if not isinstance(placement, Shard) or placement.dim != want[1]:
                problems.append(f"{name} has placement {placement}; the plan ({layout.style_of(name)}) gives "
                                f"Shard(dim={want[1]})")
                continue
        elif want[0] == "replicate" and not isinstance(placement, Replicate):
            problems.append(f"{name} has placement {placement}; the plan ({layout.style_of(name)}) replicates it")
            continue
        if isinstance(placement, Shard):
            dim = placement.dim
            expect = -(-param.shape[dim] // tp_size)
            if local[dim] != expect:
                problems.append(f"{name} holds {local[dim]} of {param.shape[dim]} rows along dim {dim} on this "
                                f"rank; one shard of {tp_size} is {expect}")
    if problems:
        raise MeshError(f"{len(problems)} parameters are not sharded as the plan says: " + "; ".join(problems))

