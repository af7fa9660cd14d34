"""Read model shapes and weights from a Hugging Face folder (Llama, Mistral, Qwen2/3, Phi-3,
Gemma 2/3) or a GGUF file (llama, qwen2, qwen3, phi3, gemma2, gemma3 architectures).

Both sources are turned into one stream of (Hugging Face parameter name, tensor) pairs; a single
`load_weights` maps that stream onto the fused, possibly sharded, parameters of `LlamaModel`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from carpool.config import ModelConfig
from carpool.model import cpu_kernels, gguf_codes
from carpool.model.llama import LlamaModel, TensorParallel
from carpool.model.gguf_codes import QuantCodes
from carpool.model.gguf_file import GGUFFile
from carpool.model.quant import CodesAssembly, QuantizedEmbedding, check_quantization, quantize_linears

log = logging.getLogger("carpool")

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"}
GEMMA = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}


def is_gguf(path: str) -> bool:
    return Path(path).is_file() and Path(path).suffix == ".gguf"


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(model: str) -> str:
    """A local file or folder as is; `org/name` (not a local path) -> its snapshot in the local
    Hugging Face cache (HF_HUB_CACHE / HF_HOME; never downloads). Other strings pass through."""
    if Path(model).exists() or not _REPO_ID.match(model):
        return model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        return snapshot_download(model, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(
            f"model {model!r} is not a local path, and the Hugging Face repo {model!r} is not in the "
            f"local cache ({cache}); carpool does not download: fetch it first with "
            f"`huggingface-cli download {model}`, or pass a local folder / .gguf file") from e


# ---------------------------------------------------------------- Hugging Face folders

# generation_config.json key -> SamplingParams field (what vLLM takes from it as defaults).
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                        "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                        "max_new_tokens": "max_tokens"}


def _ids(value) -> list[int]:
    return [value] if isinstance(value, int) else [int(v) for v in value or []]


def hf_generation_config(folder: Path) -> tuple[list[int], dict]:
    """EOS ids and sampling defaults from generation_config.json ([], {} without one)."""
    f = folder / "generation_config.json"
    if not f.exists():
        return [], {}
    gen = json.loads(f.read_text())
    defaults = {field: gen[key] for key, field in _GENERATION_DEFAULTS.items() if gen.get(key) is not None}
    return _ids(gen.get("eos_token_id")), defaults


def hf_model_config(folder: Path) -> ModelConfig:
    folder = Path(resolve_model_path(str(folder)))
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{folder} is neither a .gguf file nor a model folder with config.json")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {archs[0]!r} in {cfg_file}; "
                         f"carpool supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    eos = cfg.get("eos_token_id")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    local_theta = None
    if archs[0] == "Gemma3ForCausalLM":  # global layers as below; sliding ones a base of their own
        local = rope.get("sliding_attention") or {}
        local_theta = local.get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0)
        rope = rope.get("full_attention", rope)  # transformers 5 keys Gemma 3's RoPE by layer type
    rope_scaling = cfg.get("rope_scaling") or rope or None
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
    rotary_fraction = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 1.0)
    if rotary_fraction != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {rotary_fraction}) in "
                         f"{cfg_file} are not supported")
    eos_ids = _ids(eos)
    gen_eos, gen_defaults = hf_generation_config(folder)
    eos_ids += [i for i in gen_eos if i not in eos_ids]  # Llama-3 instruct: <|eot_id|> is only here
    gemma = archs[0] in GEMMA
    window, sliding = _hf_sliding_layers(cfg, archs[0])
    gemma_fields = dict(
        hidden_act="gelu_tanh", sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        attn_logit_softcap=cfg.get("attn_logit_softcapping"), final_logit_softcap=cfg.get("final_logit_softcapping"),
        rope_local_theta=local_theta, norm_weight_offset=1.0) if gemma else {}
    return ModelConfig(
        architecture=archs[0],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
        attention_bias=cfg.get("attention_bias", archs[0] == "Qwen2ForCausalLM"),
        rope_scaling=rope_scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        qk_norm=archs[0] in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        generation_defaults=gen_defaults,
        sliding_window=window if sliding else None,
        sliding_layers=sliding if window else [],
        **gemma_fields,
    )


def _hf_sliding_layers(cfg: dict, arch: str) -> tuple[int | None, list[int]]:
    """The sliding window and the layers it applies to, as transformers reads a config.json:
    `layer_types` where given; else Gemma 2 slides every other layer, Gemma 3 five in six, Mistral
    and Phi-3 every layer (Mistral 7B v0.1: 4096 tokens, Phi-3 mini 4k: 2047), Qwen2/3 the
    layers from `max_window_layers` on where `use_sliding_window` is set."""
    window, layers = cfg.get("sliding_window"), range(cfg["num_hidden_layers"])
    if not window:
        return None, []
    if cfg.get("layer_types"):
        return window, [i for i, kind in enumerate(cfg["layer_types"]) if kind == "sliding_attention"]
    if arch in GEMMA:
        pattern = 2 if arch == "Gemma2ForCausalLM" else cfg.get("sliding_window_pattern", 6)
        return window, [i for i in layers if (i + 1) % pattern]
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return window, list(layers)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        return window, [i for i in layers if i >= cfg.get("max_window_layers", 0)]
    return None, []


def hf_weights(folder: Path, wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs; tensors `wanted` rejects are not read at all."""
    from safetensors import safe_open

    folder = Path(resolve_model_path(str(folder)))
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if wanted is None or wanted(name):
                    yield name, st.get_tensor(name)


