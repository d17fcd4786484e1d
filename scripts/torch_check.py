#!/usr/bin/env python3
"""Loads an `fp8-moe train --save DIR` checkpoint into an equivalent PyTorch model and prints
its loss on the evaluation batch the checkpoint carries, beside the loss the train job
computed on the same batch (with its FP8 GEMMs).

    python3 scripts/torch_check.py DIR [--device cuda|cpu] [--tolerance NATS]

Needs PyTorch only: the safetensors file is parsed here (an 8-byte little-endian header
length, a JSON header, then the raw little-endian tensors), and nothing is downloaded. The
model follows the checkpoint format of the README ("Checkpoints"): byte embedding, blocks of
[RMSNorm -> causal attention -> residual -> RMSNorm -> top-k softmax MoE of SwiGLU experts
-> residual], final RMSNorm, LM head. The reference runs in float32 from the f32 master
weights (no FP8, float32 residual stream), so it differs from the train job's FP8 forward by
the FP8 and bf16 rounding of the job; exits 1 when the two losses differ by more than the
tolerance (default 0.05 nats: see the README for why), and 2 when the checkpoint records no
loss of the job's to compare with (saved from graph mode layer or breaking).
"""

import argparse
import json
import math
import struct
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {
    "F32": torch.float32,
    "F64": torch.float64,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
}


def read_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = memoryview(raw)[8 + n :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        t = torch.frombuffer(bytearray(data[lo:hi]), dtype=dtype) if hi > lo else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(info["shape"])
    return tensors


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def block(x, t, l, cfg):
    b, s, d = x.shape
    heads = cfg["heads"]
    hd = d // heads
    p = f"blocks.{l}."
    n1 = rmsnorm(x, t[p + "norm1"], cfg["norm_eps"])
    qkv = n1 @ t[p + "wqkv"].T  # [b, s, 3d]: q heads, then k, then v
    q, k, v = qkv.split(d, dim=-1)
    q, k, v = (z.reshape(b, s, heads, hd).transpose(1, 2) for z in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(hd))
    o = o.transpose(1, 2).reshape(b, s, d)
    h1 = x + o @ t[p + "wo"].T
    n2 = rmsnorm(h1, t[p + "norm2"], cfg["norm_eps"]).reshape(b * s, d)
    # Router: softmax over the experts, top-k (ties to the lower expert), gates not
    # renormalised (the job's default RouterConfig).
    probs = torch.softmax(n2 @ t[p + "moe.router"].T, dim=-1)
    gates, experts = torch.topk(probs, cfg["top_k"], dim=-1, sorted=True)
    w1, w2 = t[p + "moe.fc1"], t[p + "moe.fc2"]  # [E, 2F, d], [E, d, F]
    ffn = w1.shape[1] // 2
    y = torch.zeros_like(n2)
    for e in range(w1.shape[0]):
        rows, slot = (experts == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        a = n2[rows] @ w1[e].T
        h = F.silu(a[:, :ffn]) * a[:, ffn:]
        y.index_add_(0, rows, (h @ w2[e].T) * gates[rows, slot].unsqueeze(1))
    return h1 + y.reshape(b, s, d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tolerance", type=float, default=0.05)
    args = ap.parse_args()

    state = json.loads((args.checkpoint / "state.json").read_text())
    run = state["state"]
    cfg = run["model"]
    t = {k: v.to(args.device) for k, v in read_safetensors(args.checkpoint / "model.safetensors").items()}
    tokens = t["eval.tokens"].long()
    targets = t["eval.targets"].long()
    with torch.no_grad():
        x = t["embed"][tokens].float()
        for l in range(cfg["layers"]):
            x = block(x, t, l, cfg)
        logits = rmsnorm(x, t["norm_f"], cfg["norm_eps"]) @ t["head"].T
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()
    ours = run.get("eval_loss")
    print(f"checkpoint {args.checkpoint} at step {run['steps_done']}: evaluation batch of {tokens.numel()} tokens")
    print(f"  PyTorch float32 reference loss: {loss:.5f}")
    if ours is None:
        # Nothing to compare against (a checkpoint saved in graph mode layer or breaking):
        # not a pass.
        print("  fp8-moe loss: not recorded in this checkpoint (save it from --graphs none or "
              "step to compare); nothing was checked")
        return 2
    diff = abs(loss - ours)
    print(f"  fp8-moe (FP8 GEMMs) loss:       {ours:.5f}")
    print(f"  difference: {diff:.5f} nats (tolerance {args.tolerance})")
    return 0 if diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
