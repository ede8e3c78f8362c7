"""Layouts for ``lowprec recommend``: which (FSDP, TP, AC) a recipe can use on N GPUs and whether it fits, and the
ablation that would give a recipe loss evidence, as a command that runs as printed.

The ablation (``ablation_plan``) runs the control and the recipe, ``ABLATION_SEEDS`` seeds each (the default
experiment's), eager (``train.compile=false``: every FP8 backend trains eager, while some refuse
``torch.compile`` on CUDA, ``Float8Backend.compile_blocker``), on the fewest GPUs (a power of two up to the plan's
``gpus``) where a layout fits both in memory, for ``steps`` steps of the plan's batch and sequence length
(``train.batch_size`` is the global batch: ``dp_shard`` x ``batch``). On one node the command is a plain
``lowprec ablate`` (it starts torchrun itself); across nodes it is the torchrun line the README gives for several
machines, started on each node with ``HEAD_NODE`` set to the first. Its cost is the cost model's eager step time
of both recipes x seeds x steps x GPUs.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from functools import lru_cache

from lowprec.estimate.cost_model import AC_MODES, Layout, step_cost
from lowprec.estimate.estimator import predict_state_bytes
from lowprec.estimate.memory_model import peak_breakdown
from lowprec.model import MoEArgs
from lowprec.recipe import Recipe

TP_DEGREES = (1, 2, 4, 8)
#: A layout fits when its predicted peak leaves this fraction of device memory free: the memory model's largest
#: held-out error on the H100 points of ``published.yaml`` (README, estimate section).
MEMORY_MARGIN = 0.07
#: seeds per recipe of the printed ablation: the default experiment's (conf/experiment/default.yaml)
ABLATION_SEEDS = 3
#: steps of the printed ablation unless ``ablate_steps=`` says otherwise
EVIDENCE_STEPS = 1000


def layouts(args, gpus: int, recipe: Recipe):
    """``(dp_shard, tp)`` pairs of ``gpus`` GPUs that lowprec can train ``recipe`` on: ``tp`` in ``TP_DEGREES``
    dividing ``gpus`` and the head counts (FSDP over the rest); no TP for a MoE model (not modelled), no TP with an
    FP8 weight all-gather (lowprec refuses it) and FSDP for FP8 communication."""
    for tp in TP_DEGREES:
        if gpus % tp or args.n_heads % tp or args.n_kv_heads % tp:
            continue
        if tp > 1 and isinstance(args, MoEArgs):
            continue  # tensor/expert parallelism of a MoE model is not modelled (lowprec.estimate.cost_model)
        dp = gpus // tp
        if recipe.comm.weight_all_gather == "fp8" and tp > 1:
            continue  # lowprec refuses the FP8 weight all-gather with TP
        if (recipe.comm.weight_all_gather == "fp8" or recipe.comm.grad_reduce == "fp8") and dp == 1:
            continue  # FP8 communication needs FSDP
        yield dp, tp


@lru_cache(maxsize=4096)
def peak_reserved(args, recipe: Recipe, dp: int, tp: int, batch: int, seq: int, ac: str, compiled: bool) -> int:
    """Predicted peak reserved bytes per GPU (``lowprec.estimate.memory_model.peak_breakdown``); cached: the
    control's layouts are asked again for every recipe's ablation (model and recipe are frozen dataclasses)."""
    return peak_breakdown(
        args, recipe, dp_shard=dp, tp=tp, batch=batch, seq=seq, ac=ac, compiled_loss=compiled
    ).reserved


def memory_limit(hw) -> float:
    """Bytes a layout may use on ``hw``: its memory less ``MEMORY_MARGIN``."""
    return (1 - MEMORY_MARGIN) * hw.memory_bytes


#: GPUs per host where it differs from 8 (a GB200 NVL72 tray holds 4 of the rack's 72)
GPUS_PER_HOST = {"gb200": 4}


@dataclass(frozen=True)
class AblationPlan:
    """The printed ablation of ``recipe`` against ``control`` on ``model``: ``gpus`` on ``nodes`` hosts of
    ``nproc_per_node``, layout ``dp_shard`` x ``tp`` with ``ac``, ``steps`` of ``batch`` x ``seq`` per data-parallel
    rank, ``seeds`` per recipe, at report ``margin``; predicted GPU-hours of the control's and the recipe's runs
    (cost model, eager); ``command`` runs it as printed (``command_for`` runs several recipes in that layout)."""

    model: str
    control: str
    recipe: str
    gpus: int
    nodes: int
    nproc_per_node: int
    dp_shard: int
    tp: int
    ac: str
    steps: int
    batch: int
    seq: int
    seeds: int
    margin: float
    control_gpu_hours: float
    recipe_gpu_hours: float

    @property
    def gpu_hours(self) -> float:
        return self.control_gpu_hours + self.recipe_gpu_hours

    @property
    def command(self) -> str:
        return self.command_for([self.recipe])

    def layout_key(self) -> tuple:
        """Plans with equal keys run in one ablation (``command_for`` with all their recipes)."""
        return (self.model, self.control, self.gpus, self.dp_shard, self.tp, self.ac, self.steps, self.batch, self.seq)

    def command_for(self, recipes: list[str]) -> str:
        """The command that ablates ``recipes`` against the control in this layout: ``lowprec ablate`` on one host
        (it starts torchrun itself), else the torchrun line to start on every host with ``HEAD_NODE`` set."""
        overrides = [
            f"recipes=[{','.join([self.control, *recipes])}]",
            f"model={self.model}",
            "model.qk_norm=false",  # the size's own architecture (the default experiment turns QK-norm on for tiny)
            "device=cuda",
            f"parallel.dp_shard={self.dp_shard}",
            f"parallel.tp={self.tp}",
            f"train.batch_size={self.dp_shard * self.batch}",
            f"train.seq_len={self.seq}",
            f"train.steps={self.steps}",
            f"train.val_every={max(1, self.steps // 10)}",
            f"train.ac={self.ac}",
            "train.compile=false",
            f"seeds={self.seeds}",
            f"report.margin={self.margin:g}",
        ]
        return launch_line("ablate", overrides, self.nodes, self.nproc_per_node)

    def to_dict(self) -> dict:
        return {**asdict(self), "gpu_hours": self.gpu_hours, "command": self.command}


def launch_line(subcommand: str, overrides: list[str], nodes: int, nproc_per_node: int) -> str:
    """``lowprec <subcommand> <overrides>`` (shell-quoted) on one host, where lowprec starts torchrun itself; across
    ``nodes`` hosts, the torchrun line the README gives, to start on each with ``HEAD_NODE`` set to the first."""
    if nodes == 1:
        return shlex.join(["lowprec", subcommand, *overrides])
    # Each host's shell expands HEAD_NODE, which must be exported first: an inline ``HEAD_NODE=x torchrun ...`` is
    # expanded before the assignment, and an empty host made torch print a 25-line traceback; ``:?`` stops the
    # line with one that says what to do.
    launcher = (
        f"torchrun --nnodes={nodes} --nproc_per_node={nproc_per_node} --rdzv_backend=c10d "
        f'--rdzv_endpoint="${{{HEAD_NODE_CHECK}}}:29500" --rdzv_id=lowprec -m lowprec_lab {subcommand}'
    )
    return f"{launcher} {shlex.join(overrides)}"


#: The rendezvous host as each host's shell expands it, refusing an unset or empty one in one line.
HEAD_NODE_CHECK = "HEAD_NODE:?export HEAD_NODE=<the first host> on every host before this line"


def run_commands(
    model: str,
    recipe: str,
    control: str,
    hardware: str,
    *,
    dp_shard: int,
    tp: int,
    batch_per_rank: int,
    seq: int,
    ac: str,
    compile: bool,
    margin: float,
    extra: tuple[str, ...] = (),
) -> dict[str, str]:
    """``{"train": ..., "ablate": ...}``: the command lines that train ``recipe`` on ``model`` in the layout
    ``dp_shard`` x ``tp`` (``train.batch_size = dp_shard * batch_per_rank``, ``train.seq_len``, ``train.ac``,
    ``train.compile``), and that ablate it against ``control`` in the same layout with the verdicts at ``margin``;
    ``extra``: the user's other ``lowprec train`` overrides, carried over. No ``device=``: ``auto`` takes the GPU.
    One host runs ``lowprec`` (it starts torchrun); more (``GPUS_PER_HOST``) get ``launch_line``'s torchrun line."""
    common = [
        f"model={model}",
        f"parallel.dp_shard={dp_shard}",
        f"parallel.tp={tp}",
        f"train.batch_size={dp_shard * batch_per_rank}",
        f"train.seq_len={seq}",
        f"train.ac={ac}",
        f"train.compile={str(compile).lower()}",
        *extra,
    ]
    nodes, nproc = _hosts(dp_shard * tp, hardware)
    recipes = [control] if recipe == control else [control, recipe]
    return {
        "train": launch_line("train", [f"recipe={recipe}", *common], nodes, nproc),
        "ablate": launch_line(
            # model.qk_norm=false: the size's own architecture (the default experiment turns QK-norm on for tiny)
            "ablate",
            [f"recipes=[{','.join(recipes)}]", *common, "model.qk_norm=false", f"report.margin={margin:g}"],
            nodes,
            nproc,
        ),
    }


