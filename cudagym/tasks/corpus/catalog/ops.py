"""torch's operators in the seed catalog (`cudagym.tasks.corpus.catalog`), by family: convolutions,
linear algebra, pooling, normalization, activations, reductions, elementwise math, indexing and
losses. `add_operators` adds them all.
"""

from __future__ import annotations

from collections.abc import Callable

from cudagym.tasks.corpus.catalog.spec import (ANY_RANK, IMAGE_LAYOUTS, Catalog, OpSpec, Reject, choice, fn_op,
                                             module_op, need_fixed, reduce_dim)

from cudagym.tasks.corpus.emit import EmitContext, State


# -- convolutions ---------------------------------------------------------------------------
def _add_convs(cat: Catalog) -> None:
    for nd in (1, 2, 3):
        for transposed in (False, True):
            cls = f"ConvTranspose{nd}d" if transposed else f"Conv{nd}d"

            def ctor(ctx: EmitContext, state: State, nd: int = nd, transposed: bool = transposed,
                     cls: str = cls) -> str:
                need_fixed(state, 1)
                cin = ctx.dim(state, 1, "in_channels")
                outs = [8, 16, 32, 64] if nd == 3 else [16, 32, 64, 128]
                cout = ctx.size("out_channels", choice(ctx, outs))
                k = ctx.size("kernel_size", choice(ctx, [3, 3, 5, 1] if not transposed else [2, 3, 4]))
                extra = ""
                stride = choice(ctx, [1, 1, 2])
                if stride != 1:
                    extra += f", stride={ctx.size('stride', stride)}"
                pad = choice(ctx, [0, 0, 1])
                if pad:
                    extra += f", padding={ctx.size('padding', pad)}"
                if not transposed and choice(ctx, [False, False, False, True]):
                    extra += ", bias=False"
                return f"nn.{cls}({cin}, {cout}, {k}{extra})"

            module_op(cat, f"nn.{cls}", "conv", ctor, "conv_t" if transposed else "conv",
                      ranks=(nd + 2,), starts=(IMAGE_LAYOUTS[nd],), weight=1.5)

    def depthwise(ctx: EmitContext, state: State) -> str:
        need_fixed(state, 1)
        c = ctx.dim(state, 1, "channels")
        k = ctx.size("kernel_size", choice(ctx, [3, 5, 7]))
        return f"nn.Conv2d({c}, {c}, {k}, padding={k} // 2, groups={c})"

    module_op(cat, "nn.Conv2d(depthwise)", "conv", depthwise, "depthwise", ranks=(4,), starts=("image2d",))


