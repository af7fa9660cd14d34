"""GPU iteration times without a GPU: measured operator profiles plus modelled attention.

`carpool/data/profiles/compute/<gpu>/<org>/<model>/mlp.csv` (shipped in the package) holds
per-layer timings (ms) of every operator other than attention, measured on A100/H100 for a few
Llama-family models, per token count and tensor-parallel degree. Attention is not profiled
there, so it is modelled from FLOPs and bytes against the GPU's peak rates (with the
efficiencies below). Tensor parallelism adds two all-reduces per layer, pipeline parallelism a
send/recv between stages, both from the measured collective tables in
`carpool/data/profiles/network/`. `profiles=` (`carpool simulate --profiles-dir`) points at other
profiles of the same layout.

A model without its own profile borrows the closest profiled one's and scales each operator by
the ratio of its FLOPs per token (QKV, output projection, MLP up and down separately).
"""

from __future__ import annotations

import bisect
import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from carpool.core.step_cost import BatchShape
from carpool.data import PROFILES_DIR


def interp1(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear; linear extrapolation from the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def op_flops(self) -> dict[str, float]:
        """Per-token multiply-adds x2 of the profiled linear operators (whole layer, TP 1)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        up = (2 if self.gated_mlp else 1) * self.intermediate
        return {"attn_pre_proj": 2 * h * (h + 2 * kv), "attn_post_proj": 2 * h * h,
                "mlp_up_proj": 2 * h * up, "mlp_down_proj": 2 * self.intermediate * h}


BUILTIN_SHAPES = {s.name: s for s in (
    ModelShape("mistral-7b", 32, 4096, 32, 8, 14336, 32000),
    ModelShape("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    ModelShape("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
    ModelShape("codellama-34b", 48, 8192, 64, 8, 22016, 32000),
    ModelShape("yi-34b", 60, 7168, 56, 8, 20480, 64000),
    ModelShape("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
    ModelShape("falcon-180b", 80, 14848, 232, 8, 59392, 65024, gated_mlp=False),
    ModelShape("gpt-3-175b", 96, 12288, 96, 96, 49152, 50257, gated_mlp=False),
)}

# Which profile stands in for each model (the same shapes where the profile exists).
PROFILE_FOR = {
    "mistral-7b": "meta-llama/Meta-Llama-3-8B", "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf", "codellama-34b": "codellama/CodeLlama-34b-Instruct-hf",
    "yi-34b": "codellama/CodeLlama-34b-Instruct-hf", "llama-2-70b": "meta-llama/Llama-2-70b-hf",
    "falcon-180b": "meta-llama/Llama-2-70b-hf", "gpt-3-175b": "meta-llama/Llama-2-70b-hf",
}
PROFILED_SHAPES = {
    "meta-llama/Meta-Llama-3-8B": BUILTIN_SHAPES["llama-3-8b"],
    "meta-llama/Llama-2-7b-hf": BUILTIN_SHAPES["llama-2-7b"],
    "codellama/CodeLlama-34b-Instruct-hf": BUILTIN_SHAPES["codellama-34b"],
    "meta-llama/Llama-2-70b-hf": BUILTIN_SHAPES["llama-2-70b"],
}


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float
    hbm_gbs: float
    network: str  # node type in profiles/network for NVSwitch nodes


GPUS = {"a100": Gpu("a100", 312.0, 2039.0, "a100_dgx"), "h100": Gpu("h100", 989.0, 3350.0, "h100_dgx")}
# Sustained fractions of peak reached by attention kernels (FlashAttention-2-class); a modelling
# assumption, printed with every GPU estimate.
ATTN_FLOP_EFFICIENCY = 0.5
ATTN_BW_EFFICIENCY = 0.7
KERNEL_LAUNCH_S = 5e-6
CPU_OVERHEAD_S = 1e-3  # scheduling and input preparation per iteration on the host


def shape_from_config(path: str | Path) -> ModelShape:
    cfg = json.loads(Path(path).read_text())
    try:
        heads = cfg["num_attention_heads"]
        return ModelShape(cfg.get("_name_or_path") or Path(path).parent.name, cfg["num_hidden_layers"],
                          cfg["hidden_size"], heads, cfg.get("num_key_value_heads", heads),
                          cfg["intermediate_size"], cfg["vocab_size"],
                          gated_mlp=cfg.get("hidden_act", "silu") in ("silu", "swiglu"))
    except KeyError as e:
        raise ValueError(f"{path}: config.json lacks {e.args[0]!r}, needed for a model shape") from e


def resolve_shape(model: str) -> ModelShape:
    if model in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[model]
    p = Path(model)
    if p.is_dir() and (p / "config.json").exists():
        return shape_from_config(p / "config.json")
    if p.name == "config.json" and p.exists():
        return shape_from_config(p)
    raise ValueError(f"unknown model shape {model!r}: give a HF config.json (or its folder) or one of "
                     f"{', '.join(BUILTIN_SHAPES)}")


def closest_profile(shape: ModelShape) -> str:
    if shape.name in PROFILE_FOR:
        return PROFILE_FOR[shape.name]
    per_token = sum(shape.op_flops().values())
    return min(PROFILED_SHAPES, key=lambda k: abs(sum(PROFILED_SHAPES[k].op_flops().values()) - per_token))


class OpTable:
    """Median per-layer times (s) of each profiled operator vs token count, for one TP degree."""

    OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
           "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")

    def __init__(self, path: Path, tp: int):
        if not path.exists():
            raise FileNotFoundError(f"no operator profile at {path}")
        with path.open() as f:
            rows = [r for r in csv.DictReader(f) if int(r["num_tensor_parallel_workers"]) == tp]
        if not rows:
            raise ValueError(f"{path} has no rows for tensor parallel size {tp}")
        rows.sort(key=lambda r: int(r["num_tokens"]))
        self.tokens = [float(r["num_tokens"]) for r in rows]
        try:
            self.times = {op: [float(r[f"time_stats.{op}.median"]) * 1e-3 for r in rows] for op in self.OPS}
            self.emb = [float(r["time_stats.emb.median"]) * 1e-3 for r in rows]
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: malformed operator profile ({e})") from e

    def op(self, op: str, tokens: int) -> float:
        return interp1(self.tokens, self.times[op], tokens)


class Collectives:
    def __init__(self, folder: Path):
        self.tables: dict[tuple[str, int, int], tuple[list[float], list[float]]] = {}
        for kind in ("all_reduce", "send_recv"):
            path = folder / f"{kind}.csv"
            if not path.exists():
                raise FileNotFoundError(f"no collective profile at {path}")
            with path.open() as f:
                groups: dict[tuple[int, int], list[tuple[float, float]]] = {}
                for r in csv.DictReader(f):
                    key = (int(r["num_workers"]), int(r["devices_per_node"]))
                    groups.setdefault(key, []).append((float(r["size"]), float(r[f"time_stats.{kind}.median"]) * 1e-3))
            for (w, d), pts in groups.items():
                pts.sort()
                self.tables[(kind, w, d)] = ([p[0] for p in pts], [p[1] for p in pts])

    def time(self, kind: str, workers: int, devices_per_node: int, size: float) -> float:
        key = (kind, workers, devices_per_node)
        if key not in self.tables:
            have = sorted((w, d) for k, w, d in self.tables if k == kind)
            raise ValueError(f"no {kind} profile for {workers} workers with {devices_per_node} per node; have {have}")
        return interp1(*self.tables[key], size)


@dataclass
class GpuCostModel:
    """Per-stage iteration time of `shape` on `gpu` with TP x PP (stages spread over nodes of
    `gpus_per_node` GPUs when they do not fit one)."""

    shape: ModelShape
    gpu: Gpu
    tp: int = 1
    num_stages: int = 1
    gpus_per_node: int = 8
    profiles: Path = PROFILES_DIR
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shape.heads % self.tp:
            raise ValueError(f"{self.shape.name}: {self.shape.heads} heads do not split over TP {self.tp}")
        if self.shape.num_layers % self.num_stages:
            raise ValueError(f"{self.shape.name}: {self.shape.num_layers} layers do not split into "
                             f"{self.num_stages} pipeline stages")
        profiled = closest_profile(self.shape)
        self.table = OpTable(self.profiles / "compute" / self.gpu.name / profiled / "mlp.csv", self.tp)
        base = PROFILED_SHAPES[profiled].op_flops()
        self.scale = {op: self.shape.op_flops()[op] / base[op] for op in base}
        if any(abs(v - 1) > 1e-9 for v in self.scale.values()):
            self.notes.append(f"{self.shape.name}: linear ops scaled by FLOPs from the {profiled} profile "
                              f"({', '.join(f'{k} x{v:.2f}' for k, v in self.scale.items())})")
        self.notes.append(f"attention modelled: max(FLOPs / ({ATTN_FLOP_EFFICIENCY:.0%} of {self.gpu.bf16_tflops} "
                          f"TFLOP/s), bytes / ({ATTN_BW_EFFICIENCY:.0%} of {self.gpu.hbm_gbs} GB/s))")
        self.net = Collectives(self.profiles / "network" / self.gpu.network)
        self.layers_per_stage = self.shape.num_layers // self.num_stages

    def layer_time(self, shape: BatchShape) -> float:
        n = shape.num_tokens
        t = sum(self.table.op(op, n) * self.scale.get(op, 1.0) for op in OpTable.OPS)
        t += self.attention_time(shape)
        if self.tp > 1:
            size = n * self.shape.hidden * 2
            t += 2 * self.net.time("all_reduce", self.tp, min(self.tp, self.gpus_per_node), size)
        return t

    def attention_time(self, shape: BatchShape) -> float:
        heads = self.shape.heads // self.tp
        kv = max(self.shape.kv_heads // self.tp, 1)
        d = self.shape.head_dim
        flops = bytes_ = 0.0
        for n, prefix in shape.prefills:
            flops += 4 * heads * d * n * (prefix + (n + 1) / 2)
            bytes_ += 2 * 2 * kv * d * (prefix + n) + 2 * 2 * heads * d * n
        for ctx in shape.decode_contexts:
            flops += 4 * heads * d * ctx
            bytes_ += 2 * 2 * kv * d * ctx
        compute = flops / (self.gpu.bf16_tflops * 1e12 * ATTN_FLOP_EFFICIENCY)
        memory = bytes_ / (self.gpu.hbm_gbs * 1e9 * ATTN_BW_EFFICIENCY)
        kernels = (len(shape.prefills) > 0) + (len(shape.decode_contexts) > 0)
        return max(compute, memory) + kernels * KERNEL_LAUNCH_S

    def lm_head_time(self, rows: int) -> float:
        flops = 2 * rows * self.shape.hidden * self.shape.vocab / self.tp
        weights = 2 * self.shape.hidden * self.shape.vocab / self.tp
        return max(flops / (self.gpu.bf16_tflops * 1e12 * 0.7), weights / (self.gpu.hbm_gbs * 1e9 * 0.8))

    def stage_time(self, shape: BatchShape, stage: int) -> float:
        t = self.layers_per_stage * self.layer_time(shape)
        if stage == 0:
            t += interp1(self.table.tokens, self.table.emb, shape.num_tokens) + CPU_OVERHEAD_S
        if stage == self.num_stages - 1:
            t += self.lm_head_time(shape.num_sampled) if shape.num_sampled else 0.0
        else:
            # Activations to the next stage: same node if both stages' GPUs fit on one node.
            first_gpu, last_gpu = stage * self.tp, (stage + 2) * self.tp - 1
            same_node = first_gpu // self.gpus_per_node == last_gpu // self.gpus_per_node
            t += self.net.time("send_recv", 2, 2 if same_node else 1, shape.num_tokens * self.shape.hidden * 2)
        return t
