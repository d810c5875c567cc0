"""benchmarks/sweep.py: the model audit over a library's whole population (issue 33).

Default run (no extra): the sweep's machinery on a library of our own, each model in a forked child with a time
limit (a row for a model that hangs or dies), rows appended to the results file and a second run resuming from it,
the rates. Slow (CI's slow step, with the real extra): a fixed sample of transformers' model types through the
real sweep, correct models passing, the library's own confirmed problems failing as `KNOWN` says, and the injected
bugs caught at their layer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import diagnostics

SWEEP = Path(__file__).resolve().parent.parent / "benchmarks" / "sweep.py"


def _sweep():
    if "sweep_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sweep_benchmark", SWEEP)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["sweep_benchmark"]


def _fake_run(model_type: str, *, bugs: bool):
    sweep = _sweep()
    if model_type == "hangs":
        time.sleep(60)
    if model_type == "dies":
        os._exit(3)
    verdict = {"good": "passed", "leaky": "failed"}[model_type]
    return sweep.Row(model_type, cls=model_type.title(), built=True, verdict=verdict,
                     findings=["prefix_causality@h.1.attn"] if verdict == "failed" else [],
                     bugs={"missing_scale": "caught"} if bugs and verdict == "passed" else {})


def test_a_model_that_hangs_or_dies_is_a_row_and_the_sweep_goes_on():
    sweep = _sweep()
    good = sweep.in_child(_fake_run, "good", 30, bugs=True)
    assert (good.verdict, good.bugs) == ("passed", {"missing_scale": "caught"}) and good.seconds > 0
    hung = sweep.in_child(_fake_run, "hangs", 1.0, bugs=False)
    assert (hung.verdict, hung.why) == ("timeout", "over 1 s")
    dead = sweep.in_child(_fake_run, "dies", 30, bugs=False)
    assert dead.verdict == "crashed" and "wrote no row" in dead.why
    # the rates count a child that died with the built (it was building or auditing), not as "not built"
    lines = sweep.rates([good, hung, dead])
    assert lines[0] == "3 / 3 built (100%)" and "crashed 1 (33%), timeout 1 (33%)" in lines[1], lines


def test_the_results_file_resumes_a_sweep_and_the_rates_count_each_verdict(tmp_path, monkeypatch, capsys):
    sweep = _sweep()
    log = tmp_path / "calls"  # each model runs in a forked child: what it ran is written down

    def run(model_type, *, bugs):
        with log.open("a") as f:
            f.write(model_type + "\n")
        return _fake_run(model_type, bugs=bugs)

    def calls():
        ran = log.read_text().split() if log.exists() else []
        log.unlink(missing_ok=True)
        return ran

    monkeypatch.setitem(sweep.LIBRARIES, "json", (lambda: ["good", "leaky"], run))  # `json`: importable, versioned
    results = tmp_path / "rows.jsonl"
    assert sweep.main(["json", "--results", str(results), "--jobs", "1"]) == 0  # one at a time: rows in order
    assert [json.loads(line)["model_type"] for line in results.read_text().splitlines()] == ["good", "leaky"]
    first = capsys.readouterr().out
    assert "2 / 2 built (100%)" in first and "passed 1 (50%), failed 1 (50%)" in first, first
    assert "injected bugs caught at the right layer: 1 / 1 in 1 models" in first, first
    assert calls() == ["good", "leaky"]
    assert sweep.main(["json", "--results", str(results)]) == 0  # resumed: nothing run again
    assert calls() == [] and "(2 already there)" in capsys.readouterr().out
    assert sweep.main(["json", "--results", str(results), "--fresh", "--only", "leaky"]) == 0
    assert calls() == ["leaky"] and len(results.read_text().splitlines()) == 1


@pytest.mark.parametrize("model_type, kept", [("edgetam_vision_model", True), ("someone_elses", False)])
def test_an_inconclusive_row_is_the_librarys_own_only_where_known_says_so(model_type, kept):
    """A model the library's own problem keeps from running (EdgeTAM's default config raises on every forward) is
    inconclusive, counted and marked as KNOWN in the rates and the table; an inconclusive row of a type KNOWN does not
    list is neither."""
    sweep = _sweep()
    row = sweep.Row(model_type, cls="M", built=True, verdict="inconclusive", why="inconclusive: raised on the example")
    rates, table = "\n".join(sweep.rates([row])), sweep.table([row])
    known = ("1 of the inconclusive the library's own problem (KNOWN: kept from running, or failing under the "
             "declaration their report names)")
    assert (known in rates) is kept, rates
    assert ("(KNOWN: " in table) is kept, table


SAMPLE = {  # model type -> the verdict the sweep must give it
    "gpt2": "passed", "llama": "passed", "bert": "passed", "roberta": "passed", "modernbert": "passed",
    "mamba": "failed", "swiftformer": "failed",
}


@pytest.mark.slow
def test_a_fixed_sample_of_transformers_model_types_through_the_sweep(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    rows = {t: sweep.in_child(sweep.run_transformers, t, 600, bugs=t in ("gpt2", "llama")) for t in SAMPLE}
    for t, want in SAMPLE.items():
        row = rows[t]
        assert row.verdict == want, (t, row.verdict, row.why, row.findings)
        assert (t in sweep.KNOWN) == (want == "failed"), t  # a failure is one confirmed outside the audit
    for t in ("gpt2", "llama"):  # every injected bug caught at the layer it was injected into
        grouped = rows[t].bugs.pop(sweep.GROUPED)  # Llama's default config: a key/value head per query head
        assert grouped.startswith("not applicable: a key/value head per query head"), grouped
        assert rows[t].bugs == dict.fromkeys(sweep.BUGS, "caught"), rows[t].bugs
    assert rows["llama"].causal.startswith("True (inferred: LlamaForCausalLM is a causal LM")


def _meeting(model_type: str, *, bugs: bool, where: Path):
    """"a" and "b" each mark that they started and wait (up to 20 s) for the other's mark: both pass only when
    they run at the same time. Reports the child's torch thread count."""
    import torch

    sweep = _sweep()
    (where / model_type).touch()
    other = where / {"a": "b", "b": "a"}[model_type]
    deadline = time.monotonic() + 20
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return sweep.Row(model_type, built=True, verdict="passed" if other.exists() else "failed",
                     why=f"threads {torch.get_num_threads()}")


def test_jobs_run_children_side_by_side_each_on_one_thread(tmp_path):
    sweep = _sweep()
    rows = {r.model_type: r for r in sweep.run_children(_meeting, ["a", "b"], 30, jobs=2, bugs=False, where=tmp_path)}
    assert {t: (r.verdict, r.why) for t, r in rows.items()} == dict.fromkeys("ab", ("passed", "threads 1"))
    one = tmp_path / "one"  # its twin: one at a time, "a" waits for a "b" that has not started, past its limit
    one.mkdir()
    rows = {r.model_type: r for r in sweep.run_children(_meeting, ["a", "b"], 1.0, jobs=1, bugs=False, where=one)}
    assert rows["a"].verdict == "timeout" and rows["b"].verdict == "passed"


def _spends(model_type: str, *, bugs: bool):
    """"busy" spends 0.4 s of its own CPU (however long the machine's load makes that); "idle" sleeps 0.4 s."""
    sweep = _sweep()
    if model_type == "idle":
        time.sleep(0.4)
    start = time.process_time()
    while model_type == "busy" and time.process_time() - start < 0.4:
        pass
    return sweep.Row(model_type, built=True, verdict="passed")


def test_a_rows_cpu_time_is_the_childs_own_and_its_wall_clock_is_apart():
    sweep = _sweep()
    busy = sweep.in_child(_spends, "busy", 30, bugs=False)
    idle = sweep.in_child(_spends, "idle", 30, bugs=False)  # its twin: as long on the clock, no CPU of its own
    assert busy.seconds >= 0.4 and idle.seconds >= 0.4
    assert busy.cpu_seconds >= 0.4, busy
    assert idle.cpu_seconds < 0.2, idle


