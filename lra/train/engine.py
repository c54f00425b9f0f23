"""The one training engine shared by the runner (``lra.train.run``) and the bench (``lra.bench``): device, precision and
compilation resolved the same way, the single training step, the optimiser with the mixers' parameter groups,
synchronised timing and peak memory. What one measures the other measures identically.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import os
import re
import resource
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
import torch.nn.functional as F

from lra.errors import ConfigError, first_line
from lra.train.encoder import Classifier, build_classifier
from models import get_model_class
from models.base import checked_setting


def resolve_device(name: str) -> torch.device:
    """``device``'s torch device; a ConfigError (one line) for a CUDA device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} is not valid here: CUDA is not available; use device=cpu or device=auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device={name} is not valid here: this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto`` is bf16 autocast on CUDA and fp32 elsewhere."""
    return name if name != "auto" else ("bf16" if device.type == "cuda" else "fp32")


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay graphs as CUDA graphs
GRAPH_WARMUP = 3  # warm-up calls a timing under CUDA graphs needs: compile, record, then replay


def replays_cuda_graphs(compiled: bool, device: torch.device, mode: str) -> bool:
    """Whether a model compiled (or not) in torch.compile's ``mode`` replays CUDA graphs on ``device``: then each
    step must begin with ``torch.compiler.cudagraph_mark_step_begin()`` (the last step's outputs are dead)."""
    return compiled and device.type == "cuda" and mode in CUDA_GRAPH_MODES


def recorded_compile_mode(compiled: bool, mode: str) -> str:
    """A bench row's ``compile_mode``: torch.compile's mode where it is not the default; blank for the default mode
    (as in rows written before the column) and for eager rows."""
    return mode if compiled and mode != "default" else ""


def check_graph_warmup(mode: str, warmup: int, setting: str) -> None:
    """Refuse a timing whose warm-up is too short to record CUDA graphs in (``setting``: the option to raise)."""
    if mode in CUDA_GRAPH_MODES and warmup < GRAPH_WARMUP:
        raise ValueError(f"compile mode {mode} records CUDA graphs in the warm-up: set {setting} to {GRAPH_WARMUP} "
                         "or more")


def resolve_compile(flag: str | bool, device: torch.device) -> bool:
    """``auto`` compiles on CUDA only (on CPU the compile costs more than a short run gains)."""
    flag = str(flag).lower()
    return device.type == "cuda" if flag == "auto" else flag == "true"


def autocast(precision: str, device: torch.device):
    """A factory of autocast contexts for ``precision`` (a fresh context per use)."""
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def host_gpus() -> int:
    """The NVIDIA GPUs of this host, whichever of them ``CUDA_VISIBLE_DEVICES`` shows this process (the driver
    lists each in /proc/driver/nvidia/gpus); torch's count where that listing is absent."""
    try:
        return max(1, len(list(Path("/proc/driver/nvidia/gpus").iterdir())))
    except OSError:  # no NVIDIA driver here, or its listing unreadable
        return max(1, torch.cuda.device_count())