# -- linear algebra -------------------------------------------------------------------------
def _add_linear(cat: Catalog) -> None:
    def linear(ctx: EmitContext, state: State) -> str:
        need_fixed(state, -1)
        fin = ctx.dim(state, -1, "in_features")
        fout = ctx.size("out_features", choice(ctx, [256, 512, 1024, 2048, 4096]))
        bias = "" if choice(ctx, [True, True, False]) else ", bias=False"
        return f"nn.Linear({fin}, {fout}{bias})"

    module_op(cat, "nn.Linear", "linear", linear, "linear", ranks=(2, 3), starts=("features", "seq"), weight=3.0)

    def matmul_param(ctx: EmitContext, state: State) -> bool:
        need_fixed(state, -1)
        k = ctx.dim(state, -1, "in_features")
        n = ctx.size("out_features", choice(ctx, [256, 512, 1024, 2048]))
        a = ctx.attr("weight")
        ctx.init(f"self.{a} = nn.Parameter(torch.randn({k}, {n}) / {k} ** 0.5)")
        ctx.fwd(f"x = torch.matmul(x, self.{a})")
        return True

    cat.add(OpSpec("torch.matmul", "linear", (2, 3), matmul_param, starts=("features", "seq")))

    def addmm(ctx: EmitContext, state: State) -> bool:
        need_fixed(state, -1)
        k = ctx.dim(state, -1, "in_features")
        n = ctx.size("out_features", choice(ctx, [256, 512, 1024, 2048]))
        w, b = ctx.attr("weight"), ctx.attr("bias")
        ctx.init(f"self.{w} = nn.Parameter(torch.randn({k}, {n}) / {k} ** 0.5)")
        ctx.init(f"self.{b} = nn.Parameter(torch.randn({n}))")
        ctx.fwd(f"x = torch.addmm(self.{b}, x, self.{w})")
        return True

    cat.add(OpSpec("torch.addmm", "linear", (2,), addmm, starts=("features",)))

    def bmm(ctx: EmitContext, state: State) -> bool:
        need_fixed(state, -1)
        n = ctx.size("n", choice(ctx, [64, 128, 256, 512]))
        y = ctx.input("y", [state.dims[0], state.dims[2], n])
        ctx.fwd(f"x = torch.bmm(x, {y})")
        return True

    cat.add(OpSpec("torch.bmm", "linear", (3,), bmm, starts=("seq",), weight=1.5))

    def baddbmm(ctx: EmitContext, state: State) -> bool:
        need_fixed(state, -1)
        n = ctx.size("n", choice(ctx, [64, 128, 256]))
        y = ctx.input("y", [state.dims[0], state.dims[2], n])
        ctx.fwd(f"x = torch.baddbmm(torch.ones_like(x[..., :1]), x, {y}, beta=0.5, alpha=2.0)")
        return True

    cat.add(OpSpec("torch.baddbmm", "linear", (3,), baddbmm, starts=("seq",), weight=0.5))

    def einsum(ctx: EmitContext, state: State) -> bool:
        need_fixed(state, -1)
        d = ctx.dim(state, -1, "in_features")
        e = ctx.size("out_features", choice(ctx, [128, 256, 512, 1024]))
        a = ctx.attr("weight")
        ctx.init(f"self.{a} = nn.Parameter(torch.randn({d}, {e}) / {d} ** 0.5)")
        ctx.fwd(f'x = torch.einsum("bld,de->ble", x, self.{a})')
        return True

    cat.add(OpSpec("torch.einsum", "linear", (3,), einsum, starts=("seq",), weight=0.7))

    def self_gram(ctx: EmitContext, state: State) -> bool:
        ctx.fwd("x = torch.matmul(x, x.transpose(-2, -1))")
        return True

    cat.add(OpSpec("torch.matmul(gram)", "linear", (3,), self_gram, starts=("seq",), weight=0.5))


# -- pooling --------------------------------------------------------------------------------
def _add_pooling(cat: Catalog) -> None:
    for nd in (1, 2, 3):
        for kind in ("Max", "Avg"):
            def ctor(ctx: EmitContext, state: State, nd: int = nd, kind: str = kind) -> str:
                k = ctx.size("pool_kernel", choice(ctx, [2, 2, 3, 4]))
                stride = choice(ctx, [None, None, 1, 2])
                extra = "" if stride is None else f", stride={ctx.size('pool_stride', stride)}"
                return f"nn.{kind}Pool{nd}d({k}{extra})"

            module_op(cat, f"nn.{kind}Pool{nd}d", "pool", ctor, "pool", ranks=(nd + 2,),
                      starts=(IMAGE_LAYOUTS[nd],))

        def actor(ctx: EmitContext, state: State, nd: int = nd) -> str:
            out = ctx.size("pool_output", choice(ctx, [1, 2, 4, 8]))
            return f"nn.AdaptiveAvgPool{nd}d({out})"

        module_op(cat, f"nn.AdaptiveAvgPool{nd}d", "pool", actor, "pool", ranks=(nd + 2,),
                  starts=(IMAGE_LAYOUTS[nd],))

    def amax(ctx: EmitContext, state: State) -> str:
        return f"nn.AdaptiveMaxPool2d({ctx.size('pool_output', choice(ctx, [1, 2, 4]))})"

    module_op(cat, "nn.AdaptiveMaxPool2d", "pool", amax, "pool", ranks=(4,), starts=("image2d",))

    def lp(ctx: EmitContext, state: State) -> str:
        return f"nn.LPPool2d(2, {ctx.size('pool_kernel', choice(ctx, [2, 3]))})"

    module_op(cat, "nn.LPPool2d", "pool", lp, "pool", ranks=(4,), starts=("image2d",), weight=0.5)

    def gap(ctx: EmitContext, state: State) -> str:
        dims = tuple(range(2, state.rank))
        return f"torch.mean(x, dim={dims})"

    fn_op(cat, "torch.mean(global_pool)", "pool", gap, ranks=(3, 4, 5), starts=("image2d", "image3d", "image1d"))