@pytest.mark.slow  # two fresh processes that import transformers (about 10 s each)
def test_after_warm_a_transformers_model_imports_only_its_own_modules():
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    import subprocess

    script = ("import sys; sys.path[:0] = [{bench!r}]; import torch, sweep\n"
              "{warm}before = set(sys.modules)\n"
              "sweep.run_transformers('camembert', bugs=False)\n"
              "print(sorted(m for m in set(sys.modules) - before if not m.startswith('transformers.models')))\n")
    def imported(warm: str) -> list:
        code = script.format(bench=str(SWEEP.parent), warm=warm)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True).stdout
        return eval(out.strip().splitlines()[-1])
    assert imported("sweep.warm('transformers', bugs=False)\n") == []
    cold = imported("")  # its twin: a child forked from a parent that did not warm imports the machinery itself
    assert "transformers.generation.utils" in cold and "diagnostics.model" in cold, cold


def test_with_jobs_the_parent_writes_every_row_once_and_a_second_run_resumes(tmp_path, monkeypatch, capsys):
    sweep = _sweep()
    types = ["good", "leaky", "dies", "good2", "leaky2"]

    def run(model_type, *, bugs):
        time.sleep(0.2 * (len(types) - types.index(model_type)) / len(types))  # finish out of order
        row = _fake_run(model_type.rstrip("2"), bugs=bugs)
        row.model_type = model_type
        return row

    monkeypatch.setitem(sweep.LIBRARIES, "json", (lambda: types, run))
    results = tmp_path / "rows.jsonl"
    assert sweep.main(["json", "--results", str(results), "--jobs", "3"]) == 0
    written = [json.loads(line) for line in results.read_text().splitlines()]  # every line whole JSON
    assert sorted(r["model_type"] for r in written) == sorted(types)
    out = capsys.readouterr().out
    table = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in types]
    assert table[-len(types):] == types, out  # the table in the types' order, whatever order they finished in
    assert sweep.main(["json", "--results", str(results), "--jobs", "3"]) == 0
    assert "(5 already there)" in capsys.readouterr().out and len(results.read_text().splitlines()) == 5


def test_jobs_below_one_is_a_usage_error(monkeypatch, capsys):
    sweep = _sweep()
    monkeypatch.setitem(sweep.LIBRARIES, "json", (lambda: ["good"], _fake_run))
    with pytest.raises(SystemExit):
        sweep.main(["json", "--jobs", "0"])
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def test_device_and_dtype_place_whole_models_and_are_refused_where_the_sweep_builds_layers(monkeypatch, capsys):
    sweep = _sweep()
    monkeypatch.setitem(sweep.LIBRARIES, "json", (lambda: ["good"], _fake_run))
    with pytest.raises(SystemExit):  # the layer sweeps (diffusers, the zoo's packages) build their own layers
        sweep.main(["json", "--dtype", "bfloat16"])
    assert "--device and --dtype place the models of transformers, timm; json's sweep" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            sweep.main(["transformers", "--device", "cuda"])
        assert "torch.cuda.is_available() is False" in capsys.readouterr().err
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert sweep.placed(model) is model  # the CPU in float32: the model as built
    assert sweep.placed(model, dtype="bfloat16")[0].weight.dtype == torch.bfloat16