def cpu_threads(requested: int | None, device: torch.device | None = None) -> int:
    """Threads for this process: ``requested``, else its share of the cores it may run on. Every process of a
    multi-GPU host otherwise takes all the cores (torch's default) and they thrash, each run training far slower
    than it does alone. ``LRA_LOCAL_JOBS`` (set by the launcher and the data-parallel ranks) says how many jobs
    share the host; a process on a GPU takes at most one GPU's share of the cores, since runs started by hand, one
    per GPU, share the host unknown to each other."""
    if requested:
        return int(requested)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    jobs = float(os.environ.get("LRA_LOCAL_JOBS", "1") or 1)  # 4 GPU slots, a 3-GPU job: 4/3
    if device is not None and device.type == "cuda":
        jobs = max(jobs, host_gpus())
    return max(1, int(cores // jobs))


# The cuBLAS workspace settings under which torch lets a matmul run in deterministic mode (cuBLAS's documented ones)
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
NONDETERMINISTIC_OP = re.compile(r"(\S+) does not have a deterministic implementation")


def set_deterministic(on: bool) -> None:
    """``trainer.deterministic``: torch's deterministic kernels (an op that has only a nondeterministic one raises at
    its first call), cuDNN's deterministic algorithms without benchmarking, Inductor's deterministic mode and the
    cuBLAS workspace setting they need. Mixers read the mode as well (``models.base``: ``nondeterministic_backends``,
    ``cumsum``). Off, torch is left as it is, except that what an earlier deterministic run of this process set is
    undone (runs that share a process: tests)."""
    if not on and not torch.are_deterministic_algorithms_enabled():
        return
    if on and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS:
        # read when cuBLAS sets up its workspace (the process's first matmul, after this) and before each call by
        # torch's check, which raises without it
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS[0]
    # warn_only=False, not True: under the warning-only mode the flash and memory-efficient SDPA kernels keep the
    # backward that sums by atomic adds and cuDNN's attention stays eligible; under the strict one torch runs the first
    # two's deterministic backward and leaves cuDNN's attention out
    torch.use_deterministic_algorithms(on)
    if hasattr(torch._inductor.config, "deterministic"):  # no kernel chosen by timing (the line above sets it too)
        torch._inductor.config.deterministic = on
    torch.backends.cudnn.deterministic = on
    if on:
        torch.backends.cudnn.benchmark = False  # benchmarking picks an algorithm by its timing, run by run


def nondeterministic_op(error: BaseException) -> str | None:
    """The op named by torch's error for an op without a deterministic implementation under deterministic mode (e.g.
    ``cumsum_cuda_kernel``), else None."""
    found = NONDETERMINISTIC_OP.search(str(error)) if isinstance(error, RuntimeError) else None
    return found.group(1) if found else None


def configure(device: torch.device, threads: int | None = None, deterministic: bool = False) -> None:
    """Sets up this process for ``device``: its CPU threads (``threads``, else its share: ``cpu_threads``), torch's
    deterministic mode or its default (``set_deterministic``), and on CUDA the device, TF32 for fp32 matmuls and no
    AOTAutograd cache."""
    torch.set_num_threads(cpu_threads(threads, device))
    set_deterministic(deterministic)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device.index)
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left
        # Saving AOTAutograd's cache entry at the first backward can segfault on CUDA (pytorch#177442: pickling a
        # compiled graph), killing the run. The cache only saves a recompile of a graph another process compiled
        # before; Inductor's own kernel cache stays on.
        torch._functorch.config.enable_autograd_cache = False


def full_precision(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or as it is where it is float64 (the compile check's reference keeps its precision)."""
    return t if t.dtype == torch.float64 else t.float()


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 whatever the autocast dtype of the logits (in float64 for float64 logits)."""
    return F.cross_entropy(full_precision(logits), labels)


COMPILE_CHECK_ROWS = 4  # examples whose gradients check a compiled model (the runner's first training rows)

# The compile check's rule (compiled_gradient_check). The gradients of the compiled model and of the eager model are
# each measured against the eager model's in float64 (a copy of it: the same weights, buffers and inputs), per
# parameter: e = |g - g64| / |g64|. The compiled model is accepted where for every parameter
#     e_compiled <= COMPILE_ERROR_FACTOR * e_eager + COMPILE_ERROR_FLOOR[precision].
# Against float64 and not against each other: eager fp32 is itself off the exact gradient by its rounding, and in a
# model of long sums of large cancelling terms (random features, many layers) by percents; two executions in other
# summation orders are then as far from each other as each is from float64, and a bound on their difference rejects
# a compiled model no worse than the eager one.
# The factor: a right compilation computes the same products in the same precision (TF32 or not is set for the
# process, so for both) in other orders and fusions, so its rounding error is a draw of the same size as eager's; over
# a gradient of k elements the error's norm varies between such draws by about 1/sqrt(k) of itself, and 4x lies far
# outside that spread. A wrong kernel is off by orders of magnitude more than rounding (models/mamba.py: Inductor's
# code for Mamba's dt gradients at an odd length).
# The floor: for a gradient of few elements (a bias, a scalar) the ratio of two rounding errors is unbounded (for one
# element, the ratio of two Gaussians), so an error below the floor passes whatever eager's. fp32: 2^-9 of the
# gradient's size, 4 units of TF32's rounding (2^-11) and half a unit of bf16's (2^-8): training under bf16 autocast
# rounds every product's inputs by more, and a minibatch gradient's sampling noise is larger still. bf16: 2^-5, 8
# units of bf16's rounding: each product of the forward and the backward rounds its inputs to 8 bits, so a right
# gradient is already several units off.
COMPILE_ERROR_FACTOR = 4.0
COMPILE_ERROR_FLOOR = {"fp32": 2.0**-9, "bf16": 2.0**-5}
# Where the model does not run in float64 (a kernel without float64, such as a Triton or FlexAttention path; tensors
# of two dtypes meeting inside the model; float64 not fitting in memory), compiled against eager directly, as a
# fraction of the eager gradient's size: TF32 products and another order of the reductions move them by ~1e-3 of
# it; under bf16 autocast each execution rounds its own way (a rightly compiled Mamba stays within 0.1 of float64
# there, a wrongly compiled one is off by 7 times the gradient's size).
PAIRWISE_TOLERANCE = {"fp32": 2e-2, "bf16": 0.3}


def loss_gradients(model: torch.nn.Module, fn, inputs: tuple[torch.Tensor, ...], labels, autocast=None,
                   loss_fn=classification_loss) -> dict[str, torch.Tensor]:
    """The gradients of ``loss_fn(fn(*inputs), labels)`` on ``model``'s parameters, by name (``fn``: ``model``, or it
    through torch.compile), under ``autocast`` (a factory of contexts, as ``autocast`` returns; None: autocast off).
    The parameters' ``.grad`` are left cleared."""
    if autocast is None:
        autocast = lambda: torch.autocast(inputs[0].device.type, enabled=False)
    model.zero_grad(set_to_none=True)
    try:
        with autocast():
            loss_fn(fn(*inputs), labels).backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        model.zero_grad(set_to_none=True)


def _widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 (complex128 where complex): a model, its inputs and its gradients widened for the compile
    check's reference; ids and masks as they are."""
    if t.is_complex():
        return t.to(torch.complex128)
    return t.double() if t.is_floating_point() else t


def float64_gradients(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], labels,
                      loss_fn=classification_loss) -> dict[str, torch.Tensor]:
    """``loss_gradients`` of a copy of ``model`` in float64: the module copied, not rebuilt (its random features,
    masks and other buffers are the same numbers), its parameters and buffers widened (complex ones to complex128),
    in eval mode (nothing random is drawn), on ``inputs`` widened alike, with float64 the default dtype meanwhile (for
    tensors the model creates). Raises where the model does not run in float64 or its gradients are not finite."""
    twin = copy.deepcopy(model)._apply(_widen).eval()
    wide = tuple(_widen(t) if isinstance(t, torch.Tensor) else t for t in inputs)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        grads = loss_gradients(twin, twin, wide, labels, None, loss_fn)
    finally:
        torch.set_default_dtype(default)
    for name, g in grads.items():
        if not torch.isfinite(g).all():
            raise FloatingPointError(f"{name}'s float64 gradient is not finite")
    return grads


def relative_errors(grads: dict, reference: dict, names) -> dict[str, float]:
    """|g - g_ref| / |g_ref| for each of ``names`` (a gradient missing from either is zero), |g_ref| floored at 1e-3
    of the largest reference gradient's (a gradient near 0 is all rounding); in float64; inf where not finite."""
    sizes = {n: _widen(reference[n]).norm().item() if n in reference else 0.0 for n in names}
    floor = max(1e-3 * max(sizes.values(), default=0.0), torch.finfo(torch.float64).tiny)
    errors = {}
    for n in names:
        g, ref = grads.get(n), reference.get(n)
        diff = (_widen(g) if g is not None else 0.0) - (_widen(ref) if ref is not None else 0.0)
        error = torch.as_tensor(diff).norm().item() / max(sizes[n], floor)
        errors[n] = error if math.isfinite(error) else math.inf
    return errors


@dataclass
class GradientCheck:
    """What ``compiled_gradient_check`` found. ``precision``: the attempt whose graphs compiled (fp32, else bf16); None
    where none did. ``failed``: [(precision, error type)] of the attempts that did not compile. ``name``: the
    parameter nearest its bound (or furthest past it), ``compiled_error`` and ``eager_error`` its gradients' distances
    from float64's (``relative_errors``), ``bound`` what the compiled one may be (COMPILE_ERROR_FACTOR x eager's +
    COMPILE_ERROR_FLOOR). ``no_float64``: why the model has no float64 reference; then ``compiled_error`` is the
    distance from the eager gradient, ``eager_error`` None and ``bound`` PAIRWISE_TOLERANCE."""

    precision: str | None = None
    name: str | None = None
    compiled_error: float = 0.0
    eager_error: float | None = None
    bound: float = 0.0
    failed: list[tuple[str, str]] = field(default_factory=list)
    no_float64: str | None = None

    @property
    def rejected(self) -> bool:
        """The compiled model's gradients are not the model's: one is further off than the bound allows."""
        return self.precision is not None and not self.compiled_error <= self.bound

    def describe(self) -> str:
        """The finding in a line: the parameter and both errors, with the bound (none where nothing compiled)."""
        if self.precision is None:
            return "no graph of the check compiled: the compiled gradients are unchecked"
        if self.no_float64 is None:
            return (f"{self.name}'s gradient is {self.compiled_error:.2e} of its size off float64's compiled, "
                    f"{self.eager_error:.2e} eager (bound {COMPILE_ERROR_FACTOR:g} x eager + "
                    f"{COMPILE_ERROR_FLOOR[self.precision]:.1e} = {self.bound:.2e}) in {self.precision}")
        return (f"{self.name}'s gradient differs from the eager one by {self.compiled_error:.2e} of its size "
                f"(tolerance {self.bound:g}, compiled against eager: no float64 reference) in {self.precision}")

    def notes(self) -> list[str]:
        """Lines for the log on how the check ran: attempts that did not compile, a missing float64 reference."""
        lines = [f"torch.compile failed on it in {precision} ({kind})" for precision, kind in self.failed]
        if self.no_float64 is not None:
            lines.append(f"the model does not run in float64 ({self.no_float64}), so its compiled gradients are "
                         f"compared with its eager ones")
        return lines


def compile_check_due(setting: str, compiled: bool) -> bool:
    """Whether a compiled model's gradients are checked before it runs (``trainer.compile_check``,
    ``bench.compile_check``, layer_bench's ``--compile-check``): true or auto, on every device. Inductor's code is
    wrong in places on the CPU as on CUDA (torch 2.13's CPU backward of a padded tensor's overlapping ``unfold``),
    and a run compiled on a CPU trains on what it computes as much as one on a card."""
    return compiled and setting in ("true", "auto")


def refuse_compiled(model: str, where: str, compile_setting: str, section: str) -> str:
    """What a check that rejected ``model``'s compiled form decides (the runner's and the bench's one rule), with the
    finding in a line, ``where`` saying what the check found on what: with ``<section>.compile=auto`` the model runs
    eagerly (this returns the line, for the log); asked for explicitly, compiling was the user's choice, and the
    finding is an error with the ways out."""
    report = f"torch.compile gives {model} other gradients than the eager model: {where}"
    if str(compile_setting).lower() != "auto":
        raise RuntimeError(f"{report}. {section}.compile=auto runs it eagerly instead; {section}.compile_check=false "
                           f"runs it compiled regardless")
    return report


def is_compile_error(error: BaseException) -> bool:
    """An error raised while torch.compile traced or compiled (Dynamo, Inductor), not by the model's own code."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error, 160)}"


def compiled_gradient_check(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], labels, bf16=None,
                            loss_fn=classification_loss) -> GradientCheck:
    """The compile check (the runner's ``check_compiled_gradients``, the bench's, and the GPU test over the
    registry): the loss gradients of ``model`` through a fresh torch.compile and of ``model`` eagerly, in fp32 and
    eval mode (nothing random differs between the calls), each against a float64 copy's (``float64_gradients``), by
    the rule of COMPILE_ERROR_FACTOR. Where the fp32 graphs do not compile and ``bf16`` (the run's autocast factory)
    is given, compiled and eager under it, against the same float64 gradients. Where the model does not run in float64
    (any error there, an out-of-memory included), compiled against eager at PAIRWISE_TOLERANCE. Each attempt's graphs
    are dropped after it; errors other than torch.compile's are raised; the model is left as it was found, its
    gradients cleared."""
    was_training = model.training
    model.eval()
    check = GradientCheck()
    try:
        try:
            reference = float64_gradients(model, inputs, labels, loss_fn)
        except Exception as e:  # noqa: BLE001 - whatever stops float64 (a kernel, a dtype, memory): the pairwise rule
            reference, check.no_float64 = None, _first_line(e)
        if reference is None:  # the failed copy's tensors, held by the error's frames until now
            gc.collect()
            if inputs[0].is_cuda:
                torch.cuda.empty_cache()
        for precision, autocast in (("fp32", None), ("bf16", bf16)):
            if precision == "bf16" and bf16 is None:
                break
            try:
                eager = loss_gradients(model, model, inputs, labels, autocast, loss_fn)
                compiled = loss_gradients(model, torch.compile(model), inputs, labels, autocast, loss_fn)
            except Exception as e:
                if not is_compile_error(e):
                    raise
                check.failed.append((precision, type(e).__name__))
                continue
            finally:
                torch._dynamo.reset()  # the check's graphs go; training compiles its own
            check.precision = precision
            names = list(dict.fromkeys([*(reference or eager), *eager, *compiled]))
            if not names:  # no parameter has a gradient: nothing to tell apart
                return check
            if reference is None:
                errors, eager_errors = relative_errors(compiled, eager, names), None
                bounds = dict.fromkeys(names, PAIRWISE_TOLERANCE[precision])
            else:
                errors = relative_errors(compiled, reference, names)
                eager_errors = relative_errors(eager, reference, names)
                bounds = {n: COMPILE_ERROR_FACTOR * eager_errors[n] + COMPILE_ERROR_FLOOR[precision] for n in names}
            worst = max(names, key=lambda n: (not errors[n] <= bounds[n],
                                              errors[n] / bounds[n] if math.isfinite(bounds[n]) else 0.0))
            check.name = worst
            check.compiled_error, check.bound = errors[worst], bounds[worst]
            check.eager_error = None if eager_errors is None else eager_errors[worst]
            return check
        return check
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)


def train_step(model, optimizer, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor, *, autocast, grad_clip=None,
               scheduler=None, loss_weight: float = 1.0, loss_fn=classification_loss) -> torch.Tensor:
    """One optimisation step: forward, loss, backward, clip, AdamW, schedule. ``inputs``: the model's arguments
    (the ids, or a packed batch). ``loss_weight``: what the loss is multiplied by for the backward (a data-parallel
    rank's share, ``World.loss_weight``). ``loss_fn(outputs, labels)``: the loss (pretraining's counts its
    predicted tokens as well: ``lra.train.pretrain.TokenLoss``). Returns the loss, unweighted (not synchronised)."""
    with autocast():
        loss = loss_fn(model(*inputs), labels)
    (loss * loss_weight if loss_weight != 1.0 else loss).backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return loss.detach()


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: the default one, plus one per distinct ``_optim`` setting a mixer put on its parameters
    (e.g. an SSM's lower learning rate and no weight decay)."""
    default, special = [], {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        opts = getattr(p, "_optim", None)
        if opts:
            special.setdefault(tuple(sorted(opts.items())), []).append(p)
        else:
            default.append(p)
    groups = [{"params": default, "weight_decay": weight_decay}] if default else []
    groups += [{"params": ps, **dict(key)} for key, ps in special.items()]
    return groups


def build_optimizer(model: torch.nn.Module, optim, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameter_groups(model, optim.weight_decay), lr=optim.lr, betas=tuple(optim.betas),
                             eps=optim.eps, fused=device.type == "cuda")


def lr_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """LRA's schedules as products of factors (``utils/train_utils.py``), ``step`` counting from 1."""
    warm = min(1.0, step / warmup) if warmup else 1.0
    if schedule == "rsqrt":
        return warm / math.sqrt(max(step, warmup, 1))
    if schedule == "cosine":
        progress = (max(0, step - warmup) / max(total, 1)) % 1.0
        return warm * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    if schedule == "constant":
        return warm
    raise ValueError(f"optim.lr_schedule must be rsqrt, cosine or constant, got {schedule!r}")


def build_scheduler(optimizer, optim, total_steps: int):
    """Scales each group's own learning rate (so ``_optim`` groups keep their ratio to the base)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s + 1, optim.lr_schedule, optim.warmup_steps, total_steps))


@dataclass
class TaskShape:
    """What a model needs to know of its data."""

    vocab_size: int
    seq_len: int
    n_classes: int
    pair: bool = False
    padded: bool = True  # False: no token is ever 0, so the model runs mask-free (see ``lra.train.encoder.Classifier``)
    grid: tuple[int, int] | None = None


def build_model(name: str, options: dict, backbone, shape: TaskShape) -> Classifier:
    """The classifier a run trains and the bench times."""
    return build_classifier(name, options, backbone, shape.vocab_size, shape.seq_len, shape.n_classes,
                            pair=shape.pair, padded=shape.padded, grid=shape.grid)


def set_mixer_attributes(model: torch.nn.Module, name: str, attributes: dict) -> None:
    """Set ``attributes`` (how a mixer runs: its ``backend``, ``scan``, ... as ``models.base.execution_settings``
    lists them) on every mixer of registry model ``name`` in ``model`` (a whole model, or the mixer itself); a
    setting the mixer does not declare, or a value outside its allowed ones, is an error raised here rather than at
    its first call (``models.base.checked_setting``)."""
    cls = get_model_class(name)
    checked = {key: checked_setting(cls, key, value, name) for key, value in attributes.items()}
    for mixer in (m for m in model.modules() if isinstance(m, cls)):
        for key, value in checked.items():
            setattr(mixer, key, value)


def median_and_spread(times: list[float]) -> tuple[float, float, float]:
    """(median, 10th percentile, 90th percentile) of timed calls, in their unit: the spread says whether two
    medians differ by more than the noise of the machine. A single call is its own spread. Interpolated between the
    calls (``inclusive``): the default method extrapolates past the fastest and slowest of a few calls, below zero
    even."""
    median = statistics.median(times)
    if len(times) < 2:
        return median, median, median
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return median, deciles[0], deciles[8]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> str:
    """Start a new peak; returns what the next ``peak_memory_mb`` measures."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_allocated"
    try:  # Linux: writing 5 resets the process's peak resident set (VmHWM) to its current size
        Path("/proc/self/clear_refs").write_text("5")
        return "peak_rss"
    except OSError:
        return "peak_rss_since_start"


def peak_memory_mb(device: torch.device) -> float:
    """CUDA allocator peak on a GPU; the process's peak resident set on CPU (since the last reset where possible)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def release_leftovers(device: torch.device) -> float:
    """Frees what earlier measurements left on the GPU (reference cycles, the last compiled model's graphs, cached
    blocks) and returns the MB still allocated (a package's or a mixer's module-level caches, say), which a
    measurement takes off its peak: otherwise a row after a leaky one counts the leak as its own memory. Off CUDA the
    peak is the process's, and nothing is taken off."""
    if device.type != "cuda":
        return 0.0
    gc.collect()
    torch._dynamo.reset()  # before the count: a measurement's own reset would free them inside it
    # cuBLAS keeps its workspace (tens of MB) from the first matmul on: freed so that every row pays its own,
    # as a row alone in its process does, and not only the first row of a sweep
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / 2**20


# the profiler's key of a Python call of ours: "lra/train/run.py(421): step", or the whole path where the profiler could
# not strip it (it strips the sys.path entries it knows of)
OWN_FUNCTION = re.compile(r"(?:^|/)((?:lra|models)/[\w/]+\.py\(\d+\): .*)")


def own_functions(trace_events: list[dict], rows: int = 30) -> str:
    """The profiled calls of our own Python functions, by host time including their callees: which function of the
    harness or of a model a host-bound step spends its time in. ``trace_events``: the exported trace's events, whose
    ``python_function`` entries the profiler records under ``with_stack`` (read from the trace, not from
    ``key_averages()``, which leaves Python calls out in some torch versions)."""
    totals: dict[str, list[float]] = {}
    for e in trace_events:
        if e.get("cat") == "python_function" and (m := OWN_FUNCTION.search(e.get("name", ""))):
            total = totals.setdefault(m.group(1), [0.0, 0])
            total[0], total[1] = total[0] + float(e.get("dur", 0.0)), total[1] + 1
    if not totals:
        return "(the profiler recorded no Python calls of lra/ or models/)"
    calls = sorted(totals.items(), key=lambda kv: -kv[1][0])
    lines = [f"{'function':<70} {'host ms':>10} {'calls':>7} {'ms/call':>9}"]
    lines += [f"{name[:70]:<70} {us / 1e3:>10.2f} {n:>7} {us / 1e3 / n:>9.3f}" for name, (us, n) in calls[:rows]]
    return "\n".join(lines)


class StepProfiler:
    """``trainer.profile_steps``: torch.profiler over that many training steps right after the timing warm-up;
    writes ``profile.txt`` and ``profile_trace.json`` (for chrome://tracing or Perfetto) into the run folder, then
    steps aside. ``profile.txt`` holds three tables: operators and kernels by self time on the device (on a GPU),
    operators by self time on the host, and the host time of the harness's and the models' own functions, each
    with all it calls (where a step is bound by the host, the last says which function to look at)."""

    def __init__(self, device: torch.device, start: int, steps: int, out_dir: Path):
        self.device, self.start, self.stop, self.out_dir = device, start, start + steps, Path(out_dir)
        self._prof = None

    def before_step(self, step: int) -> None:
        if step == self.start and self.stop > self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, with_stack=True)
            self._prof.__enter__()

    def after_step(self, step: int) -> None:
        """``step``: the number of steps done."""
        if self._prof is None or step < self.stop:
            return
        synchronize(self.device)
        self._prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "profile_trace.json"
        self._prof.export_chrome_trace(str(trace))
        averages = self._prof.key_averages()  # one aggregation for the operator tables
        tables = {"host time by operator": averages.table(sort_by="self_cpu_time_total", row_limit=30,
                                                          max_name_column_width=80),
                  "host time by function of lra/ and models/, with what it calls": own_functions(
                      json.loads(trace.read_text())["traceEvents"])}
        if self.device.type == "cuda":
            tables = {"device time by operator and kernel": averages.table(
                sort_by="self_device_time_total", row_limit=40, max_name_column_width=80), **tables}
        text = "".join(f"\n== {title}\n{table}\n" for title, table in tables.items())
        (self.out_dir / "profile.txt").write_text(f"steps {self.start + 1}-{self.stop}\n{text}")
        self._prof = None


class StepTimer:
    """Synchronised wall time of training steps only: the first ``warmup`` steps (compilation, allocator warm-up)
    and everything between ``pause()`` and the next step (evaluation, checkpoints) are excluded. ``steps`` and
    ``seconds`` accumulate across resumes when restored from a checkpoint."""

    def __init__(self, device: torch.device, warmup: int, steps: int = 0, seconds: float = 0.0):
        self.device, self.warmup_left, self.steps, self.seconds = device, warmup, steps, seconds
        self._start: float | None = None
        self._open = 0

    def before_step(self) -> None:
        if self.warmup_left == 0 and self._start is None:
            synchronize(self.device)
            self._start = time.perf_counter()

    def after_step(self) -> None:
        if self.warmup_left > 0:
            self.warmup_left -= 1
        else:
            self._open += 1

    def pause(self) -> None:
        """Close the running segment (synchronising), so what follows is not timed."""
        if self._start is not None and self._open:
            synchronize(self.device)
            self.seconds += time.perf_counter() - self._start
            self.steps += self._open
        self._start, self._open = None, 0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else float("nan")

    def running(self) -> tuple[int, float]:
        """(timed steps, seconds) so far, the open segment included (not synchronised: an estimate)."""
        if self._start is None:
            return self.steps, self.seconds
        return self.steps + self._open, self.seconds + time.perf_counter() - self._start
