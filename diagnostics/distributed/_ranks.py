"""Starting the ranks: W forked processes in one gloo group, each running the same list of jobs on its own rank and
sending each job's result home as it finishes; whatever happens, every process is ended and every file removed.

Why each choice:
- fork, not spawn: the child inherits the layer, the inputs and the factory as they are (nothing to pickle, nothing
  to import again): a check of a small layer costs 0.2-0.3 s at 2 ranks and 0.4-0.65 s at 4, where spawn costs 6-18 s.
- `torch.set_num_threads(1)` first thing in the child: a forked child that touches the OpenMP pool its parent started
  hangs; one thread a rank is also what the ranks sharing the machine's cores want.
- a FileStore in a fresh temporary folder: no port to pick, collide with or leave open.
- an explicit collective timeout (gloo's default is 30 minutes), and a deadline of the parent's own: a rank that
  hangs outside any collective is killed by it.
- results travel pickled as bytes through a pipe (plain pickle: no shared-memory file descriptors left behind).
- the child ignores Ctrl-C, and dies with its parent (Linux's PR_SET_PDEATHSIG): the parent's `finally` ends them.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Callable

import torch

TEMP_PREFIX = "attention-sharded-"
"""Every group's temporary folder is named so (tests count them: none may stay behind)."""


@dataclass(frozen=True)
class Job:
    """One piece of work every rank runs: `run(rank, world_size, group)` returns what is sent home (picklable)."""

    name: str
    run: Callable = field(repr=False)


@dataclass(frozen=True)
class RankFailure:
    """A rank that did not finish a job: it raised (`kind` "raised", with the exception and the innermost frame
    outside torch), hung past the deadline ("hung"), or exited without a word ("exited", with its exit code); or it
    lost its peers, its collective failing because another rank had failed ("lost": gloo's "connection closed",
    "timed out"), or was stopped for that reason before it said anything ("stopped")."""

    rank: int
    job: str
    kind: str
    error: str = ""

    def describe(self) -> str:
        what = {"raised": f"raised {self.error}", "hung": f"did not answer within the timeout ({self.error})",
                "exited": f"exited ({self.error}) without reporting", "stopped": "was stopped after another rank failed",
                "lost": f"lost its peers ({self.error})"}
        return f"rank {self.rank} {what[self.kind]} in job {self.job!r}"

    @property
    def primary(self) -> bool:
        """The rank's own failure, not a consequence of another's."""
        return self.kind in ("raised", "exited", "hung")


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Socket Timeout",
             "Broken pipe")
"""Words of gloo's errors when a collective's peer is gone or silent: the consequence of another rank's failure."""


@dataclass
class Session:
    """What one group of ranks returned: {job: [result of rank 0, 1, ...]} for the jobs every rank finished, the
    failures (empty when every job ran), and the timings."""

    world_size: int
    results: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    startup_s: float = 0.0  # fork to every rank in the group
    seconds: float = 0.0  # fork to the last process ended

    @property
    def failed_job(self) -> str | None:
        return self.failures[0].job if self.failures else None


def distributed_available(device: str = "cpu", world_size: int = 2) -> tuple[bool, str]:
    """(whether this torch can run the audit's groups on `device`, why not)."""
    import torch.distributed as dist

    if device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
            return False, (f"{world_size} ranks on CUDA need {world_size} GPUs (NCCL puts one rank on each); "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} available")
        if not dist.is_nccl_available():
            return False, "torch.distributed has no NCCL backend in this build of torch"
        if torch.cuda.is_initialized():
            return False, ("CUDA is already initialised in this process, and a forked child cannot use it: run the "
                           "audit before anything touches CUDA (the audit computes its references on the CPU)")
    if not dist.is_available():
        return False, "torch.distributed is not available in this build of torch"
    if not dist.is_gloo_available():
        return False, "torch.distributed has no gloo backend in this build of torch"
    if not hasattr(os, "fork"):
        return False, "this platform cannot fork processes (the audit forks its ranks)"
    if not _forked_backward_runs():
        return False, ("this process has run a backward pass on a machine with a GPU, which started autograd's device "
                       "threads, and a forked rank cannot run backward after that (torch: \"Unable to handle "
                       "autograd's threading in combination with fork-based multiprocessing\"): run the sharded audit "
                       "before any backward pass in the process (first in the script, or `attention-audit sharded` "
                       "in a process of its own)")
    return True, ""


_FORK_UNSAFE = False  # once a process's autograd has started its device threads, it stays so


