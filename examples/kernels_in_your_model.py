"""bloomnative's Triton kernels in a model of your own: a small ALiBi language model (not BLOOM)
whose LayerNorms, bias-GeLU, attention and loss are the fused ops, compiled with
`torch.compile`, checked against the same model written with plain torch ops and run eagerly.

    python examples/kernels_in_your_model.py                      # on a GPU: the Triton kernels
    TRITON_INTERPRET=1 python examples/kernels_in_your_model.py   # on CPU: Triton's interpreter

Elsewhere (CPU without the interpreter) each op runs its pure-torch reference.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from bloomnative.kernels import bias_gelu, flash_alibi_attention, layer_norm, linear_cross_entropy


class Block(nn.Module):
    """Pre-LN transformer block with ALiBi attention; `fused` picks the kernels or torch ops."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)  # ALiBi, heads a power of 2
        self.register_buffer("slopes", slopes)

    def forward(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        b, s, w = x.shape
        h = layer_norm(x, self.norm1.weight, self.norm1.bias) if fused else self.norm1(x)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if fused:
            a = flash_alibi_attention(q, k, v, self.slopes)  # causal, no [s, s] tensor
        else:  # score of query i and key j: q.k / sqrt(d) + slope * (j - i), keys j <= i
            pos = torch.arange(s, device=x.device)
            bias = self.slopes[:, None, None] * (pos[None, :] - pos[:, None])
            a = F.scaled_dot_product_attention(
                q, k, v, bias.masked_fill(pos > pos[:, None], -torch.inf)
            )
        x = x + self.out(a.transpose(1, 2).reshape(b, s, w))
        h = layer_norm(x, self.norm2.weight, self.norm2.bias) if fused else self.norm2(x)
        if fused:
            h = bias_gelu(F.linear(h, self.up.weight), self.up.bias)  # GeLU(x W + b) in one pass
        else:
            h = F.gelu(self.up(h), approximate="tanh")
        return x + self.down(h)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 2, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, fused: bool) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction, the head tied to the embedding."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, fused)
        if fused:  # head + cross-entropy in chunks: the [tokens, vocab] logits never exist whole
            x = layer_norm(x, self.norm.weight, self.norm.bias)
            return linear_cross_entropy(x.flatten(0, 1), self.embed.weight, targets.flatten())
        logits = self.norm(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_and_grads(model: nn.Module, forward, tokens: torch.Tensor):
    model.zero_grad()
    loss = forward(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyLM().to(device)
    tokens = torch.randint(0, 64, (2, 33), device=device)

    compiled = torch.compile(model, fullgraph=True)  # the kernels are custom ops: no graph break
    loss, grads = loss_and_grads(model, lambda x, y: compiled(x, y, fused=True), tokens)
    ref_loss, ref_grads = loss_and_grads(model, lambda x, y: model(x, y, fused=False), tokens)
    loss_diff = (abs(loss - ref_loss) / abs(ref_loss)).item()
    grad_diff = max(
        (g - r).abs().max() / r.abs().max() for g, r in zip(grads, ref_grads, strict=True)
    ).item()
    print(f"loss: compiled kernels {loss:.6f}, eager torch ops {ref_loss:.6f}")
    print(f"relative difference: loss {loss_diff:.2e}, gradients {grad_diff:.2e} (worst tensor)")
    if max(loss_diff, grad_diff) > 1e-4:
        raise SystemExit("the kernels differ from the eager reference by more than 1e-4")


if __name__ == "__main__":
    main()