@pytest.mark.slow  # builds and audits a transformers model in bfloat16
def test_a_model_cast_to_bfloat16_is_audited_in_bfloat16():
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    model = sweep.build("gpt2", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {__import__("torch").bfloat16}
    row = sweep.run_transformers("gpt2", bugs=False, dtype="bfloat16")
    assert (row.built, row.verdict) == (True, "passed"), row


@pytest.mark.slow  # builds and audits GraniteMoE five times (the correct model, the reference, three bugs)
def test_a_missing_scale_is_not_judged_where_the_layers_own_scale_is_1():
    """Granite's `scaling` is its config's attention_multiplier, 1.0 by default: 'missing scale' (scores times 1)
    is then the correct layer itself, and was counted as a bug missed. The other bugs are still judged."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    row = _sweep().run_transformers("granitemoe", bugs=True)
    assert row.verdict == "passed", row
    assert row.bugs.pop("missing_scale").startswith("not applicable: the layer's own scale is 1"), row.bugs
    assert row.bugs.pop(_sweep().GROUPED).startswith("not applicable: a key/value head per query head"), row.bugs
    assert row.bugs and set(row.bugs.values()) == {"caught"}, row.bugs


@pytest.mark.slow  # builds and audits Zaya six times (the correct model, the reference, four bugs), and 4 builds more
def test_a_bug_that_changes_no_output_at_these_weights_is_not_applicable_and_one_that_does_is_judged():
    """Zaya multiplies its keys by a learned temperature that its init sets to 0: q·k is 0 everywhere, so dropping
    1/sqrt(d_k) changes nothing, bit for bit, and its audit passing that is no bug missed. The reference's audit was
    inconclusive (no factor of q·k to read) and no bug was judged; now the other bugs are, and caught. The twin: in
    Llama the same bug moves the output, so it is no such case."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    row = sweep.run_transformers("zaya", bugs=True)
    assert row.verdict == "passed", row
    assert row.bugs.pop("missing_scale").startswith("not applicable: the bug changes no output"), row.bugs
    row.bugs.pop(sweep.GROUPED)  # Zaya's projections (its CCA) are not identified: no check can see this bug
    assert set(row.bugs.values()) == {"caught"}, row.bugs
    assert sweep.moves_nothing("zaya", "missing_scale", "model.layers.1.self_attn")
    assert not sweep.moves_nothing("llama", "missing_scale", "model.layers.1.self_attn")


@pytest.mark.slow  # builds and audits Unlimited-OCR six times (the correct model, the reference, four bugs)
def test_a_model_whose_vision_part_keys_classes_by_name_gets_the_bugs_in_its_text_part():
    """Unlimited-OCR's SAM vision encoder picks its attention class from a dict keyed by "eager" and "sdpa", so the
    model did not build with the sweep's function registered under a name of its own (KeyError) and none of its bugs
    was judged. The parts that build with it get it, the others sdpa; the bugs, in the language model, are caught."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    from test_model_audit import bug_attention, register_attention

    register_attention("sweep_bugs", bug_attention)
    model_class = sweep.model_class("unlimited_ocr")
    parts = sweep.by_part(model_class, sweep.tiny_config("unlimited_ocr", decoder=False), "sweep_bugs")
    assert parts["vision_config"] == "sdpa" and parts["text_config"] == "sweep_bugs", parts
    row = sweep.run_transformers("unlimited_ocr", bugs=True)
    assert row.verdict == "passed", row
    row.bugs.pop(sweep.GROUPED)
    assert set(row.bugs.values()) == {"caught"}, row.bugs


@pytest.mark.slow  # builds and audits Kosmos-2.5 six times (the correct model, the reference, four bugs)
def test_a_missing_scale_is_not_judged_where_the_layer_hands_its_function_a_scale_of_1():
    """Kosmos-2.5's text attention multiplies q by its scaling and hands the attention function scaling=1.0: the
    'missing scale' (the function's scale dropped) is the correct layer, and was counted as a bug missed (the whole
    passing population with bugs, 2026-12-04). The scale the function is handed is read in the reference run."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    row = _sweep().run_transformers("kosmos-2.5", bugs=True)
    assert row.verdict == "passed", row
    assert row.bugs.pop("missing_scale").startswith("not applicable: the layer scales q itself"), row.bugs
    assert row.bugs.pop(_sweep().GROUPED).startswith("not applicable: a key/value head per query head"), row.bugs
    assert set(row.bugs.values()) == {"caught"}, row.bugs


@pytest.mark.slow  # builds and audits CLIP's text model six times (the correct model, the reference, four bugs)
def test_a_bug_is_located_by_its_failures_and_a_warning_at_another_layer_is_said():
    """CLIP's text layers are causal by their own mask, which the model declares nowhere: audited through the sweep's
    explicit attention, layer 0 is audited as causal while the model is; a bug at layer 1 that lets the future in
    leaves it non-causal, and layer 0 then warns that it masks the future itself. The failure is at layer 1 alone:
    caught there, the warning said beside it (it counted as 'elsewhere' when warnings located a bug too)."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    row = _sweep().run_transformers("clip_text_model", bugs=True)
    assert row.verdict == "passed", row
    assert row.bugs.pop("missing_scale") == "caught", row.bugs  # the model stays causal: no warning
    assert row.bugs.pop(_sweep().GROUPED).startswith("not applicable"), row.bugs  # CLIP: no grouped key/value heads
    assert set(row.bugs.values()) == {"caught; a warning also at encoder.layers.0.self_attn"}, row.bugs


@pytest.mark.slow  # imports every timm model module (timm_types): 71 s under load
def test_timm_models_are_built_small_and_one_without_attention_is_not_counted():
    pytest.importorskip("timm", reason="timm is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    vit = sweep.timm_build("vit_tiny_patch16_224")  # every keyword of TIMM_TINY taken
    assert (vit.embed_dim, len(vit.blocks), vit.blocks[0].attn.num_heads, vit.patch_embed.img_size) == (32, 2, 4, (64, 64))
    types = sweep.timm_types()
    assert "vit_tiny_patch16_224" in types and "resnet18" not in types
    row = sweep.run_timm("resnet18", bugs=False)  # builds (depth, embed_dim, num_heads dropped), holds no attention
    assert (row.built, row.verdict) == (True, "no attention"), row  # audited: the audit found none, no class holds one
    lines = sweep.rates([row, sweep.Row("vit", built=True, verdict="passed")])
    assert lines[0] == "1 / 1 built (100%); 1 more built with no attention module, not counted", lines
    # attention in a class not named *Attention (AttentionRope) is counted: the rule is what the audit finds running
    rope = sweep.run_timm("vit_small_patch16_rope_mixed_224", bugs=False)
    assert (rope.built, rope.verdict) == (True, "passed"), rope


def test_a_fixed_size_timm_model_is_built_small_and_its_configuration_says_the_size_it_was_built_at():
    pytest.importorskip("timm", reason="timm is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    levit = sweep.timm_build("levit_128")  # img_size=64 taken; its configuration kept 224 (a usage error, issue 33)
    assert levit.pretrained_cfg["input_size"] == (3, 64, 64), levit.pretrained_cfg
    assert sweep.timm_image_size(levit) == ((64, 64), 3, "its pretrained_cfg's input_size (fixed)")


def test_a_timm_model_that_takes_no_image_size_runs_at_the_smallest_its_configuration_states():
    """SAM 2's Hiera takes no img_size and states 896 px (1,024 for large), where its global blocks were past the
    audit's memory guard (4 rows inconclusive); its configuration's min_input_size, 224 px, is the one the audit
    runs; a model that states none keeps its input_size."""
    pytest.importorskip("timm", reason="timm is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    sam2 = sweep.timm_build("sam2_hiera_tiny")
    assert sam2.pretrained_cfg["input_size"] == (3, 224, 224), sam2.pretrained_cfg
    assert sweep.timm_image_size(sam2) == ((224, 224), 3, "its pretrained_cfg's input_size")
    vit = sweep.timm_build("vit_tiny_patch16_224")  # takes img_size=64, states no minimum
    assert sweep.timm_image_size(vit)[0] == (64, 64), vit.pretrained_cfg


def test_a_rows_long_reason_is_cut_in_the_middle_so_that_where_to_look_stays():
    sweep = _sweep()
    row = sweep.Row("many layers")
    reason = ("inconclusive: " + ", ".join(f"blocks.{i}.attn" for i in range(40)) + " could not be audited in place "
              "(see the notes)")
    row.judged("inconclusive", reason)  # was: cut at 300 characters, "(see the notes)" lost
    assert (row.verdict, len(row.why)) == ("inconclusive", 300), row
    assert row.why.startswith("inconclusive: blocks.0.attn, ") and row.why.endswith("(see the notes)"), row.why
    row.judged("usage error", "expected example=...; got X\nsecond line")
    assert row.why == "expected example=...; got X", row.why


def test_a_sweep_stopped_early_leaves_no_child_running(tmp_path):
    sweep = _sweep()
    rows = sweep.run_children(_fake_run, ["good", "hangs"], 30, jobs=2, bugs=False)
    assert next(rows).model_type == "good"
    hung = next(c for c in rows.gi_frame.f_locals["running"])  # the child still running
    rows.close()  # as when the parent is interrupted
    with pytest.raises(ChildProcessError):
        os.waitpid(hung.pid, os.WNOHANG)  # reaped: killed, not left behind


def test_tiny_configs_keep_what_a_layer_needs_consistent():
    """Widths shrunk together so that the tiny model runs a plain forward: multi-head latent attention's per-head
    widths with the head (DeepSeek-V3's 64-wide rotary part on an 8-wide head raised), a key/value head per query head
    kept so (MLA), the experts per token within the 4 experts left (set where the default leaves it None: DeepSeek-V2),
    a partial rotary within the head (CodeGen's rotary_dim)."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    v3, v2, codegen, llama = (sweep.tiny_config(t) for t in ("deepseek_v3", "deepseek_v2", "codegen", "llama"))
    assert (v3.qk_rope_head_dim, v3.qk_nope_head_dim, v3.v_head_dim, v3.kv_lora_rank) == (8, 8, 8, 16)
    assert v3.num_key_value_heads == v3.num_attention_heads == 4 and v3.num_experts_per_tok == 2
    assert v3.n_group == v3.topk_group == 1
    assert v2.num_experts_per_tok == 2  # None in its default config
    assert codegen.rotary_dim == 4 <= codegen.n_embd // codegen.n_head
    assert llama.num_key_value_heads == llama.num_attention_heads == 4  # Llama's default: as many as query heads
    from diagnostics.model.gradients import LONGER

    v32 = sweep.tiny_config("deepseek_v32")  # its indexer chooses among fewer keys than gradient_flow's lengths
    assert (v32.index_topk, v32.index_n_heads, v32.index_head_dim) == (32, 4, 16) and 32 < LONGER[0]
    mistral4 = sweep.tiny_config("mistral4")  # its rotary table, head_dim x 0.5, as wide as its rope part
    assert mistral4.head_dim * mistral4.rope_parameters["partial_rotary_factor"] == mistral4.qk_rope_head_dim == 8
    sapiens2 = sweep.tiny_config("sapiens2")  # key/value heads per layer within the 4 query heads (was 16 each)
    assert sapiens2.num_key_value_heads_per_layer == [4, 4] and sapiens2.num_attention_heads == 4
    dory = sweep.tiny_config("dory")  # a looped model's input, middle and output sections within its depth
    assert (dory.n_input_layers, dory.n_recurrent_layers, dory.n_output_layers) == (1, 0, 1)  # was (8, -14, 8)
    # heads per stage shrunk with the first stage's width (96 -> 32), each head as wide as before: Swin's 3 heads on
    # 32 channels made heads 10.67 wide (SwinModel raised, SwinV2, Donut-Swin, MaskFormer-Swin, Swin2SR did not build)
    assert sweep.tiny_config("swin").num_heads == (1, 2, 4, 8) and sweep.tiny_config("swinv2").embed_dim == 32
    assert sweep.tiny_config("swin2sr").num_heads == (1,) * 6  # 6 heads of 180: 6 x 32 / 180 rounds to 1
    # (time, height, width) rotary sections within the tiny head's half-width (4): GLM-4V states none in its config
    # and defaults to [8, 12, 12] in its code (it raised on every example); Qwen2-VL's own [16, 24, 24] shrunk too
    for model_type in ("glm4v_text", "qwen2_vl"):
        text = sweep.tiny_config(model_type).get_text_config()
        assert text.rope_parameters["mrope_section"] == [2, 1, 1], (model_type, text.rope_parameters)
        assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert "mrope_section" not in sweep.tiny_config("llama").rope_parameters  # a model that splits no rotary table
    # a linear-attention mixer's own heads shrunk (GLM-5-Next's 64 of 128: its audit held 14.5 GB), value heads a
    # multiple of key heads (Qwen3-Next's 16 key and 32 value heads)
    glm = sweep.tiny_config("glm5_next_text")
    assert (glm.linear_num_heads, glm.linear_head_dim) == (4, 8)
    qwen = sweep.tiny_config("qwen3_next")
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads, qwen.linear_key_head_dim) == (2, 4, 8)


def test_a_composite_config_is_handed_to_its_text_models_class_as_the_auto_class_does():
    """Qwen3.5's causal LM class takes its text config; given the whole (vision and text) config it raised on its
    vocab_size and the type was "not built". The sweep builds it as AutoModelForCausalLM.from_config does; a class
    whose config is the whole, Qwen3.5's image-text class, still gets the whole."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    model = sweep.build("qwen3_5")
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and type(model.config).__name__ == "Qwen3_5TextConfig"
    import transformers

    whole = sweep.tiny_config("qwen3_5")
    cls = transformers.Qwen3_5ForConditionalGeneration
    assert isinstance(whole, cls.config_class)  # the build's text config is chosen only where the class asks for it


def test_a_hybrids_tiny_config_keeps_a_layer_of_each_kind():
    sweep = _sweep()
    linear_then_full = ["linear_attention"] * 3 + ["full_attention"]
    assert sweep.kept_layers(linear_then_full * 4, 16, 2) == [0, 3]  # was [0, 1]: two linear layers, none to audit
    assert sweep.kept_layers(None, 12, 2) == [0, 1] and sweep.kept_layers(["full_attention"] * 8, 8, 2) == [0, 1]
    assert sweep.kept_layers(["a", "b", "c"], 3, 2) == [0, 1]  # more kinds than layers: the first ones


# ---- the plain scripts behind KNOWN (transformers, no diagnostics) -------------------------------------------------

TINY_LM = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128)


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")


@pytest.mark.parametrize("model_type, known", [("mra", True), ("bert", False)])
def test_changing_the_attention_weights_moves_the_output_except_where_known_says_it_is_zeros(model_type, known):
    """MRA without its CUDA kernel returns zeros from its attention (KNOWN); BERT's, the same script, moves."""
    import torch

    tf = _transformers()
    assert (model_type in _sweep().KNOWN) is known
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(tf.AutoConfig.for_model(model_type, **TINY_LM)).eval()
    ids = torch.randint(5, 128, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).last_hidden_state
        for name, p in model.named_parameters():
            if ".attention.self." in name and name.endswith("weight"):
                p.add_(torch.randn_like(p))
        after = model(ids).last_hidden_state
    assert torch.equal(before, after) is known, float((after - before).abs().max())


@pytest.mark.parametrize("model_type, step, known", [("jamba", 3, True), ("jamba", 1, False)])
def test_a_cached_step_matches_the_full_forward_except_where_known_says_it_restarts_the_scan(model_type, step, known):
    """Jamba (KNOWN): prefill 10 tokens, then steps of 3 through its cache: the logits differ from the full forward
    far past float64 rounding; the twin, steps of 1 through the same cache, match."""
    import torch

    tf = _transformers()
    assert (model_type in _sweep().KNOWN) is True
    torch.manual_seed(0)
    config = tf.JambaConfig(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mamba_dt_rank=4, **TINY_LM)
    model = tf.JambaForCausalLM(config).double().eval()
    model.set_experts_implementation("eager")  # grouped_mm takes no float64
    ids = torch.randint(5, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :10], use_cache=True)
        logits, past = [out.logits], out.past_key_values
        for start in range(10, 16, step):
            out = model(ids[:, start:start + step], past_key_values=past, use_cache=True)
            logits, past = logits + [out.logits], out.past_key_values
    error = float((torch.cat(logits, dim=1) - full).abs().max() / full.square().mean().sqrt())
    assert (error > 1e-6) is known, error  # float64 rounding: ~1e-15


@pytest.mark.parametrize("hidden, known", [(32, True), (128, False)])
def test_xlstm_decodes_through_its_cache_only_where_its_widths_are_multiples_of_64(hidden, known):
    """xLSTM (KNOWN): at hidden 32 (query width 16, value width 32) the full forward runs and a cached step raises;
    at 128 (64 and 128) the cached steps match the full forward."""
    import torch

    tf = _transformers()
    assert "xlstm" in _sweep().KNOWN
    torch.manual_seed(0)
    config = tf.xLSTMConfig(hidden_size=hidden, embedding_dim=hidden, num_heads=4, num_hidden_layers=2, vocab_size=128)
    model = tf.xLSTMForCausalLM(config).double().eval()
    ids = torch.randint(5, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits  # runs at either width (its default, use_cache=True, raises)
        try:
            first = model(ids[:, :10], use_cache=True)
            rest = model(ids[:, 10:], cache=first.cache, use_cache=True)
        except ValueError as exc:
            assert known and "matC_old has wrong shape" in str(exc), exc
            return
    assert not known
    assert torch.allclose(torch.cat([first.logits, rest.logits], dim=1), full, atol=1e-10)


@pytest.mark.parametrize("model_type, known", [("switch_transformers", True), ("t5", False)])
def test_a_seq2seq_forward_with_use_cache_runs_except_where_known_says_it_raises(model_type, known):
    """SwitchTransformers (KNOWN) raises on model(input_ids, decoder_input_ids, use_cache=True); T5, the same call,
    returns its cache."""
    import torch

    tf = _transformers()
    assert (model_type in _sweep().KNOWN) is known
    torch.manual_seed(0)
    config = tf.AutoConfig.for_model(model_type, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                     num_decoder_layers=2, vocab_size=128)
    model = tf.AutoModelForSeq2SeqLM.from_config(config).eval()
    ids = torch.randint(5, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, decoder_input_ids=ids, use_cache=True)
    except ValueError as exc:
        assert known and "use_cache" in str(exc), exc
        return
    assert not known and out.cache is not None


@pytest.mark.parametrize("model_type, known", [("fsmt", True), ("bart", False)])
def test_a_decoder_prefill_with_use_cache_gives_the_uncached_logits_except_where_known_says_it_drops_the_mask(
        model_type, known):
    """FSMT (KNOWN): decoder logits over 8 tokens with use_cache=True differ from those without (its causal mask is
    dropped with a cache); BART, the same script, gives the same logits either way."""
    import torch

    tf = _transformers()
    assert (model_type in _sweep().KNOWN) is known
    torch.manual_seed(0)
    small = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64)
    vocab = dict(src_vocab_size=128, tgt_vocab_size=128) if model_type == "fsmt" else dict(vocab_size=128)
    config = tf.AutoConfig.for_model(model_type, **small, **vocab)
    model = tf.AutoModelForSeq2SeqLM.from_config(config).eval()  # FSMT's mask overflows in float64
    gen = torch.Generator().manual_seed(1)
    ids, decoder_ids = torch.randint(5, 128, (1, 8), generator=gen), torch.randint(5, 128, (1, 8), generator=gen)
    with torch.no_grad():
        cached = model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=True).logits
        plain = model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False).logits
    change = float((cached - plain).abs().max() / plain.square().mean().sqrt())
    assert (change > 1e-3) is known, change  # float32 rounding: ~1e-7


