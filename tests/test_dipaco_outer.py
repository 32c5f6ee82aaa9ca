"""DiPaCo's outer step against an independent float64 reference, and its reductions:

- L = K = 1 is DiLoCo (one path: τ AdamW steps, then Nesterov SGD on θ_global − θ);
- DiLoCo with τ = 1, outer lr 1, momentum 0 and inner SGD is synchronous SGD on the union of the
  workers' data (k workers = one module shared by k paths, α = their token shares, no √P);
- flat MoE (L = 1, K = P) with outer lr 1 and momentum 0 is independent training of the paths.

The reductions run the trainer's own pieces (inner optimizer, inner steps, module split, outer
step) on a small GPT-shaped model whose parameter names are GPTModel's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_ext.config import load_recipe
from megatron_ext.dipaco.model.layout import ModuleId, PathLayout, model_parts
from megatron_ext.dipaco.model.parts import assign_params, split_by_level
from megatron_ext.dipaco.steps.inner import InnerOptimizer, inner_schedule, inner_steps
from megatron_ext.dipaco.steps.outer import OuterConfig, outer_step, path_weights
from megatron_ext.dipaco.steps.zero_order import SPSAInner, spsa_inner_steps
from megatron_ext.zo.probes import probe_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V, D = 11, 6


# ------------------------------------------------------------------ the outer step itself


def reference_outer(theta, momentum, paths, tokens, lr, mu, nesterov, sqrt_p, alpha):
    """Written from the paper's formulas, element by element, in Python floats."""
    p = len(paths)
    weights = [t / sum(tokens) for t in tokens] if alpha else [1.0 / p] * p
    scale = math.sqrt(p) if sqrt_p else 1.0
    new_theta, new_mom = [], []
    for j, th in enumerate(theta):
        delta = scale * sum(w * (th - path[j]) for w, path in zip(weights, paths, strict=True))
        buf = delta if momentum is None else mu * momentum[j] + delta
        step = delta + mu * buf if nesterov else buf
        new_theta.append(th - lr * step)
        new_mom.append(buf)
    return new_theta, new_mom


@pytest.mark.parametrize("sqrt_p", [True, False])
@pytest.mark.parametrize("alpha", [True, False])
@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_a_float64_reference(sqrt_p: bool, alpha: bool, nesterov: bool) -> None:
    rng = np.random.default_rng(0)
    cfg = OuterConfig(
        lr=0.7, momentum=0.9, nesterov=nesterov, sqrt_p_scaling=sqrt_p, alpha_weighting=alpha
    )
    tokens = {4: 600, 0: 100, 2: 300}  # listed out of order on purpose
    theta = rng.standard_normal(7)
    ref_theta, ref_mom = list(theta), None
    ours = {"w": torch.tensor(theta, dtype=torch.float32)}
    mom = None
    ref_theta = [float(x) for x in ours["w"]]
    for _ in range(3):
        paths = {i: rng.standard_normal(7) for i in tokens}
        torch_paths = {i: {"w": torch.tensor(v, dtype=torch.float32)} for i, v in paths.items()}
        order = sorted(tokens)
        ref_theta, ref_mom = reference_outer(
            ref_theta,
            ref_mom,
            [[float(x) for x in torch_paths[i]["w"]] for i in order],
            [tokens[i] for i in order],
            0.7,
            0.9,
            nesterov,
            sqrt_p,
            alpha,
        )
        ours, mom = outer_step(ours, mom, tokens, lambda i, tp=torch_paths: tp[i], cfg)
        assert ours["w"].dtype == torch.float32
        np.testing.assert_allclose(ours["w"].double().numpy(), ref_theta, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(mom["w"].double().numpy(), ref_mom, rtol=1e-6, atol=1e-6)
        ref_theta = [float(x) for x in ours["w"]]  # the stored (float32) module goes on
        ref_mom = [float(x) for x in mom["w"]]


def test_single_path_modules_take_the_step_too() -> None:
    cfg = OuterConfig()
    theta = {"w": torch.tensor([1.0, 2.0])}
    path = {"w": torch.tensor([0.5, 1.0])}
    new, mom = outer_step(theta, None, {3: 10}, lambda _: path, cfg)
    delta = torch.tensor([0.5, 1.0])  # √1 · 1 · (θ − θ_1)
    torch.testing.assert_close(mom["w"], delta)
    torch.testing.assert_close(new["w"], theta["w"] - 0.7 * (delta + 0.9 * delta))
    assert path_weights([10], cfg) == [1.0]
    assert path_weights([1, 3], cfg) == pytest.approx([math.sqrt(2) / 4, 3 * math.sqrt(2) / 4])
    with pytest.raises(ValueError):
        path_weights([0, 0], cfg)


# ------------------------------------------------------------------ a GPT-shaped model


class TinyGPT(torch.nn.Module):
    """Parameter names as GPTModel's: embedding, decoder.layers.i, final norm, output layer."""

    def __init__(self, layers: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(V, D, dtype=dtype)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(
            torch.nn.Linear(D, D, dtype=dtype) for _ in range(layers)
        )
        self.decoder.final_layernorm = torch.nn.LayerNorm(D, dtype=dtype)
        self.output_layer = torch.nn.Linear(D, V, bias=False, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding.word_embeddings(tokens)
        for layer in self.decoder.layers:
            h = h + torch.tanh(layer(h))
        return self.output_layer(self.decoder.final_layernorm(h))


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every target of ``batch`` (b, s+1)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))


def batches(seed: int, n: int, rows: int = 4, seq: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (rows, seq + 1), generator=g) for _ in range(n)]


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def optimizer_cfg(**kw):
    return load_recipe("dipaco_tiny", [f"optimizer.{k}={v}" for k, v in kw.items()]).optimizer