# -- normalization --------------------------------------------------------------------------
def _add_norms(cat: Catalog) -> None:
    for nd, ranks in ((1, (2, 3)), (2, (4,)), (3, (5,))):
        def bn(ctx: EmitContext, state: State) -> str:
            need_fixed(state, 1)
            return f"nn.BatchNorm{state.rank - 2 if state.rank > 2 else 1}d({ctx.dim(state, 1, 'num_features')})"

        layouts = {1: ("features", "image1d"), 2: ("image2d",), 3: ("image3d",)}[nd]
        module_op(cat, f"nn.BatchNorm{nd}d", "norm", bn, "bn", ranks=ranks, starts=layouts)
        if nd > 0:
            def inorm(ctx: EmitContext, state: State) -> str:
                need_fixed(state, 1)
                affine = ", affine=True" if choice(ctx, [True, False]) else ""
                return f"nn.InstanceNorm{state.rank - 2}d({ctx.dim(state, 1, 'num_features')}{affine})"

            module_op(cat, f"nn.InstanceNorm{nd}d", "norm", inorm, "inorm", ranks=(nd + 2,),
                      starts=(IMAGE_LAYOUTS[nd],))

    def ln(ctx: EmitContext, state: State) -> str:
        need_fixed(state, -1)
        return f"nn.LayerNorm({ctx.dim(state, -1, 'normalized_shape')})"

    module_op(cat, "nn.LayerNorm", "norm", ln, "ln", ranks=(2, 3, 4), weight=2.0)

    def gn(ctx: EmitContext, state: State) -> str:
        need_fixed(state, 1)
        c = state.dims[1].full
        groups = [g for g in (2, 4, 8, 16) if c % g == 0 and g < c]
        if not groups:
            raise Reject("no group count divides the channels")
        g = ctx.size("num_groups", choice(ctx, groups))
        return f"nn.GroupNorm({g}, {ctx.dim(state, 1, 'num_channels')})"

    module_op(cat, "nn.GroupNorm", "norm", gn, "gn", ranks=(3, 4, 5), starts=("image2d", "image3d", "image1d"))

    def lrn(ctx: EmitContext, state: State) -> str:
        return f"nn.LocalResponseNorm({ctx.size('lrn_size', choice(ctx, [3, 5]))})"

    module_op(cat, "nn.LocalResponseNorm", "norm", lrn, "lrn", ranks=(3, 4), starts=("image2d",), weight=0.5)
    fn_op(cat, "F.normalize", "norm", lambda c, s: f"F.normalize(x, p=2.0, dim={reduce_dim(c, s)})")


# -- activations ----------------------------------------------------------------------------
_ACT_MODULES: dict[str, Callable[[EmitContext], str]] = {
    "ReLU": lambda c: "nn.ReLU()",
    "LeakyReLU": lambda c: f"nn.LeakyReLU(negative_slope={choice(c, [0.01, 0.1, 0.2])})",
    "ELU": lambda c: f"nn.ELU(alpha={choice(c, [1.0, 0.5])})",
    "SELU": lambda c: "nn.SELU()",
    "CELU": lambda c: f"nn.CELU(alpha={choice(c, [1.0, 2.0])})",
    "GELU": lambda c: f"nn.GELU(approximate={choice(c, ['none', 'tanh'])!r})",
    "SiLU": lambda c: "nn.SiLU()",
    "Mish": lambda c: "nn.Mish()",
    "Softplus": lambda c: f"nn.Softplus(beta={choice(c, [1.0, 2.0])})",
    "Softsign": lambda c: "nn.Softsign()",
    "Tanh": lambda c: "nn.Tanh()",
    "Sigmoid": lambda c: "nn.Sigmoid()",
    "Hardtanh": lambda c: f"nn.Hardtanh(min_val={choice(c, [-1.0, -0.5])}, max_val={choice(c, [1.0, 0.5])})",
    "Hardswish": lambda c: "nn.Hardswish()",
    "Hardsigmoid": lambda c: "nn.Hardsigmoid()",
    "ReLU6": lambda c: "nn.ReLU6()",
    "LogSigmoid": lambda c: "nn.LogSigmoid()",
    "Tanhshrink": lambda c: "nn.Tanhshrink()",
    "Softshrink": lambda c: f"nn.Softshrink(lambd={choice(c, [0.5, 0.25])})",
    "Hardshrink": lambda c: f"nn.Hardshrink(lambd={choice(c, [0.5, 0.25])})",
    "Threshold": lambda c: f"nn.Threshold({choice(c, [0.1, 0.5])}, {choice(c, [0.0, -1.0])})",
}