@pytest.mark.parametrize("model_type, known", [("cpmant", True), ("gpt2", False)])
def test_a_causal_lms_first_logits_ignore_the_last_token_except_where_known_says_it_attends_both_ways(model_type,
                                                                                                      known):
    """CpmAntForCausalLM (KNOWN): changing the last token moves the logits at the first; GPT-2's, the same script,
    stay exactly."""
    import torch

    tf = _transformers()
    assert (model_type in _sweep().KNOWN) is known
    torch.manual_seed(0)
    small = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, dim_head=8, dim_ff=64, vocab_size=128,
                 prompt_length=4) if model_type == "cpmant" else dict(n_embd=32, n_head=4, n_layer=2, vocab_size=128)
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **small)).eval()
    ids = torch.randint(5, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 100 + 5
    with torch.no_grad():
        first, again = model(ids).logits[:, :4], model(changed).logits[:, :4]
    assert (not torch.equal(first, again)) is known, float((first - again).abs().max())


@pytest.mark.parametrize("model_type, known", [("recurrent_gemma", True), ("gemma", False)])
def test_left_padding_leaves_the_real_tokens_except_where_known_says_the_recurrence_runs_over_the_pads(model_type,
                                                                                                      known):
    """RecurrentGemma (KNOWN): 4 left pad tokens, masked and with positions from the mask, move the logits at the real
    tokens; Gemma, the same script, leaves them."""
    import torch

    tf = _transformers()
    assert (model_type in _sweep().KNOWN) is known
    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                 vocab_size=128, num_hidden_layers=3)
    if model_type == "recurrent_gemma":
        small.update(lru_width=32, attention_window_size=16)
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **small)).eval()
    change = _left_padding_change(model, torch.randint(5, 128, (1, 8), generator=torch.Generator().manual_seed(1)))
    assert (change > 1e-3) is known, change  # measured: 0.45 of the RMS (RecurrentGemma), 1.2e-7 (Gemma)


