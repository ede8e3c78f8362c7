"""Explicit FP32 master weights for BF16/FP16 model parameters (Megatron / DeepSpeed style).

The model keeps its parameters (and so its gradients) in the low-precision dtype; an FP32 copy of every
low-precision parameter (the master) is what the optimizer updates. One optimizer step is:

1. ``before_step``: copy each parameter's low-precision ``.grad`` into its master's FP32 ``.grad``;
2. the inner optimizer (any ``torch.optim.Optimizer`` built over the masters) steps on the masters;
3. ``after_step``: copy each master back into its parameter, rounding to nearest, and free the
   master gradients (they live only during the step unless ``keep_master_grads``).

Sources: Micikevicius et al., "Mixed Precision Training" (arXiv 1710.03740) for the FP32 master copy;
Megatron-LM's ``Float16OptimizerWithFloat16Params`` and distributed optimizer
(``megatron/core/optimizer/optimizer.py``, ``distrib_optimizer.py``: ``main_param`` FP32 copies of the
``model_param`` BF16 tensors, ``_copy_model_grads_to_main_grads`` before and
``_copy_main_params_to_model_params`` after the inner step); DeepSpeed ``BF16_Optimizer``
(``fp32_groups_flat_partition``). Without a master, updates smaller than half a BF16 ulp are lost
(Zamirai et al., "Revisiting BFloat16 Training", arXiv 2010.06192; see ``lowprec.optim.rounding``).

Memory per parameter with AdamW: BF16 weight 2 + BF16 grad 2 + master 4 + m 4 + v 4 = 16 B, plus a
transient FP32 gradient (4 B) during the step.

Parameters that are already in the master dtype are their own master: no copy is made and they are not
listed in ``master_params``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor


class MasterWeights:
    """Master copies of ``params`` in ``master_dtype`` (FP32) and the two copy steps around an optimizer step.

    ``params``: the model's trainable parameters (any shape; BF16/FP16, FP32 ones are their own master).
    ``masters[i]`` is the master of ``params[i]`` (a detached leaf tensor, same shape and device).
    ``keep_master_grads``: keep the FP32 gradient buffers between steps (saves an allocation per step,
    costs ``4 * numel`` bytes); by default they are freed in ``after_step``.
    """

    def __init__(
        self, params: Iterable[Tensor], master_dtype: torch.dtype = torch.float32, keep_master_grads: bool = False
    ) -> None:
        self.params: list[Tensor] = list(params)
        self.master_dtype = master_dtype
        self.keep_master_grads = keep_master_grads
        self.masters: list[Tensor] = []
        with torch.no_grad():
            for p in self.params:
                if p.dtype == master_dtype:
                    self.masters.append(p)
                else:
                    m = p.detach().to(master_dtype, copy=True)
                    m.requires_grad_(p.requires_grad)
                    self.masters.append(m)

    @property
    def master_params(self) -> list[Tensor]:
        """The explicit master tensors (excluding parameters that are their own master), for accounting."""
        return [m for p, m in zip(self.params, self.masters) if m is not p]

    def pairs(self) -> Iterator[tuple[Tensor, Tensor]]:
        """(parameter, master) for every parameter that has an explicit master."""
        return ((p, m) for p, m in zip(self.params, self.masters) if m is not p)

    @torch.no_grad()
    def before_step(self) -> None:
        """Copy every parameter's ``.grad`` into its master's ``.grad`` (converted to ``master_dtype``).

        A parameter without a gradient leaves its master without one (the inner optimizer skips it).
        """
        for p, m in self.pairs():
            g = p.grad
            if g is None:
                m.grad = None
            elif m.grad is None:
                m.grad = g.detach().to(self.master_dtype, copy=True)
            else:
                m.grad.copy_(g)

    @torch.no_grad()
    def after_step(self) -> None:
        """Copy every master into its parameter (round to nearest even); free master gradients unless kept."""
        for p, m in self.pairs():
            p.copy_(m)
            if not self.keep_master_grads:
                m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the master gradients."""
        for _, m in self.pairs():
            if m.grad is not None:
                if set_to_none:
                    m.grad = None
                else:
                    m.grad.zero_()