# ---------------------------------------------------------------- GGUF files

def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# GGUF general.architecture -> the Hugging Face architecture it holds.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _gguf_gemma_fields(arch: str, get, num_layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma's settings as llama.cpp reads them: what the file does not hold (the sliding-layer
    pattern, Gemma 3's local RoPE base, the query scale, Gemma 2's default caps) as it assumes."""
    window = get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [i for i, slides in enumerate(pattern) if slides]
    else:
        period = 2 if arch == "gemma2" else 6
        sliding = [i for i in range(num_layers) if (i + 1) % period]
    # The 27B models scale queries by (hidden / heads)^-1/2, the others by head_dim^-1/2.
    is_27b = num_layers == {"gemma2": 46, "gemma3": 62}[arch]
    caps = (50.0, 30.0) if arch == "gemma2" else (None, None)
    return dict(
        hidden_act="gelu_tanh", sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=float(hidden // heads if is_27b else head_dim),
        attn_logit_softcap=get("attn_logit_softcapping", caps[0]),
        final_logit_softcap=get("final_logit_softcapping", caps[1]),
        sliding_window=window, sliding_layers=sliding if window else [],
        rope_local_theta=10000.0 if arch == "gemma3" else None)


def gguf_model_config(reader) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; carpool reads "
                         f"{', '.join(GGUF_ARCHITECTURES)} GGUF files")

    def get(key, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    tensors = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens"))
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    if "rope_factors_long.weight" in tensors:
        raise ValueError(f"GGUF {arch} with long-context RoPE factors (rope_factors_long) is not supported")
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    family = (_gguf_gemma_fields(arch, get, get("block_count"), hidden, heads, head_dim)
              if arch in ("gemma2", "gemma3") else {})
    if arch == "phi3" and get("attention.sliding_window"):  # llama.cpp slides every phi3 layer
        family = dict(sliding_window=get("attention.sliding_window"), sliding_layers=list(range(get("block_count"))))
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=scaling,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **family,
    )


# ffn_norm is the MLP's input norm: Llama's post_attention_layernorm, Gemma's
# pre_feedforward_layernorm (load_weights takes either name for Llama's layers). phi3's attn_qkv
# and ffn_up (gate and up stacked) are split by _unfused.
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved per head (pairs for its rotary kernel);
    regroup them into the two halves that rotate_half-style RoPE expects."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(reader, config: ModelConfig, wanted: Callable[[str], bool] | None = None,
                 keep_codes: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantCodes]]:
    """(HF name, tensor) pairs; tensors `wanted` rejects are never read. keep_codes: a matrix of a
    type csrc/kquant.c multiplies comes as its codes (gguf_codes.QuantCodes), read from the
    mapped file with no float copy."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, kind, suffix = parts[1], parts[2], parts[3]
            if kind not in _GGUF_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name}")
            name = f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
        else:
            name = {"token_embd.weight": "model.embed_tokens.weight",
                    "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}.get(t.name)
            if name is None:
                continue  # e.g. rope_freqs: recomputed from the metadata
        if wanted is not None and not wanted(name):
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        permuted = config.architecture == "LlamaForCausalLM"  # llama.cpp's NeoX-RoPE models keep HF's order
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(parts[2]) if parts[0] == "blk" else None
        if keep_codes and len(shape) == 2 and t.tensor_type in gguf_codes.SUPPORTED:
            codes = gguf_codes.from_blocks(t.data, t.tensor_type, shape)
            if permuted and heads:
                codes = codes.rows(unpermute_qk(np.arange(shape[0]), heads))
            yield name, codes
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name} has unsupported type "
                             f"{GGMLQuantizationType(t.tensor_type).name}") from e
        w = np.array(w, dtype=np.float32).reshape(shape)
        if permuted and heads:
            w = unpermute_qk(w, heads)
        yield name, torch.from_numpy(w)