def _left_padding_change(model, ids, pads: int = 4) -> float:
    """A plain script, no diagnostics: the greatest change of the logits at the real tokens when `pads` pad tokens
    (id 3), masked and with positions from the mask, are put to the left, in the logits' RMS."""
    import torch

    T = ids.shape[1]
    padded = torch.cat([torch.full((1, pads), 3), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pads, dtype=torch.long), torch.ones(1, T, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model(ids, position_ids=torch.arange(T)[None], use_cache=False).logits
        left = model(padded, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                     use_cache=False).logits[:, pads:]
    return float((left - plain).abs().max() / plain.square().mean().sqrt())


@pytest.mark.parametrize("model_type, known", [("blt", True), ("llama", False)])
def test_a_causal_lms_forward_with_its_default_cache_runs_except_where_known_says_its_config_has_no_depth(model_type,
                                                                                                        known):
    """BLT (KNOWN), as the sweep builds it: model(input_ids) with the config's use_cache=True raises AttributeError,
    its cache built from a BltConfig with no num_hidden_layers; with use_cache=False it runs. Llama, the same script,
    runs either way."""
    import torch

    _transformers()
    sweep = _sweep()
    assert (model_type in sweep.KNOWN) is known
    model = sweep.build(model_type)
    ids = torch.randint(5, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert model(ids, use_cache=False).logits.shape[:2] == (1, 8)
        try:
            model(ids)
        except AttributeError as exc:
            assert known and "num_hidden_layers" in str(exc), exc
        else:
            assert not known


@pytest.mark.parametrize("model_type, known", [("blt", True), ("llama", False)])
def test_left_padding_leaves_the_real_tokens_except_where_known_says_the_patcher_reads_no_mask(model_type, known):
    """BLT (KNOWN), as the sweep builds it: 4 left pads, masked, positions from the mask, move the logits at the 12
    real tokens (its entropy patcher runs without the mask); Llama, the same script, leaves them. use_cache=False:
    BLT's cache raises (the test above)."""
    import torch

    _transformers()
    sweep = _sweep()
    assert (model_type in sweep.KNOWN) is known
    model = sweep.build(model_type)
    change = _left_padding_change(model, torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(1)))
    assert (change > 1e-3) is known, change  # measured: 4.5 of the RMS (BLT), 1.1e-6 (Llama)


def _logits(out):
    """The first output of a transformers model: its logits, else its first field (ColPali's embeddings)."""
    return out.logits if getattr(out, "logits", None) is not None else out[0]


@pytest.mark.parametrize("model_type, side, known", [
    ("yoso", "right", True), ("nystromformer", "right", True), ("funnel", "right", True), ("convbert", "right", True),
    ("deepseek_v4", "left", True), ("sam3_lite_text_text_model", "right", True), ("bert", "right", False),
    ("deepseek_v3", "left", False)])
def test_padding_leaves_the_real_tokens_except_where_known_says_the_model_mixes_the_pads_in(model_type, side, known):
    """YOSO, Nyströmformer, Funnel, ConvBERT, SAM3-LiteText's text model (4 right pads) and DeepSeek-V4 (4 left pads,
    positions from the mask), each as the sweep builds it (KNOWN): the masked pads move the outputs at the 12 real
    tokens (ConvBERT's span convolution runs over them; SAM3-LiteText's by the length its position table is
    interpolated to); BERT and DeepSeek-V3, the same script, leave them."""
    import torch

    _transformers()
    sweep = _sweep()
    assert (model_type in sweep.KNOWN) is known
    model = sweep.build(model_type)
    ids = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    pads, ones, zeros = torch.full((1, 4), 3), torch.ones(1, 12, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    left = side == "left"
    padded = torch.cat([pads, ids] if left else [ids, pads], dim=1)
    mask = torch.cat([zeros, ones] if left else [ones, zeros], dim=1)
    real = slice(4, 16) if left else slice(0, 12)
    positions = {"position_ids": (mask.cumsum(-1) - 1).clamp_min(0)} if left else {}
    with torch.no_grad():
        plain = _logits(model(ids, **({"position_ids": torch.arange(12)[None]} if left else {})))
        moved = _logits(model(padded, attention_mask=mask, **positions))[:, real]
    change = float((moved - plain).abs().max() / plain.square().mean().sqrt())
    assert (change > 1e-3) is known, change


@pytest.mark.parametrize("model_type, known", [("paligemma", True), ("colpali", True), ("gemma", False)])
def test_a_sequence_gives_what_it_gives_alone_beside_a_padded_one_except_where_known_says_the_mask_changes(
        model_type, known):
    """PaliGemma and ColPali (KNOWN): a sequence beside a padded one (a causal mask built) gives other logits than alone
    (no mask built: its language model, bidirectional by configuration, attends both ways); Gemma, the same script,
    gives the same."""
    import torch

    _transformers()
    sweep = _sweep()
    assert (model_type in sweep.KNOWN) is known
    model = sweep.build(model_type)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 8:] = 0  # the other sequence: 8 tokens, right-padded
    with torch.no_grad():
        alone = _logits(model(ids[1:]))
        beside = _logits(model(ids, attention_mask=mask))[1:]
    change = float((beside - alone).abs().max() / alone.square().mean().sqrt())
    assert (change > 1e-3) is known, change


@pytest.mark.parametrize("name, path", [("levit_128", "stages.0.blocks.0.attn"),
                                        ("tiny_vit_5m_224", "stages.1.blocks.0.attn")])
@pytest.mark.parametrize("no_grad_first", [True, False])
def test_timms_cached_attention_biases_get_no_gradient_after_a_forward_under_no_grad(name, path, no_grad_first):
    """LeViT and TinyViT (as EfficientFormer and EfficientViT-MSRA): an eval forward under no_grad caches the
    attention biases cut from their graph, and the next forward's backward gives them no gradient; the same script
    without the no_grad forward gives them one. A pitfall of timm's, not in KNOWN: gradient_flow enters eval mode
    again before its forward, and timm's train() drops the cache there, so the sweep's rows no longer fail on it."""
    import torch

    timm = pytest.importorskip("timm", reason="timm is not installed: pip install -e \".[real]\"")
    assert name not in _sweep().KNOWN
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10).eval()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    if no_grad_first:
        with torch.no_grad():
            model(x)
    model(x).square().sum().backward()
    assert (model.get_submodule(path).attention_biases.grad is None) is no_grad_first


def test_yosos_hand_written_backward_is_not_its_forwards_derivative_for_query_and_key_but_is_for_value():
    """YOSO (KNOWN): YosoCumulation's forward is (1 - acos(q.k) / pi) ** h @ v exactly, its backward is written by
    hand; autograd through the same formula gives other gradients for q and k (measured: 16% of their norm), the
    same for v (the twin: exact)."""
    import math

    import torch

    _transformers()
    from transformers.models.yoso.modeling_yoso import YosoCumulation

    assert "yoso" in _sweep().KNOWN
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(2, 6, 8, generator=gen, dtype=torch.float64), dim=-1)
            .requires_grad_() for _ in range(2))
    v = torch.randn(2, 6, 8, generator=gen, dtype=torch.float64).requires_grad_()
    ones = torch.ones(2, 6, dtype=torch.float64)
    out = YosoCumulation.apply(ones, ones, q, k, v, {"hash_code_len": 9})
    formula = ((1 - torch.acos(q @ k.transpose(-1, -2)) / math.pi) ** 9) @ v  # (B, T, T) x (B, T, d) -> (B, T, d)
    assert torch.allclose(out, formula)
    theirs = torch.autograd.grad(out.square().sum(), (q, k, v))
    autograd = torch.autograd.grad(formula.square().sum(), (q, k, v))
    off = [float((a - b).norm() / b.norm()) for a, b in zip(theirs, autograd)]
    assert off[0] > 0.05 and off[1] > 0.05 and off[2] < 1e-12, off


