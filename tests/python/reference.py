"""Pure-torch reference of the daemon's optimizers, written from docs/algorithms.md for the tests
to compare against. Deliberately independent of the muond package: it takes fully spelled-out
options and keeps its own state, in fp32 throughout.

Not thread-safe; one instance per test.
"""

import math

import torch

SIMPLE = [(3.4445, -4.7750, 2.0315)]
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
POLAR_EXPRESS = [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                 (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                 (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)]
SETS = {"simple": (SIMPLE, "cycle"), "quintic": (QUINTIC, "cycle"),
        "polar_express": (POLAR_EXPRESS, "repeat_last")}

MUON_DEFAULTS = dict(lr=0.02, momentum=0.95, nesterov=True, momentum_style="ema", ns_steps=5,
                     coefficients=SIMPLE, after="cycle", ns_eps=1e-7, ns_norm_safety=1.0,
                     scale_mode="shape_scaling", extra_scale_factor=1.0, weight_decay=0.0,
                     weight_decay_mode="decoupled", moment2_method=None, beta2=0.95, eps=1e-8)
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, weight_decay_mode="decoupled")


# The option that sets the storage format of each state tensor of the reference.
_STATE_DTYPE_OPTION = {"muon": {"M": "momentum_dtype", "V": "exp_avg_sq_dtype"},
                       "adamw": {"m": "exp_avg_dtype", "v": "exp_avg_sq_dtype"}}
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _round(x, dtype):
    """Rounds the fp32 tensor x in place to the nearest value of dtype ("bf16", "fp16"; None or
    "fp32" leaves it)."""
    if dtype not in (None, "fp32"):
        x.copy_(x.to(_TORCH_DTYPE[dtype]))


def newton_schulz(u, steps, coefficients, after, eps, safety):
    x = u.clone().float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    x = x / (safety * x.norm() + eps)
    for t in range(steps):
        if t < len(coefficients):
            a, b, c = coefficients[t]
        elif after == "cycle":
            a, b, c = coefficients[t % len(coefficients)]
        else:
            a, b, c = coefficients[-1]
        A = x @ x.t()
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.t() if transposed else x


def scale(mode, k, m, n):
    if mode == "shape_scaling":
        return k * math.sqrt(max(1.0, m / n))
    if mode == "spectral":
        return k * math.sqrt(max(m, n))
    if mode == "unit_rms_norm":
        return k * math.sqrt(m / n)
    raise ValueError(mode)


class Reference:
    """Steps a list of groups; each group is {"kind": "muon"|"adamw", "params": [tensor], **opts}
    with every option given (see MUON_DEFAULTS / ADAMW_DEFAULTS). Parameters are updated in place
    (they should be fp32 tensors detached from any model)."""

    def __init__(self, groups):
        self.groups = groups
        self.state = {}

    @torch.no_grad()
    def step(self, grads):
        """grads: {id(param): gradient}; a parameter without one is left alone."""
        for group in self.groups:
            for p in group["params"]:
                g = grads.get(id(p))
                if g is None:
                    continue
                st = self.state.setdefault(id(p), {"t": 0})
                st["t"] += 1
                # Precision-aware state: values are stored rounded to the group's *_dtype; each
                # step computes on them in fp32 and rounds what it stores.
                _round(p, group.get("master_dtype"))
                if group["kind"] == "muon":
                    self._muon(p, g.float().clone(), st, group)
                else:
                    self._adamw(p, g.float().clone(), st, group)
                for key, option in _STATE_DTYPE_OPTION[group["kind"]].items():
                    if key in st:
                        _round(st[key], group.get(option))
                _round(p, group.get("master_dtype"))

    @staticmethod
    def _muon(W, G, st, o):
        lr, beta, wd = o["lr"], o["momentum"], o["weight_decay"]
        if o["weight_decay_mode"] == "l2":
            G = G + wd * W
        M = st.setdefault("M", torch.zeros_like(W))
        if o["momentum_style"] == "ema":
            M.copy_(beta * M + (1 - beta) * G)
            U = (1 - beta) * G + beta * M if o["nesterov"] else M
        else:
            M.copy_(beta * M + G)
            U = G + beta * M if o["nesterov"] else M
        m, n = W.shape
        O = newton_schulz(U, o["ns_steps"], o["coefficients"], o["after"], o["ns_eps"],
                          o["ns_norm_safety"])
        s = scale(o["scale_mode"], o["extra_scale_factor"], m, n)
        D = s * O  # the direction W moves along, times lr
        method = o.get("moment2_method")
        if method == "adamuon":  # Megatron-Core AdaptiveMuon: Adam's second moment on s·O
            V = st.setdefault("V", torch.zeros_like(W))
            V.copy_(o["beta2"] * V + (1 - o["beta2"]) * D * D)
            D = D / (V.sqrt() + o["eps"])
        elif method == "normuon":  # modded-nanogpt: per row (m >= n) or column, norm kept
            dim = 1 if m >= n else 0
            V = st.setdefault("V", torch.zeros(m if m >= n else n))
            V.copy_(o["beta2"] * V + (1 - o["beta2"]) * (O * O).mean(dim=dim))
            r = 1 / V.clamp(min=o["eps"]).sqrt()
            OS = O * (r[:, None] if dim == 1 else r[None, :])
            D = s * OS * (O.norm() / OS.norm() if OS.norm() > 0 else 0.0)
        if o["weight_decay_mode"] == "decoupled":
            W.sub_(lr * wd * W)
        elif o["weight_decay_mode"] == "independent":
            W.sub_(wd * W)
        elif o["weight_decay_mode"] == "cautious":
            W.sub_(lr * wd * W * (D * W >= 0))
        W.sub_(lr * D)

    @staticmethod
    def _adamw(W, g, st, o):
        lr, wd, eps = o["lr"], o["weight_decay"], o["eps"]
        b1, b2 = o["betas"]
        m = st.setdefault("m", torch.zeros_like(W))
        v = st.setdefault("v", torch.zeros_like(W))
        t = st["t"]
        coupled = o.get("weight_decay_mode") == "l2"  # Adam with coupled L2 (torch.optim.Adam)
        if coupled:
            g = g + wd * W
        m.copy_(b1 * m + (1 - b1) * g)
        v.copy_(b2 * v + (1 - b2) * g * g)
        decay = 1 if coupled else 1 - lr * wd
        W.copy_(W * decay - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps))