def _of_context(ctor: Callable[[EmitContext], str]) -> Callable[[EmitContext, State], str]:
    """`ctor` as a module op's constructor (which is also given the state, unused here)."""
    return lambda c, s: ctor(c)


def _add_activations(cat: Catalog) -> None:
    for name, ctor in _ACT_MODULES.items():
        module_op(cat, f"nn.{name}", "activation", _of_context(ctor), name.lower(), weight=1.2)

    def prelu(ctx: EmitContext, state: State) -> str:
        if choice(ctx, [True, False]) and state.fixed(1):
            return f"nn.PReLU({ctx.dim(state, 1, 'num_parameters')})"
        return "nn.PReLU()"

    module_op(cat, "nn.PReLU", "activation", prelu, "prelu")

    def glu(ctx: EmitContext, state: State) -> str:
        if state.dims[-1].full % 2 or state.dims[-1].small % 2:
            raise Reject("GLU needs an even last dim")
        return "F.glu(x, dim=-1)"

    fn_op(cat, "F.glu", "activation", glu)


# -- softmax-likes and reductions -----------------------------------------------------------
def _add_reductions(cat: Catalog) -> None:
    module_op(cat, "nn.Softmax", "softmax", lambda c, s: f"nn.Softmax(dim={reduce_dim(c, s)})", "softmax", weight=1.5)
    module_op(cat, "nn.LogSoftmax", "softmax", lambda c, s: f"nn.LogSoftmax(dim={reduce_dim(c, s)})", "log_softmax")
    module_op(cat, "nn.Softmin", "softmax", lambda c, s: f"nn.Softmin(dim={reduce_dim(c, s)})", "softmin", weight=0.5)
    fn_op(cat, "torch.logsumexp", "softmax", lambda c, s: f"torch.logsumexp(x, dim={reduce_dim(c, s)})")

    def red(fn: str, extra: str = "") -> Callable[[EmitContext, State], str]:
        def expr(ctx: EmitContext, state: State) -> str:
            keep = ", keepdim=True" if choice(ctx, [True, False]) else ""
            return f"torch.{fn}(x, dim={reduce_dim(ctx, state)}{extra}{keep})"
        return expr

    for fn in ("sum", "mean", "amax", "amin"):
        fn_op(cat, f"torch.{fn}", "reduction", red(fn))
    fn_op(cat, "torch.var", "reduction", red("var", ", unbiased=False"), weight=0.7)
    fn_op(cat, "torch.std", "reduction", red("std"), weight=0.7)
    fn_op(cat, "torch.linalg.vector_norm", "reduction",
          lambda c, s: f"torch.linalg.vector_norm(x, ord=2, dim={reduce_dim(c, s)})")
    fn_op(cat, "torch.max(dim)", "reduction", lambda c, s: f"torch.max(x, dim={reduce_dim(c, s)}).values")
    fn_op(cat, "torch.argmax", "reduction", lambda c, s: f"torch.argmax(x, dim={reduce_dim(c, s)}).float()", weight=0.4)
    fn_op(cat, "torch.cumsum", "scan", lambda c, s: f"torch.cumsum(x, dim={reduce_dim(c, s)})")
    fn_op(cat, "torch.logcumsumexp", "scan", lambda c, s: f"torch.logcumsumexp(x, dim={reduce_dim(c, s)})", weight=0.5)
    fn_op(cat, "torch.cummax", "scan", lambda c, s: f"torch.cummax(x, dim={reduce_dim(c, s)}).values", weight=0.5)
    fn_op(cat, "torch.sort", "scan", lambda c, s: "torch.sort(x, dim=-1).values", weight=0.4)
    fn_op(cat, "torch.topk", "scan",
          lambda c, s: f"torch.topk(x, k=min({choice(c, [4, 8])}, x.shape[-1]), dim=-1).values", weight=0.4)


