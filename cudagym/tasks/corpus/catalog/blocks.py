"""Transformer-style blocks in the seed catalog (`cudagym.tasks.corpus.catalog`): the source of each
block's helper class (`BLOCK_SOURCES`, written into a task that uses it) and the ops that use them.
"""

from __future__ import annotations

from collections.abc import Callable

from cudagym.tasks.corpus.catalog.spec import Catalog, OpSpec, Reject, choice, need_fixed

from cudagym.tasks.corpus.emit import EmitContext, State


# -- transformer-style blocks ---------------------------------------------------------------
BLOCK_SOURCES: dict[str, str] = {
    "RMSNorm": '''
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
''',
    "RotaryEmbedding": '''
class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, x):
        t = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
        freqs = torch.outer(t, self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
''',
    "SwiGLU": '''
class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
''',
    "GeGLU": '''
class GeGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=-1)
        return self.out(a * F.gelu(b))
''',
    "FeedForward": '''
class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
''',
    "MultiHeadSelfAttention": '''
class MultiHeadSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))
''',
    "CausalSelfAttention": '''
class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        y = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))
''',
    "GroupedQueryAttention": '''
class GroupedQueryAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, d))
''',
    "PreNormResidualMLP": '''
class PreNormResidualMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))
''',
    "ConvNeXtBlock": '''
class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.pw2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pw2(F.gelu(self.pw1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)
''',
}


def add_blocks(cat: Catalog) -> None:
    """Every block of `BLOCK_SOURCES`, as an op."""
    def block(name: str, args: Callable[[EmitContext, State], str], ranks: tuple[int, ...] = (3,),
              starts: tuple[str, ...] = ("seq",), axis: int = -1) -> None:
        def sample(ctx: EmitContext, state: State) -> bool:
            need_fixed(state, axis)
            a = ctx.attr(name.lower() if len(name) < 12 else "block")
            ctx.init(f"self.{a} = {name}({args(ctx, state)})")
            ctx.fwd(f"x = self.{a}(x)")
            ctx.helper(name)
            return True

        cat.add(OpSpec(f"block.{name}", "block", ranks, sample, starts=starts, block=name, weight=1.5))

    def dim(ctx: EmitContext, state: State) -> str:
        return ctx.dim(state, -1, "dim")

    def dim_hidden(ctx: EmitContext, state: State) -> str:
        d = ctx.dim(state, -1, "dim")
        return f"{d}, {ctx.size('hidden', choice(ctx, [2 * state.dims[-1].full, 4 * state.dims[-1].full, 1024]))}"

    def heads(ctx: EmitContext, state: State, kv: bool = False) -> str:
        d_full = state.dims[-1].full
        options = [h for h in (4, 8, 16) if d_full % h == 0 and d_full // h >= 16]
        if not options:
            raise Reject("no head count divides dim")
        h = choice(ctx, options)
        out = f"{ctx.dim(state, -1, 'dim')}, {ctx.size('heads', h)}"
        if kv:
            out += f", {ctx.size('kv_heads', choice(ctx, [g for g in (1, 2, 4) if h % g == 0 and g < h]))}"
        return out

    def even_dim(ctx: EmitContext, state: State) -> str:
        if state.dims[-1].full % 2:
            raise Reject("odd dim")
        return dim(ctx, state)

    block("RMSNorm", dim, ranks=(2, 3), starts=("seq", "features"))
    block("RotaryEmbedding", even_dim)
    block("SwiGLU", dim_hidden, ranks=(2, 3), starts=("seq", "features"))
    block("GeGLU", dim_hidden, ranks=(2, 3), starts=("seq", "features"))
    block("FeedForward", dim_hidden, ranks=(2, 3), starts=("seq", "features"))
    block("MultiHeadSelfAttention", heads)
    block("CausalSelfAttention", heads)
    block("GroupedQueryAttention", lambda c, s: heads(c, s, kv=True))
    block("PreNormResidualMLP", dim_hidden, ranks=(2, 3), starts=("seq", "features"))
    block("ConvNeXtBlock", lambda c, s: c.dim(s, 1, "dim"), ranks=(4,), starts=("image2d",), axis=1)
