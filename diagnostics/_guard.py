"""The state guard every floor uses: whatever diagnostics does to a layer or a model, it leaves it as it was.

`untouched(layer, device)` runs the body in eval mode and afterwards restores training flags, every parameter
and buffer (persistent or not, even one the layer replaced, or made or set on its first call, with the plain
attributes that record it), every `.grad` and the global RNG state. The
layer audit, its trial calls, localisation's replays and the model audit all run inside it; `seed_rng(seed,
device)` is how they seed the generators the layer draws from, inside it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn


@contextlib.contextmanager
def untouched(layer, device):
    """Eval mode during the body; afterwards training flags, every parameter and buffer (persistent or
    not, even if the layer replaced it, set one registered as None or registered one more: a cache made on its first
    call), the plain attributes that record such state (its length, a flag that it was built: `registries`), every
    .grad and the global RNG state are as they were. Yields `as_given()`, which puts all that state back
    as it came (values, entries and attributes), inside the body too (a locator replaying a layer's first call, whose cache the audit's
    calls have filled)."""
    modules = list(layer.modules()) if isinstance(layer, nn.Module) else []
    modes = [m.training for m in modules]
    # (module, registry, name, the original tensor object, a copy of its values)
    slots = [(m, registry, name, t, t.detach().clone())
             for m in modules for registry in (m._parameters, m._buffers)
             for name, t in registry.items() if t is not None]
    entries = registries(layer)  # as they came, None ones included
    grads = [(t, None if t.grad is None else t.grad.clone()) for _, registry, _, t, _ in slots
             if isinstance(t, nn.Parameter) or t.is_leaf and t.requires_grad]  # a TorchScript module's are plain
    cuda = [device] if torch.device(device).type == "cuda" else []

    def as_given() -> None:
        entries()  # a buffer the layer reassigned (a growing cache), set from None or registered, goes back, and what
        # records it (a cache's length, a `built` flag) with it
        with torch.no_grad():
            for m, registry, name, original, values in slots:
                if not torch.equal(original.detach(), values):
                    original.detach().copy_(values)

    with torch.random.fork_rng(devices=cuda):
        try:
            if modules:
                layer.eval()
            yield as_given
        finally:
            for m, mode in zip(modules, modes):
                m.train(mode)
            as_given()
            for t, grad in grads:
                t.grad = grad


def compiled_simply(audit_fn):
    """`audit_fn(layer, ...)` run under `script_executor(layer)`, its signature and docstring kept (`functools.wraps`:
    the pytest plugin and the command line read the audit's parameters from its signature)."""
    @functools.wraps(audit_fn)
    def run(layer, *args, **kwargs):
        with script_executor(layer):
            return audit_fn(layer, *args, **kwargs)

    return run


def script_executor(layer):
    """TorchScript's simple executor while inside, where `layer` holds a compiled module (else nothing changes): the
    profiling executor's first runs of a traced graph fail under a dispatch mode, as the audit's observers are
    (aten::equal given an int: a correct traced layer failed `runs`); the simple executor runs the same ops."""
    compiled = isinstance(layer, nn.Module) and any(isinstance(m, torch.jit.ScriptModule) for m in layer.modules())
    return torch.jit.optimized_execution(False) if compiled else contextlib.nullcontext()


def cut_from(copied: nn.Module, original: nn.Module) -> nn.Module:
    """`copied` (a deepcopy of `original`, before any conversion) with every parameter a leaf of its own: a TorchScript
    module's deepcopy clones its parameters with autograd history, so the copy's backward would reach the user's
    parameters (a .grad written there) and leave the copy's own .grad unset (the float64 copy's gradients all read 0)."""
    for mine, theirs in zip(copied.parameters(), original.parameters()):
        if not mine.is_leaf:
            mine.detach_().requires_grad_(theirs.requires_grad)
    return copied


PLAIN = (bool, int, float, str, bytes, type(None), torch.Tensor, tuple)
"""The plain attributes a module's state is kept in beside its registries (a cache's length, a flag that it was built,
a tensor held as an attribute): restored with them, so that a cache and what records it agree."""


def registries(layer):
    """A function that puts `layer`'s modules' state back as it was when this was called: every parameter and buffer
    entry to the tensor (or None) it held, unregistering what was registered since (the objects, not their values),
    and every plain attribute (`PLAIN`: a rotary cache's `max_seq_len_cached`, a `built` flag) to its value, deleting
    those set since; `training` is left to the caller. The audit keeps one at its end (`Probe.as_left`), so that a
    locator can replay a failure that depended on what the audit's calls left in the layer (a cache made at one
    length, read at another) once the layer is back as it came."""
    # a TorchScript module's registries are fixed when it is compiled (none can be added, removed or reassigned), and
    # its attributes live in the compiled object: only its values change, which `untouched` puts back
    modules = [m for m in layer.modules() if not isinstance(m, torch.jit.ScriptModule)] \
        if isinstance(layer, nn.Module) else []
    held = [(registry, dict(registry)) for m in modules for registry in (m._parameters, m._buffers)]
    transient = [(m, set(m._non_persistent_buffers_set)) for m in modules]
    plain = [(m, {k: v for k, v in vars(m).items() if _plain(k, v)}) for m in modules]

    def put_back() -> None:
        for registry, entries in held:
            for name in [n for n in registry if n not in entries]:
                del registry[name]
            registry.update(entries)
        for m, names in transient:
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(names)
        for m, attributes in plain:
            now = vars(m)
            for name in [k for k, v in now.items() if k not in attributes and _plain(k, v)]:
                del now[name]
            now.update(attributes)

    return put_back


def _plain(name: str, value) -> bool:
    return not name.startswith("_") and name != "training" and isinstance(value, PLAIN)


def seed_rng(seed: int, device="cpu") -> None:
    """Seed the global generators a layer's own randomness (dropout) draws from: the CPU's, and that of the layer's
    device. `torch.manual_seed` seeds every device type and, where CUDA is not initialised (any CPU-only machine),
    queues the seed for CUDA, XPU and MTIA with a formatted stack trace each: 0.26 ms a call from a shallow stack,
    1.4 ms from 60 frames deeper (this function: 0.006 and 0.010 ms), 6.3 s of this project's suite in 3,900 calls
    (on 2 slow cores, where `import torch` took 2.8 s)."""
    torch.random.default_generator.manual_seed(seed)
    device = torch.device(device)
    if device.type == "cuda":  # that GPU alone: `untouched` restores the generators of the CPU and the layer's device
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)


def flushing_denormals() -> bool:
    """Whether this thread flushes denormal floats to zero (torch has a setter, no getter): 1e-30 * 1e-10 is 1e-40,
    a float32 denormal, or exactly 0 where they are flushed."""
    return bool((torch.tensor([1e-30]) * torch.tensor([1e-10]))[0] == 0)


@contextlib.contextmanager
def denormals_flushed():
    """The body runs with denormal floats flushed to zero in this thread (where the CPU can), and the thread's own
    setting is restored afterwards. The audit's perturbations push tokens 1000x, and a softmax over such logits
    leaves weights below float32's smallest normal (1.2e-38), whose arithmetic is slow on x86: flushing them cut a
    warm audit of MultiHeadAttention(512, 8) at seq_len 1024 by 13% of its CPU time (one thread), nothing at 128.
    No threshold reads a value that small: a change of 1e-38 is far below every tolerance (1e-10 of the outputs'
    RMS in float64). torch sets the flag for the calling thread only: intra-op worker threads keep theirs."""
    before = flushing_denormals()
    supported = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if supported:
            torch.set_flush_denormal(before)