@pytest.mark.parametrize("model_type, known", [("nemotron_asr_streaming_encoder", True), ("parakeet_encoder", False)])
def test_eager_and_sdpa_agree_except_where_known_says_eager_reads_its_additive_mask_as_a_boolean(model_type, known):
    """NemotronAsrStreamingEncoder (KNOWN): masked_fill_ on `attention_mask.logical_not()` blocks every key eager's
    additive mask allows (0.0), and its output is NaN; ParakeetEncoder, its base, the same script: eager equals sdpa."""
    import torch

    _transformers()
    sweep = _sweep()
    assert (model_type in sweep.KNOWN) is known
    eager, sdpa = sweep.build(model_type, "eager"), sweep.build(model_type, "sdpa")
    sdpa.load_state_dict(eager.state_dict())
    features = torch.randn(1, 64, eager.config.num_mel_bins, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = (m(input_features=features).last_hidden_state for m in (eager, sdpa))
    assert bool(b.isfinite().all())
    assert (not bool(a.isfinite().all())) is known
    if not known:
        assert float((a - b).abs().max()) < 1e-4


@pytest.mark.parametrize("model_type, known", [("qwen3_omni_moe_thinker", True), ("qwen2_5_omni_thinker", True),
                                               ("qwen3_vl", False), ("qwen2_5_vl", False)])
def test_a_forward_with_an_attention_mask_runs_except_where_known_says_the_config_lacks_a_token_id(model_type, known):
    """Qwen3-Omni-MoE's and Qwen2.5-Omni's thinkers (KNOWN) read config.vision_start_token_id, which their configs do
    not have, whenever input_ids come with an attention_mask (all ones here); Qwen3-VL and Qwen2.5-VL, the same
    script, run."""
    import torch

    _transformers()
    sweep = _sweep()
    assert (model_type in sweep.KNOWN) is known
    model = sweep.build(model_type)
    ids = torch.randint(5, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)  # without the mask both run
        try:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        except AttributeError as exc:
            assert known and "vision_start_token_id" in str(exc), exc
        else:
            assert not known


@pytest.mark.parametrize("model_type, known", [("swin", True), ("donut-swin", True), ("swinv2", False),
                                               ("maskformer-swin", False)])
def test_a_swin_built_for_64_px_runs_on_64_px_except_where_known_says_its_window_outgrows_the_stage(model_type, known):
    """Swin and Donut-Swin (KNOWN) clamp their 7-wide window to a 4 x 4 stage after building the relative position
    bias for 7 x 7, and raise; SwinV2 and MaskFormer-Swin, the same script, run. As the sweep builds each, at 64 px."""
    import torch

    _transformers()
    sweep = _sweep()
    assert (model_type in sweep.KNOWN) is known
    model = sweep.build(model_type)
    assert model.config.image_size == 64
    with torch.no_grad():
        try:
            model(pixel_values=torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)))
        except RuntimeError as exc:
            assert known and "must match the size" in str(exc), exc
        else:
            assert not known


@pytest.mark.parametrize("model_type, fails", [("swin", True), ("swinv2", False)])
def test_where_every_form_of_the_example_raises_the_one_the_model_ran_furthest_on_is_reported(model_type, fails):
    """Swin raises in its third stage's attention on images (KNOWN) and in its patch embedding on pairs of images,
    which it does not take: model_runs fails at that attention (was: inconclusive, quoting the pair's raise in the
    embeddings as the example's fault); SwinV2, which runs on the images, passes model_runs."""
    import diagnostics

    _transformers()
    report = diagnostics.audit_model(_sweep().build(model_type), detectors=["model_runs"])
    ran = report.result("model_runs")
    if fails:
        assert report.status == "failed" and ran.verdict == "fail", str(report)
        assert ran.layer == "encoder.layers.2.blocks.0.attention" and "SwinAttention" in ran.evidence, ran
    else:
        assert ran.verdict == "pass", str(report)


