"""audit_sharded(): the sharded forms of the reference pass against their unsharded self, each one-step broken variant
of them fails with its detector and its cause named beside its correct twin on the same inputs, and a rank that
raises, hangs or exits is reported, naming it, leaving no process and no file behind.

Every test here forks groups of ranks: the module runs on one pytest-xdist worker (`--dist=loadscope`) and holds the
machine's lock on groups (`one_group_at_a_time`) while it runs, so that two groups never share the two cores at once.
The default run is a slice at 2 ranks (about 15 s); the full matrix (every correct form at 2 and 4 ranks, causal and
not, float32 and float64; Ctrl-C and the command line; torch's DTensor plans) is marked slow. Every broken variant of
the chapter beside its twin at 2 and 4 ranks, with its cause named, is a row of the kill matrix
(tests/test_kill_matrix.py, slow); the default run here checks eleven of them at 2 ranks and the replicas' one at 4.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from torch import nn  # noqa: E402

from diagnostics.distributed import TEMP_PREFIX, distributed_available  # noqa: E402

_OK, _WHY = distributed_available()
if not _OK:
    pytest.skip(f"the sharded audit needs torch.distributed with gloo: {_WHY}", allow_module_level=True)

import correct.sharded as cs  # noqa: E402
from buggy_variants._sharded import SHARDED_VARIANTS, ShardedSetting  # noqa: E402
from buggy_variants.teaching_sharded import audit_sharded_variant  # noqa: E402
from correct import MultiHeadAttention  # noqa: E402
from diagnostics import AuditUsageError  # noqa: E402
from diagnostics.distributed import SHARDED_DETECTORS, audit_sharded, shard_positions  # noqa: E402
from diagnostics.distributed._context import ShardedContext  # noqa: E402
from diagnostics.distributed.heads import check_heads_per_rank  # noqa: E402
from diagnostics.distributed.pytest_plugin import one_group_at_a_time  # noqa: E402

pytestmark = pytest.mark.xdist_group("distributed")
pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _groups_one_at_a_time():
    """The module's groups never run beside another worker's (the sharded kill matrix's)."""
    with one_group_at_a_time():
        yield


@pytest.fixture(autouse=True)
def _ranks_can_run_backward(request):
    """On a machine with a GPU, a worker that ran a backward pass in an earlier test can no longer fork ranks that run
    one (autograd's device threads): each test skips, saying so, instead of failing on its ranks."""
    if request.node.name.startswith("test_a_backward_pass_on_a_machine_with_a_gpu"):
        return  # the test of that very rule
    ok, why = distributed_available()
    if not ok:
        pytest.skip(why)

FORMS = {  # name: (factory, audit options)
    "ring": (lambda layer, rank, world_size, group: cs.RingAttention(layer, group), {}),
    "ring_zigzag": (lambda layer, rank, world_size, group: cs.RingAttention(layer, group), {"layout": "zigzag"}),
    "ring_striped": (lambda layer, rank, world_size, group: cs.RingAttention(layer, group), {"layout": "striped"}),
    "ulysses": (lambda layer, rank, world_size, group: cs.UlyssesAttention(layer, group), {}),
    "head_parallel": (lambda layer, rank, world_size, group: cs.HeadParallelAttention(layer, group), {"takes": "full"}),
    "sequence_parallel_zigzag": (lambda layer, rank, world_size, group:
                                 cs.SequenceParallel(cs.RingAttention(layer, group), "zigzag"), {"takes": "full"}),
}


def reference_layer(causal: bool, *, seed: int = 0, rotary: bool = False) -> MultiHeadAttention:
    torch.manual_seed(seed)
    layer = MultiHeadAttention(32, 8, causal=causal, rotary=rotary)
    with torch.no_grad():  # a trained layer's biases are not zero: a bias added twice must be able to show
        layer.out.bias.normal_()
    return layer


def leftovers() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), TEMP_PREFIX + "*"))


@pytest.fixture
def own_tempdir(tmp_path, monkeypatch):
    """The groups' folders made in this test's own folder: other processes' audits cannot mix in."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def children() -> list[int]:
    """This process's live child processes (read from /proc: multiprocessing knows only those it started)."""
    me, found = os.getpid(), []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(stat.split("/")[2]))
    return found


def audit_form(name: str, *, causal: bool, dtype=torch.float32, world_sizes=(2,), device="cpu", rotary=False):
    factory, options = FORMS[name]
    return audit_sharded(reference_layer(causal, rotary=rotary), factory, causal=causal, dtype=dtype, world_sizes=world_sizes,
                         device=device, **options)