# -- elementwise math -----------------------------------------------------------------------
_UNARY: dict[str, str] = {
    "torch.abs": "torch.abs(x)",
    "torch.exp": "torch.exp(-torch.abs(x))",
    "torch.log": "torch.log(torch.abs(x) + 1.0)",
    "torch.log1p": "torch.log1p(torch.abs(x))",
    "torch.sqrt": "torch.sqrt(torch.abs(x) + 1e-6)",
    "torch.rsqrt": "torch.rsqrt(torch.abs(x) + 1.0)",
    "torch.square": "torch.square(x)",
    "torch.sin": "torch.sin(x)",
    "torch.cos": "torch.cos(x)",
    "torch.erf": "torch.erf(x)",
    "torch.reciprocal": "torch.reciprocal(torch.abs(x) + 1.0)",
    "torch.tanh": "torch.tanh(x)",
    "torch.sigmoid": "torch.sigmoid(x)",
    "torch.atan": "torch.atan(x)",
    "torch.sign": "torch.sign(x) * torch.sqrt(torch.abs(x) + 1e-6)",
}


def _add_elementwise(cat: Catalog) -> None:
    for name, expr in _UNARY.items():
        fn_op(cat, name, "elementwise", expr, weight=0.6)
    fn_op(cat, "torch.clamp", "elementwise",
          lambda c, s: f"torch.clamp(x, min={choice(c, [-1.0, -0.5, 0.0])}, max={choice(c, [0.5, 1.0, 2.0])})")
    fn_op(cat, "torch.mul(scalar)", "elementwise", lambda c, s: f"x * {choice(c, [0.5, 2.0, 1.5, -1.0])}")
    fn_op(cat, "torch.add(scalar)", "elementwise", lambda c, s: f"x + {choice(c, [0.5, 1.0, -0.25])}")
    fn_op(cat, "torch.div(scalar)", "elementwise", lambda c, s: f"x / {choice(c, [2.0, 3.0, 0.5])}")
    fn_op(cat, "torch.pow", "elementwise", lambda c, s: f"torch.pow(torch.abs(x), {choice(c, [1.5, 0.5, 3.0])})")
    fn_op(cat, "torch.where", "elementwise", lambda c, s: f"torch.where(x > 0, x, x * {choice(c, [0.1, 0.5])})")
    fn_op(cat, "torch.lerp", "elementwise", lambda c, s: f"torch.lerp(x, torch.tanh(x), {choice(c, [0.25, 0.5])})",
          weight=0.5)

    def channel_param(kind: str) -> Callable[[EmitContext, State], bool]:
        def sample(ctx: EmitContext, state: State) -> bool:
            axis = 1 if state.rank > 2 else -1
            need_fixed(state, axis)
            c = ctx.dim(state, axis, "channels" if axis == 1 else "features")
            shape = ", ".join([c] + ["1"] * (state.rank - 2)) if axis == 1 else c
            a = ctx.attr(kind)
            init = "torch.randn" if kind == "bias" else "torch.rand"
            ctx.init(f"self.{a} = nn.Parameter({init}({shape}){' + 0.5' if kind == 'scale' else ''})")
            ctx.fwd(f"x = x {'+' if kind == 'bias' else '*'} self.{a}")
            return True
        return sample

    cat.add(OpSpec("torch.add(bias)", "elementwise", ANY_RANK, channel_param("bias"), weight=1.5))
    cat.add(OpSpec("torch.mul(scale)", "elementwise", ANY_RANK, channel_param("scale"), weight=1.5))

    def residual(ctx: EmitContext, state: State) -> bool:
        y = ctx.input("residual", list(state.dims))
        ctx.fwd(f"x = x + {y}")
        return True

    cat.add(OpSpec("torch.add(residual)", "elementwise", ANY_RANK, residual, weight=0.8))

    def gate(ctx: EmitContext, state: State) -> bool:
        y = ctx.input("gate", list(state.dims))
        ctx.fwd(f"x = x * torch.sigmoid({y})")
        return True

    cat.add(OpSpec("torch.mul(gate)", "elementwise", ANY_RANK, gate, weight=0.5))