def test_tiny_configs_keep_their_widths_consistent():
    """The sweep's tiny configs on the model types whose shrinking was inconsistent (issue 33, 2026-12-05): ConvNeXt's
    stage count left with its per-stage tuples (cut to 2 stages, its last LayerNorm read hidden_sizes[-1], 768, after
    the second stage's 192: every forward raised), PP-FormulaNet's vision output width (decoder_hidden_size) following its text decoder's
    d_model, VibeVoice's codec widths (num_filters) shrunk: 1.03 billion parameters "tiny" before; SAM's neck, sine
    features and prompt grid, SAM 2's per-stage widths and the neck's list of them."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    convnext = sweep.tiny_config("convnext")
    assert (convnext.num_stages, tuple(convnext.hidden_sizes)) == (4, (96, 192, 384, 768))
    formula = sweep.tiny_config("pp_formulanet")
    assert formula.vision_config.decoder_hidden_size == formula.text_config.d_model == 32
    vibevoice = sweep.tiny_config("vibevoice")
    assert vibevoice.audio_config.num_filters == vibevoice.semantic_model_config.num_filters == 8
    sam = sweep.tiny_config("sam")  # the vision neck's output is the mask decoder's input, its grid image / patch
    assert sam.vision_config.output_channels == sam.mask_decoder_config.hidden_size == 32
    assert (sam.vision_config.num_pos_feats, sam.prompt_encoder_config.image_embedding_size) == (16, 4)
    sam2 = sweep.tiny_config("sam2").vision_config  # Hiera's stages start at its hidden_size; the neck reads them
    assert list(sam2.backbone_config.embed_dim_per_stage) == [32, 64, 128, 256]
    assert list(sam2.backbone_channel_list) == [256, 128, 64, 32]
    detr = sweep.tiny_config("rt_detr")  # one width repeated is no per-stage list: the encoder's, left
    assert tuple(detr.decoder_in_channels) == (256, 256, 256)


@pytest.mark.slow  # builds timm's DaViT-giant and Swin-CR giant small, and InternViT-300M at 56 px (about 10 s)
def test_timm_stage_models_are_built_small_only_with_their_widths():
    pytest.importorskip("timm", reason="timm is not installed: pip install -e \".[real]\"")
    sweep = _sweep()
    for name in ("davit_giant", "swinv2_cr_giant_224", "vit_intern300m_patch14_448"):
        model = sweep.timm_build(name)
        assert sum(p.numel() for p in model.parameters()) < 3e6, name  # 1.4 billion, 312 million, 304 million before


@pytest.mark.parametrize("attends", [False, True])
def test_a_model_with_no_attention_class_that_the_audit_found_none_in_is_not_counted(attends):
    """ResNet, FNet, a codec: "no attention module was found" and no attention class among its modules is a row "no
    attention" (not counted, as timm's are); the twin holds torch's nn.MultiheadAttention, so an audit that found
    none there missed it, and the row stays inconclusive."""
    import torch

    sweep = _sweep()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.MultiheadAttention(4, 1) if attends else torch.nn.ReLU())
    row = sweep.Row("m", built=True, verdict="inconclusive", why=sweep.NONE_FOUND + " (no torch, timm or ...)")
    sweep.without_attention(row, model)
    assert row.verdict == ("inconclusive" if attends else "no attention"), row
    assert sweep.rates([row, sweep.Row("p", built=True, verdict="passed")])[0].startswith(
        "1 / 1 built" if not attends else "2 / 2 built"), sweep.rates([row])


@pytest.mark.parametrize("model_type, known", [("aimv2", True), ("clip", False), ("pi05", True), ("gemma", False)])
def test_right_padding_leaves_a_text_models_real_tokens_except_where_known_says_it_turns_causal(model_type, known):
    """Aimv2's text tower and PI0.5's language model (KNOWN): 4 right pad tokens, masked, move the outputs at the real
    tokens (their causal mask comes only with a padding mask; unpadded they attend both ways). PI0.5's is a GemmaModel
    with `use_bidirectional_attention=True`, built so here. CLIP's text tower and a plain GemmaModel, the same script,
    leave them."""
    import torch

    tf = _transformers()
    assert (model_type in _sweep().KNOWN) is known
    sizes = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    if model_type in ("aimv2", "clip"):
        config_cls, model_cls = ((tf.Aimv2TextConfig, tf.Aimv2TextModel) if model_type == "aimv2" else
                                 (tf.CLIPTextConfig, tf.CLIPTextModel))
        model = model_cls(config_cls(max_position_embeddings=32, **sizes))
    else:
        model = tf.GemmaModel(tf.GemmaConfig(num_key_value_heads=1, head_dim=8, **sizes,
                                             use_bidirectional_attention=model_type == "pi05"))
    model.eval()
    gen = torch.Generator().manual_seed(1)
    ids, pads = torch.randint(3, 90, (1, 12), generator=gen), torch.randint(3, 90, (1, 4), generator=gen)
    mask = torch.cat([torch.ones(1, 12, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model(input_ids=ids).last_hidden_state
        padded = model(input_ids=torch.cat([ids, pads], dim=1), attention_mask=mask).last_hidden_state[:, :12]
    change = float((padded - plain).abs().max() / plain.square().mean().sqrt())
    assert (change > 1e-3) is known, change  # measured: 1.2 (Aimv2), 0.52 (Gemma bidirectional); 9e-7, 2.4e-7


@pytest.mark.parametrize("stage, known", [(1, True), (2, True), (0, False)])
def test_cvt_multiplies_q_k_by_its_whole_widths_scale_where_a_stage_has_several_heads(stage, known):
    """CvT (KNOWN): `self.scale = embed_dim**-0.5`, the original CvT code's line, applied to q·k before the softmax:
    cvt-13's stages of 3 and 6 heads of 64 multiply by 1/sqrt(192) and 1/sqrt(384), not 1/sqrt(64). Its first stage,
    one head of 64, the same script: the whole width is the head's."""
    import torch

    tf = _transformers()
    from transformers.models.cvt import modeling_cvt

    assert "cvt" in _sweep().KNOWN
    torch.manual_seed(0)
    model = tf.CvtModel(tf.CvtConfig()).eval()  # cvt-13's: stages of 1, 3 and 6 heads of 64
    seen, einsum, softmax = [], torch.einsum, torch.nn.functional.softmax

    def recorded_einsum(equation, *operands):
        out = einsum(equation, *operands)
        if equation == "bhlk,bhtk->bhlt":  # q·k (modeling_cvt.py:205)
            seen.append([out, operands[0][0].shape])
        return out

    def recorded_softmax(x, dim=None, **kw):
        if seen and len(seen[-1]) == 2:  # the softmax of those scores (line 206)
            seen[-1].append(x)
        return softmax(x, dim=dim, **kw)

    modeling_cvt.torch.einsum, modeling_cvt.torch.nn.functional.softmax = recorded_einsum, recorded_softmax
    try:
        with torch.no_grad():
            model(torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)))
    finally:
        modeling_cvt.torch.einsum, modeling_cvt.torch.nn.functional.softmax = einsum, softmax
    qk, shape, scores = next(s for s in seen if s[1][1] == (1, 3, 6)[stage])  # the stage's first block
    heads, d_k = shape[1], shape[-1]
    factor = float((scores / qk).median())
    assert abs(factor * (heads * d_k) ** 0.5 - 1) < 1e-4, (factor, heads, d_k)  # the whole width's
    assert (abs(factor * d_k ** 0.5 - 1) > 0.2) is known, (factor, heads, d_k)  # not a head's, where it has several