# ---- correct forms -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, causal", [("ring_zigzag", True), ("head_parallel", False)])
def test_a_correct_sharded_layer_passes_every_check(name, causal):
    report = audit_form(name, causal=causal)
    assert report.status == "passed", str(report)
    measured = {r.detector for r in report.results if r.measured}
    assert {"sharded_runs", "sharded_output", "sharded_large_logits", "sharded_lengths",
            "sharded_gradients"} <= measured, str(report)
    assert ("sharded_causality" in measured) == causal
    assert ("sharded_ranks_agree" in measured) == (FORMS[name][1].get("takes") == "full")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(FORMS))
def test_every_correct_form_passes_at_2_and_4_ranks(name, causal, dtype):
    report = audit_form(name, causal=causal, dtype=dtype, world_sizes=(2, 4))
    assert report.status == "passed", str(report)
    assert not report.findings, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(FORMS))
def test_every_correct_form_of_a_rotary_layer_passes_at_2_and_4_ranks(name, causal):
    """RoPE turns each token by its global position in every form (the twin of ring_rotary_from_zero's catch)."""
    report = audit_form(name, causal=causal, world_sizes=(2, 4), rotary=True)
    assert report.status == "passed", str(report)
    assert not report.findings, str(report)


@pytest.mark.parametrize("pattern", [{"sliding_window": 4}, {"attention_chunk_size": 4}, {"prefix": 2}],
                         ids=lambda p: next(iter(p)))
def test_a_layer_with_a_pattern_of_its_own_is_refused_not_sharded_without_it(pattern):
    """No sharded form writes a layer's window, chunks or prefix: sharding one would drop it silently, so the form
    refuses it before any collective, with expected / seen / fix; its twins (no pattern, or packed documents, which
    every form honours) are every other test here."""
    layer = MultiHeadAttention(32, 8, causal=True, **pattern)
    for form in (cs.RingAttention, cs.UlyssesAttention, cs.HeadParallelAttention):
        with pytest.raises(ValueError, match=f"a layer without a pattern of its own.*{next(iter(pattern))}=.*Fix: "):
            form(layer)


DOCS = [5, 6, 5]  # three packed documents of 16 tokens: boundaries inside rank 0's shard and across ranks


def documents_layer(causal: bool, lengths=DOCS) -> MultiHeadAttention:
    torch.manual_seed(0)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    layer = MultiHeadAttention(32, 8, causal=causal, documents=ids)
    with torch.no_grad():
        layer.out.bias.normal_()
    return layer


def test_documents_packed_per_sequence_are_refused_by_the_forms():
    """One row of ids for the whole batch is what the forms write; a (B, T) packing is refused, expected / seen / fix
    (its twin: every documents test here)."""
    layer = MultiHeadAttention(32, 8, documents=torch.tensor([[0] * 8 + [1] * 8, [0] * 4 + [1] * 12]))
    for form in (cs.RingAttention, cs.UlyssesAttention, cs.HeadParallelAttention):
        with pytest.raises(ValueError, match=r"documents: one row of ids.*got documents of shape \(2, 16\).*Fix: "):
            form(layer)


def test_a_correct_ring_over_packed_documents_passes_every_check_with_documents_measured():
    factory, options = FORMS["ring_zigzag"]
    report = audit_sharded(documents_layer(True), factory, causal=True, world_sizes=(2,), documents=DOCS, **options)
    assert report.status == "passed", str(report)
    result = report.result("sharded_documents")
    assert result.verdict == "pass" and result.value is not None, str(report)  # measured: 0 here (masked keys weigh 0)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(FORMS))
def test_every_correct_form_over_packed_documents_passes_at_2_and_4_ranks(name, causal):
    """The twin of ring_documents_stay_home's catch, for every form and layout: ids as lengths and as a tensor."""
    factory, options = FORMS[name]
    for documents in (DOCS, torch.tensor([0] * 3 + [1] * 10 + [2] * 3)):
        lengths = DOCS if isinstance(documents, list) else [3, 10, 3]
        report = audit_sharded(documents_layer(causal, lengths), factory, causal=causal, world_sizes=(2, 4),
                               documents=documents, **options)
        assert report.status == "passed", str(report)
        assert report.result("sharded_documents").verdict == "pass" and not report.findings, str(report)