# -- indexing / reshaping that carries work -------------------------------------------------
def _add_indexing(cat: Catalog) -> None:
    fn_op(cat, "torch.flip", "indexing", lambda c, s: f"torch.flip(x, dims=[{reduce_dim(c, s)}])", weight=0.6)
    fn_op(cat, "torch.roll", "indexing",
          lambda c, s: f"torch.roll(x, shifts={choice(c, [1, 3, -2])}, dims={reduce_dim(c, s)})", weight=0.6)
    fn_op(cat, "torch.transpose", "indexing", "x.transpose(1, -1).contiguous()", ranks=(3, 4), weight=0.6)
    fn_op(cat, "torch.triu", "indexing", lambda c, s: f"torch.triu(x, diagonal={choice(c, [0, 1])})", weight=0.5)
    fn_op(cat, "torch.tril", "indexing", lambda c, s: f"torch.tril(x, diagonal={choice(c, [0, -1])})", weight=0.5)
    fn_op(cat, "torch.masked_fill", "indexing",
          lambda c, s: f"x.masked_fill(x < {choice(c, [-1.0, 0.0])}, {choice(c, [0.0, -1.0])})", weight=0.6)
    fn_op(cat, "torch.cat", "indexing",
          lambda c, s: f"torch.cat([x, {choice(c, ['torch.relu(x)', 'x * x', 'torch.tanh(x)'])}], "
                       f"dim={reduce_dim(c, s)})",
          weight=0.6)

    def pixel_shuffle(ctx: EmitContext, state: State) -> str:
        need_fixed(state, 1)
        if state.dims[1].full % 4:
            raise Reject("channels not divisible by 4")
        return f"nn.PixelShuffle({ctx.size('upscale_factor', 2)})"

    module_op(cat, "nn.PixelShuffle", "indexing", pixel_shuffle, "shuffle", ranks=(4,), starts=("image2d",), weight=0.5)

    def pixel_unshuffle(ctx: EmitContext, state: State) -> str:
        if state.dims[2].full % 2 or state.dims[2].small % 2 or state.dims[3].full % 2 or state.dims[3].small % 2:
            raise Reject("odd spatial size")
        return f"nn.PixelUnshuffle({ctx.size('downscale_factor', 2)})"

    module_op(cat, "nn.PixelUnshuffle", "indexing", pixel_unshuffle, "unshuffle", ranks=(4,), starts=("image2d",),
              weight=0.5)

    def upsample(mode: str) -> Callable[[EmitContext, State], str]:
        def expr(ctx: EmitContext, state: State) -> str:
            if mode == "bilinear" and state.rank != 4:
                raise Reject("bilinear needs 4-D input")
            align = ", align_corners=False" if mode != "nearest" else ""
            return f"F.interpolate(x, scale_factor=2, mode={mode!r}{align})"
        return expr

    fn_op(cat, "F.interpolate(nearest)", "indexing", upsample("nearest"), ranks=(3, 4, 5), starts=("image2d",),
          weight=0.6)
    fn_op(cat, "F.interpolate(bilinear)", "indexing", upsample("bilinear"), ranks=(4,), starts=("image2d",), weight=0.6)

    def index_select(ctx: EmitContext, state: State) -> bool:
        need_fixed(state, -1)
        n = ctx.dim(state, -1, "features")
        a = ctx.attr("index")
        ctx.init(f"self.register_buffer({a!r}, torch.arange({n} - 1, -1, -2))")
        ctx.fwd(f"x = torch.index_select(x, -1, self.{a})")
        return True

    cat.add(OpSpec("torch.index_select", "indexing", ANY_RANK, index_select, weight=0.5))

    def gather(ctx: EmitContext, state: State) -> bool:
        need_fixed(state, -1)
        k = ctx.size("num_gathered", choice(ctx, [8, 16, 32]))
        idx = ctx.input("index", [state.dims[0], k], kind="randint", high=state.dims[-1])
        if state.rank != 2:
            raise Reject("gather op takes 2-D input")
        ctx.fwd(f"x = torch.gather(x, 1, {idx})")
        return True

    cat.add(OpSpec("torch.gather", "indexing", (2,), gather, starts=("features",), weight=0.5))

    def embedding(ctx: EmitContext, state: State) -> bool:
        raise Reject("embedding only starts a chain")

    cat.add(OpSpec("nn.Embedding", "indexing", (2,), embedding, starts=("tokens",), weight=0.8))