class _MasterStateView(Mapping):
    """``optimizer.state`` of the wrapper: keyed by model parameters, values are the inner optimizer's
    per-master state dicts, so ``optimizer.state.get(param)`` and ``optimizer.state.values()`` work as for a
    plain optimizer (``lowprec.optim.moment_kind``, ``lowprec.measure.accounting.measure_state_bytes``)."""

    def __init__(self, inner: torch.optim.Optimizer, params: list[Tensor], masters: list[Tensor]) -> None:
        self._inner = inner
        self._to_master = dict(zip(params, masters))
        self._to_param = dict(zip(masters, params))

    def __getitem__(self, p: Tensor) -> dict:
        m = self._to_master.get(p) if isinstance(p, Tensor) else None
        if m is None or m not in self._inner.state:
            raise KeyError("no optimizer state for this parameter")
        return self._inner.state[m]

    def __iter__(self):
        return (self._to_param[m] for m in self._inner.state if m in self._to_param)

    def __len__(self) -> int:
        return sum(1 for m in self._inner.state if m in self._to_param)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over low-precision model parameters that steps an inner optimizer on FP32
    masters: ``step()`` = copy grads to masters -> ``inner.step()`` -> copy masters back (round to nearest).

    ``params``: model parameters or param-group dicts (as for any optimizer). ``inner_factory``: called once
    with the same groups whose ``params`` are the masters, returns the inner optimizer, e.g.
    ``lambda groups: torch.optim.AdamW(groups, lr=1e-3)``; it must keep the groups and their order.

    Drop-in for the training loop:
    - ``param_groups`` hold the *model* parameters and the inner optimizer's hyper-parameters; changes made
      to them (an ``LRScheduler`` writing ``lr``) are copied into the inner groups at every ``step``;
      ``torch.distributed.checkpoint.state_dict.get_state_dict`` maps them to FQNs;
    - ``state`` is keyed by model parameters (a read-only view of the inner state);
    - ``zero_grad`` clears model and master gradients; step hooks (``register_step_post_hook``) run after
      the masters were copied back;
    - ``state_dict()`` is the inner optimizer's, with each parameter's master added as ``"master"`` in its
      per-parameter state; ``load_state_dict`` restores both (bit-identical next steps);
    - ``master_params`` lists the explicit masters for ``lowprec.measure.accounting.measure_state_bytes``.

    Raises ``TypeError`` if ``inner_factory`` does not return an Optimizer, ``ValueError`` if it reorders
    parameters.
    """

    def __init__(
        self,
        params,
        inner_factory: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        master_dtype: torch.dtype = torch.float32,
        keep_master_grads: bool = False,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("MasterWeightOptimizer got an empty parameter list")
        groups = [dict(g) for g in params] if isinstance(params[0], dict) else [{"params": params}]
        for g in groups:
            g["params"] = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
        flat = [p for g in groups for p in g["params"]]
        self.master = self._make_copies(flat, master_dtype, keep_master_grads)
        to_master = dict(zip(flat, self.master.masters))
        self.inner = inner_factory([{**g, "params": [to_master[p] for p in g["params"]]} for g in groups])
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise TypeError(f"inner_factory returned {type(self.inner).__name__}, not a torch.optim.Optimizer")
        inner_flat = [p for g in self.inner.param_groups for p in g["params"]]
        if len(inner_flat) != len(flat) or any(a is not b for a, b in zip(inner_flat, self.master.masters)):
            raise ValueError("the inner optimizer must keep the parameter groups and their order")
        wrapper_groups = [
            {**{k: v for k, v in ig.items() if k != "params"}, "params": g["params"]}
            for g, ig in zip(groups, self.inner.param_groups)
        ]
        super().__init__(wrapper_groups, dict(self.inner.defaults))
        self.state = _MasterStateView(self.inner, flat, self.master.masters)  # type: ignore[assignment]

    def _make_copies(self, flat: list[Tensor], master_dtype: torch.dtype, keep_master_grads: bool) -> MasterWeights:
        return MasterWeights(flat, master_dtype, keep_master_grads)

    @property
    def master_params(self) -> list[Tensor]:
        """The explicit FP32 master tensors (bytes counted as ``mem_master_bytes``)."""
        return self.master.master_params

    @property
    def model_params(self) -> list[Tensor]:
        """The model parameters, in group order."""
        return self.master.params

    def master_of(self, p: Tensor) -> Tensor:
        """The master of model parameter ``p`` (``p`` itself if it is already in the master dtype)."""
        return self.state._to_master[p]

    def _sync_hparams(self) -> None:
        for wg, ig in zip(self.param_groups, self.inner.param_groups):
            for k, v in wg.items():
                if k == "params" or ig.get(k) is v:
                    continue
                cur = ig.get(k)
                if isinstance(cur, Tensor) and not isinstance(v, Tensor):
                    cur.fill_(v)  # torchao keeps lr as a tensor and refuses a float
                else:
                    ig[k] = v

    def step(self, closure=None):
        """Grad copy -> inner step on the masters -> masters copied into the parameters. Returns the
        closure's loss if a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hparams()
        self.master.before_step()
        self.inner.step()
        self.master.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.master.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "inner", None) is not None and len(self.param_groups) >= len(self.inner.param_groups):
            raise ValueError(
                "MasterWeightOptimizer takes its parameter groups at construction; add_param_group after it is refused"
            )
        super().add_param_group(param_group)

    def _load_group_hparams(self, saved_groups: list[dict]) -> None:
        """Copy the saved groups' hyper-parameters (lr, betas, ...) into this wrapper's groups."""
        for wg, sg in zip(self.param_groups, saved_groups):
            for k, v in sg.items():
                if k != "params":
                    wg[k] = copy.deepcopy(v)

    def state_dict(self) -> dict:
        """``{"state": {pid: {inner state..., "master": fp32 tensor}}, "param_groups": [...]}`` with the
        usual integer parameter ids (the order of ``param_groups``). Tensors are references, as in torch."""
        inner_sd = self.inner.state_dict()
        state = {}
        for i, (p, m) in enumerate(zip(self.master.params, self.master.masters)):
            s = dict(inner_sd["state"].get(i, {}))
            if m is not p:
                s["master"] = m
            if s:
                state[i] = s
        groups = [
            {**{k: v for k, v in wg.items() if k != "params"}, "params": ig["params"]}
            for wg, ig in zip(self.param_groups, inner_sd["param_groups"])
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` of a MasterWeightOptimizer over the same parameters: inner state, group
        hyper-parameters and masters (copied exactly). The model parameters are not touched.

        Raises ``ValueError`` for a different group layout or a missing master.
        """
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("loaded state dict has a different parameter-group layout")
        saved_ids = [pid for g in saved_groups for pid in g["params"]]
        inner_state, masters = {}, {}
        for pid, s in state_dict["state"].items():
            s = dict(s)
            if "master" in s:
                masters[pid] = s.pop("master")
            if s:
                inner_state[pid] = s
        missing = [
            pid
            for pid, (p, m) in zip(saved_ids, zip(self.master.params, self.master.masters))
            if m is not p and pid not in masters
        ]
        if missing:
            raise ValueError(f"loaded state dict has no master weights for parameter ids {missing[:5]}")
        self.inner.load_state_dict({"state": inner_state, "param_groups": saved_groups})
        self._load_group_hparams(saved_groups)
        with torch.no_grad():
            for pid, p, m in zip(saved_ids, self.master.params, self.master.masters):
                if m is not p:
                    m.copy_(masters[pid])