@pytest.mark.parametrize("declared, words", [
    ([5, 6, 4], "lengths >= 1 summing to seq_len=16"),
    (torch.tensor([0] * 8), r"a \(16,\) integer tensor"),
    ([8, 8], "the declared documents to pack the tokens as the layer's own"),
])
def test_a_documents_declaration_that_does_not_fit_is_refused(declared, words):
    with pytest.raises(AuditUsageError, match=words + ".*Fix: "):
        audit_sharded(documents_layer(True), FORMS["ring"][0], causal=True, documents=declared)


def test_documents_declared_for_a_layer_that_ignores_them_is_a_usage_error():
    """The unsharded layer is the yardstick: if it attends across the declared documents the declaration is wrong,
    not the sharded form; its twin is the passing audit above (the layer built with its documents)."""
    with pytest.raises(AuditUsageError, match="expected the unsharded layer to keep to the declared documents.*Fix: "):
        audit_sharded(reference_layer(True), FORMS["ring"][0], causal=True, documents=DOCS, world_sizes=(2,))


class Unmapped(cs.HeadParallelAttention):
    """A form that does not say how its parameters map (as a DTensor plan's module does not)."""

    unsharded_parameters = None


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "unmapped"])
def test_parameter_gradients_are_compared_where_the_form_maps_its_parameters(mapped):
    cls = cs.HeadParallelAttention if mapped else Unmapped
    report = audit_sharded(reference_layer(False), lambda layer, rank, world_size, group: cls(layer, group),
                           takes="full", world_sizes=(2,), detectors=["sharded_runs", "sharded_gradients"])
    result = report.result("sharded_gradients")
    assert result.verdict == "pass", str(report)
    assert ("every parameter's" in result.message) == mapped, result.message
    assert ("4 parameters' gradients compared" in result.evidence) == mapped, result.evidence
    assert ("parameters not compared at 2 ranks" in result.evidence) == (not mapped), result.evidence


def test_data_parallel_beside_context_parallel_passes_at_4_ranks_as_2_by_2():
    factory = lambda layer, rank, world_size, group: cs.DataContextParallel(layer, 2, group)  # noqa: E731
    report = audit_sharded(reference_layer(True), factory, causal=True, world_sizes=(4,), data_parallel=2)
    assert report.status == "passed", str(report)
    result = report.result("sharded_data_parallel")
    assert result.verdict == "pass" and result.value is not None, str(report)  # measured (0 here)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("W, dp", [(2, 1), (4, 1), (4, 2), (4, 4)])
def test_the_rank_an_evidence_names_for_a_token_is_the_rank_that_holds_it(layout, W, dp):
    """`holder` inverts `piece`: the rank named for token t of sequence b (sharded_output's and sharded_causality's
    evidence) is the one rank whose piece holds it; with data parallelism, the replica's rank, not the context rank
    (the two differ for every sequence of a replica other than the first)."""
    from diagnostics.distributed._context import ShardedContext
    B, T = 4, 8
    ctx = ShardedContext(layer=None, golden_layer=None, takes="shard", layout=layout, causal=True,
                         dtype=torch.float32, num_heads=None, world_sizes=(W,), seq_len=T, batch=B, seed=0, cuts=(),
                         data_parallel=dp)
    held = {(b, p): r for r in range(W) for rows, positions in [ctx.piece(r, W, T)]
            for b in range(*rows.indices(B)) for p in positions.tolist()}
    assert len(held) == B * T, held  # every token held once
    named = {(b, p): ctx.holder(b, p, T, W) for b in range(B) for p in range(T)}
    assert named == held


@pytest.mark.parametrize("p", [0.0, 0.1], ids=["plain", "output dropout"])
def test_head_parallel_maps_its_parameters_onto_the_unsharded_layer_it_computes(p):
    """With output dropout the unsharded layer is OutputDropout(layer, p), its parameters under `layer.`: the form's
    mapping names them so, and every gradient is compared (it named them without the prefix, and none was)."""
    layer = cs.OutputDropout(reference_layer(False), p) if p else reference_layer(False)
    factory = lambda given, rank, world_size, group: cs.HeadParallelAttention(  # noqa: E731
        given.layer if p else given, group, output_dropout=p)
    report = audit_sharded(layer, factory, takes="full", world_sizes=(2,),
                           detectors=["sharded_runs", "sharded_gradients"])
    result = report.result("sharded_gradients")
    assert result.verdict == "pass" and "every parameter's" in result.message, str(report)
    assert "4 parameters' gradients compared" in result.evidence and "not compared" not in result.evidence, \
        result.evidence