# -- losses (terminal) ----------------------------------------------------------------------
def _add_losses(cat: Catalog) -> None:
    def loss(name: str, ctor: str, target: str = "randn") -> None:
        def sample(ctx: EmitContext, state: State) -> bool:
            t = ctx.input("target", list(state.dims), kind=target)
            a = ctx.attr("loss")
            ctx.init(f"self.{a} = {ctor}")
            ctx.fwd(f"x = self.{a}(x, {t})")
            return True

        cat.add(OpSpec(name, "loss", ANY_RANK, sample, terminal=True, weight=0.6))

    loss("nn.MSELoss", "nn.MSELoss()")
    loss("nn.L1Loss", "nn.L1Loss()")
    loss("nn.SmoothL1Loss", "nn.SmoothL1Loss(beta=1.0)")
    loss("nn.HuberLoss", "nn.HuberLoss(delta=0.5)")
    loss("nn.BCEWithLogitsLoss", "nn.BCEWithLogitsLoss()", target="rand")
    loss("nn.SoftMarginLoss", "nn.SoftMarginLoss()", target="sign")

    def cross_entropy(ctx: EmitContext, state: State) -> bool:
        need_fixed(state, 1)
        t = ctx.input("target", [state.dims[0]] + list(state.dims[2:]), kind="randint", high=state.dims[1])
        ctx.fwd(f"x = F.cross_entropy(x, {t})")
        return True

    cat.add(OpSpec("F.cross_entropy", "loss", (2, 3, 4), cross_entropy, terminal=True, weight=0.6))

    def kl_div(ctx: EmitContext, state: State) -> bool:
        t = ctx.input("target", list(state.dims))
        ctx.fwd(f"x = F.kl_div(F.log_softmax(x, dim=-1), F.softmax({t}, dim=-1), reduction='batchmean')")
        return True

    cat.add(OpSpec("F.kl_div", "loss", (2, 3), kl_div, terminal=True, weight=0.4))

    def cosine(ctx: EmitContext, state: State) -> bool:
        t = ctx.input("other", list(state.dims))
        ctx.fwd(f"x = F.cosine_similarity(x, {t}, dim=-1)")
        return True

    cat.add(OpSpec("F.cosine_similarity", "loss", (2, 3), cosine, weight=0.5))

    def triplet(ctx: EmitContext, state: State) -> bool:
        p = ctx.input("positive", list(state.dims))
        n = ctx.input("negative", list(state.dims))
        ctx.fwd(f"x = F.triplet_margin_loss(x, {p}, {n}, margin=1.0)")
        return True

    cat.add(OpSpec("F.triplet_margin_loss", "loss", (2,), triplet, terminal=True, starts=("features",), weight=0.4))


def add_operators(cat: Catalog) -> None:
    """Every operator family, in the catalog's order."""
    for add in (_add_convs, _add_linear, _add_pooling, _add_norms, _add_activations, _add_reductions,
                _add_elementwise, _add_indexing, _add_losses):
        add(cat)