class SGD:
    """Plain SGD with the inner optimizer's interface (``step(lr)``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self, lr: float) -> None:
        with torch.no_grad():
            for p in self.params:
                p.sub_(lr * p.grad)


def run_dipaco(layout, data, phases, tau, cfg, make_opt, lrs, dtype=torch.float32):
    """Phases of DiPaCo with the trainer's pieces: each path loads its modules' global versions
    (and its path-specific part and optimizer state), takes τ inner steps, and every module
    takes an outer step over its paths (tokens = the path's targets per phase)."""
    base = params(TinyGPT(dtype=dtype))
    split = split_by_level(base, layout)
    modules = {m: dict(split[m.level]) for m in layout.modules}
    momenta: dict[ModuleId, dict | None] = dict.fromkeys(layout.modules)
    specific = {p: dict(split.get(None, {})) for p in range(layout.num_paths)}
    models = {p: TinyGPT(dtype=dtype) for p in range(layout.num_paths)}
    opts = {p: make_opt(models[p]) for p in models}  # inner state persists across phases
    for t in range(phases):
        trained, tokens = {}, {}
        for p, model in models.items():
            mods = layout.path_modules(p)
            assign_params(model, *(modules[m] for m in mods), specific[p])
            steps = data[p][t * tau : (t + 1) * tau]
            inner_steps(model, opts[p], steps, lrs[t * tau : (t + 1) * tau], lm_loss)
            trained[p] = split_by_level(params(model), layout)
            specific[p] = trained[p].get(None, {})
            tokens[p] = sum(b[:, 1:].numel() for b in steps)
        for m in layout.modules:
            users = {p: tokens[p] for p in layout.paths_of(m)}
            modules[m], momenta[m] = outer_step(
                modules[m], momenta[m], users, lambda p, lv=m.level, tr=trained: tr[p][lv], cfg
            )
    return modules, specific


def test_one_path_one_module_is_diloco() -> None:
    """L = K = 1 against DiLoCo written out: AdamW inner steps from θ, Nesterov on θ − θ'."""
    layout = PathLayout((1,), (model_parts(2, tied_output=False),))
    phases, tau, cfg = 3, 4, OuterConfig(lr=0.7, momentum=0.9)
    opt_cfg = optimizer_cfg(clip_grad=0.0, lr=0.01, min_lr=0.001)
    sched = inner_schedule(opt_cfg, phases, tau, warmup=0)
    lrs = [sched.lr_at(k) for k in range(phases * tau)]
    data = {0: batches(1, phases * tau)}
    modules, _ = run_dipaco(
        layout,
        data,
        phases,
        tau,
        cfg,
        lambda m: InnerOptimizer(list(m.named_parameters()), opt_cfg),
        lrs,
    )

    model = TinyGPT()
    theta = {n: p.double() for n, p in params(model).items()}
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    buf = {n: torch.zeros_like(v) for n, v in theta.items()}
    for t in range(phases):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(theta[n])
        for k in range(tau):
            adamw.zero_grad()
            for g in adamw.param_groups:
                g["lr"] = lrs[t * tau + k]
            lm_loss(model, data[0][t * tau + k]).backward()
            adamw.step()
        for n, p in model.named_parameters():
            delta = theta[n] - p.detach().double()
            buf[n] = 0.9 * buf[n] + delta
            theta[n] = (theta[n] - 0.7 * (delta + 0.9 * buf[n])).float().double()
    (module,) = modules.values()
    for n, v in theta.items():
        torch.testing.assert_close(module[n].double(), v, rtol=1e-5, atol=1e-6)


def test_diloco_tau1_lr1_momentum0_sgd_is_synchronous_sgd_on_the_union() -> None:
    """k = 3 workers (paths sharing one module) with shards of different sizes."""
    cfg = OuterConfig(lr=1.0, momentum=0.0, sqrt_p_scaling=False, alpha_weighting=True)
    model = TinyGPT(dtype=torch.float64)
    theta = params(model)
    sync = TinyGPT(dtype=torch.float64)
    assign_params(sync, theta)
    rows = {0: 2, 1: 3, 2: 6}
    momentum = None
    for step in range(3):
        data = {i: batches(10 * step + i, 1, rows=r)[0] for i, r in rows.items()}
        trained, tokens = {}, {}
        for i, batch in data.items():
            assign_params(model, theta)
            inner_steps(model, SGD(model), [batch], [0.1], lm_loss)
            trained[i], tokens[i] = params(model), batch[:, 1:].numel()
        theta, momentum = outer_step(theta, momentum, tokens, trained.__getitem__, cfg)
        # synchronous SGD: one step on the mean loss over every target of the union
        union = torch.cat(list(data.values()))
        inner_steps(sync, SGD(sync), [union], [0.1], lm_loss)
        for n, p in sync.named_parameters():
            torch.testing.assert_close(theta[n], p.detach(), rtol=1e-12, atol=1e-13)


def test_flat_moe_with_lr1_momentum0_is_independent_training_of_the_paths() -> None:
    layout = PathLayout((3,), (model_parts(2, tied_output=False),))
    phases, tau = 3, 3
    cfg = OuterConfig(lr=1.0, momentum=0.0)
    opt_cfg = optimizer_cfg(lr=0.01, min_lr=0.001)
    sched = inner_schedule(opt_cfg, phases, tau, warmup=1)
    lrs = [sched.lr_at(k) for k in range(phases * tau)]
    data = {p: batches(100 + p, phases * tau) for p in range(3)}
    make = lambda m: InnerOptimizer(list(m.named_parameters()), opt_cfg)  # noqa: E731
    modules, _ = run_dipaco(layout, data, phases, tau, cfg, make, lrs)
    for p in range(3):
        alone = TinyGPT()
        inner_steps(alone, make(alone), data[p], lrs, lm_loss)
        for n, v in params(alone).items():
            assert torch.equal(modules[ModuleId(0, p)][n], v), n  # bit for bit


def test_path_specific_parameters_are_never_averaged() -> None:
    """2 x 1 levels with block 1 path-specific: each path keeps its own copy of block 1."""
    layout = PathLayout(
        (2,), (("embedding", "block0", "final_layernorm", "output_layer"),), ("block1",)
    )
    opt_cfg = optimizer_cfg(lr=0.01)
    data = {p: batches(7 + p, 4) for p in range(2)}
    make = lambda m: InnerOptimizer(list(m.named_parameters()), opt_cfg)  # noqa: E731
    _, specific = run_dipaco(layout, data, 2, 2, OuterConfig(), make, [0.01] * 4)
    a, b = specific[0], specific[1]
    assert set(a) == {"decoder.layers.1.weight", "decoder.layers.1.bias"}
    assert not torch.equal(a["decoder.layers.1.weight"], b["decoder.layers.1.weight"])


def test_zero_order_inner_step_matches_spsa_written_out() -> None:
    """dipaco.inner=spsa: one step is ĝ = (1/k) Σ_j [L(θ+εz_j) − L(θ−εz_j)]/(2ε) z_j with the
    probes keyed by (seed, path, phase, step, j), then Adam with coupled decay (float64)."""
    model = TinyGPT(dtype=torch.float64)
    theta0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    opt = SPSAInner(model, n_pert=4, eps=1e-3, weight_decay=0.1, betas=(0.9, 0.95), seed=5, path=2)
    batch = batches(3, 1)[0]
    spsa_inner_steps(opt, [batch], [0.01], first_step=7, phase=1, loss_fn=lm_loss)
    ours = torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    ref = TinyGPT(dtype=torch.float64)
    gains = torch.cat([torch.full((p.numel(),), p.ndim == 1) for p in ref.parameters()])
    z = probe_rows([(5, 2, 1, 7, j) for j in range(4)], gains, dtype=torch.float64)

    def loss_at(theta: torch.Tensor) -> float:
        torch.nn.utils.vector_to_parameters(theta, ref.parameters())
        with torch.no_grad():
            return float(lm_loss(ref, batch))

    g = sum((loss_at(theta0 + 1e-3 * zj) - loss_at(theta0 - 1e-3 * zj)) / 2e-3 * zj for zj in z) / 4
    g = g + 0.1 * theta0  # coupled weight decay
    m, v = 0.1 * g, 0.05 * g * g
    expected = theta0 - 0.01 * (m / 0.1) / ((v / 0.05).sqrt() + 1e-8)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12)
    assert not torch.equal(ours, theta0)
    again = SPSAInner(
        model, n_pert=4, eps=1e-3, weight_decay=0.1, betas=(0.9, 0.95), seed=5, path=2
    )
    again.load_state_dict(opt.state_dict())
    assert again.adam.steps == 1 and torch.equal(again.adam.m, opt.adam.m)
