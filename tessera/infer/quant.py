"""Weight-only int8 quantisation with one scale per output channel.

W (out x in) is stored as int8 Q and fp32 scales s (out): s_o = max_i |W_oi| / 127,
Q = round(W / s). A linear layer computes y = (x Q^T) * s (+ b), which is exactly x (Q * s)^T:
the scale factors out of the sum because it belongs to the output channel (symmetric absmax,
as in LLM.int8()'s vector-wise quantisation, Dettmers et al. 2022, without its outlier split).
Routed experts ([E, out, in]) get one scale per (expert, output channel). The embedding (a table
lookup, not a product), norms, the router and the output head stay in full precision: the head
and the router are where rounding hurts most (logits and expert choices).

Quantized layers take a quarter of their fp32 memory (half of bf16). `save_quantized` writes a model directory
that `load_quantized` reads back without the full-precision weights (`python -m tessera.infer.quant
SRC OUT` makes one from a HuggingFace directory).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tessera.config.errors import CheckpointError
from tessera.config.hf_config import config_to_hf, read_hf_config
from tessera.models.moe.experts import GroupedExperts, grouped_linear
from tessera.models.transformer import Transformer

QUANT_FILE = "tessera_quantization.json"
WEIGHTS_FILE = "model.int8.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and fp32 scales over the last dim: w [..., out, in] -> q [..., out, in], s [..., out]."""
    w = w.float()
    scale = w.abs().amax(-1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    is_quantized_linear = True

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, m: nn.Linear) -> Int8Linear:
        q = cls(m.in_features, m.out_features, m.bias is not None, m.weight.dtype, m.weight.device)
        q.qweight, q.scale = quantize_per_channel(m.weight.detach())
        if m.bias is not None:
            q.bias = nn.Parameter(m.bias.detach().clone())
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return y + self.bias if self.bias is not None else y


class Int8GroupedExperts(GroupedExperts):
    """Routed experts with int8 weights, dequantised expert by expert inside the forward pass."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, dtype: torch.dtype, device=None):
        nn.Module.__init__(self)
        self.use_grouped_mm = True
        self.dtype = dtype
        for name, (o, i) in {"w1": (hidden_dim, dim), "w2": (dim, hidden_dim), "w3": (hidden_dim, dim)}.items():
            self.register_buffer(f"q{name}", torch.zeros(num_experts, o, i, dtype=torch.int8, device=device))
            self.register_buffer(f"{name}_scale", torch.ones(num_experts, o, device=device))

    @classmethod
    def from_experts(cls, m: GroupedExperts) -> Int8GroupedExperts:
        E, F_, D = m.w1.shape
        q = cls(E, D, F_, m.w1.dtype, m.w1.device)
        for name in ("w1", "w2", "w3"):
            qw, s = quantize_per_channel(getattr(m, name).detach())
            setattr(q, f"q{name}", qw)
            setattr(q, f"{name}_scale", s)
        return q

    def _weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return getattr(self, f"q{name}").to(dtype) * getattr(self, f"{name}_scale")[..., None].to(dtype)

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        d = x_ND.dtype
        h = F.silu(grouped_linear(x_ND, self._weight("w1", d), tokens_per_expert)) * grouped_linear(
            x_ND, self._weight("w3", d), tokens_per_expert)
        return grouped_linear(h, self._weight("w2", d), tokens_per_expert)


def _quantizable(model: Transformer) -> list[tuple[str, nn.Module]]:
    """Linear layers and routed experts inside the transformer blocks (not the head or router)."""
    out = []
    for name, m in model.named_modules():
        if not name.startswith("layers.") or ".router" in name:
            continue
        if isinstance(m, (nn.Linear, GroupedExperts)) and not getattr(m, "is_quantized_linear", False) \
                and not isinstance(m, Int8GroupedExperts):
            out.append((name, m))
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


@torch.no_grad()
def quantize_model(model: Transformer) -> list[str]:
    """Replace every quantizable layer of `model` by its int8 version (in place); returns their names."""
    names = []
    for name, m in _quantizable(model):
        new = Int8Linear.from_linear(m) if isinstance(m, nn.Linear) else Int8GroupedExperts.from_experts(m)
        _replace(model, name, new)
        names.append(name)
    return names


def save_quantized(model: Transformer, quantized: list[str], path: str | Path, source_dir: str | Path | None = None
                   ) -> None:
    """Write a pre-quantized model directory: config.json, int8 weights, the list of quantized
    layers, and the tokenizer files of `source_dir` if given."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    hf_cfg = config_to_hf(model.cfg)
    hf_cfg["torch_dtype"] = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    (path / QUANT_FILE).write_text(json.dumps({"method": "int8_weight_only", "format": 1, "layers": quantized},
                                              indent=2))
    if source_dir is not None:
        for f in TOKENIZER_FILES:
            if (Path(source_dir) / f).is_file():
                shutil.copy(Path(source_dir) / f, path / f)


def is_quantized_dir(path: str | Path) -> bool:
    return (Path(path) / QUANT_FILE).is_file()


def load_quantized(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                   ) -> tuple[Transformer, list[str]]:
    """Read a directory written by `save_quantized`."""
    path = Path(path)
    meta = json.loads((path / QUANT_FILE).read_text())
    if meta.get("method") != "int8_weight_only":
        raise CheckpointError(f"{path}: quantization method {meta.get('method')!r} is not supported")
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
        for name in meta["layers"]:
            m = model.get_submodule(name)
            if isinstance(m, nn.Linear):
                new = Int8Linear(m.in_features, m.out_features, m.bias is not None, dtype)
            elif isinstance(m, GroupedExperts):
                E, F_, D = m.w1.shape
                new = Int8GroupedExperts(E, D, F_, dtype)
            else:
                raise CheckpointError(f"{path}: quantized layer {name!r} is not a linear layer or experts")
            _replace(model, name, new)
    state = load_file(str(path / WEIGHTS_FILE), device=str(device))
    state = {k: (v if v.dtype in (torch.int8,) or k.endswith("scale") or k.endswith("expert_bias")
                 else v.to(dtype)) for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit the config: {str(e)[:300]}") from e
    model.reset_rope(device)
    return model.eval(), list(meta["layers"])


def main(argv: list[str] | None = None) -> int:
    """`python -m tessera.infer.quant SRC_DIR OUT_DIR`: write a pre-quantized copy of a model."""
    import argparse

    from tessera.checkpoint.hf import load_pretrained

    parser = argparse.ArgumentParser(prog="python -m tessera.infer.quant", description=main.__doc__)
    parser.add_argument("src", help="HuggingFace model directory")
    parser.add_argument("out", help="directory to write (serve it with `tessera serve OUT`)")
    args = parser.parse_args(argv)
    model = load_pretrained(args.src)
    layers = quantize_model(model)
    save_quantized(model, layers, args.out, source_dir=args.src)
    print(f"wrote {args.out}: {len(layers)} int8 layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