class Disagreeing(cs.HeadParallelAttention):
    """Rank r's output nudged by r x 1e-3 of a unit: what a replica drawing from its own stream returns."""

    def forward(self, x):
        return super().forward(x) + 1e-3 * self.rank


@pytest.mark.parametrize("disagree", [False, True], ids=["twin", "nudged"])
def test_ranks_that_return_different_wholes_are_caught_beside_their_twin(disagree):
    cls = Disagreeing if disagree else cs.HeadParallelAttention
    report = audit_sharded(reference_layer(False), lambda layer, rank, world_size, group: cls(layer, group),
                           takes="full", world_sizes=(2,), detectors=["sharded_runs", "sharded_ranks_agree"])
    result = report.result("sharded_ranks_agree")
    assert result.verdict == ("fail" if disagree else "pass"), str(report)
    if disagree:
        assert "rank 1 at 2 ranks" in result.message


class Truncating(cs.HeadParallelAttention):
    """Returns the first half of the sequence only: a shape, not a value, gone wrong."""

    def forward(self, x):
        return super().forward(x)[:, : x.shape[1] // 2]


def test_an_output_of_the_wrong_shape_is_a_finding_not_a_crash():
    report = audit_sharded(reference_layer(False), lambda layer, rank, world_size, group: Truncating(layer, group),
                           takes="full", world_sizes=(2,), detectors=["sharded_runs", "sharded_output"])
    result = report.result("sharded_output")
    assert result.verdict == "fail" and "returned shape (2, 8, 32)" in result.message, str(report)


def test_the_ranks_run_on_gpus_with_nccl_where_there_are_two(device):
    """The NCCL path: rank r on GPU r, the references on the CPU (written, not yet run here: no GPU was lent)."""
    if device.type == "cuda":
        ok, why = distributed_available("cuda", 2)
        if not ok:
            pytest.skip(why)
    report = audit_form("ring_zigzag", causal=True, device=device.type)
    assert report.status == "passed", str(report)


def test_the_reference_and_the_audit_cut_sequences_alike():
    for layout in cs.LAYOUTS:
        for t, W in ((16, 2), (16, 4), (17, 2), (17, 4), (12, 3)):
            ours = [shard_positions(layout, t, r, W) for r in range(W)]
            assert all(torch.equal(a, cs.shard_positions(layout, t, r, W)) for r, a in enumerate(ours))
            assert sorted(torch.cat(ours).tolist()) == list(range(t))  # every position held once


# ---- broken variants beside their twins (the whole chapter at 2 and 4 ranks: tests/test_kill_matrix.py) -------------
def check_variant(vid: str, world_sizes):
    __tracebackhide__ = True
    v = SHARDED_VARIANTS[vid]
    twin = audit_sharded_variant(v, twin=True, world_sizes=world_sizes)
    assert twin.status == "passed", f"the correct twin of {vid} failed:\n{twin}"
    for det in v.expected_detectors:  # measured on the twin, not skipped: the same check could have failed it
        assert twin.result(det).verdict == "pass", f"{det} did not measure the twin of {vid}:\n{twin}"
    broken = audit_sharded_variant(v, world_sizes=world_sizes)
    assert broken.status == "failed", f"{vid} passed:\n{broken}"
    for det in v.expected_detectors:
        assert broken.result(det).verdict == "fail", f"{vid}: {det} did not fail:\n{broken}"
    assert v.cause in broken.result(v.expected_detectors[0]).message, str(broken)
    # the fix shown is that cause's, not marked as the detector's general one
    assert broken.result(v.expected_detectors[0]).remedy == (broken.result(v.expected_detectors[0]).fix, False)
    assert v.cause not in str(twin)  # the twin, on the same inputs, names no cause
    if vid == "bias_on_every_rank":  # the finding names the bias, the multiple and the ranks, and its fix the bias
        result = broken.result("sharded_output")
        k = world_sizes[0] - 1
        assert f"{k} x `out.bias`" in result.message and f"each of the {world_sizes[0]} ranks" in result.message
        assert "out.bias" in result.fix
    return broken


CHEAP = ["bias_on_every_rank", "zigzag_not_undone", "ring_merge_overflows", "dropout_stream_per_rank",
         "ring_merge_with_max", "fused_qkv_contiguous_rows", "pads_to_even_shards", "dropout_stream_of_its_own",
         "ring_rotary_from_zero", "ring_documents_stay_home", "bias_grad_on_rank_zero"]


def test_every_variant_names_the_cause_its_detector_must_find():
    """Each entry says which phrase its first expected detector's message must hold (the slow matrix asserts it at 2
    and 4 ranks, the default run for CHEAP at 2): a failure without its cause named is half a diagnosis."""
    assert all(v.cause and v.expected_detectors for v in SHARDED_VARIANTS.values())
    assert not [vid for vid in CHEAP if vid not in SHARDED_VARIANTS]


@pytest.mark.parametrize("vid", CHEAP)
def test_a_broken_variant_fails_with_its_cause_beside_its_twin(vid):
    check_variant(vid, (2,))


def test_context_groups_built_across_replicas_fail_with_the_cause_beside_their_twin():
    """Observable from 4 ranks (2 replicas x 2 context ranks; at 2 ranks each replica is one rank, and both
    arithmetics give the same groups)."""
    broken = check_variant("context_groups_across_replicas", (4,))
    assert "groups built by rank % 2 would be [0, 2], [1, 3]" in broken.result("sharded_data_parallel").message


def test_every_variant_is_observable_in_the_audit_of_the_slow_matrix():
    """Each entry's own condition holds at 4 ranks with 8 heads, where the slow test audits it (the K/V gradient bug
    cannot show at 2 ranks: r+1 and r-1 are one rank)."""
    for v in SHARDED_VARIANTS.values():
        setting = ShardedSetting(world_size=4, num_heads=8, causal=v.audit_kwargs.get("causal", False), seq_len=16)
        assert v.detectable_when(setting), v.id
    assert not SHARDED_VARIANTS["ring_kv_grad_wrong_step"].detectable_when(ShardedSetting(2, 8, False, 16))


# ---- ranks that fail ------------------------------------------------------------------------------------------------
class Faulty(nn.Module):
    """The ring with rank 1 raising, hanging or exiting in its forward."""

    def __init__(self, inner, rank: int, how: str):
        super().__init__()
        self.inner, self.rank, self.how = inner, rank, how

    def forward(self, x, positions):
        if self.rank == 1:
            if self.how == "raise":
                raise RuntimeError("rank one breaks on purpose")
            if self.how == "hang":
                time.sleep(3600)
            if self.how == "exit":
                os._exit(3)
        return self.inner(x, positions)


@pytest.mark.parametrize("how, expected", [("raise", "rank 1 raised RuntimeError: rank one breaks on purpose"),
                                           ("exit", "rank 1 exited (exit code 3)"),
                                           ("hang", "rank 1 did not answer within the timeout")])
def test_a_failing_rank_is_named_within_the_timeout_and_nothing_is_left_behind(how, expected, own_tempdir):
    started = time.perf_counter()
    report = audit_sharded(reference_layer(False), lambda layer, rank, world_size, group, how=how:
                           Faulty(cs.RingAttention(layer, group), rank, how), world_sizes=(2,), timeout=1.0)
    took = time.perf_counter() - started
    result = report.result("sharded_runs")
    assert result.verdict == "fail" and result.message.startswith(expected), str(report)
    assert "in job 'forward'" in result.message
    assert report.status == "failed"
    assert took < 1.0 + 2.0 + 6.0  # the patience (timeout + 2 s), plus the groups of the jobs after a raise
    assert not leftovers() and not children()


def test_the_twin_of_the_failing_ranks_runs_through(own_tempdir):
    report = audit_sharded(reference_layer(False), lambda layer, rank, world_size, group:
                           Faulty(cs.RingAttention(layer, group), rank, "none"), world_sizes=(2,), timeout=1.0)
    assert report.result("sharded_runs").verdict == "pass" and report.status == "passed", str(report)
    assert not leftovers() and not children()


@pytest.mark.slow
def test_ctrl_c_ends_every_rank_and_removes_the_folder(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        import correct.sharded as cs
        from correct import MultiHeadAttention
        from diagnostics.distributed import audit_sharded

        def hang(layer, rank, world_size, group):
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
            time.sleep(3600)

        print("started", flush=True)
        audit_sharded(MultiHeadAttention(32, 8), hang, world_sizes=(2,), timeout=60)
    """))
    own = tmp_path / "tmp"
    own.mkdir()
    # Ctrl-C as a user's shell delivers it: SIGINT at its default, which Python turns into KeyboardInterrupt. A child
    # inherits an ignored SIGINT, and in CI's slow step (2026-12-05) the worker that spawned it had one: the script
    # then never saw the interrupt and ended at the audit's own 60 s timeout, with no KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(own)}, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while len(os.listdir(pids)) < 2 and time.time() < deadline:
        time.sleep(0.1)
    assert len(os.listdir(pids)) == 2, proc.stderr.read() if proc.poll() is not None else "ranks did not start"
    proc.send_signal(signal.SIGINT)
    # a liveness bound, not a speed target: alone the ranks are gone in about a second, but in CI's slow step, beside
    # the other worker's long tests on 2 cores, 30 s ran out twice on 2026-12-05
    _, err = proc.communicate(timeout=120)
    assert "KeyboardInterrupt" in err
    time.sleep(0.5)
    for pid in map(int, os.listdir(pids)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not list(own.iterdir())  # the group's folder removed


# ---- the audit's own rules --------------------------------------------------------------------------------------
def test_the_users_layer_stays_untouched():
    layer = reference_layer(True)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    rng = torch.get_rng_state()
    audit_form_layer = audit_sharded(layer, FORMS["head_parallel"][0], takes="full", causal=True, world_sizes=(2,),
                                     detectors=["sharded_runs", "sharded_output"])
    assert audit_form_layer.status == "passed", str(audit_form_layer)
    assert all(torch.equal(state[k], v) for k, v in layer.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and layer.training


@pytest.mark.parametrize("options, words", [
    ({"seq_len": 10, "layout": "zigzag"}, "seq_len divisible by 8"),
    ({"takes": "half"}, "takes in"),
    ({"world_sizes": (1,)}, "world sizes: ints >= 2"),
    ({"detectors": ["sharded_nothing"]}, "detector ids"),
    ({"draws_like_unsharded": "yes"}, "draws_like_unsharded=True or False"),
    ({"data_parallel": 3}, "data_parallel: an int >= 1 dividing every world size"),
    ({"data_parallel": 2, "takes": "full"}, 'with takes="shard"'),
])
def test_misuse_is_refused_with_expected_seen_and_fix(options, words):
    with pytest.raises(AuditUsageError, match=words):
        audit_sharded(reference_layer(False), FORMS["ring"][0], **options)


def test_an_unsharded_layer_that_cannot_run_is_a_usage_error_saying_so():
    class NeedsMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x, mask):
            return self.proj(x)

    with pytest.raises(AuditUsageError, match=r"expected the unsharded layer to run as layer\(x\) on x of shape"):
        audit_sharded(NeedsMask(), FORMS["ring"][0])


def _heads_context(num_heads, world_sizes):
    return ShardedContext(layer=None, golden_layer=None, takes="shard", layout="contiguous", causal=False,
                          dtype=torch.float32, num_heads=num_heads, world_sizes=world_sizes, seq_len=16, batch=2,
                          seed=0, cuts=())


def test_one_head_a_rank_is_a_warning_and_two_pass():
    one = check_heads_per_rank(_heads_context(4, (2, 4)))
    assert one.verdict == "warn" and "at 4 ranks" in one.message
    assert check_heads_per_rank(_heads_context(8, (2, 4))).verdict == "pass"


def test_every_sharded_detector_says_where_it_points():
    assert list(SHARDED_DETECTORS)[:2] == ["sharded_runs", "sharded_output"]
    assert all(d.scope == "sharded" and (d.locate is not None or d.unlocated) for d in SHARDED_DETECTORS.values())


def test_the_report_reads_as_text_and_json_with_the_unsharded_layers_own_audit():
    factory, _ = FORMS["ring"]
    report = audit_sharded(reference_layer(False), factory, world_sizes=(2,), check_unsharded=True)
    text = str(report)
    assert text.startswith("sharded audit of MultiHeadAttention: PASSED") and "sharded_output" in text
    assert "the unsharded layer's own audit: PASSED" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["status"] == "passed" and data["world_sizes"] == [2] and data["unsharded"]["status"] == "passed"
    assert len(data["groups"]["2"]) == 1  # one group ran every check


def test_the_report_is_a_page_with_its_findings_and_their_causes_fix(tmp_path):
    """ShardedReport.to_html draws with the layer's and model's pieces (diagnostics._html): a failing report's page
    shows the finding, its named cause's fix, every reading and the groups; its twin (passed) says no findings."""
    from diagnostics._result import DetectorResult
    from diagnostics.distributed import ShardedReport

    cause = "the gradient of `out.bias`, held whole on every rank, reaches rank 0 only"
    failed = DetectorResult("sharded_gradients", "fail", f"the gradients differ: {cause}", value=2.3, threshold=1e-5,
                            evidence="2 ranks: 4 parameters' gradients compared", fix="add `out.bias` after the sum",
                            extras={"cause": cause})
    common = dict(layer="MultiHeadAttention", causal=False, takes="full", layout="contiguous", world_sizes=(2, 4),
                  seq_len=16, dtype="float32", groups={2: [(0.1, 0.3)], 4: [(0.2, 0.6)]}, documents=[0] * 8 + [1] * 8)
    pages = {}
    for name, result in (("broken", failed), ("twin", DetectorResult("sharded_gradients", "pass", "equal"))):
        report = ShardedReport(status="failed" if name == "broken" else "passed", status_reason="",
                               results=[result], **common)
        report.to_html(tmp_path / f"{name}.html")
        pages[name] = (tmp_path / f"{name}.html").read_text()
    assert "Sharded audit of MultiHeadAttention: FAILED" in pages["broken"]
    assert "reaches rank 0 only" in pages["broken"] and "add `out.bias` after the sum".replace("`", "") in \
        pages["broken"].replace("<code>", "").replace("</code>", "").replace("`", "")
    assert "Groups of ranks started" in pages["broken"] and "packed documents" in pages["broken"]
    assert "No findings" in pages["twin"] and "reaches rank 0 only" not in pages["twin"]


def test_the_pytest_fixture_fails_a_broken_layer_and_passes_its_twin(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(textwrap.dedent("""
        import torch
        from correct import MultiHeadAttention
        from buggy_variants._sharded import SHARDED_VARIANTS

        v = SHARDED_VARIANTS["bias_on_every_rank"]

        def layer():
            torch.manual_seed(0)
            m = MultiHeadAttention(32, 8)
            torch.nn.init.normal_(m.out.bias)
            return m

        def test_twin(sharded_audit):
            sharded_audit(layer(), v.reference, takes="full", world_sizes=(2,))

        def test_broken(sharded_audit):
            sharded_audit(layer(), v.build, takes="full", world_sizes=(2,))
    """))
    result = pytester.runpytest_inprocess("-p", "diagnostics.distributed.pytest_plugin", "-p", "no:xdist",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*sharded_output*FAIL*bias is added on each of the 2 ranks*"])


@pytest.mark.slow
def test_the_command_line_audits_a_sharded_layer(tmp_path):
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        import torch
        from correct import MultiHeadAttention
        from correct.sharded import RingAttention

        def make_layer():
            torch.manual_seed(0)
            return MultiHeadAttention(32, 8, causal=True)

        def make_ring(layer, rank, world_size, group):
            return RingAttention(layer, group)

        def make_packed():
            torch.manual_seed(0)
            return MultiHeadAttention(32, 8, causal=True, documents=torch.tensor([0] * 5 + [1] * 6 + [2] * 5))
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # mine.py is found in the working directory, as attention-audit finds it
    for command in (["diagnostics", "sharded"], ["diagnostics.distributed"]):  # attention-audit sharded, and -m
        done = subprocess.run([sys.executable, "-m", *command, "mine:make_layer", "mine:make_ring", "--causal",
                               "--layout", "zigzag", "--world-sizes", "2", "--json"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == "passed"
    done = subprocess.run([sys.executable, "-m", "diagnostics", "sharded", "mine:make_packed", "mine:make_ring",
                           "--causal", "--documents", "5", "6", "5", "--world-sizes", "2", "--html", "page.html",
                           "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["documents"] == [0] * 5 + [1] * 6 + [2] * 5
    assert next(r for r in data["results"] if r["detector"] == "sharded_documents")["verdict"] == "pass"
    assert "Sharded audit of MultiHeadAttention: PASSED" in (tmp_path / "page.html").read_text()


def test_attention_audit_sharded_reaches_the_sharded_command_and_refuses_a_missing_layer(tmp_path, monkeypatch,
                                                                                          capsys):
    """The dispatch, without forking: a LAYER that cannot be loaded is a usage error (2) in the sharded command's
    words, and `--help` is the sharded command's own (the slow test above audits a layer through it)."""
    from diagnostics._cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["sharded", "no_such_module:layer", "no_such_module:ring"]) == 2
    assert "attention-audit sharded: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["sharded", "--help"])
    assert done.value.code == 0 and {"--world-sizes", "--draws-like-unsharded"} <= set(capsys.readouterr().out.split())


# ---- torch's own tensor parallelism (DTensor plans) -----------------------------------------------------------------
class SeparateQKV(nn.Module):
    """Llama-style attention, q, k, v and o projections apart; the heads are read from the projections' widths, so a
    rank holding a column shard of q, k and v runs its own heads (what torchtitan's plans rely on)."""

    def __init__(self, d_model: int = 32, num_heads: int = 8, fused: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.fused = num_heads, d_model // num_heads, fused
        if fused:
            self.qkv = nn.Linear(d_model, 3 * d_model)
        else:
            self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, _ = x.shape
        parts = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = (p.view(B, T, -1, self.head_dim).transpose(1, 2) for p in parts)  # (B, H_r, T, d_k)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(B, T, -1))


def dtensor_plan(layer, rank, world_size, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    columns = ["qkv"] if layer.fused else ["q", "k", "v"]
    plan = {**{name: ColwiseParallel() for name in columns}, "o": RowwiseParallel()}
    return parallelize_module(layer, DeviceMesh("cpu", list(range(world_size))), plan)


@pytest.mark.slow  # DTensor's first use costs 2-13 s in each rank
@pytest.mark.parametrize("fused", [False, True], ids=["separate_qkv", "fused_qkv"])
def test_torch_tensor_parallel_plans_separate_qkv_pass_and_a_fused_qkv_cut_in_rows_fails(fused):
    torch.manual_seed(0)
    report = audit_sharded(SeparateQKV(fused=fused), dtensor_plan, takes="full", causal=True, world_sizes=(2,),
                           dtype=torch.float32)
    if fused:  # ColwiseParallel cuts the stack [W_Q; W_K; W_V] in contiguous rows: rank 0 gets W_Q, half W_K
        result = report.result("sharded_output")
        assert result.verdict == "fail" and "`qkv.weight`" in result.message, str(report)
        assert SHARDED_VARIANTS["fused_qkv_contiguous_rows"].cause in result.message, str(report)
    else:
        assert report.status == "passed", str(report)


def test_a_forked_rank_runs_backward_where_this_process_has_run_one(device):
    """The probe behind distributed_available(): a child forked after a backward pass on `device` runs one itself.
    Without a GPU this holds on every machine; where there is one, it holds until the process's first backward."""
    if device.type == "cuda":
        pytest.skip("on a machine with a GPU a backward pass makes forked ranks unable to run one: the test below")
    x = torch.ones(3, requires_grad=True, device=device)
    (x * x).sum().backward()
    from diagnostics.distributed._ranks import backward_in_a_fork

    assert backward_in_a_fork()
    assert distributed_available() == (True, "")


def test_a_backward_pass_on_a_machine_with_a_gpu_makes_the_audit_a_usage_error_not_a_failed_rank(device):
    """Seen on an H200: every sharded check of a pytest worker that had audited other layers first failed
    `sharded_runs` ("Unable to handle autograd's threading in combination with fork-based multiprocessing"), a FAIL
    of a correct layer. Now the audit refuses before forking, with the reason and the fix; the twin above (no GPU,
    the same backward pass) audits as before."""
    if device.type != "cuda":
        pytest.skip("autograd starts device threads only where there is a GPU: the twin above runs here")
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()  # on the CPU: the GPU's presence alone starts autograd's device threads
    ok, why = distributed_available()
    assert not ok and "run the sharded audit before any backward pass" in why
    with pytest.raises(AuditUsageError, match="a forked rank cannot run backward"):
        audit_sharded(reference_layer(False), FORMS["ring"][0], world_sizes=(2,))


def test_the_references_backward_pass_computed_in_a_fork_is_the_one_computed_here():
    """On a machine with a GPU the audit computes the unsharded layer's gradients in a forked child (a backward pass
    in this process would leave no rank able to run one: seen on an H200, where the first sharded audit of a fresh
    worker failed its own ranks). The child's answer is the one this process computes; its exception comes home."""
    from diagnostics.distributed._ranks import in_a_fork

    layer = reference_layer(False)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))

    def grads():
        layer.zero_grad(set_to_none=True)
        layer(x)[0].square().sum().backward()  # (out, weights)
        out = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        return out

    there, here = in_a_fork(grads), grads()
    assert there.keys() == here.keys() and all(torch.equal(there[n], here[n]) for n in here)
    with pytest.raises(ValueError, match="broken on purpose"):
        in_a_fork(lambda: (_ for _ in ()).throw(ValueError("broken on purpose")))
    with pytest.raises(AuditUsageError, match="expected the unsharded layer to run"):  # what audit_sharded reports
        in_a_fork(lambda: _raise_usage_error())


def _raise_usage_error():
    from diagnostics._errors import expect

    expect(False, "the unsharded layer to run as layer(x)", "it raised", "pass the unsharded module")