def _hosts(n: int, hardware: str) -> tuple[int, int]:
    """``(nodes, nproc_per_node)`` for ``n`` GPUs: one host when they fit in it, else the fewest hosts that split
    them evenly."""
    per_host = GPUS_PER_HOST.get(hardware, 8)
    if n <= per_host:
        return 1, n
    nodes = -(-n // per_host)
    while n % nodes:
        nodes += 1
    return nodes, n // nodes


def _gpu_counts(gpus: int) -> list[int]:
    out, n = [], 1
    while n < gpus:
        out.append(n)
        n *= 2
    return [*out, gpus]


def ablation_layout(args, recipes: list[Recipe], hw, gpus: int, batch: int, seq: int):
    """``(n, dp, tp, ac)``: the fewest GPUs (``_gpu_counts`` up to ``gpus``) and a layout on them where every one
    of ``recipes`` fits eager with the lightest AC mode; ``None`` when none does."""
    limit = memory_limit(hw)
    for n in _gpu_counts(gpus):
        common = [lt for lt in layouts(args, n, recipes[0]) if all(lt in set(layouts(args, n, r)) for r in recipes)]
        for dp, tp in common:
            if any(predict_state_bytes(args, r, dp, tp).total > limit for r in recipes):
                continue  # the state alone does not fit: no AC mode helps
            if any(peak_reserved(args, r, dp, tp, batch, seq, "full", False) > limit for r in recipes):
                continue  # the heaviest recompute does not fit: no lighter one does
            for ac in AC_MODES:
                if ac == "full" or all(peak_reserved(args, r, dp, tp, batch, seq, ac, False) <= limit for r in recipes):
                    return n, dp, tp, ac
    return None


def ablation_plan(
    model: str,
    args,
    control: Recipe,
    recipe: Recipe,
    hw,
    *,
    gpus: int,
    batch: int,
    seq: int,
    gap: float,
    steps: int = EVIDENCE_STEPS,
) -> AblationPlan | None:
    """The ablation of ``recipe`` against ``control`` on ``model`` (module doc), or ``None`` when no layout of at
    most ``gpus`` GPUs fits both."""
    found = ablation_layout(args, [control, recipe], hw, gpus, batch, seq)
    if found is None:
        return None
    n, dp, tp, ac = found
    lo = Layout(dp, tp, batch, seq, ac, False)
    hours = [ABLATION_SEEDS * steps * step_cost(args, r, hw, lo).step_time_s * n / 3600 for r in (control, recipe)]
    nodes, nproc = _hosts(n, hw.name)
    return AblationPlan(
        model, control.name, recipe.name, n, nodes, nproc, dp, tp, ac, steps, batch, seq, ABLATION_SEEDS, gap, *hours
    )
