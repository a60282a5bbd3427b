"""Gated MLPs that keep two of their four activations for backward.

Llama's MLP, and that of Mistral, Qwen2/2.5/3 and Gemma, computes down(act(gate(x)) · up(x)). For backward, autograd
keeps per layer gate(x), up(x), act(gate(x)) and their product: four [tokens, intermediate] tensors, about half of a
training forward's activations (intermediate ≈ 2.7 × hidden). `_GatedMLP` keeps only gate(x) and up(x), with the
input x that the projections' weight gradients need anyway, and recomputes act(gate)·up in backward. That is
elementwise work, small beside the layer's six matmuls, which are the ones autograd runs.

`lean_gated_mlps(model)` gives this forward to every module of the model that has bias-free `gate_proj`, `up_proj`
and `down_proj` linear layers and an `act_fn`, after checking on a small input, once per module class, that the
module computes exactly that and that the gradients agree. A module whose layers are no longer plain full linear
layers when it runs (LoRA replaced them; ZeRO-3 holds only a shard outside their own forward) takes its own forward,
as does any forward without gradients.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _GatedMLP(torch.autograd.Function):
    """down(act(x gateᵀ) · x upᵀ): [..., H] -> [..., H], saving x, x gateᵀ and x upᵀ.

    Under autocast the three matmuls run in its dtype, as autograd's would: x is cast once and kept in that dtype.
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, act):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            xc = x.to(dtype)
            g, u = F.linear(xc, w_gate.to(dtype)), F.linear(xc, w_up.to(dtype))  # [..., I]
            y = F.linear(act(g) * u, w_down.to(dtype))  # [..., H]
        ctx.save_for_backward(xc, g, u, w_gate, w_up, w_down)
        ctx.act, ctx.dtype, ctx.x_dtype, ctx.device = act, dtype, x.dtype, device
        return y

    @staticmethod
    def backward(ctx, grad):  # grad: [..., H]
        xc, g, u, w_gate, w_up, w_down = ctx.saved_tensors
        dtype = ctx.dtype
        with torch.autocast(ctx.device, enabled=False):
            grad = grad.to(dtype)
            with torch.enable_grad():
                g_ = g.detach().requires_grad_()
                a = ctx.act(g_)  # [..., I]
            grad_down = _flat(grad).T @ _flat(a.detach() * u)  # [H, I]
            grad_h = grad @ w_down.to(dtype)  # [..., I]
            grad_u = grad_h * a.detach()
            (grad_g,) = torch.autograd.grad(a, g_, grad_h * u)  # [..., I]
            del grad_h, a
            grad_gate, grad_up = _flat(grad_g).T @ _flat(xc), _flat(grad_u).T @ _flat(xc)  # [I, H] each
            # each projection's share in x's dtype, then summed, as autograd adds them
            grad_x = (grad_g @ w_gate.to(dtype)).to(ctx.x_dtype) + (grad_u @ w_up.to(dtype)).to(ctx.x_dtype)
        return (grad_x, grad_gate.to(w_gate.dtype), grad_up.to(w_up.dtype),
                grad_down.to(w_down.dtype), None)


def _full_linear(layer) -> bool:
    """A plain, bias-free linear layer whose whole weight is here (not a LoRA wrapper, not a ZeRO-3 weight: ZeRO-3
    gathers each layer's weight in that layer's own forward and backward, which this forward does not call, and
    may have prefetched some of the three and not the others)."""
    w = getattr(layer, "weight", None)
    return (type(layer) is torch.nn.Linear and layer.bias is None and w is not None and not hasattr(w, "ds_id")
            and tuple(w.shape) == (layer.out_features, layer.in_features))


def _lean_forward(self, x, *args, **kwargs):
    if (torch.is_grad_enabled() and not args and not kwargs
            and all(_full_linear(m) for m in (self.gate_proj, self.up_proj, self.down_proj))):
        return _GatedMLP.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.act_fn)
    return self.plain_forward(x, *args, **kwargs)


@functools.cache
def _lean_class(cls: type) -> type:
    return type(cls.__name__, (cls,), {"forward": _lean_forward, "plain_forward": cls.forward,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    return (not hasattr(module, "plain_forward") and callable(getattr(module, "act_fn", None))
            and all(_full_linear(getattr(module, n, None)) for n in ("gate_proj", "up_proj", "down_proj")))


def _computes_the_same(module: torch.nn.Module) -> bool:
    """Whether the module's own forward and the lean one agree on a small random input, value and gradient."""
    w = module.gate_proj.weight
    generator = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(2, 3, module.gate_proj.in_features, dtype=w.dtype, device=w.device, generator=generator)
    outs = []
    for forward in (type(module).plain_forward, _lean_forward):
        xi = x.clone().requires_grad_()
        with torch.enable_grad():
            y = forward(module, xi)
            (gx,) = torch.autograd.grad(y.float().square().sum(), xi)
        outs.append((y.detach(), gx))
    tol = dict(rtol=1e-4, atol=1e-5) if w.dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    return all(torch.allclose(a, b, **tol) for a, b in zip(outs[0], outs[1], strict=True))


def lean_gated_mlps(model: torch.nn.Module) -> int:
    """Gives every gated MLP of `model` the two-activation backward (in place); returns how many modules took it."""
    checked: dict[type, bool] = {}
    count = 0
    for module in model.modules():
        if not _is_gated_mlp(module):
            continue
        cls = type(module)
        module.__class__ = _lean_class(cls)
        if cls not in checked:
            checked[cls] = _computes_the_same(module)
        if checked[cls]:
            count += 1
        else:
            module.__class__ = cls
    return count