@pytest.mark.parametrize("heads, known", [(4, True), (1, False)])
def test_clvp_raises_inside_its_attention_where_its_heads_are_narrower_than_its_rotary_width(heads, known):
    """CLVP (KNOWN): its rotary width is max(projection_dim // (2 x heads), 32), not the head's: an encoder 32 wide
    with 4 heads of 8 raises in its attention on any token ids; with 1 head of 32, the same script, it runs."""
    import torch

    tf = _transformers()
    assert "clvp" in _sweep().KNOWN
    torch.manual_seed(0)
    config = tf.ClvpEncoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                                  projection_dim=32)
    model = tf.ClvpEncoder(config).eval()
    ids = torch.randint(5, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    except RuntimeError:
        raised = True
    else:
        raised = False
    assert raised is known


# ---- bugs injected into one layer through the SDPA its forward calls (timm's models: `inject_timm`) ---------------


class _Block(torch.nn.Module):
    """A timm-style attention block: `fused_attn` switches between torch's SDPA (looked up at the call) and a softmax
    of its own; `calls_sdpa=False`: a layer with no SDPA path at all."""

    def __init__(self, calls_sdpa: bool, biased: bool = False):
        super().__init__()
        self.calls_sdpa, self.fused_attn = calls_sdpa, False  # the manual path by default: the sweep switches it
        self.biased = biased  # a finite distance bias handed to SDPA as its attn_mask, as BEiT's relative bias is
        self.norm, self.qkv, self.proj = torch.nn.LayerNorm(32), torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        position = torch.arange(T, dtype=x.dtype)
        bias = -0.5 * (position[:, None] - position[None, :]).abs() if self.biased else None  # (T, T), finite
        if self.calls_sdpa and self.fused_attn:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # looked up at the call, where the sweep put it
        else:
            y = ((q @ k.transpose(-2, -1)) * 8 ** -0.5 + (0 if bias is None else bias)).softmax(-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(B, T, 32))


class _Net(torch.nn.Module):
    def __init__(self, calls_sdpa: bool, biased: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50)
        self.blocks = torch.nn.ModuleList(_Block(calls_sdpa, biased) for _ in range(2))

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("calls_sdpa", [True, False], ids=["calls SDPA", "no SDPA path"])
def test_timms_bugs_break_one_layer_through_the_sdpa_it_calls_and_are_caught_there(calls_sdpa):
    """The correct model passes; each bug, applied only to the calls made inside blocks.1 (its `fused_attn` switched on,
    as timm's classes have it), is caught there and nowhere else; the mask bugs are not applicable (no call in it is
    given a mask). A layer with no SDPA path is not broken, and the row says so."""
    sweep = _sweep()
    report = diagnostics.audit_model(_Net(calls_sdpa))
    assert report.status == "passed" and list(report.layers) == ["blocks.0", "blocks.1"], str(report)
    row = sweep.Row("net")
    before = torch.nn.functional.scaled_dot_product_attention
    sweep.inject_timm(row, report, lambda: _Net(calls_sdpa))
    assert torch.nn.functional.scaled_dot_product_attention is before  # put back
    if not calls_sdpa:
        assert row.bugs == {} and "no bug injected: blocks.1 calls no scaled_dot_product_attention" in row.why, row
        return
    from sweep_diffusers import NO_MASK

    assert row.bugs == {"missing_scale": "caught", "softmax_wrong_dim": "caught", "mask_ignored": NO_MASK,
                        "mask_after_softmax": NO_MASK}, row


def test_a_mask_of_finite_biases_is_no_mask_to_break():
    """A layer that hands SDPA a distance bias as its attn_mask (BEiT's, Swin's relative position bias) blocks no key:
    the mask applied after the softmax computes the same attention (4 timm rows counted it missed) and the mask
    ignored drops the bias, a position bias lost, not a mask, so neither is applicable; the scale is still caught."""
    from sweep_diffusers import NO_MASK  # benchmarks/ is on the path once the sweep is loaded

    sweep = _sweep()
    report = diagnostics.audit_model(_Net(True, biased=True))
    assert report.status == "passed", str(report)
    row = sweep.Row("biased")
    sweep.inject_timm(row, report, lambda: _Net(True, biased=True))
    assert row.bugs == {"missing_scale": "caught", "softmax_wrong_dim": "caught", "mask_ignored": NO_MASK,
                        "mask_after_softmax": NO_MASK}, row


class BlockAttention(torch.nn.Module):
    """NesT's attention in a few lines: the tokens cut into runs of `block`, each attended apart, q, k and v handed to
    SDPA as (B, H, blocks, block, d); a length that is no multiple of `block` is one block."""

    def __init__(self, d_model=32, heads=4, block=4):
        super().__init__()
        self.heads, self.block = heads, block
        self.qkv, self.proj = torch.nn.Linear(d_model, 3 * d_model), torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        n = self.block if T % self.block == 0 else T
        q, k, v = self.qkv(x).reshape(B, T // n, n, 3, self.heads, C // self.heads).permute(
            3, 0, 4, 1, 2, 5)  # each (B, H, blocks, n, d)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.permute(0, 2, 3, 1, 4).reshape(B, T, C))


def test_the_reference_attention_keeps_a_layers_blocks_so_that_its_weights_are_read():
    """NesT and Hiera hand SDPA (B, H, blocks, n, d): the sweep's explicit reference folded the blocks into one batch
    axis, its softmax over (B * H * blocks, 1, n, n) matched no block of the tokens, and the reference audit was
    inconclusive ("the attention itself was not measured") in 14 timm models, whose bugs were then not judged. The
    reference keeps the layer's shape: it passes as the layer through SDPA does, and a bug through it fails."""
    sweep = _sweep()
    torch.manual_seed(0)
    layer = BlockAttention()
    assert diagnostics.audit(layer, seq_len=16).status == "passed"
    with sweep._Within(layer, "reference") as within:
        reference = diagnostics.audit(layer, seq_len=16)
    assert within.routed.calls and reference.status == "passed", reference.status_reason
    with sweep._Within(layer, "missing_scale"):
        broken = diagnostics.audit(layer, seq_len=16)
    assert broken.status == "failed" and "softmax_saturation" in broken.status_reason, broken.status_reason


def _raises_on_an_image(model, size: int, said: tuple[str, ...]) -> bool:
    """Whether `model` raises on one random image of `size` pixels a side; where it does, the error says each of `said`
    (the channels that disagree, as a plain script shows them)."""
    import torch

    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            model(pixel_values=pixels)
    except RuntimeError as exc:
        assert all(part in str(exc) for part in said), exc
        return True
    return False


@pytest.mark.parametrize("fixed", [False, True], ids=["default", "six_stages"])
def test_uvdocs_default_config_runs_except_where_known_says_its_backbone_gives_one_stage_of_six(fixed):
    """UVDoc (KNOWN) from its default config: the backbone's out_features default to its last stage alone, whose 128
    channels meet a bridge connector built for all six (768), and the forward raises on any image; its twin on the
    same image, the backbone asked for its six stages, runs."""
    import torch

    _transformers()
    from transformers import UVDocConfig, UVDocModel

    assert "uvdoc" in _sweep().KNOWN
    six = [f"stage{i}" for i in range(1, 7)]
    backbone = {"model_type": "uvdoc_backbone", "out_features": six}
    config = UVDocConfig(backbone_config=backbone) if fixed else UVDocConfig()
    torch.manual_seed(0)
    assert _raises_on_an_image(UVDocModel._from_config(config).eval(), 224, ("768 channels, but got 128",)) is not fixed


@pytest.mark.parametrize("fixed", [False, True], ids=["default", "v3_four_stages"])
def test_pp_ocrv6_small_dets_default_config_runs_except_where_known_says_its_backbone_is_not_the_one_it_names(fixed):
    """PP-OCRv6 small det (KNOWN) from its default config: __post_init__ builds a bare pp_lcnet_v4 backbone, one
    384-channel stage, before the pp_lcnet_v3 its sub_configs_defaults name is read, and the neck, built for four
    stages of PP-OCRv5-mobile's widths (12, 18, 42, 360), raises on any image; its twin on the same image, the v3
    backbone it names with its four stages and their widths, runs."""
    import torch

    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    import transformers

    assert "pp_ocrv6_small_det" in _sweep().KNOWN
    config_class = CONFIG_MAPPING["pp_ocrv6_small_det"]
    assert config_class.sub_configs_defaults["backbone_config"].model_type == "pp_lcnet_v3"  # what it names
    assert config_class().backbone_config.model_type == "pp_lcnet_v4"  # what it builds
    config = config_class(backbone_config=CONFIG_MAPPING["pp_lcnet_v3"](
        scale=0.75, out_features=["stage2", "stage3", "stage4", "stage5"], divisor=16),
        layer_list_out_channels=[48, 96, 192, 384]) if fixed else config_class()
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_MAPPING_NAMES["pp_ocrv6_small_det"])._from_config(config).eval()
    assert _raises_on_an_image(model, 224, ("to have 12 channels, but got 384",)) is not fixed


@pytest.mark.parametrize("architecture, raises", [(None, True), ("repvit_m1", False)], ids=["default", "repvit_m1"])
def test_edgetams_default_config_runs_except_where_known_says_its_backbone_key_is_misspelt(architecture, raises):
    """EdgeTAM's vision model (KNOWN) from its default config: `"archirecture": "repvit_m1"`, a misspelt key, leaves
    the timm backbone at TimmWrapperConfig's resnet50, whose 1024 channels meet a neck built for 384, and the forward
    raises; its twin on the same image, the architecture set under its right name, runs."""
    import torch

    _transformers()
    from transformers import EdgeTamVisionConfig, EdgeTamVisionModel

    assert "edgetam_vision_model" in _sweep().KNOWN
    config = EdgeTamVisionConfig()
    assert getattr(config.backbone_config, "archirecture", None) == "repvit_m1"  # the misspelt key, as shipped
    if architecture is not None:
        config.backbone_config.architecture = architecture
    torch.manual_seed(0)
    model = EdgeTamVisionModel(config).eval()
    assert _raises_on_an_image(model, 128, ("expected input", "1024 channels")) is raises