# ---------------------------------------------------------------- both

def open_gguf(path: str):
    """The file's metadata and tensor table (model/gguf_file.py), shared by the loader and the
    tokenizer; the tensors stay in the mapped file."""
    try:
        reader = GGUFFile(path)
    except (ValueError, IndexError, KeyError, OverflowError, EOFError, struct.error) as e:
        raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated): {e}") from e
    for t in reader.tensors:  # a truncated file maps fewer bytes than its tensors claim
        if t.data.nbytes < t.n_bytes:
            raise ValueError(f"{path} is truncated: tensor {t.name} needs {t.n_bytes} bytes, "
                             f"{t.data.nbytes} are in the file")
    return reader


def load_model_config(path: str, gguf_reader=None) -> ModelConfig:
    if is_gguf(path):
        return gguf_model_config(gguf_reader or open_gguf(path))
    return hf_model_config(Path(path))


def _unfused(weights: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3 keeps q/k/v and gate/up in one tensor each (in GGUF, gate/up as a double-height
    ffn_up); yield them as Llama's separate ones."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def split(w, sizes: list[int]) -> list:
        if not isinstance(w, QuantCodes):
            return w.split(sizes)
        ends = np.cumsum([0, *sizes])
        return [w.rows(slice(a, b)) for a, b in zip(ends[:-1], ends[1:])]

    for name, w in weights:
        if ".self_attn.qkv_proj." in name:
            pre, kind = name.split(".qkv_proj.")
            for part, t in zip("qkv", split(w, [q, kv, kv])):
                yield f"{pre}.{part}_proj.{kind}", t
        elif name.endswith(".mlp.gate_up_proj.weight") or (
                name.endswith(".mlp.up_proj.weight") and w.shape[0] == 2 * cfg.intermediate_size):
            pre = name.rsplit(".", 2)[0] + "."
            gate, up = split(w, [w.shape[0] // 2] * 2)
            yield pre + "gate_proj.weight", gate
            yield pre + "up_proj.weight", up
        else:
            yield name, w


def load_weights(model: LlamaModel, weights: Iterator[tuple[str, torch.Tensor | QuantCodes]],
                 codes_sink: CodesAssembly | None = None) -> None:
    """Copy HF-named tensors into the fused, sharded parameters this model holds. GGUF codes go
    to `codes_sink` where the target linear has no weight parameter (it keeps the file's codes),
    else they are dequantized into it."""
    cfg, tp = model.config, model.tp
    params = dict(model.named_parameters())
    loaded: set[str] = set()

    def shard(w: torch.Tensor | QuantCodes, dim: int) -> torch.Tensor | QuantCodes:
        size = (w.n, w.k)[dim] // tp.size if isinstance(w, QuantCodes) else w.shape[dim] // tp.size
        if isinstance(w, QuantCodes):
            return w.rows(slice(tp.rank * size, (tp.rank + 1) * size)) if dim == 0 else \
                w.columns(tp.rank * size, (tp.rank + 1) * size)
        return w.narrow(dim, tp.rank * size, size)

    def put(target: str, w: torch.Tensor | QuantCodes, offset: int = 0) -> None:
        loaded.add(f"{target}@{offset}")
        if isinstance(w, QuantCodes):
            if target not in params:  # a layer that keeps the file's codes
                return codes_sink.add(target, offset, w)
            w = torch.from_numpy(gguf_codes.dequantize(w))
        p = params[target]
        p.data.narrow(0, offset, w.shape[0]).copy_(w)

    def put_vocab(target: str, w: torch.Tensor | QuantCodes) -> None:
        """This rank's vocabulary rows; rows past the vocabulary (padding of the last slice) are 0."""
        if tp.size == 1:
            return put(target, w)
        start, rows = tp.vocab_range(cfg.vocab_size)
        params[target].data.zero_()
        put(target, w.rows(slice(start, start + rows)) if isinstance(w, QuantCodes) else w[start:start + rows])

    norms = {"input_layernorm", "post_attention_layernorm"}
    if cfg.sandwich_norms:
        norms |= {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
    if cfg.qk_norm:
        norms |= {"self_attn.q_norm", "self_attn.k_norm"}
    for name, w in _unfused(weights, cfg):
        if name.endswith("norm.weight"):
            w = w + cfg.norm_weight_offset if cfg.norm_weight_offset else w
        if name == "model.embed_tokens.weight":
            if model.is_first:
                put_vocab("embed_tokens.weight", w)
            if model.is_last and cfg.tie_word_embeddings:
                put_vocab("lm_head.weight", w)
            continue
        if name == "lm_head.weight":
            if model.is_last:
                put_vocab("lm_head.weight", w)
            continue
        if name == "model.norm.weight":
            if model.is_last:
                put("norm.weight", w)
            continue
        if not name.startswith("model.layers."):
            continue
        _, _, idx, rest = name.split(".", 3)
        layer = int(idx)
        if not model.first_layer <= layer < model.last_layer:
            continue
        prefix = f"layers.{layer - model.first_layer}."
        module, kind = rest.rsplit(".", 1)  # e.g. ("self_attn.q_proj", "weight")
        if module == "pre_feedforward_layernorm" and not cfg.sandwich_norms:
            module = "post_attention_layernorm"  # a Llama-layout GGUF's ffn_norm
        attn = model.layers[layer - model.first_layer].self_attn
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            offset = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[module[-6]]
            put(prefix + f"self_attn.qkv_proj.{kind}", shard(w, 0), offset)
        elif module in ("mlp.gate_proj", "mlp.up_proj"):
            inter = model.layers[0].mlp.inter
            put(prefix + "mlp.gate_up_proj.weight", shard(w, 0), 0 if module == "mlp.gate_proj" else inter)
        elif module in ("self_attn.o_proj", "mlp.down_proj"):
            put(prefix + f"{module}.weight", shard(w, 1))
        elif module in norms:
            put(prefix + f"{module}.weight", w)
        else:
            raise ValueError(f"unexpected weight {name}")

    expected = {"embed_tokens.weight@0"} if model.is_first else set()
    if model.is_last:
        expected |= {"norm.weight@0", "lm_head.weight@0"}
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        pre = f"layers.{i}."
        expected |= {f"{pre}self_attn.qkv_proj.weight@{o}" for o in (0, a.q_size, a.q_size + a.kv_size)}
        expected |= {f"{pre}mlp.gate_up_proj.weight@0", f"{pre}mlp.gate_up_proj.weight@{layer.mlp.inter}",
                     f"{pre}self_attn.o_proj.weight@0", f"{pre}mlp.down_proj.weight@0",
                     f"{pre}input_layernorm.weight@0", f"{pre}post_attention_layernorm.weight@0"}
        expected |= {f"{pre}{n}.weight@0" for n in norms}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(sorted(missing)[:6])}")


def stage_wants(model: LlamaModel) -> Callable[[str], bool]:
    """Which checkpoint tensors a pipeline stage needs: its layers, plus the embedding on the
    first stage and the final norm and LM head (or the tied embedding) on the last."""
    def wanted(name: str) -> bool:
        if name.startswith("model.layers."):
            return model.first_layer <= int(name.split(".")[2]) < model.last_layer
        if name == "model.embed_tokens.weight":
            return model.is_first or (model.is_last and model.config.tie_word_embeddings)
        if name in ("model.norm.weight", "lm_head.weight"):
            return model.is_last
        return True
    return wanted


# The mode that keeps a GGUF's layer weights at their own precision. Q4_1 codes survive int4's
# requantization exactly (same 32-wide groups, min/max scale), Q4_0 nearly (a block's min need not
# sit on its grid's end), Q8_0 loses little to int8: those run on csrc/quant_gemv.c (and the fused
# layers). Every other type kquant.c multiplies keeps its own codes ('gguf').
_GGUF_QUANTIZATION = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}
_FLOAT_TYPES = {"F32", "F16", "BF16"}


def _layer_matrices(reader) -> list:
    return [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]


def resolve_quantization(mode: str, device: torch.device, dtype: torch.dtype, gguf_reader=None) -> str:
    """'auto' -> for a GGUF run on CPU in bf16 / fp16: int4 / int8 when its layer weights are
    all Q4_0/Q4_1 / (some) Q8_0; 'gguf' when they are types csrc/kquant.c multiplies (K-quants,
    Q5_x) and the CPU runs it; else 'none', with one warning line naming a quantized type that
    is widened to the dtype. Float checkpoints, other devices and float32 (the reference
    arithmetic): 'none'. Other modes pass through; 'gguf' is checked here."""
    from gguf import GGMLQuantizationType

    if mode == "gguf":
        if gguf_reader is None:
            raise ValueError("--quantization gguf keeps a GGUF file's own codes; the model is not a .gguf file")
        for t in _layer_matrices(gguf_reader):
            if t.tensor_type not in gguf_codes.SUPPORTED:
                raise ValueError(f"--quantization gguf: tensor {t.name} has type "
                                 f"{GGMLQuantizationType(t.tensor_type).name}, which carpool's kernels do not "
                                 f"multiply; supported: {', '.join(sorted(q.name for q in gguf_codes.SUPPORTED))}")
        if dtype != torch.bfloat16 or not cpu_kernels.has_kq_matmul():
            raise ValueError("--quantization gguf runs csrc/kquant.c: bfloat16 on a CPU with AVX-512 VNNI or AVX2")
    if mode != "auto":
        return mode
    if gguf_reader is None or device.type != "cpu" or dtype == torch.float32:
        return "none"
    types = {GGMLQuantizationType(t.tensor_type).name: t.name for t in _layer_matrices(gguf_reader)}
    legacy = {_GGUF_QUANTIZATION.get(name) for name in types}
    if types and None not in legacy:
        return "int8" if "int8" in legacy else "int4"
    quantized = {name: tensor for name, tensor in types.items() if name not in _FLOAT_TYPES}
    if not quantized:
        return "none"
    unsupported = [name for name in quantized if GGMLQuantizationType[name] not in gguf_codes.SUPPORTED]
    if not unsupported and dtype == torch.bfloat16 and cpu_kernels.has_kq_matmul():
        return "gguf"
    why = (f"tensor {quantized[unsupported[0]]} has type {unsupported[0]}, which carpool's kernels do not multiply"
           if unsupported else "csrc/kquant.c runs in bfloat16 on CPUs with AVX-512 VNNI or AVX2")
    log.warning("GGUF weights widened to %s (%s): expect more memory and slower decode", dtype, why)
    return "none"


def _quantized_tables(reader, model: LlamaModel) -> tuple[bool, bool]:
    """Whether the LM head and the embedding keep the file's codes: their tensor (the embedding's
    for a tied head) is of a type kquant.c multiplies, and the vocabulary is not split across
    tensor-parallel ranks."""
    types = {t.name: t.tensor_type for t in reader.tensors}
    quantized = lambda name: model.tp.size == 1 and types.get(name) in gguf_codes.SUPPORTED  # noqa: E731
    head = "token_embd.weight" if model.config.tie_word_embeddings else "output.weight"
    return model.is_last and quantized(head), model.is_first and quantized("token_embd.weight")


def load_model(path: str, dtype: torch.dtype, device: torch.device, first_layer: int = 0,
               last_layer: int | None = None, tp: TensorParallel | None = None,
               gguf_reader=None, quantization: str = "none") -> LlamaModel:
    """quantization: 'int8' / 'int4' swap the linear layers (LM head included, not the embedding)
    for weight-only quantized ones, quantized from the fp32 weights after sharding; 'auto': see
    resolve_quantization. The mode in use is left in `model.quantization`."""
    start = time.perf_counter()
    if is_gguf(path):
        reader = gguf_reader or open_gguf(path)
        config = gguf_model_config(reader)
    else:
        reader, config = None, hf_model_config(Path(path))
    quantization = resolve_quantization(quantization, device, dtype, reader)
    check_quantization(quantization, device)
    with torch.device("meta"):
        model = LlamaModel(config, first_layer, last_layer, tp)
    wanted = None if model.is_first and model.is_last else stage_wants(model)
    keep_codes = quantization == "gguf"
    weights = gguf_weights(reader, config, wanted, keep_codes) if is_gguf(path) else hf_weights(Path(path), wanted)
    sink = CodesAssembly(model, dtype, *_quantized_tables(reader, model)) if keep_codes else None
    if quantization in ("none", "gguf"):  # loaded straight into the dtype it runs in: no float copy
        model.to(dtype=dtype)  # (int4 / int8 quantize from the float weights, so they load in fp32)
    allocate_on_cpu(model)  # the linears that keep codes have no weight to allocate
    load_weights(model, weights, sink)
    if sink is not None:
        sink.check_complete()
    quantize_linears(model, quantization, dtype)
    model.quantization = quantization
    model = model.to(device=device, dtype=dtype).eval()
    if reader is not None:
        reader.drop_pages()  # the weights are copied out (packed or widened); the tokenizer reads fields
    stored = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        t.numel() * t.element_size() for m in model.modules() if getattr(m, "kq", None) is not None
        and not isinstance(m, QuantizedEmbedding) for t in m.kq.tensors if t is not None)
    log.info("loaded %s in %.1f s (quantization %s): weights %.0f MiB as held; process RSS %.0f MiB",
             Path(path).name, time.perf_counter() - start, quantization, stored / 2**20, resident_bytes() / 2**20)
    return model


def allocate_on_cpu(model: nn.Module) -> None:
    """Give each parameter and buffer built on the meta device uninitialised CPU memory, as
    `to_empty` does; `to_empty` takes the meta tensors through torch's Python reference ops,
    whose first call imports sympy (0.5 s of start-up)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
