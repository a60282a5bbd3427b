"""The two-activation gated MLP: the same values and gradients as the model's own forward, bit for bit, in every
family that has one; fewer saved activations; and the model's own forward wherever the lean one does not apply."""

import copy

import pytest
import torch
import transformers

from posttrain.models.gated_mlp import lean_gated_mlps
from posttrain.models.scoring import token_logprobs

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
            "gemma": "GemmaConfig"}  # Gemma's activation is GELU (tanh), the others' SiLU


def tiny(family: str, dtype=torch.float32):
    torch.manual_seed(0)
    config = getattr(transformers, FAMILIES[family])(**SHAPE)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def logp_and_grads(model, ids, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logp = token_logprobs(model, ids, torch.ones_like(ids), 5)  # [B, R]
    (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_values_and_gradients_are_the_models_own_bit_for_bit(family, precision):
    plain = tiny(family, torch.bfloat16 if precision == "bf16" else torch.float32)
    lean = copy.deepcopy(plain)
    assert lean_gated_mlps(lean) == SHAPE["num_hidden_layers"]  # every layer's MLP took the lean forward
    ids = torch.randint(3, SHAPE["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(1))
    want_logp, want = logp_and_grads(plain, ids, autocast=precision == "bf16-mixed")
    got_logp, got = logp_and_grads(lean, ids, autocast=precision == "bf16-mixed")
    assert torch.equal(got_logp, want_logp)
    assert want.keys() == got.keys() and any(g.abs().sum() > 0 for g in want.values())
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


def saved_bytes(model, ids) -> int:
    """Bytes of the distinct activations autograd keeps for backward (the parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, ids, torch.ones_like(ids), 5)
    return sum(seen.values())


def test_keeps_two_of_four_intermediate_activations():
    plain = tiny("llama")
    lean = copy.deepcopy(plain)
    lean_gated_mlps(lean)
    ids = torch.randint(3, SHAPE["vocab_size"], (8, 40))
    tokens, layers, inter = ids.numel(), SHAPE["num_hidden_layers"], SHAPE["intermediate_size"]
    # act(gate) and act(gate)·up are no longer kept: 2 × [tokens, I] float32 per layer
    assert saved_bytes(plain, ids) - saved_bytes(lean, ids) == 2 * tokens * inter * 4 * layers


def test_own_forward_without_gradients_or_with_replaced_or_zero3_layers():
    model = tiny("llama")
    lean_gated_mlps(model)
    mlp = model.model.layers[0].mlp
    calls = []
    original = type(mlp).plain_forward

    def counted(self, x):
        calls.append(1)
        return original(self, x)

    type(mlp).plain_forward = counted
    try:
        x = torch.randn(2, 3, SHAPE["hidden_size"])
        with torch.no_grad():
            mlp(x)
        assert len(calls) == 1  # no gradients: nothing to save, the model's own forward

        class Adapted(torch.nn.Linear):  # what LoRA puts in place of a projection
            pass

        adapted = Adapted(SHAPE["hidden_size"], SHAPE["intermediate_size"], bias=False)
        adapted.weight = mlp.up_proj.weight
        mlp.up_proj = adapted
        mlp(x).sum().backward()
        assert len(calls) == 2

        mlp.up_proj = torch.nn.Linear(SHAPE["hidden_size"], SHAPE["intermediate_size"], bias=False)
        mlp(x).sum().backward()
        assert len(calls) == 2  # plain full layers again: the lean forward
        mlp.down_proj.weight.ds_id = 7  # a ZeRO-3 weight, whole here only if prefetched, and never in backward
        mlp(x).sum().backward()
        assert len(calls) == 3
    finally:
        type(mlp).plain_forward = original


def test_a_module_that_computes_something_else_is_left_alone():
    class Swapped(torch.nn.Module):  # gate and up attributes, but act(up) · gate
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(8, 16, bias=False)
            self.down_proj, self.act_fn = torch.nn.Linear(16, 8, bias=False), torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    model = torch.nn.Sequential(Swapped())
    assert lean_gated_mlps(model) == 0
    assert type(model[0]) is Swapped
