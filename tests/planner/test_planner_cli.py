"""``tensorpar plan`` end to end through the command dispatcher (no process group, no GPU)."""
import json

import pytest

from tensorpar import cli

GPT3 = ["--model", "gpt3-175b", "--gpus", "1024", "--gpus-per-node", "8", "--device", "a100-80gb",
        "--global-batch", "1536", "--seq", "2048"]


@pytest.fixture
def plan(capsys):
    """Run ``tensorpar plan ARGS`` through tensorpar.cli.main; return (exit code, stdout, stderr)."""

    def run(*args):
        code = cli.main(["plan", *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_gpt3_175b_ranked_table(plan):
    """The ranked table for GPT-3 175B on 1024 A100s (its planning time is bench/bench_plan_time.py's, not a test's)."""
    code, out, _ = plan(*GPT3)
    assert code == 0
    assert "gpt3-175b on 1024 x a100-80gb" in out
    assert "#1 tp=" in out and "Ruled out:" in out
    assert "needs" in out and "GiB usable" in out  # at least one value is explained by memory


def test_plan_command_does_not_import_torch():
    """Planning needs no torch: the dispatcher imports only the command it runs."""
    import subprocess
    import sys

    code = ("import sys; from tensorpar import cli; "
            f"cli.main(['plan', *{GPT3!r}, '--json', '--top', '1']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")


def test_json_is_a_ranked_list_in_the_schema(plan):
    code, out, _ = plan(*GPT3, "--json", "--top", "5")
    plans = json.loads(out)
    assert code == 0 and len(plans) == 5
    assert [p["rank"] for p in plans] == [1, 2, 3, 4, 5]
    times = [p["step_time_s"] for p in plans]
    assert times == sorted(times)
    for p in plans:
        assert {"tp", "pp", "dp", "micro_batch", "sequence_parallel", "recompute", "distributed_optimizer",
                "memory_gb", "step_time_s", "tflops_per_device", "mfu"} <= set(p)
        assert p["tp"] * p["pp"] * p["dp"] == 1024 and p["fits"]
        assert p["memory_gb"]["total"] <= 80 - 4


def test_evaluate_scores_one_layout_in_the_same_schema(plan):
    code, out, _ = plan(*GPT3, "--json", "--evaluate", "tp=8,pp=4,dp=32,micro_batch=2,recompute=selective")
    (only,) = json.loads(out)
    assert code == 0
    assert (only["tp"], only["pp"], only["dp"], only["micro_batch"], only["recompute"]) == (8, 4, 32, 2, "selective")
    assert only["sequence_parallel"] is False and only["distributed_optimizer"] is False
    code, out, _ = plan(*GPT3, "--evaluate", "tp=8,pp=4,dp=32,micro_batch=2")
    assert code == 0 and "needs" in out  # 126 GiB: does not fit, and the note says so


def test_evaluate_rejects_an_invalid_layout_naming_the_setting(plan):
    code, _, err = plan(*GPT3, "--evaluate", "tp=16,pp=4")
    assert code == 2
    assert "tp (16) must divide --gpus-per-node (8)" in err


def test_plot_writes_a_png(plan, tmp_path):
    path = tmp_path / "memory.png"
    code, out, _ = plan(*GPT3, "--top", "4", "--plot", str(path))
    assert code == 0 and "plot written to" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_json_and_explicit_dimensions(plan, tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 49152, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    common = ["--gpus", "16", "--device", "h100-80gb", "--global-batch", "64", "--seq", "4096", "--json",
              "--evaluate", "tp=2,pp=1"]
    _, from_file, _ = plan("--model", str(path), *common)
    _, from_preset, _ = plan("--model", "smollm2-1.7b", *common)
    _, explicit, _ = plan("--layers", "24", "--hidden", "2048", "--heads", "32", "--ffn", "8192", "--vocab", "49152",
                          *common)
    (file_plan,), (preset_plan,), (explicit_plan,) = map(json.loads, (from_file, from_preset, explicit))
    assert file_plan == preset_plan
    # Explicit dimensions default to an untied output layer: one more vocabulary shard of
    # 24576 rows x 2048 x 2 bytes = 0.09375 GiB of weights.
    extra = explicit_plan["memory_gb"]["weights"] - file_plan["memory_gb"]["weights"]
    assert extra == pytest.approx(0.09375, abs=2e-3)


def test_nothing_fits_is_explained(plan):
    code, out, _ = plan("--model", "llama3-405b", "--gpus", "8", "--device", "h100-80gb", "--global-batch", "8",
                        "--seq", "8192")
    assert code == 3  # non-zero: nothing to run (issue 14.11)
    assert "No layout fits" in out and "GiB usable" in out
    code, out, _ = plan("--model", "llama3-405b", "--gpus", "8", "--device", "h100-80gb", "--global-batch", "8",
                        "--seq", "8192", "--json")
    assert code == 3 and json.loads(out)[0]["fits"] is False


def test_errors_name_the_setting(plan):
    code, _, err = plan("--model", "gpt3-175b", "--global-batch", "8", "--seq", "2048")
    assert code == 2 and "--gpus" in err
    code, _, err = plan("--model", "gpt-5", "--gpus", "8", "--global-batch", "8", "--seq", "2048")
    assert code == 2 and "--model 'gpt-5' is not a preset" in err
    code, _, err = plan(*GPT3, "--efficiency", "1.5")
    assert code == 2 and "--efficiency (1.5) must be in (0, 1]" in err
    code, _, err = plan(*GPT3, "--top", "-1")
    assert code == 2 and "--top (-1) must be >= 0" in err
    code, _, err = plan(*GPT3, "--device-file", "/nonexistent/device.json")
    assert code == 2 and "--device-file /nonexistent/device.json: cannot read" in err


def test_unreadable_config_json_is_an_error(plan, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, _, err = plan("--model", str(bad), "--gpus", "8", "--global-batch", "8", "--seq", "128")
    assert code == 2 and f"--model {bad}: cannot read a config.json" in err


def test_unwritable_plot_path_is_an_error(plan, tmp_path):
    code, _, err = plan(*GPT3, "--plot", str(tmp_path / "missing-folder" / "memory.png"))
    assert code == 2 and "--plot" in err and "cannot write it" in err


@pytest.mark.parametrize("config", [
    {"model_type": "bert", "architectures": ["BertForMaskedLM"], "num_hidden_layers": 12, "hidden_size": 768,
     "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522, "max_position_embeddings": 512},
    {"model_type": "t5", "is_encoder_decoder": True, "architectures": ["T5ForConditionalGeneration"],
     "num_layers": 6, "d_model": 512, "num_heads": 8, "d_ff": 2048, "vocab_size": 32128},
])
def test_encoder_configs_are_refused(plan, tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = plan("--model", str(path), "--gpus", "8", "--global-batch", "8", "--seq", "128")
    assert code == 2 and out == ""
    assert "encoder-only or encoder-decoder" in err and config["model_type"] in err
    assert f"--model {path}:" in err                       # the path given, not the folder's name


def test_sequence_longer_than_positions_is_refused(plan, tmp_path):
    code, _, err = plan(*GPT3[:-1], "4096")
    assert code == 2 and "--seq (4096) is longer than the 2048 positions of gpt3-175b; use --seq <= 2048" in err
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
              "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
              "max_position_embeddings": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, _, err = plan("--model", str(path), "--gpus", "2", "--global-batch", "2", "--seq", "1024")
    assert code == 2 and "--seq (1024) is longer than the 512 positions" in err
    code, _, _ = plan("--model", str(path), "--gpus", "2", "--global-batch", "2", "--seq", "512")
    assert code == 0


def test_head_dim_flag(plan):
    dims = ["--layers", "2", "--hidden", "64", "--heads", "6", "--vocab", "100", "--gpus", "2",
            "--global-batch", "2", "--seq", "64"]
    code, _, err = plan(*dims)
    assert code == 2 and "give head_dim explicitly" in err  # 64 is not divisible by 6
    code, out, _ = plan(*dims, "--head-dim", "16", "--json")
    assert code == 0 and json.loads(out)
    from tensorpar.planner.model_spec import from_dims

    assert from_dims(layers=2, hidden=64, heads=6, vocab=100, head_dim=16).layer_params() > \
        from_dims(layers=2, hidden=64, heads=4, vocab=100).layer_params()
    code, _, err = plan("--model", "gpt3-175b", "--head-dim", "64", *GPT3[2:])
    assert code == 2 and "--head-dim" in err


def test_calibrated_device_uses_a_labelled_local_link(plan, tmp_path):
    """--calibrate's device leaves the NVLink / inter-node fields unmeasured (0) and plans every group on
    the measured local link, which the output names."""
    from tensorpar.planner.cluster import ClusterSpec, device_from_file

    device = {"name": "calibrated cpu", "memory_gib": 24.0, "peak_tflops": 0.1, "intra_node_gbps": 0.0,
              "inter_node_gbps": 0.0, "matmul_efficiency": 1.0, "local_link_gbps": 2.0,
              "local_link_latency_us": 50.0, "local_link_label": "this machine's local link: 2 gloo processes"}
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"device": device}))
    spec = device_from_file(path)
    assert ClusterSpec(spec, 16, 8).link(16) == pytest.approx((2e9, 50e-6)) == ClusterSpec(spec, 16, 8).link(2)
    code, out, _ = plan("--model", "smollm2", "--gpus", "2", "--device-file", str(path), "--global-batch", "2",
                        "--seq", "256")
    assert code == 0 and "links: this machine's local link: 2 gloo processes" in " ".join(out.split())


LLAMA8 = ["--model", "llama3-8b", "--gpus", "8", "--device", "a100-80gb", "--global-batch", "16", "--seq", "2048"]


@pytest.mark.parametrize("spec, expected", [
    ("tp=8,pp=0", "--evaluate pp=0: must be >= 1"),
    ("tp=0,pp=1", "--evaluate tp=0: must be >= 1"),
    ("tp=8,pp=1,dp=0", "--evaluate dp=0: must be >= 1"),
    ("tp=8,pp=1,tp=4", "--evaluate tp=8,pp=1,tp=4: tp is given twice"),
    ("", "--evaluate '' is empty; give a layout such as tp=8,pp=1"),
    (" , ", "--evaluate ' , ' is empty"),
])
def test_evaluate_bad_specs_are_one_line_errors(plan, spec, expected):
    """A zero degree used to divide by zero while defaulting dp; a repeated key silently kept the last value;
    an empty spec silently ran the search."""
    code, out, err = plan(*LLAMA8, "--evaluate", spec)
    assert code == 2 and out == ""
    assert expected in err and len(err.strip().splitlines()) == 1


def test_model_path_missing_file_or_folder(plan, tmp_path):
    """A missing path says "no such file" (it used to say "is not a preset"); a folder holding config.json is
    read like the file; a folder without one says so."""
    common = ["--gpus", "8", "--global-batch", "8", "--seq", "128"]
    for missing in (tmp_path / "nope" / "config.json", tmp_path / "nope"):
        code, out, err = plan("--model", str(missing), *common)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert f"--model {missing}: no such file or folder; give a config.json, a folder with one" in err
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    code, _, err = plan("--model", str(folder), *common)
    assert code == 2 and f"--model {folder}: folder has no config.json" in err
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    (folder / "config.json").write_text(json.dumps(config))
    code, from_folder, _ = plan("--model", str(folder), *common, "--json", "--top", "3")
    assert code == 0
    _, from_file, _ = plan("--model", str(folder / "config.json"), *common, "--json", "--top", "3")
    assert json.loads(from_folder) == json.loads(from_file)


def test_inference_length_error_names_prompt_and_new_tokens(plan):
    code, out, err = plan("--inference", "--model", "llama3-8b", "--gpus", "8", "--batch", "1", "--prompt-len", "8000",
                          "--max-new-tokens", "512")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert ("--prompt-len + --max-new-tokens (8000 + 512) = 8512 is longer than the 8192 positions of llama3-8b; "
            "use a total <= 8192") in err and "--seq" not in err


@pytest.mark.parametrize("flag", ["--peak-tflops", "--memory-gb", "--intra-node-bw", "--inter-node-bw", "--hbm-gbps"])
@pytest.mark.parametrize("value", ["inf", "-1", "nan"])
def test_hardware_overrides_must_be_finite_and_positive(plan, flag, value):
    """Old code accepted infinity (a 0.007 s step, MFU 0.0 %, "3.0 GiB of inf GiB") and named the field
    (``device memory_gib``) instead of the flag."""
    code, out, err = plan("--model", "smollm2", "--gpus", "2", "--global-batch", "8", "--seq", "512", flag, value)
    assert code == 2 and not out and err.count("\n") == 1, err
    if flag == "--inter-node-bw":   # train --plan's rule and words (tensorpar.planner.cluster.inter_node_link)
        assert f"{flag} {value}: must be a finite number of GB/s > 0" in err, err
    elif flag == "--hbm-gbps":      # 0 means "not modelled" there (training allows it)
        assert f"{flag} {value}: must be a finite number >= 0 (0: not modelled)" in err, err
    else:                           # the same form: the flag, its value, what would work
        assert f"{flag} {value}: must be a finite number > 0" in err, err


@pytest.mark.parametrize("flag,value,range_", [("--hbm-gbps", "1e-300", "0.01-100000 GB/s"),
                                                ("--memory-gb", "1e30", "0.01-100000 GiB"),
                                                ("--peak-tflops", "5e6", "0.0001-100000 TFLOP/s"),
                                                ("--intra-node-latency-us", "1e9", "0-1e+07 microseconds")])
def test_hardware_overrides_far_outside_any_device_are_refused(plan, flag, value, range_):
    """Finite but absurd values (``--hbm-gbps 1e-300`` printed TTFTs of 1e300 ms): one line with the flag, its
    value and the plausible range, before any plan is priced."""
    code, out, err = plan("--model", "smollm2", "--gpus", "2", "--inference", "--batch", "1", "--prompt-len", "16",
                          "--max-new-tokens", "8", flag, value)
    assert code == 2 and not out and err.count("\n") == 1, err
    assert f"{flag} {float(value):.12g}: outside the plausible {range_}" in err, err


def test_the_value_refused_is_the_one_given_not_a_rounding_of_it(plan):
    """``:g`` printed 10000000.1 as 1e+07, a value inside the range it was refused for (review)."""
    code, _, err = plan("--model", "smollm2", "--gpus", "2", "--global-batch", "8", "--seq", "512",
                        "--intra-node-latency-us", "10000000.1")
    assert code == 2 and "--intra-node-latency-us 10000000.1: outside the plausible 0-1e+07 microseconds" in err, err


@pytest.mark.parametrize("field,value", [("hbm_gbps", 1e-300), ("memory_gib", 1e30), ("peak_tflops", 5e6),
                                         ("intra_node_latency_us", 1e30),
                                         # the fields only a calibrated file gives (no flag; unchecked before)
                                         ("decode_read_gbps", 1e-300), ("prefill_tflops", 1e9),
                                         ("layer_overhead_us", 1e12), ("tp_link_gbps", 1e30),
                                         ("local_link_gbps", 1e-9), ("threads_per_rank", 10 ** 9),
                                         # a lower bound above 0 where a tiny value would be read (review: host_cores
                                         # 1e-300 printed a step time of 7e311 s)
                                         ("host_cores", 1e-300), ("optimizer_ns_per_param", 1e-300)])
def test_a_device_file_far_outside_any_device_is_refused(plan, tmp_path, field, value):
    """The device file's fields get the flags' ranges (review: ``"hbm_gbps": 1e-300`` in a file printed TTFTs
    hundreds of digits long, in plan and in generate --plan auto, which reads files with the same function)."""
    import dataclasses
    import json

    from tensorpar.planner import cluster as cl
    path = tmp_path / "dev.json"
    path.write_text(json.dumps({**dataclasses.asdict(cl.device_preset("h100-80gb")), field: value}))
    code, out, err = plan("--model", "smollm2", "--gpus", "2", "--inference", "--batch", "1", "--prompt-len", "16",
                          "--max-new-tokens", "8", "--device-file", str(path))
    assert code == 2 and not out and err.count("\n") == 1, err
    assert f"--device-file {path}: {field} {value:.12g}: outside the plausible" in err, err


@pytest.mark.parametrize("value,shown", [(True, "true"), ("80", '"80"'), (None, "null"), ([1], "[1]"),
                                         ({"a": 1}, '{"a": 1}'), (10 ** 400, "1" + "0" * 39 + "...")])
def test_a_device_file_field_that_is_not_a_number_is_named(plan, tmp_path, value, shown):
    """JSON's true was read as 1 GB/s, a string or null gave "'<' not supported between instances of 'int' and
    'str'" without the field, and an integer of 400 digits an OverflowError (review)."""
    import dataclasses
    import json

    from tensorpar.planner import cluster as cl
    path = tmp_path / "dev.json"
    path.write_text(json.dumps({**dataclasses.asdict(cl.device_preset("h100-80gb")), "hbm_gbps": value}))
    code, out, err = plan("--model", "smollm2", "--gpus", "2", "--inference", "--batch", "1", "--prompt-len", "16",
                          "--max-new-tokens", "8", "--device-file", str(path))
    assert code == 2 and not out and err.count("\n") == 1, err
    assert f"--device-file {path}: hbm_gbps {shown} is not a number; give a number in GB/s" in err, err


@pytest.mark.parametrize("value", ["nan", "inf", "-nan"])
def test_reserve_that_is_not_a_finite_number_is_refused(plan, value):
    """``--reserve-gb nan`` passed ``< 0`` and printed a table ending "nan GiB usable" (review)."""
    for extra in (("--inference", "--batch", "1", "--prompt-len", "16", "--max-new-tokens", "8"),
                  ("--global-batch", "8", "--seq", "512")):
        code, out, err = plan("--model", "smollm2", "--gpus", "2", *extra, "--reserve-gb", value)
        assert code == 2 and not out and err.count("\n") == 1, err
        assert f"--reserve-gb {float(value):.12g}: must be a finite number >= 0" in err, err


def test_every_device_field_has_a_plausible_range():
    """A field added to DeviceSpec without a range would let a file's typo through unchecked (the calibrated fields
    were, review of 12-03); ``name`` and ``local_link_label`` are labels, ``matmul_efficiency`` has its own (0, 1]."""
    import dataclasses

    from tensorpar.planner import cluster as cl
    fields = {f.name for f in dataclasses.fields(cl.DeviceSpec)}
    assert fields - set(cl.PLAUSIBLE_DEVICE) == {"name", "local_link_label", "tp_link_label", "matmul_efficiency"}


@pytest.mark.parametrize("extra,says", [
    (("--memory-gb", "0.01"), "--memory-gb 0.01 GiB leaves no memory for the model after --reserve-gb 2 (its "
                              "default); give more than 2 GiB per device or a smaller --reserve-gb"),
    (("--memory-gb", "8", "--reserve-gb", "8"), "--memory-gb 8 GiB leaves no memory for the model after "
                                                "--reserve-gb 8; give more than 8 GiB"),
    (("--reserve-gb", "100"), "--device h100-80gb's memory 79.6 GiB leaves no memory for the model after "
                              "--reserve-gb 100;"),
    (("--memory-gb", "1.9999999"), "--memory-gb 1.9999999 GiB leaves no memory")])   # not rounded to 2 (review)
def test_memory_not_more_than_the_reserve_is_refused(plan, extra, says):
    """``--memory-gb 0.01`` printed every layout with negative usable memory (-2.0 GiB): one line instead, naming
    where the memory came from and the reserve, for inference and training plans."""
    code, out, err = plan("--model", "smollm2", "--gpus", "2", "--inference", "--batch", "1", "--prompt-len", "16",
                          "--max-new-tokens", "8", "--device", "h100-80gb", *extra)
    assert code == 2 and not out and err.count("\n") == 1 and says in err, err
    code, out, err = plan("--model", "smollm2", "--gpus", "2", "--global-batch", "8", "--seq", "512",
                          "--memory-gb", "0.5", "--reserve-gb", "1")
    assert code == 2 and "--memory-gb 0.5 GiB leaves no memory for the model after --reserve-gb 1;" in err, err


@pytest.mark.parametrize("flag,value", [("--inter-node-bw", "1e-300"), ("--inter-node-bw", "1e30"),
                                        ("--inter-node-latency-us", "1e30")])
def test_the_link_between_hosts_far_outside_any_link_is_refused(plan, flag, value):
    """Inside 1e-4-1e5 GB/s a bandwidth outside 0.01-1000 is used with a note (a unit slip is likely); beyond it, as
    the other device flags, refused (review: 1e-300 printed step times hundreds of digits long)."""
    code, out, err = plan("--model", "smollm2", "--gpus", "16", "--gpus-per-node", "8", "--global-batch", "64",
                          "--seq", "512", flag, value)
    assert code == 2 and not out and err.count("\n") == 1, err
    assert f"{flag} {float(value):.12g}: outside the plausible" in err, err


def test_inference_refuses_hbm_gbps_zero(plan):
    """--hbm-gbps 0 (not modelled) with --inference: one line naming the flag, not "give --hbm-gbps" (review)."""
    code, out, err = plan("--model", "smollm2", "--gpus", "2", "--inference", "--batch", "1", "--prompt-len", "16",
                          "--max-new-tokens", "8", "--hbm-gbps", "0")
    assert code == 2 and not out and err.count("\n") == 1, err
    assert "--hbm-gbps 0: decode time needs the device-memory bandwidth" in err, err
