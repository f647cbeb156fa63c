"""Attention of a group's completion queries over [prompt keys | own keys], block-sparse and exact.

Each completion token attends to the whole prompt and to its own completion's past. Rather
than one masked attention over the group's [P + Lc] keys (which spends Lc x Lc scores on the
other completions' keys, mostly masked), this computes two dense blocks with the fused
flash kernel, which also returns each row's log-sum-exp:

  A: all completion queries  x  prompt keys        (no mask; the prompt K/V are read in place)
  B: each completion's queries x its own keys      (causal, the completions batched)

and merges them exactly: lse = logaddexp(lse_A, lse_B), out = e^(lse_A-lse) out_A + e^(lse_B-lse) out_B.
The backward calls the flash backward of each block with the *merged* output and lse, which
gives each block's exact share of the gradient (the identity ring attention relies on).

CPU only: it uses PyTorch's CPU flash-attention ops, which return the log-sum-exp that the
public scaled_dot_product_attention does not. Other devices use the masked path.
"""

from __future__ import annotations

import torch

_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def available(device: torch.device) -> bool:
    return device.type == "cpu" and _FORWARD is not None and _BACKWARD is not None


def _to_batches(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """[1, H, Lc, D] (completions back to back) -> [G, H, Cmax, D], zero-padded at the end."""
    if len(set(lens)) == 1:
        return x[0].unflatten(1, (len(lens), lens[0])).transpose(0, 1)  # a view when the lengths agree
    out = x.new_zeros(len(lens), x.shape[1], max(lens), x.shape[3])
    for j, piece in enumerate(x[0].split(lens, dim=1)):
        out[j, :, : piece.shape[1]] = piece
    return out


def _from_batches(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """[G, H, Cmax, ...] -> [1, H, Lc, ...], dropping the padding."""
    return torch.cat([x[j, :, :n] for j, n in enumerate(lens)], dim=1)[None]


class PrefixMergedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_c, k_p, v_p, k_c, v_c, lens, scale):
        # q_c: [1, H, Lc, D]; k_p, v_p: [1, Hkv, P, D]; k_c, v_c: [1, Hkv, Lc, D]
        out_a, lse_a = _FORWARD(q_c, k_p, v_p, 0.0, False, scale=scale)  # [1, H, Lc, D], [1, H, Lc]
        q_b, k_b, v_b = (_to_batches(t, lens) for t in (q_c, k_c, v_c))  # [G, H(kv), Cmax, D]
        out_b, lse_b = _FORWARD(q_b, k_b, v_b, 0.0, True, scale=scale)  # [G, H, Cmax, D], [G, H, Cmax]
        out_b = _from_batches(out_b, lens)  # [1, H, Lc, D]
        lse_b = _from_batches(lse_b[..., None], lens)[..., 0]  # [1, H, Lc]
        lse = torch.logaddexp(lse_a, lse_b)  # [1, H, Lc]
        wide = torch.promote_types(q_c.dtype, torch.float32)  # merge bf16 blocks in float32
        out = (torch.exp(lse_a - lse)[..., None] * out_a.to(wide)
               + torch.exp(lse_b - lse)[..., None] * out_b.to(wide)).to(q_c.dtype)  # [1, H, Lc, D]
        ctx.save_for_backward(q_c, k_p, v_p, k_c, v_c, out, lse)
        ctx.lens, ctx.scale = lens, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_c, k_p, v_p, k_c, v_c, out, lse = ctx.saved_tensors
        lens, scale = ctx.lens, ctx.scale
        grad_out = grad_out.contiguous()
        dq_a, dk_p, dv_p = _BACKWARD(grad_out, q_c, k_p, v_p, out, lse, 0.0, False, scale=scale)
        batched = [_to_batches(t, lens) for t in (grad_out, q_c, k_c, v_c, out)]
        lse_b = _to_batches(lse[..., None], lens)[..., 0]  # [G, H, Cmax]; padding 0, a finite dummy
        dq_b, dk_b, dv_b = _BACKWARD(*batched[:4], batched[4], lse_b, 0.0, True, scale=scale)
        return (dq_a + _from_batches(dq_b, lens), dk_p, dv_p, _from_batches(dk_b, lens), _from_batches(dv_b, lens),
                None, None)


def prefix_merged_attention(q_c, k_p, v_p, k_c, v_c, lens: list[int], scale: float | None) -> torch.Tensor:
    """Completion queries [1, H, Lc, D] over their prompt's and own keys -> [1, H, Lc, D]."""
    return PrefixMergedAttention.apply(q_c, k_p, v_p, k_c, v_c, list(lens), scale)