def _forked_backward_runs() -> bool:
    """Whether a rank forked from this process can run a backward pass. On a machine with a GPU, the first backward
    pass a process runs (on any device) starts autograd's device threads, and from then on a forked child's backward
    raises: seen on an H200, where every sharded check in a pytest worker that had audited other layers first failed
    `sharded_runs` on its own ranks. Without a GPU no such threads exist and nothing is forked to ask."""
    global _FORK_UNSAFE
    if _FORK_UNSAFE:
        return False
    if not torch.cuda.is_available():
        return True
    _FORK_UNSAFE = not backward_in_a_fork()
    return not _FORK_UNSAFE


def backward_in_a_fork() -> bool:
    """Fork a child that runs the backward pass of one number (`in_a_fork`): whether it could (a fork costs this
    process nothing it keeps; the child shares its memory copy-on-write and never returns into the caller's code)."""
    def one_backward() -> bool:
        x = torch.ones(1, requires_grad=True)
        (x * 2).sum().backward()
        return True

    try:
        return in_a_fork(one_backward)
    except Exception:  # autograd's threading and the fork: the child's backward raised
        return False


def in_a_fork(fn: Callable):
    """`fn()` computed in a forked child and sent home pickled, so that what it runs (a backward pass) leaves this
    process as it was: on a machine with a GPU the first backward pass starts autograd's device threads, after which
    no forked rank can run one (`_forked_backward_runs`). The child's exception is raised here (as a RuntimeError with
    its text where it cannot be pickled)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send, gone (no atexit of the parent's may run in a fork)
        try:
            os.close(reader)
            torch.set_num_threads(1)  # a forked child that touches its parent's OpenMP pool hangs
            try:
                message = pickle.dumps(("ok", fn()))
            except BaseException as error:
                try:  # the exception itself where it travels (an AuditUsageError the caller reports), else its text
                    message = pickle.dumps(("raised", error))
                except Exception:
                    message = pickle.dumps(("raised", f"{type(error).__name__}: {error}"))
            with os.fdopen(writer, "wb") as out:
                out.write(message)
        finally:
            os._exit(0)
    os.close(writer)
    try:
        with os.fdopen(reader, "rb") as answer:
            data = answer.read()
    finally:
        os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("the forked child exited without an answer")
    kind, value = pickle.loads(data)
    if kind != "ok":
        raise value if isinstance(value, BaseException) else RuntimeError(value)
    return value


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's finally still ends the child
        pass


def _user_frame(error: BaseException) -> str:
    """The innermost frame outside torch and this package, as `file:line in function`."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith((here, os.path.dirname(torch.__file__)))]
    return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def _child(rank: int, world_size: int, store_path: str, jobs: list[Job], writer, timeout_s: float,
           device: str) -> None:
    torch.set_num_threads(1)  # before any torch op: a forked child hangs in its parent's OpenMP pool otherwise
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends the ranks
    _die_with_parent()
    import torch.distributed as dist

    def send(*message) -> None:
        writer.send_bytes(pickle.dumps(message))

    job = "start"
    try:
        backend = "gloo"
        if device == "cuda":  # one GPU a rank, NCCL between them (the parent never touched CUDA: see run_group)
            torch.cuda.set_device(rank)
            torch.backends.cuda.matmul.allow_tf32 = False  # the references are computed without TF32
            torch.backends.cudnn.allow_tf32 = False
            backend = "nccl"
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        send("ready", "")
        for job_ in jobs:
            job = job_.name
            send("start", job)
            send("done", job, job_.run(rank, world_size, dist.group.WORLD))
        send("finished", "")
    except BaseException as error:  # the layer's exception is the finding: send it home, then go
        text = f"{type(error).__name__}: {str(error).strip()[:300]}{_user_frame(error)}"
        try:
            send("raised", job, text)
        except Exception:
            pass
    finally:
        writer.close()
        os._exit(0)  # no atexit of the parent's (pytest's, the group's) may run in a fork


def run_group(world_size: int, jobs: list[Job], *, timeout: float, device: str = "cpu") -> Session:
    """Run `jobs` on `world_size` forked ranks (gloo on the CPU; `device="cuda"`: NCCL, rank r on GPU r); a rank silent
    for `timeout` + 2 s has hung; leaves no process and no file behind, Ctrl-C included."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    folder = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    session = Session(world_size)
    processes, readers = [], {}
    started = time.perf_counter()
    try:
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)
            p = context.Process(target=_child, args=(rank, world_size, os.path.join(folder, "store"), jobs, writer,
                                                     timeout, device), daemon=True, name=f"attention-sharded-rank{rank}")
            p.start()
            writer.close()
            processes.append(p)
            readers[reader] = rank
        _collect(session, processes, readers, jobs, started, timeout)
    finally:
        _end(processes)
        for reader in readers:
            reader.close()
        shutil.rmtree(folder, ignore_errors=True)
        session.seconds = time.perf_counter() - started
    return session


def _collect(session: Session, processes: list, readers: dict, jobs: list[Job], started: float, timeout: float) -> None:
    """Read the ranks' messages until every rank finished or failed; a rank's own failure (raised, exited) gives the
    others 0.3 s to report theirs, then they are stopped; a rank silent past the patience has hung."""
    W = session.world_size
    patience = timeout + 2.0  # past the ranks' own collective timeout, so that a waiting peer reports first
    deadline = started + patience  # moved on by every message: a hang is a rank silent for that long
    current = {r: "start" for r in range(W)}  # the job each rank is in
    done: dict[str, dict[int, object]] = {}
    ready, finished, open_readers = set(), set(), dict(readers)
    sentinels = {p.sentinel: r for r, p in enumerate(processes)}
    failed_at = None  # once a rank fails, the others get a moment to report their own error, then stop
    while len(finished) < W:
        now = time.perf_counter()
        limit = deadline if failed_at is None else min(deadline, failed_at + 0.3)
        if now >= limit:
            break
        waiting = list(open_readers) + [s for s, r in sentinels.items() if r not in finished]
        for ready_one in connection.wait(waiting, timeout=limit - now):
            if ready_one in open_readers:
                rank = open_readers[ready_one]
                try:
                    kind, job, *rest = pickle.loads(ready_one.recv_bytes())
                except (EOFError, OSError):
                    del open_readers[ready_one]
                    continue
                if kind in ("ready", "start", "done"):  # progress
                    deadline = time.perf_counter() + patience
                if kind == "ready":
                    ready.add(rank)
                    if len(ready) == W:
                        session.startup_s = time.perf_counter() - started
                elif kind == "start":
                    current[rank] = job
                elif kind == "done":
                    done.setdefault(job, {})[rank] = rest[0]
                elif kind == "finished":
                    finished.add(rank)
                elif kind == "raised":
                    lost = any(words in rest[0] for words in PEER_LOST)
                    session.failures.append(RankFailure(rank, job, "lost" if lost else "raised",
                                                        rest[0].split(". ")[0] if lost else rest[0]))
                    finished.add(rank)
                    if not lost:  # a lost peer waits for the rank that failed (or the deadline) to show itself
                        failed_at = failed_at or time.perf_counter()
            else:
                rank = sentinels[ready_one]
                if rank not in finished and not any(f.rank == rank for f in session.failures):
                    # the pipe may still hold its last words: read them before calling it an exit
                    reader = next((c for c, r in open_readers.items() if r == rank), None)
                    if reader is not None and reader.poll(0):
                        continue
                    processes[rank].join(0.5)
                    code = processes[rank].exitcode
                    session.failures.append(RankFailure(rank, current[rank], "exited", f"exit code {code}"))
                    finished.add(rank)
                    failed_at = failed_at or time.perf_counter()
    timed_out = time.perf_counter() >= deadline
    for rank in range(W):
        if rank not in finished:
            kind = "hung" if timed_out and not any(f.primary for f in session.failures) else "stopped"
            session.failures.append(RankFailure(rank, current[rank], kind, f"silent for {patience:g} s"))
    session.failures.sort(key=lambda f: ({"raised": 0, "exited": 1, "hung": 2, "lost": 3, "stopped": 4}[f.kind], f.rank))
    for job in jobs:  # the jobs every rank finished, in order
        if len(done.get(job.name, {})) == W:
            session.results[job.name] = [done[job.name][r] for r in range(W)]


def _end(processes: list) -> None:
    """Every process ended: SIGTERM, a moment, SIGKILL, and reaped."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    stop = time.perf_counter() + 1.0
    for p in processes:
        p.join(timeout=max(0.0, stop - time.perf_counter()))
        if p.is_alive():
            p.kill()
            p.join()
        p.close()


__all__ = ["Job", "RankFailure", "Session", "TEMP_PREFIX", "distributed_available", "in_a_fork", "run_group"]
